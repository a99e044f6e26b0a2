package extproc_test

import (
	"bytes"
	"context"
	"fmt"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

func TestConcurrentDuplicatesRunOnce(t *testing.T) {
	forEachStore(t, func(t *testing.T, newStore func(t *testing.T) testStore) {
		ts := newStore(t)
		// 200 acquires at once on a loaded 2-core machine with the race detector can take longer
		// than the default 100ms store_timeout; this test is about the lease, not the deadline.
		h := newHarness(t, harnessOptions{policy: "store_timeout: 5s", store: ts.store, advance: ts.advance})
		const n = 200
		var (
			start   = make(chan struct{})
			wg      sync.WaitGroup
			mu      sync.Mutex
			results []result
			// The winner's upstream waits until every duplicate has been answered, so that
			// all of them find it in flight.
			duplicatesDone = make(chan struct{})
		)
		req := post("/v1/payments", "same-key", `{"amount":100}`)
		for range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				s := h.open()
				defer s.end()
				<-start
				resp := s.send(requestHeaders(req))
				require.NotNil(t, resp.GetRequestHeaders())
				resp = s.send(requestBody(req.body))
				if res, ok := immediateAnswer(resp); ok {
					mu.Lock()
					results = append(results, res)
					if len(results) == n-1 {
						close(duplicatesDone)
					}
					mu.Unlock()
					return
				}
				h.mu.Lock()
				h.executed["same-key"]++
				h.mu.Unlock()
				select {
				case <-duplicatesDone:
				case <-time.After(time.Minute):
					// A duplicate failed before it was counted: end, rather than hang the suite.
					mu.Lock()
					t.Errorf("only %d of %d duplicates were answered", len(results), n-1)
					mu.Unlock()
					return
				}
				s.send(responseHeaders(created))
				s.send(responseBody(created.body, true))
			}()
		}
		close(start)
		wg.Wait()
		require.Equal(t, 1, h.executions("same-key"), "exactly one of %d concurrent duplicates reaches the upstream", n)
		require.Len(t, results, n-1)
		for _, res := range results {
			requireProblem(t, res, 409, "request-in-progress")
		}
		for range 20 {
			res := h.do(req, created)
			require.False(t, res.executed)
			require.Equal(t, []string{"true"}, res.header(replayed))
			require.Equal(t, created.body, res.body)
		}
		require.Equal(t, 1, h.executions("same-key"))
	})
}

// A storable status seen via the upstream whose body never arrives (upstream reset mid-body, a
// body over Envoy's buffer limit, the client gone): the upstream certainly ran, so the record is
// completed without a body and a retry gets 409 response-not-replayable.
func TestStreamEndedMidBodyCompletesWithoutBody(t *testing.T) {
	forEachStore(t, func(t *testing.T, newStore func(t *testing.T) testStore) {
		ts := newStore(t)
		h := newHarness(t, harnessOptions{store: ts.store, advance: ts.advance})
		s := h.open()
		s.send(requestHeaders(post("/v1/payments", "k", `{}`)))
		s.send(requestBody([]byte(`{}`)))
		h.executed["k"]++
		resp := s.send(responseHeaders(created))
		require.NotNil(t, resp.GetResponseHeaders())
		require.Nil(t, resp.GetModeOverride(), "a response to store keeps its body phase")
		s.end()
		h.waitIdle(t)
		rec := h.record(t, "k")
		require.Equal(t, cache.Completed, rec.State)
		require.True(t, rec.Response.BodyOmitted)
		require.Equal(t, 201, rec.Response.Status)
		res := h.do(post("/v1/payments", "k", `{}`), created)
		requireProblem(t, res, 409, "response-not-replayable")
		require.Equal(t, 1, h.executions("k"), "the retry never runs")
		require.Zero(t, h.counter("idempotency_releases_total", "route", "default", "reason", "unknown_outcome"))
		require.Equal(t, 0.0, h.counter("idempotency_inflight"))
		require.Contains(t, h.logs.String(), `"body_kept":false`)
	})
}

func TestLeaseRenewedWhileRequestRuns(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: "defaults: {lock_ttl: 3s}"})
	s := h.open()
	s.send(requestHeaders(post("/v1/payments", "slow", `{}`)))
	s.send(requestBody([]byte(`{}`)))
	// The upstream takes ten lock_ttls; renewals every second keep the key.
	for range 30 {
		h.clock.Advance(time.Second)
	}
	requireProblem(t, h.do(post("/v1/payments", "slow", `{}`), created), 409, "request-in-progress")
	s.send(responseHeaders(created))
	s.send(responseBody(created.body, true))
	res := h.do(post("/v1/payments", "slow", `{}`), created)
	require.Equal(t, []string{"true"}, res.header(replayed))
	require.Equal(t, 0, h.clock.Pending(), "renewal stops when the request completes")
}

