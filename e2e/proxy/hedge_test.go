package proxy_test

import (
	"net/http"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
)

// A route with hedge_on_per_try_timeout sends another attempt when one outlasts its
// per_try_timeout, leaving the first running (router.cc Filter::onSoftPerTryTimeout and
// RetryStateImpl::shouldHedgeRetryPerTryTimeout, which retries whatever retry_on says while
// retries are left): the upstream runs the request once per attempt, the processor sees one
// request, and the first response wins. Without a per-try timeout, retries or retry_on there is
// nothing to hedge on.
func TestRouterHedgesOnPerTryTimeout(t *testing.T) {
	const perTry = 100 * time.Millisecond
	hedge := &routev3.HedgePolicy{HedgeOnPerTryTimeout: true}
	retry := func(on string, retries *wrapperspb.UInt32Value, perTry time.Duration) *routev3.RetryPolicy {
		rp := &routev3.RetryPolicy{RetryOn: on, NumRetries: retries}
		if perTry > 0 {
			rp.PerTryTimeout = durationpb.New(perTry)
		}
		return rp
	}
	for _, tc := range []struct {
		name     string
		hedge    *routev3.HedgePolicy
		retry    *routev3.RetryPolicy
		attempts int
	}{
		{"one retry, the default", hedge, retry("connect-failure", nil, perTry), 2},
		{"two retries", hedge, retry("connect-failure", wrapperspb.UInt32(2), perTry), 3},
		{"no hedge policy", nil, retry("connect-failure", nil, perTry), 1},
		{"hedge_on_per_try_timeout false", &routev3.HedgePolicy{}, retry("connect-failure", nil, perTry), 1},
		{"no per-try timeout", hedge, retry("connect-failure", nil, 0), 1},
		{"num_retries 0", hedge, retry("connect-failure", wrapperspb.UInt32(0), perTry), 1},
		{"no retry_on", hedge, retry("", nil, perTry), 1},
		{"no retry policy", hedge, nil, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, bufferedFilter(), nil, func(c *proxy.Config) {
				c.Routes = []proxy.Route{{Name: "r", Prefix: "/", Retry: tc.retry, Hedge: tc.hedge}}
			})
			// Each attempt waits far longer than the per-try timeout: every hedge starts before
			// the first attempt answers, on a loaded machine too.
			resp, _ := e.do(t, http.MethodPost, "/x", []byte("the body"), "Idempotency-Key", "k", "X-Test-Delay", "2s")
			require.Equal(t, http.StatusOK, resp.StatusCode)
			reqs := e.up.Requests()
			require.Len(t, reqs, tc.attempts)
			for _, r := range reqs {
				require.Equal(t, reqs[0].BodySHA256, r.BodySHA256, "each attempt sends the same body")
			}
			require.Equal(t, tc.attempts, e.up.Ran("k"), "the upstream ran the request once per attempt")
			rec := e.record(t)
			require.Equal(t, tc.attempts, rec.Attempts)
			e.proc.next(t)
			e.proc.none(t) // the processor saw one request
		})
	}
}

// The filter-level checks of ext_proc's config.cc (verifyFilterConfig, verifyProcessingModeConfig)
// refuse http_service with a body or trailer mode that sends, and both services at once; the
// GRPC body mode is not refused there.
func TestNewRefusesWhatEnvoyRefuses(t *testing.T) {
	httpService := &corev3.HttpService{HttpUri: &corev3.HttpUri{Uri: "http://processor/", HttpUpstreamType: &corev3.HttpUri_Cluster{Cluster: "processor"}, Timeout: durationpb.New(time.Second)}}
	withHTTP := func(m *filterextproc.ProcessingMode) *filterextproc.ExternalProcessor {
		return &filterextproc.ExternalProcessor{HttpService: &filterextproc.ExtProcHttpService{HttpService: httpService}, ProcessingMode: m}
	}
	headersOnly := &filterextproc.ProcessingMode{RequestHeaderMode: filterextproc.ProcessingMode_SEND, ResponseHeaderMode: filterextproc.ProcessingMode_SEND}
	both := withHTTP(headersOnly)
	both.GrpcService = &corev3.GrpcService{TargetSpecifier: &corev3.GrpcService_EnvoyGrpc_{EnvoyGrpc: &corev3.GrpcService_EnvoyGrpc{ClusterName: "processor"}}}
	grpcBodies := bufferedFilter()
	grpcBodies.ProcessingMode.RequestBodyMode = filterextproc.ProcessingMode_GRPC
	grpcBodies.ProcessingMode.ResponseBodyMode = filterextproc.ProcessingMode_GRPC
	trailers := proto.Clone(headersOnly).(*filterextproc.ProcessingMode)
	trailers.RequestTrailerMode = filterextproc.ProcessingMode_SEND
	for _, tc := range []struct {
		name   string
		filter *filterextproc.ExternalProcessor
		want   string
	}{
		{"http_service with buffered bodies", withHTTP(bufferedFilter().GetProcessingMode()), "can not be configured to send body or trailer"},
		{"http_service with request trailers", withHTTP(trailers), "can not be configured to send body or trailer"},
		{"both services", both, "One and only one of grpc_service or http_service"},
		{"http_service, headers only (Envoy accepts it)", withHTTP(headersOnly), "http_service is not modelled"},
		{"GRPC body modes (Envoy accepts them)", grpcBodies, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := proxy.New(proxy.Config{Filter: tc.filter, Processors: []string{"127.0.0.1:1"}, Upstream: "http://127.0.0.1:1"})
			if tc.want == "" {
				require.NoError(t, err)
				require.NoError(t, p.Close())
				return
			}
			require.ErrorContains(t, err, tc.want)
		})
	}
}
