package proxy_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
	"github.com/idempotency-extproc/idempotency-extproc/e2e/upstream"
)

// The router retries on the response status as the route's retry_policy says
// (RetryStateImpl::wouldRetryFromHeaders in source/common/router/retry_state_impl.cc), up to
// num_retries, sending the same request and body again after ext_proc: the processor sees one
// request, the upstream runs it once per attempt, and the access log counts the attempts.
func TestRouterRetriesOnStatus(t *testing.T) {
	for _, tc := range []struct {
		name     string
		policy   *routev3.RetryPolicy
		status   string
		attempts int
	}{
		{"5xx, the default one retry", &routev3.RetryPolicy{RetryOn: "5xx"}, "503", 2},
		{"gateway-error, two retries", &routev3.RetryPolicy{RetryOn: "gateway-error", NumRetries: wrapperspb.UInt32(2)}, "502", 3},
		{"gateway-error does not take 500", &routev3.RetryPolicy{RetryOn: "gateway-error", NumRetries: wrapperspb.UInt32(2)}, "500", 1},
		{"retriable-status-codes", &routev3.RetryPolicy{RetryOn: "retriable-status-codes", RetriableStatusCodes: []uint32{201}, NumRetries: wrapperspb.UInt32(1)}, "201", 2},
		{"retriable-4xx is 409", &routev3.RetryPolicy{RetryOn: "retriable-4xx"}, "409", 2},
		{"connect-failure is no status", &routev3.RetryPolicy{RetryOn: "connect-failure,refused-stream"}, "503", 1},
		{"num_retries 0", &routev3.RetryPolicy{RetryOn: "5xx", NumRetries: wrapperspb.UInt32(0)}, "503", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, bufferedFilter(), nil, func(c *proxy.Config) {
				c.Routes = []proxy.Route{{Name: "r", Prefix: "/", Retry: tc.policy}}
			})
			resp, _ := e.do(t, http.MethodPost, "/x", []byte("the body"), "Idempotency-Key", "k", "X-Test-Status", tc.status)
			require.Equal(t, tc.status, strconv.Itoa(resp.StatusCode))
			reqs := e.up.Requests()
			require.Len(t, reqs, tc.attempts)
			for _, r := range reqs {
				require.Equal(t, reqs[0].BodySHA256, r.BodySHA256, "each attempt sends the same body")
			}
			require.Equal(t, tc.attempts, e.up.Ran(upstream.Key(&http.Request{Header: http.Header{"Idempotency-Key": {"k"}}})))
			rec := <-e.recs
			require.Equal(t, tc.attempts, rec.Attempts)
		})
	}
}

// A retry sends the request's trailers again after its body, as the first attempt did
// (Router::Filter::doRetry in source/common/router/router.cc).
func TestRouterRetrySendsTheTrailersAgain(t *testing.T) {
	type attempt struct {
		body    string
		trailer string
	}
	got := make(chan attempt, 4)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- attempt{string(b), r.Trailer.Get("X-Checksum")}
		if len(got) == 1 {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	t.Cleanup(srv.Close)
	e := newEnv(t, bufferedFilter(), nil, func(c *proxy.Config) {
		c.Upstream = srv.URL
		c.UpstreamTrailers, c.DownstreamTrailers = true, true
		c.Routes = []proxy.Route{{Name: "r", Prefix: "/", Retry: &routev3.RetryPolicy{RetryOn: "5xx"}}}
	})
	req, err := http.NewRequest(http.MethodPost, e.proxy.URL()+"/x", io.MultiReader(strings.NewReader("the body")))
	require.NoError(t, err)
	req.ContentLength = -1
	req.Trailer = http.Header{"X-Checksum": {"1"}}
	resp, err := e.client.Do(req)
	require.NoError(t, err)
	_ = resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, attempt{"the body", "1"}, <-got, "first attempt")
	require.Equal(t, attempt{"the body", "1"}, <-got, "the retry")
	require.Equal(t, 2, (<-e.recs).Attempts)
}