// Leases of different lock_ttls renewed side by side share one timer, each renewed on its own
// schedule, and a request that ends before its first renewal leaves nothing behind.
func TestRenewalsShareOneTimer(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: `
defaults: {lock_ttl: 3s}
routes:
  - {name: quick, match: {path_prefix: /v1/quick}, lock_ttl: 600ms}
`})
	claim := func(path, key string) *stream {
		s := h.open()
		s.send(requestHeaders(post(path, key, `{}`)))
		s.send(requestBody([]byte(`{}`)))
		return s
	}
	slow, quick, short := claim("/v1/payments", "slow"), claim("/v1/quick", "quick"), claim("/v1/payments", "short")
	require.Equal(t, 1, h.clock.Pending(), "three leases, one renewal timer")
	short.send(responseHeaders(created))
	short.send(responseBody(created.body, true))
	require.Equal(t, 1, h.clock.Pending())
	// Ten of the slow lease's lock_ttls, fifty of the quick one's, in steps shorter than
	// either renewal interval.
	// At every step each lease runs past now: a renewal late by one step would let it lapse.
	for range 300 {
		h.clock.Advance(100 * time.Millisecond)
		for path, key := range map[string]string{"/v1/payments": "slow", "/v1/quick": "quick"} {
			rec, err := h.store.Lookup(t.Context(), extproc.StoredKey(h.policy, path, key))
			require.NoError(t, err)
			require.Equal(t, cache.Pending, rec.State)
			require.True(t, rec.ExpiresAt.After(h.clock.Now()), "%s's lease lapsed at %s", key, rec.ExpiresAt)
		}
	}
	requireProblem(t, h.do(post("/v1/quick", "quick", `{}`), created), 409, "request-in-progress")
	for _, s := range []*stream{slow, quick} {
		s.send(responseHeaders(created))
		s.send(responseBody(created.body, true))
	}
	require.Equal(t, []string{"true"}, h.do(post("/v1/quick", "quick", `{}`), created).header(replayed))
	require.Equal(t, 0, h.clock.Pending(), "no renewal timer once no lease is held")
}

func TestLeaseExpiresWithoutRenewal(t *testing.T) {
	// Replica a claims a key and crashes: its clock never runs again, so it renews nothing.
	// Replica b, on the same store, finds the key free once the lease expires.
	storeClock := clock.NewFake(time.Unix(1_700_000_000, 0))
	store, err := cache.NewMemory(cache.MemoryOptions{Clock: storeClock})
	require.NoError(t, err)
	a := newHarness(t, harnessOptions{policy: "defaults: {lock_ttl: 3s}", store: store})
	b := newHarness(t, harnessOptions{policy: "defaults: {lock_ttl: 3s}", store: store})
	s := a.open()
	s.send(requestHeaders(post("/v1/payments", "k", `{}`)))
	s.send(requestBody([]byte(`{}`)))
	requireProblem(t, b.do(post("/v1/payments", "k", `{}`), created), 409, "request-in-progress")
	storeClock.Advance(2 * time.Second)
	requireProblem(t, b.do(post("/v1/payments", "k", `{}`), created), 409, "request-in-progress")
	storeClock.Advance(time.Second)
	require.True(t, b.do(post("/v1/payments", "k", `{}`), created).executed, "the key is free after lock_ttl")
}

func TestStreamedResponseBody(t *testing.T) {
	for _, tc := range []struct {
		name     string
		policy   string
		replayed bool
	}{
		{"fits", "", true},
		{"larger than max_response_bytes", "defaults: {max_response_bytes: 5000}", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, harnessOptions{policy: tc.policy})
			body := bytes.Repeat([]byte("0123456789abcdef"), 1024) // 16 KiB in 4 chunks
			s := claimWithResponseMode(h, filterextproc.ProcessingMode_STREAMED)
			s.send(responseHeaders(upstream{status: 200, headers: []string{"content-type", "text/plain"}, body: body}))
			for i := 0; i < 4; i++ {
				chunk := body[i*4096 : (i+1)*4096]
				require.NotNil(t, s.send(responseBody(chunk, false)).GetResponseBody(), "every chunk is answered")
				requireProblem(t, h.do(post("/v1/payments", "k", `{}`), created), 409, "request-in-progress")
			}
			require.NotNil(t, s.send(responseBody(nil, true)).GetResponseBody(), "an empty last chunk ends the body")
			res := h.do(post("/v1/payments", "k", `{}`), created)
			if tc.replayed {
				require.Equal(t, body, res.body)
				require.Equal(t, []string{"true"}, res.header(replayed))
			} else {
				requireProblem(t, res, 409, "response-not-replayable")
			}
		})
	}
}

func TestBufferedResponseWithTrailersIsComplete(t *testing.T) {
	// With trailers, Envoy sends the buffered body with end_of_stream false (Filter::onTrailers in
	// source/extensions/filters/http/ext_proc/ext_proc.cc).
	h := newHarness(t, harnessOptions{})
	s := h.open()
	s.send(requestHeaders(post("/v1/payments", "k", `{}`)))
	s.send(requestBody([]byte(`{}`)))
	s.send(responseHeaders(created))
	s.send(responseBody(created.body, false))
	require.Equal(t, created.body, h.do(post("/v1/payments", "k", `{}`), created).body)
}

