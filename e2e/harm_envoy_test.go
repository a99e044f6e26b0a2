package e2e_test

import (
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/envoyconf"
	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/check"
)

// requireEnvoyRefuses holds that the shipped bootstrap edited by edit does not load: the
// emulator refuses its ext_proc filter with Envoy's own message (ext_proc's config.cc
// verifyFilterConfig), so no request is served under it (Envoy exits at start-up on a bootstrap
// file, and rejects the listener on an xDS update). The rest of the emulator's configuration is
// the shipped bootstrap's.
func requireEnvoyRefuses(t *testing.T, edit func(*bootstrapv3.Bootstrap) error, want string) {
	t.Helper()
	b, err := envoyconf.Load(repoFile(t, "envoy/envoy.yaml"))
	require.NoError(t, err)
	settings, err := envoyconf.ProxySettings(b)
	require.NoError(t, err)
	require.NoError(t, edit(b))
	f, err := envoyconf.ExtProc(b)
	require.NoError(t, err)
	cfg := settings.ProxyConfig([]string{"127.0.0.1:1"}, "http://127.0.0.1:1")
	cfg.Filter = f
	p, err := proxy.New(cfg)
	if err == nil {
		_ = p.Close()
	}
	require.ErrorContains(t, err, want, "Envoy refuses the filter")
}

// http_service in place of grpc_service: Envoy refuses the filter while it sends bodies or
// trailers (config.cc verifyProcessingModeConfig: ExtProcHttpClient posts headers only), which
// the shipped processing_mode does; with headers only the processor could claim no body.
func TestHarmGRPCServiceMissing(t *testing.T) {
	t.Parallel()
	edit := extProcEdit(func(f *filterextproc.ExternalProcessor) {
		f.GrpcService = nil
		f.HttpService = &filterextproc.ExtProcHttpService{HttpService: &corev3.HttpService{HttpUri: &corev3.HttpUri{
			Uri: "http://idempotency-extproc/process", HttpUpstreamType: &corev3.HttpUri_Cluster{Cluster: "idempotency_extproc"},
			Timeout: durationpb.New(time.Second),
		}}}
	})
	requireCheckFinds(t, harmPolicy, edit, check.Kind("grpc-service-missing"))
	requireEnvoyRefuses(t, edit, "can not be configured to send body or trailer")
}

// FULL_DUPLEX_STREAMED without trailer mode SEND. In the filter-level processing_mode Envoy
// refuses the filter (config.cc verifyProcessingModeConfig). In a route's, which Envoy does not
// check (createRouteSpecificFilterConfigTyped), a request with trailers is never seen whole:
// its last data goes with end_of_stream false, and Filter::onTrailers (ext_proc.cc) passes the
// trailers on unsent under SKIP. The processor cannot claim it: a duplicate runs again.
func TestHarmDuplexTrailerMode(t *testing.T) {
	t.Parallel()
	t.Run("filter", func(t *testing.T) {
		t.Parallel()
		edit := extProcEdit(func(f *filterextproc.ExternalProcessor) {
			f.ProcessingMode.ResponseBodyMode = filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
			f.ProcessingMode.ResponseTrailerMode = skip
		})
		requireCheckFinds(t, harmPolicy, edit, check.Kind("duplex-trailer-mode"))
		requireEnvoyRefuses(t, edit, "the response_trailer_mode has to be set to SEND")
	})
	t.Run("route", func(t *testing.T) {
		t.Parallel()
		edit := func(b *bootstrapv3.Bootstrap) error {
			if err := envoyconf.EnableHTTP1Trailers(b); err != nil {
				return err
			}
			return envoyconf.MutateExtProcPerRoute(b, "default", func(pr *filterextproc.ExtProcPerRoute) {
				m := routeMode(send, filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED, buffered, send)
				m.RequestTrailerMode = skip
				pr.Override = &filterextproc.ExtProcPerRoute_Overrides{Overrides: &filterextproc.ExtProcOverrides{ProcessingMode: m}}
			})
		}
		s := harmStack(t, check.Kind("duplex-trailer-mode"), harmPolicy, edit, stackOptions{})
		for range 2 {
			r := chunkedWithTrailer(t, s.url, "duplex-1", `{"amount":1}`, 0)
			require.Equal(t, http.StatusOK, r.StatusCode)
		}
		require.Equal(t, 2, s.up.Ran("duplex-1"), "the upstream ran the request twice")
	})
}