func TestReplayHeaders(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: `defaults: {exclude_response_headers: [x-trace], replay_header: idempotent-replayed, expires_header: "", first_sent_header: ""}`})
	up := upstream{status: 200, body: []byte("no type"), headers: []string{
		"set-cookie", "a=1", "vary", "accept", "set-cookie", "b=2", "x-trace", "t", "set-cookie", "c=3",
	}}
	// The replay's exact answer, the first request and its duplicate written by hand: the stored
	// headers keep the upstream's order.
	first := h.open()
	first.send(requestHeaders(post("/v1/payments", "k", `{}`)))
	first.send(requestBody([]byte(`{}`)))
	first.send(responseHeaders(up))
	first.send(responseBody(up.body, true))
	first.end()
	h.waitIdle(t)
	s := h.open()
	s.send(requestHeaders(post("/v1/payments", "k", `{}`)))
	ir := s.send(requestBody([]byte(`{}`))).GetImmediateResponse()
	require.Equal(t, 200, int(ir.GetStatus().GetCode()))
	var got []string
	for _, o := range ir.GetHeaders().GetSetHeaders() {
		//lint:ignore SA1019 ext_proc honours only the deprecated append flag (MutationUtils::applyHeaderMutations)
		got = append(got, fmt.Sprintf("%s=%s append=%v value=%q", o.GetHeader().GetKey(), o.GetHeader().GetRawValue(), o.GetAppend().GetValue(), o.GetHeader().GetValue()))
	}
	require.Equal(t, []string{
		`set-cookie=a=1 append=false value=""`,
		`vary=accept append=false value=""`,
		`set-cookie=b=2 append=true value=""`,
		`set-cookie=c=3 append=true value=""`,
		`idempotent-replayed=true append=false value=""`,
	}, got)
	require.Empty(t, ir.GetHeaders().GetRemoveHeaders(), "removing content-type cannot work: Envoy adds text/plain after the mutations")
	s.end()
	// What a client of a duplicate gets through Envoy.
	require.True(t, h.do(post("/v1/payments", "k2", `{}`), up).executed)
	res := h.do(post("/v1/payments", "k2", `{}`), up)
	require.Equal(t, 200, res.status)
	require.Equal(t, up.body, res.body)
	require.Equal(t, []string{"a=1", "b=2", "c=3"}, res.header("set-cookie"), "every value, in order")
	require.Equal(t, []string{"accept"}, res.header("vary"))
	require.Equal(t, []string{"true"}, res.header("idempotent-replayed"))
	require.Empty(t, res.header("x-trace"), "excluded")
	require.Equal(t, []string{"text/plain"}, res.header("content-type"),
		"a stored response without content-type replays through Envoy as text/plain")
	require.False(t, res.executed)
}

func TestKeysAreScoped(t *testing.T) {
	forEachStore(t, func(t *testing.T, newStore func(t *testing.T) testStore) {
		testKeysAreScoped(t, newStore(t))
	})
}

func testKeysAreScoped(t *testing.T, ts testStore) {
	h := newHarness(t, harnessOptions{store: ts.store, advance: ts.advance, policy: `
routes:
  - name: ledger
    match: {path_regex: '^/v1/organizations/(?P<org>[^/]+)/transactions'}
    scope_path_params: [org]
`})
	alice := post("/v1/payments", "shared", `{}`, "authorization", "Bearer alice")
	bob := post("/v1/payments", "shared", `{}`, "authorization", "Bearer bob")
	require.True(t, h.do(alice, created).executed)
	require.True(t, h.do(bob, created).executed, "another caller's equal key is another record")
	require.Equal(t, 2, h.executions("shared"))
	require.False(t, h.do(alice, created).executed)
	require.False(t, h.do(bob, created).executed)
	anon := post("/v1/payments", "shared", `{}`)
	require.True(t, h.do(anon, created).executed, "no authorization is a scope of its own")

	o1 := post("/v1/organizations/o1/transactions", "tx", `{}`)
	o2 := post("/v1/organizations/o2/transactions", "tx", `{}`)
	require.True(t, h.do(o1, created).executed)
	require.True(t, h.do(o2, created).executed, "scope_path_params separate organizations")
	require.NotEqual(t,
		extproc.StoredKey(h.policy, "/v1/payments", "k", "authorization", "a"),
		extproc.StoredKey(h.policy, "/v1/payments", "k", "authorization", "b"))
	require.True(t, strings.HasPrefix(extproc.StoredKey(h.policy, "/v1/payments", "k"), "idempotency:"))
	require.NotContains(t, extproc.StoredKey(h.policy, "/v1/payments", "raw-secret-key"), "raw-secret-key", "raw keys never reach the store")
}

func TestKeyForms(t *testing.T) {
	h := newHarness(t, harnessOptions{})
	require.True(t, h.do(post("/v1/payments", "", `{}`, "idempotency-key", `"abc"`), created).executed)
	for _, same := range [][]string{
		{"idempotency-key", "abc"},
		{"x-idempotency-key", "abc"},
		{"x-idempotency", ` "abc" `},
		{"idempotency-key", "abc", "x-idempotency", `"abc"`},
		{"idempotency-key", "abc", "idempotency-key", "abc"},
	} {
		res := h.do(post("/v1/payments", "", `{}`, same...), created)
		require.False(t, res.executed, "%v is the same key", same)
	}
	require.True(t, h.do(post("/v1/payments", "", `{}`, "idempotency-key", `"a\"b"`), created).executed)
	require.False(t, h.do(post("/v1/payments", "", `{}`, "idempotency-key", `a"b`), created).executed, `an escaped quote unquotes to a"b`)
}

// TestLongestDurations runs a request under the longest ttl, max_ttl and lock_ttl the policy
// takes: the store must take them too, and keep the record.
func TestLongestDurations(t *testing.T) {
	require.Equal(t, cache.MaxTTL, policy.MaxDuration, "the policy must refuse what the stores refuse")
	h := newHarness(t, harnessOptions{policy: "defaults: {ttl: 87600h, max_ttl: 87600h, lock_ttl: 87600h}"})
	require.True(t, h.do(post("/v1/payments", "k", `{}`, "x-ttl", "999999999999999999999999"), created).executed)
	h.clock.Advance(24 * time.Hour)
	res := h.do(post("/v1/payments", "k", `{}`), created)
	require.False(t, res.executed)
	require.Equal(t, 201, res.status)
}

func TestTTLHeader(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: "defaults: {ttl: 1h, max_ttl: 2h}"})
	h.do(post("/v1/payments", "short", `{}`, "x-ttl", "60"), created)
	h.do(post("/v1/payments", "capped", `{}`, "x-ttl", "999999999999999999999999"), created)
	h.do(post("/v1/payments", "default", `{}`), created)
	// A later request's TTL is ignored.
	require.False(t, h.do(post("/v1/payments", "short", `{}`, "x-ttl", "7200"), created).executed)

	h.clock.Advance(61 * time.Second)
	require.True(t, h.do(post("/v1/payments", "short", `{}`), created).executed, "x-ttl: 60 expires after a minute")
	require.False(t, h.do(post("/v1/payments", "default", `{}`), created).executed)
	h.clock.Advance(time.Hour)
	require.True(t, h.do(post("/v1/payments", "default", `{}`), created).executed, "the route's ttl")
	require.False(t, h.do(post("/v1/payments", "capped", `{}`), created).executed)
	h.clock.Advance(time.Hour)
	require.True(t, h.do(post("/v1/payments", "capped", `{}`), created).executed, "capped at max_ttl")
}

func TestBodilessRequestClaimsAtHeaders(t *testing.T) {
	h := newHarness(t, harnessOptions{})
	r := request{method: "POST", path: "/v1/ping", headers: []string{"idempotency-key", "k"}}
	res := h.do(r, upstream{status: 204})
	require.True(t, res.executed)
	require.Equal(t, []string{"false"}, res.header(replayed))
	res = h.do(r, upstream{status: 204})
	require.False(t, res.executed)
	require.Equal(t, 204, res.status)
	require.Empty(t, res.body)
}

func TestMessagesOutOfOrder(t *testing.T) {
	cases := []struct {
		name string
		msgs []*extprocv3.ProcessingRequest
		want []string // the kind of each answer
	}{
		{"body before headers", []*extprocv3.ProcessingRequest{requestBody([]byte("x")), requestHeaders(post("/v1/payments", "k", ""))},
			[]string{"request_body", "request_headers"}},
		{"response without request", []*extprocv3.ProcessingRequest{responseHeaders(created), responseBody(created.body, true)},
			[]string{"response_headers", "response_body"}},
		{"headers twice", []*extprocv3.ProcessingRequest{requestHeaders(post("/v1/x", "", "")), requestHeaders(post("/v1/x", "", ""))},
			[]string{"request_headers", "request_headers"}},
		{"trailers", []*extprocv3.ProcessingRequest{
			{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}},
			{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}},
		}, []string{"request_trailers", "response_trailers"}},
		{"pass-through still answered if Envoy ignores the override", []*extprocv3.ProcessingRequest{
			requestHeaders(request{method: "GET", path: "/"}), responseHeaders(created), responseBody(created.body, true),
		}, []string{"request_headers", "response_headers", "response_body"}},
		{"response body without headers while running", []*extprocv3.ProcessingRequest{
			requestHeaders(post("/v1/payments", "k2", `{}`)), requestBody([]byte(`{}`)), responseBody([]byte("x"), true),
		}, []string{"request_headers", "request_body", "response_body"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, harnessOptions{})
			s := h.open()
			for i, m := range c.msgs {
				resp := s.send(m)
				require.Equal(t, c.want[i], kind(resp), "answer %d", i)
			}
			s.end()
			h.waitIdle(t)
		})
	}
	t.Run("empty message ends the stream cleanly", func(t *testing.T) {
		h := newHarness(t, harnessOptions{})
		s := h.open()
		require.NoError(t, s.s.Send(&extprocv3.ProcessingRequest{}))
		_, err := s.s.Recv()
		require.ErrorIs(t, err, io.EOF, "a clean close, which Envoy treats as 'continue without the processor'")
	})
}

func kind(resp *extprocv3.ProcessingResponse) string {
	switch resp.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_RequestHeaders:
		return "request_headers"
	case *extprocv3.ProcessingResponse_RequestBody:
		return "request_body"
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		return "response_headers"
	case *extprocv3.ProcessingResponse_ResponseBody:
		return "response_body"
	case *extprocv3.ProcessingResponse_RequestTrailers:
		return "request_trailers"
	case *extprocv3.ProcessingResponse_ResponseTrailers:
		return "response_trailers"
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		return "immediate_response"
	case *extprocv3.ProcessingResponse_StreamedImmediateResponse:
		return "streamed_immediate_response"
	}
	return "unknown"
}

// TestModeOverridesSpellEveryField holds the two mode_override values, field by field, to the
// two entries allowed_override_modes lists (envoy/envoy.yaml): Envoy compares them as raw values,
// so every field is spelled out.
func TestModeOverridesSpellEveryField(t *testing.T) {
	const (
		send = filterextproc.ProcessingMode_SEND
		skip = filterextproc.ProcessingMode_SKIP
		none = filterextproc.ProcessingMode_NONE
	)
	for name, c := range map[string]struct {
		got            *filterextproc.ProcessingMode
		responseHeader filterextproc.ProcessingMode_HeaderSendMode
	}{
		"pass-through": {extproc.PassThroughMode(), skip},
		"no-store":     {extproc.NoStoreMode(), send},
	} {
		require.Equal(t, send, c.got.GetRequestHeaderMode(), name)
		require.Equal(t, none, c.got.GetRequestBodyMode(), name)
		require.Equal(t, skip, c.got.GetRequestTrailerMode(), name)
		require.Equal(t, c.responseHeader, c.got.GetResponseHeaderMode(), name)
		require.Equal(t, none, c.got.GetResponseBodyMode(), name)
		require.Equal(t, skip, c.got.GetResponseTrailerMode(), name)
	}
}