// heldRequestBody makes every request body reach the filter only after the request headers'
// answer, as a body the client sends after its headers does.
func heldRequestBody(*http.Request) proxy.Shapes {
	return proxy.Shapes{Request: proxy.BodyShape{DuringHeaders: proxy.Held}}
}

// A per-route request_body_mode GRPC: Envoy runs it as a mode without body messages
// (Filter::onData in ext_proc.cc has no case for it and continues), so a body that comes after
// the headers' answer goes upstream unseen while protocol_config tells the processor a body
// will come: the request runs before its key is claimed, and a duplicate runs again.
func TestHarmRouteBodyModeGRPC(t *testing.T) {
	t.Parallel()
	edit := func(b *bootstrapv3.Bootstrap) error {
		return envoyconf.MutateExtProcPerRoute(b, "refunds", func(pr *filterextproc.ExtProcPerRoute) {
			pr.GetOverrides().ProcessingMode = routeMode(send, filterextproc.ProcessingMode_GRPC, buffered, send)
		})
	}
	s := harmStack(t, check.Kind("route-body-mode-grpc"), harmPolicy, edit, stackOptions{shapes: heldRequestBody})
	runsTwice(t, s, call{path: "/v1/refunds", key: "grpc-1", body: `{"a":1}`})
}

// Without upstream.request_attempt_count, a response Envoy made before the request was sent
// upstream (here the 413 of a body over the listener's buffer limit, after the key was claimed
// at the request headers) is an unknown outcome: under unknown_outcome record the retry, which
// never ran, is refused 409 outcome-unknown instead of running.
func TestHarmAttemptCountMissing(t *testing.T) {
	t.Parallel()
	const records = "defaults:\n  unknown_outcome: record\n  fingerprint: [method, path]\n" +
		"routes:\n  - name: refunds\n    match: { path_prefix: /v1/refunds }\n"
	edit := extProcEdit(func(f *filterextproc.ExternalProcessor) {
		f.ResponseAttributes = slices.DeleteFunc(f.ResponseAttributes, func(a string) bool { return a == "upstream.request_attempt_count" })
	})
	s := harmStack(t, check.Kind("attempt-count-missing"), records, edit, stackOptions{localReplies: true, shapes: heldRequestBody})
	c := call{path: "/v1/refunds", key: "ac-1", body: strings.Repeat("a", 1<<20+64<<10)}
	first := s.do(c)
	require.Equal(t, http.StatusRequestEntityTooLarge, first.status, "Envoy answers: the body is over the listener's buffer limit")
	c.body = `{}`
	requireProblem(t, s.do(c), http.StatusConflict, "outcome-unknown")
	require.Zero(t, s.up.Total(), "the request never ran, yet its retry is refused")
}

// hedge_on_per_try_timeout: when the upstream takes longer than the per-try timeout, the router
// sends the claimed request again beside the first attempt (router.cc
// Filter::onSoftPerTryTimeout): one request, run twice.
func TestHarmHedge(t *testing.T) {
	t.Parallel()
	edit := func(b *bootstrapv3.Bootstrap) error {
		return envoyconf.MutateRoute(b, "documents", func(r *routev3.Route) error {
			r.GetRoute().RetryPolicy = &routev3.RetryPolicy{RetryOn: "connect-failure,refused-stream", PerTryTimeout: durationpb.New(200 * time.Millisecond)}
			r.GetRoute().HedgePolicy = &routev3.HedgePolicy{HedgeOnPerTryTimeout: true}
			return nil
		})
	}
	s := harmStack(t, check.Kind("hedge-policy"), harmPolicy, edit, stackOptions{})
	// The upstream takes ten per-try timeouts: the hedge starts while the first attempt runs.
	r := s.do(call{path: "/v1/documents", key: "hedge-1", body: `{}`, headers: map[string]string{"x-test-delay": "2s"}})
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	require.Equal(t, 2, s.up.Ran("hedge-1"), "one request, run twice at once")
}