func TestPassThroughOverride(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: `
routes: [{name: health, match: {path_prefix: /healthz}, enabled: false}]
`})
	for _, r := range []request{
		{method: "GET", path: "/v1/payments", headers: []string{"idempotency-key", "k"}},
		post("/healthz", "k", `{}`),
		post("/v1/payments", "", `{}`),
	} {
		s := h.open()
		resp := s.send(requestHeaders(r))
		require.NotNil(t, resp.GetRequestHeaders())
		require.Nil(t, resp.GetRequestHeaders().GetResponse(), "no mutation")
		require.Equal(t, extproc.PassThroughMode().String(), resp.GetModeOverride().String())
		s.end()
	}
	h.waitIdle(t)
	require.Equal(t, 2.0, h.counter("idempotency_requests_total", "route", "default", "outcome", "passthrough"))
	require.Equal(t, 1.0, h.counter("idempotency_requests_total", "route", "health", "outcome", "passthrough"))
}

func TestStreamErrorsAreNotLogged(t *testing.T) {
	h := newHarness(t, harnessOptions{})
	s := h.open()
	s.send(requestHeaders(request{method: "GET", path: "/"}))
	s.end()
	h.waitIdle(t)
	require.NotContains(t, h.logs.String(), `"level":"error"`)
}

func TestHeaderMapValueFallback(t *testing.T) {
	// Envoy always sends raw_value; a client that sends value only is still understood.
	h := newHarness(t, harnessOptions{})
	s := h.open()
	m := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
			{Key: ":method", Value: "POST"}, {Key: ":path", Value: "/v1/payments"}, {Key: "idempotency-key", Value: "bad key"},
		}},
		EndOfStream: true,
	}}}
	res, ok := immediateAnswer(s.send(m))
	require.True(t, ok)
	requireProblem(t, res, 400, "invalid-idempotency-key")
}

func TestServerEndsOnTransportError(t *testing.T) {
	h := newHarness(t, harnessOptions{})
	ctx, cancel := context.WithCancel(t.Context())
	s, err := h.client.Process(ctx)
	require.NoError(t, err)
	require.NoError(t, s.Send(requestHeaders(post("/v1/payments", "k", `{}`))))
	_, err = s.Recv()
	require.NoError(t, err)
	cancel()
	_, err = s.Recv()
	require.Equal(t, codes.Canceled, status.Code(err))
	h.waitIdle(t)
}

// A request whose body phase never came (trailers without data under request_trailer_mode SKIP,
// or an upstream that answered before the body ended) went upstream unprotected: its response
// gets the replay header and the no-store override.
func TestRequestBodyNeverCame(t *testing.T) {
	h := newHarness(t, harnessOptions{})
	s := h.open()
	s.send(requestHeaders(post("/v1/payments", "k", `{}`)))
	resp := s.send(responseHeaders(created))
	mutation := resp.GetResponseHeaders().GetResponse().GetHeaderMutation()
	require.Equal(t, []string{replayed, "false"}, setHeaders(mutation))
	require.Empty(t, mutation.GetRemoveHeaders())
	require.Equal(t, filterextproc.ProcessingMode_NONE, resp.GetModeOverride().GetResponseBodyMode())
	s.end()
	h.waitIdle(t)
	require.Contains(t, h.logs.String(), "this request ran unprotected")
	h.requireStoreEmpty(t, "k")
}

// A stream Envoy ends during the claim's store call (the client went away) is not a store
// failure: no error is logged and no store_error counted.
func TestStreamEndedDuringClaim(t *testing.T) {
	store := newFailingStore(t, true) // calls block until their context ends
	store.timeout = time.Minute
	h := newHarness(t, harnessOptions{policy: "store_timeout: 1m", store: store})
	s := h.open()
	s.send(requestHeaders(post("/v1/payments", "k", `{}`)))
	require.NoError(t, s.s.Send(requestBody([]byte(`{}`))))
	require.Eventually(t, func() bool { return store.calls.Load() == 1 }, 5*time.Second, time.Millisecond)
	s.end()
	h.waitIdle(t)
	require.Zero(t, h.counter("idempotency_requests_total", "route", "default", "outcome", "store_error"))
	require.NotContains(t, h.logs.String(), `"level":"error"`)
	require.Contains(t, h.logs.String(), "stream ended during the store call")
}

// In observability mode Envoy ignores every answer: the processor answers nothing, takes no
// lease, and says once that nothing is protected.
func TestObservabilityModeIsRefused(t *testing.T) {
	h := newHarness(t, harnessOptions{})
	for range 2 {
		s := h.open()
		first := requestHeaders(post("/v1/payments", "k", `{}`))
		first.ObservabilityMode = true
		require.NoError(t, s.s.Send(first))
		body := requestBody([]byte(`{}`))
		body.ObservabilityMode = true
		require.NoError(t, s.s.Send(body))
		require.NoError(t, s.s.CloseSend())
		_, err := s.s.Recv()
		require.ErrorIs(t, err, io.EOF, "no answer, and the stream ends with Envoy's half-close")
	}
	h.waitIdle(t)
	h.requireStoreEmpty(t, "k")
	require.Equal(t, 1, strings.Count(h.logs.String(), "observability_mode"), "said once")
}

// panickyCompletions is a store whose Complete panics, standing for a bug inside a store; it
// counts the calls made after.
type panickyCompletions struct {
	cache.Store
	after atomic.Int32
}

func (p *panickyCompletions) Complete(context.Context, cache.Lease, cache.Response) error {
	panic("boom")
}

func (p *panickyCompletions) Release(ctx context.Context, l cache.Lease) error {
	p.after.Add(1)
	return p.Store.Release(ctx, l)
}

// panickyTimers is a clock whose AfterFunc panics, standing for a bug in the stream's own code:
// the renewal timer is set once the claim holds its lease.
type panickyTimers struct{ clock.Clock }

func (panickyTimers) AfterFunc(time.Duration, func()) clock.Timer { panic("boom") }

// newPanicServer is a server on store and clk, its logs in logs.
func newPanicServer(t *testing.T, store cache.Store, clk clock.Clock, logs io.Writer) *extproc.Server {
	t.Helper()
	metrics, err := extproc.NewMetrics(prometheus.NewRegistry())
	require.NoError(t, err)
	logger := zerolog.New(logs)
	srv, err := extproc.NewServer(extproc.Options{Store: store, Policy: policy.Default(), Logger: &logger, Metrics: metrics, Clock: clk})
	require.NoError(t, err)
	return srv
}

// serveIntercepted runs srv's Process on ss through its stream interceptor, as the gRPC server
// of cmd does.
func serveIntercepted(srv *extproc.Server, ss extprocv3.ExternalProcessor_ProcessServer) error {
	return srv.StreamInterceptor()(srv, ss, &grpc.StreamServerInfo{FullMethod: "/envoy.service.ext_proc.v3.ExternalProcessor/Process"},
		func(_ any, ss grpc.ServerStream) error {
			return srv.Process(ss.(extprocv3.ExternalProcessor_ProcessServer))
		})
}

// A panic in a stream's own code ends that stream with an error and releases its lease; the
// process goes on: grpc-go would let the panic take it, and the memory store, down.
func TestPanicEndsOnlyItsStream(t *testing.T) {
	m, err := cache.NewMemory(cache.MemoryOptions{})
	require.NoError(t, err)
	logs := &syncBuffer{}
	srv := newPanicServer(t, m, panickyTimers{clock.Real{}}, logs)
	msgs := []*extprocv3.ProcessingRequest{requestHeaders(post("/v1/payments", "k", `{}`)), requestBody([]byte(`{}`))}
	err = serveIntercepted(srv, &memStream{ctx: t.Context(), msgs: msgs, script: true})
	require.Equal(t, codes.Internal, status.Code(err), "the stream ends with an error: %v", err)
	require.Contains(t, logs.String(), "stream handler panicked")
	require.Nil(t, storedRecord(t, m, policy.Default(), "k"), "the lease was released (unknown outcome)")
}

// A panic inside a store call ends the process, and no further store call is made: the store
// may be left locked or half changed, and a process that went on would hang or serve from it.
func TestPanicInTheStoreEndsTheProcess(t *testing.T) {
	m, err := cache.NewMemory(cache.MemoryOptions{})
	require.NoError(t, err)
	store := &panickyCompletions{Store: m}
	srv := newPanicServer(t, store, clock.Real{}, io.Discard)
	msgs := []*extprocv3.ProcessingRequest{requestHeaders(post("/v1/payments", "k", `{}`)), requestBody([]byte(`{}`)),
		responseHeaders(created), responseBody(created.body, true)}
	defer func() {
		p := recover()
		require.NotNil(t, p, "the panic goes on")
		require.Contains(t, fmt.Sprint(p), "panic in a store call: boom")
		require.Zero(t, store.after.Load(), "no store call after the panic")
	}()
	_ = serveIntercepted(srv, &memStream{ctx: t.Context(), msgs: msgs, script: true})
}

// slowRenewals is a store whose renewals hang until their context ends.
type slowRenewals struct {
	cache.Store
	renewing chan struct{}
}

func (s *slowRenewals) Renew(ctx context.Context, _ cache.Lease, _ time.Duration) error {
	s.renewing <- struct{}{}
	<-ctx.Done()
	return ctx.Err()
}

// The completion is the phase's one store call: a renewal in flight when the response
// ends is cut short, not waited for, or the phase could take two store timeouts and outlast
// Envoy's message_timeout.
func TestRenewalInFlightDoesNotDelayCompletion(t *testing.T) {
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	m, err := cache.NewMemory(cache.MemoryOptions{Clock: clk})
	require.NoError(t, err)
	store := &slowRenewals{Store: m, renewing: make(chan struct{}, 1)}
	h := newHarness(t, harnessOptions{policy: "store_timeout: 1m\ndefaults: {lock_ttl: 3s}", store: store, clock: clk})
	s := h.open()
	s.send(requestHeaders(post("/v1/payments", "k", `{}`)))
	s.send(requestBody([]byte(`{}`)))
	advanced := make(chan struct{})
	go func() {
		h.clock.Advance(time.Second) // the renewal comes due and hangs in the store
		close(advanced)
	}()
	<-store.renewing

	answered := make(chan error, 1)
	go func() {
		for _, m := range []*extprocv3.ProcessingRequest{responseHeaders(created), responseBody(created.body, true)} {
			if err := s.s.Send(m); err != nil {
				answered <- err
				return
			}
			if _, err := s.s.Recv(); err != nil {
				answered <- err
				return
			}
		}
		answered <- nil
	}()
	select {
	case err := <-answered:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("the completion waited for the renewal in flight, bounded by a 1m store_timeout")
	}
	<-advanced
	res := h.do(post("/v1/payments", "k", `{}`), created)
	require.Equal(t, []string{"true"}, res.header(replayed))
	require.NotContains(t, h.logs.String(), `"op":"renew"`, "a renewal cut short is not a store failure")
}

// Where each tenant has a host of its own, scope_headers may name :authority, Envoy's name for
// the request's host: equal keys on two hosts are two records.
func TestScopeByAuthority(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: `defaults: {scope_headers: [authorization, ":authority"]}`})
	require.True(t, h.do(post("/v1/payments", "k", `{}`, ":authority", "a.example.com"), created).executed)
	require.True(t, h.do(post("/v1/payments", "k", `{}`, ":authority", "b.example.com"), created).executed,
		"another host is another scope")
	require.Equal(t, []string{"true"}, h.do(post("/v1/payments", "k", `{}`, ":authority", "a.example.com"), created).header(replayed))
}

// fingerprint_headers join the payload; an empty fingerprint turns the mismatch check off.
func TestFingerprintPolicy(t *testing.T) {
	t.Run("headers", func(t *testing.T) {
		h := newHarness(t, harnessOptions{policy: "defaults: {fingerprint_headers: [x-api-version]}"})
		require.True(t, h.do(post("/v1/payments", "k", `{}`, "x-api-version", "1"), created).executed)
		require.Equal(t, []string{"true"}, h.do(post("/v1/payments", "k", `{}`, "x-api-version", "1"), created).header(replayed))
		requireProblem(t, h.do(post("/v1/payments", "k", `{}`, "x-api-version", "2"), created), 422, "idempotency-key-reused")
		requireProblem(t, h.do(post("/v1/payments", "k", `{}`), created), 422, "idempotency-key-reused")
	})
	t.Run("off", func(t *testing.T) {
		h := newHarness(t, harnessOptions{policy: "defaults: {fingerprint: []}"})
		require.True(t, h.do(post("/v1/payments", "k", `{"amount":1}`), created).executed)
		res := h.do(post("/v1/payments", "k", `{"amount":2}`), created)
		require.Equal(t, []string{"true"}, res.header(replayed), "another body under the same key is replayed")
		require.Equal(t, 1, h.executions("k"))
	})
	t.Run("off on one route", func(t *testing.T) {
		// A key reused on another endpoint is a mismatch, whichever of the two checks payloads.
		h := newHarness(t, harnessOptions{policy: `
routes:
  - {name: loose, match: {path_prefix: /v1/loose}, fingerprint: []}
  - {name: other-loose, match: {path_prefix: /v1/other}, fingerprint: []}
`})
		require.True(t, h.do(post("/v1/payments", "a", `{}`), created).executed)
		requireProblem(t, h.do(post("/v1/loose", "a", `{}`), created), 422, "idempotency-key-reused")
		require.True(t, h.do(post("/v1/loose/x", "b", `{"amount":1}`), created).executed)
		require.Equal(t, []string{"true"}, h.do(post("/v1/loose/y", "b", `{"amount":2}`), created).header(replayed),
			"within the route nothing is checked")
		requireProblem(t, h.do(post("/v1/payments", "b", `{}`), created), 422, "idempotency-key-reused")
		requireProblem(t, h.do(post("/v1/other", "b", `{}`), created), 422, "idempotency-key-reused")
		require.Equal(t, 1, h.executions("a"))
		require.Equal(t, 1, h.executions("b"))
	})
	t.Run("records of older builds", func(t *testing.T) {
		// Builds before the route's name was the fingerprint stored none for such a route.
		h := newHarness(t, harnessOptions{policy: "routes: [{name: loose, match: {path_prefix: /v1/loose}, fingerprint: []}]"})
		l, _, err := h.store.Acquire(t.Context(), extproc.StoredKey(h.policy, "/v1/loose", "old"), cache.Claim{LockTTL: time.Minute, TTL: time.Hour})
		require.NoError(t, err)
		require.NoError(t, h.store.Complete(t.Context(), l, cache.Response{Status: 201, Body: []byte("stored")}))
		res := h.do(post("/v1/loose", "old", `{}`), created)
		require.Equal(t, []string{"true"}, res.header(replayed), "the route accepts its old record")
		require.Equal(t, []byte("stored"), res.body)
	})
}

// claimWithResponseMode opens a stream that claims key k with a POST of {}, Envoy announcing mode
// as its response_body_mode; the request is running upstream.
func claimWithResponseMode(h *harness, mode filterextproc.ProcessingMode_BodySendMode) *stream {
	s := h.open()
	first := requestHeaders(post("/v1/payments", "k", `{}`))
	first.ProtocolConfig.ResponseBodyMode = mode
	s.send(first)
	s.send(requestBody([]byte(`{}`)))
	return s
}

// With response_body_mode NONE the body never comes: the outcome is recorded at the response
// headers, without the body, so a duplicate never runs.
func TestResponseBodyModeNone(t *testing.T) {
	h := newHarness(t, harnessOptions{})
	s := claimWithResponseMode(h, filterextproc.ProcessingMode_NONE)
	res := s.send(responseHeaders(created))
	require.NotNil(t, res.GetResponseHeaders())
	s.end()
	requireProblem(t, h.do(post("/v1/payments", "k", `{}`), created), 409, "response-not-replayable")
	require.Zero(t, h.executions("k"), "the duplicate never went upstream")
}

// A STREAMED response whose upstream sends trailers ends its last chunk with end_of_stream false;
// with response_trailer_mode SEND, the trailers message ends it, and the record is written then.
func TestStreamedResponseEndedByTrailers(t *testing.T) {
	h := newHarness(t, harnessOptions{})
	s := claimWithResponseMode(h, filterextproc.ProcessingMode_STREAMED)
	s.send(responseHeaders(created))
	s.send(responseBody(created.body[:5], false))
	s.send(responseBody(created.body[5:], false))
	requireProblem(t, h.do(post("/v1/payments", "k", `{}`), created), 409, "request-in-progress")
	resp := s.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}})
	require.NotNil(t, resp.GetResponseTrailers())
	res := h.do(post("/v1/payments", "k", `{}`), created)
	require.Equal(t, []string{"true"}, res.header(replayed))
	require.Equal(t, created.body, res.body)
}

// The policy fields that shape a request's record, each at the request level: key_prefix,
// scope_headers, store_statuses, key_headers and methods.
func TestPolicyFieldsAtTheRequest(t *testing.T) {
	t.Run("key_prefix", func(t *testing.T) {
		store, err := cache.NewMemory(cache.MemoryOptions{})
		require.NoError(t, err)
		a := newHarness(t, harnessOptions{store: store, policy: "defaults: {key_prefix: 'a:'}"})
		b := newHarness(t, harnessOptions{store: store, policy: "defaults: {key_prefix: 'b:'}"})
		require.True(t, a.do(post("/v1/payments", "k", `{}`), created).executed)
		require.True(t, b.do(post("/v1/payments", "k", `{}`), created).executed, "another prefix is another record on a shared store")
		require.False(t, b.do(post("/v1/payments", "k", `{}`), created).executed)
		require.True(t, strings.HasPrefix(extproc.StoredKey(a.policy, "/v1/payments", "k"), "a:"))
	})
	t.Run("scope_headers", func(t *testing.T) {
		h := newHarness(t, harnessOptions{policy: "defaults: {scope_headers: [x-api-key]}"})
		require.True(t, h.do(post("/v1/payments", "k", `{}`, "x-api-key", "one"), created).executed)
		require.True(t, h.do(post("/v1/payments", "k", `{}`, "x-api-key", "two"), created).executed, "another API key is another scope")
		res := h.do(post("/v1/payments", "k", `{}`, "x-api-key", "one", "authorization", "Bearer other"), created)
		require.Equal(t, []string{"true"}, res.header(replayed), "authorization is no longer part of the scope")
	})
	t.Run("store_statuses", func(t *testing.T) {
		h := newHarness(t, harnessOptions{policy: "defaults: {store_statuses: [2xx, 409]}"})
		conflict := upstream{status: 409, headers: []string{"content-type", "application/json"}, body: []byte(`{"error":"taken"}`)}
		require.True(t, h.do(post("/v1/payments", "k", `{}`), conflict).executed)
		res := h.do(post("/v1/payments", "k", `{}`), created)
		require.Equal(t, 409, res.status, "a listed status is stored and replayed")
		require.Equal(t, []string{"true"}, res.header(replayed))
		failed := upstream{status: 500, body: []byte("boom")}
		require.True(t, h.do(post("/v1/payments", "e", `{}`), failed).executed)
		require.True(t, h.do(post("/v1/payments", "e", `{}`), created).executed, "an unlisted status is released")
	})
	t.Run("key_headers", func(t *testing.T) {
		h := newHarness(t, harnessOptions{policy: "defaults: {key_headers: [x-request-key]}"})
		req := request{method: "POST", path: "/v1/payments", headers: []string{"x-request-key", "k"}, body: []byte(`{}`)}
		require.True(t, h.do(req, created).executed)
		require.Equal(t, []string{"true"}, h.do(req, created).header(replayed))
		other := post("/v1/payments", "k", `{}`) // idempotency-key is no longer a key header
		res := h.do(other, created)
		require.True(t, res.executed)
		require.Empty(t, res.header(replayed), "without a key it is not covered")
	})
	t.Run("methods", func(t *testing.T) {
		h := newHarness(t, harnessOptions{policy: "defaults: {methods: [DELETE]}"})
		del := request{method: "DELETE", path: "/v1/payments/1", headers: []string{"idempotency-key", "k"}}
		require.True(t, h.do(del, created).executed)
		require.Equal(t, []string{"true"}, h.do(del, created).header(replayed))
		res := h.do(post("/v1/payments", "k", `{}`), created)
		require.True(t, res.executed)
		require.Empty(t, res.header(replayed), "POST is no longer covered")
	})
}

// An Envoy before 1.32 announces no protocol_config: the stream takes the shipped BUFFERED
// modes, so the request is claimed at its body and the response captured whole and stored.
func TestNoProtocolConfigIsBuffered(t *testing.T) {
	h := newHarness(t, harnessOptions{})
	s := h.open()
	first := requestHeaders(post("/v1/payments", "k", `{}`))
	first.ProtocolConfig = nil
	require.NotNil(t, s.send(first).GetRequestHeaders(), "answered at once: Envoy sends a BUFFERED body only after")
	require.NotNil(t, s.send(requestBody([]byte(`{}`))).GetRequestBody(), "claimed at the body")
	res := s.send(responseHeaders(created))
	require.NotNil(t, res.GetResponseHeaders())
	require.Nil(t, res.GetModeOverride(), "the body phase stays on: the body is stored")
	require.NotNil(t, s.send(responseBody(created.body, true)).GetResponseBody())
	s.end()
	dup := h.do(post("/v1/payments", "k", `{}`), created)
	require.Equal(t, []string{"true"}, dup.header(replayed))
	require.Equal(t, created.body, dup.body)
	require.Zero(t, h.executions("k"), "the duplicate never went upstream")
}
