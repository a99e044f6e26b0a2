package e2e_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"go/ast"
	"go/parser"
	"go/token"
	"math/big"
	"net"
	"net/http"
	"net/url"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	mutationrulesv3 "github.com/envoyproxy/go-control-plane/envoy/config/common/mutation_rules/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	jwtauthnv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/jwt_authn/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/envoyconf"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/check"
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// An error of `check` names a way a covered request runs twice, is not protected, or is answered
// wrongly under the setting. Each error kind has here a test that runs requests through the
// setting (the bootstrap changed as the finding describes, through the emulator or a real Envoy)
// and sees that harm, after holding that check reports the kind for that very bootstrap.
// harmTests names that test for each kind.
var harmTests = map[check.Kind]string{
	check.Kind("failure-mode-allow"):               "TestHarmFailureModeAllow",
	check.Kind("observability-mode"):               "TestHarmObservabilityMode",
	check.Kind("disable-immediate-response"):       "TestHarmDisableImmediateResponse",
	check.Kind("request-header-mode"):              "TestHarmRequestHeadersSkipped",
	check.Kind("route-request-header-skip"):        "TestHarmRouteRequestHeadersSkipped",
	check.Kind("forward-rules-hide"):               "TestHarmForwardRulesHideTheKey",
	check.Kind("local-reply-config"):               "TestHarmLocalReplyConfig",
	check.Kind("mutation-rules-refuse"):            "TestHarmMutationRulesRefuseTheReplayHeader",
	check.Kind("route-name-attribute-missing"):     "TestHarmRouteNameNotSent",
	check.Kind("route-name-matches-nothing"):       "TestHarmRouteNameMatchesNothing",
	check.Kind("no-ext-proc"):                      "TestHarmNoExtProc",
	check.Kind("code-details-missing"):             "TestHarmCodeDetailsMissing",
	check.Kind("response-body-mode"):               "TestHarmResponseBodyNone",
	check.Kind("route-response-body-none"):         "TestHarmRouteResponseBodyNone",
	check.Kind("request-trailer-mode"):             "TestRequestTrailersWithoutBody",
	check.Kind("response-header-mode"):             "TestHarmResponseHeadersSkipped",
	check.Kind("route-response-header-skip"):       "TestHarmRouteResponseHeadersSkipped",
	check.Kind("request-body-mode"):                "TestHarmRequestBodyNone",
	check.Kind("route-request-body-none"):          "TestHarmRouteRequestBodyNone",
	check.Kind("processing-mode-missing"):          "TestHarmProcessingModeMissing",
	check.Kind("router-retry"):                     "TestHarmRouterRetry",
	check.Kind("router-retry-stored-status"):       "TestHarmRouterRetryOnAStoredStatus",
	check.Kind("gateway-api-retry"):                "TestHarmGatewayAPIRetry",
	check.Kind("jwt-payload-not-forwarded"):        "TestHarmJWTPayloadNotForwarded",
	check.Kind("jwt-authn-missing"):                "TestHarmNoJWTAuthn",
	check.Kind("jwt-payload-missing"):              "TestHarmJWTPayloadNotWritten",
	check.Kind("jwt-payload-key"):                  "TestHarmJWTPayloadKeyNotWritten",
	check.Kind("mutation-disallow-is-error"):       "TestHarmMutationDisallowIsError",
	check.Kind("message-timeout-in-flight-wait"):   "TestHarmMessageTimeoutBelowInFlightWait",
	check.Kind("response-buffer-limit"):            "TestHarmResponseOverTheBufferLimit",
	check.Kind("extension-policy-targets-nothing"): "TestHarmExtensionPolicyTargetsNothing",
	check.Kind("unreadable-value"):                 "TestHarmUnreadableEnvoyFilter",
	check.Kind("gateway-jwt-provider"):             "TestHarmGatewayJWTProviderName",
	check.Kind("peer-identity-attribute-missing"):  "TestHarmPeerIdentityNotSent",
	check.Kind("message-timeout"):                  "TestHarmMessageTimeoutBelowStoreTimeout",
	check.Kind("unknown-policy-route"):             "TestRouteNamedByEnvoyThroughEnvoy",
	check.Kind("grpc-service-missing"):             "TestHarmGRPCServiceMissing",
	check.Kind("grpc-streamed-replay-unsupported"): "TestHarmGRPCStreamedReplayUnsupported",
	check.Kind("duplex-trailer-mode"):              "TestHarmDuplexTrailerMode",
	check.Kind("attempt-count-missing"):            "TestHarmAttemptCountMissing",
	check.Kind("route-body-mode-grpc"):             "TestHarmRouteBodyModeGRPC",
	check.Kind("hedge-policy"):                     "TestHarmHedge",
	check.Kind("grpc-response-trailers"):           "TestHarmGRPCResponseTrailersSkipped",
	check.Kind("grpc-router-retry"):                "TestHarmGRPCRouterRetry",
}

// harmNotYetShown are the error kinds whose harm no test runs yet, each with what the test
// needs. The list may only shrink: a kind leaves it when its test joins harmTests.
var harmNotYetShown = map[check.Kind]string{}

// Every error kind has a harm test, or says what its test needs; every named test exists.
func TestEveryErrorKindShowsItsHarm(t *testing.T) {
	defined := map[string]bool{}
	files, err := filepath.Glob("*_test.go")
	require.NoError(t, err)
	fset := token.NewFileSet()
	for _, f := range files {
		file, err := parser.ParseFile(fset, f, nil, 0)
		require.NoError(t, err)
		for _, d := range file.Decls {
			if fn, ok := d.(*ast.FuncDecl); ok && fn.Recv == nil {
				defined[fn.Name.Name] = true
			}
		}
	}
	var errorKinds []check.Kind
	for k, sev := range check.Kinds() {
		if sev == check.Error {
			errorKinds = append(errorKinds, k)
		}
	}
	slices.Sort(errorKinds)
	for _, k := range errorKinds {
		test, shown := harmTests[k]
		_, pending := harmNotYetShown[k]
		switch {
		case shown && pending:
			t.Errorf("%s has a harm test (%s): remove it from harmNotYetShown", k, test)
		case shown:
			require.True(t, defined[test], "%s: no test %s in this package", k, test)
		case !pending:
			t.Errorf("error kind %s has no test that sees its harm: add one to harmTests, or make the kind a warning if nothing breaks", k)
		}
	}
	for k := range harmTests {
		require.True(t, slices.Contains(errorKinds, k), "%s is not an error kind: its test does not belong here", k)
	}
	for k := range harmNotYetShown {
		require.True(t, slices.Contains(errorKinds, k), "%s is not an error kind", k)
	}
}

// harmPolicy covers the shipped bootstrap's documents and refunds routes (refunds named by
// x-idempotency-route) and every other POST by default.
const harmPolicy = `routes:
  - name: refunds
    match: { path_prefix: /v1/refunds }
  - name: documents
    match: { path_prefix: /v1/documents }
`

// requireCheckFinds holds that check, run on the shipped bootstrap edited by edit (as the stack
// runs it) under policyText, reports kind as an error.
func requireCheckFinds(t *testing.T, policyText string, edit func(*bootstrapv3.Bootstrap) error, kind check.Kind) {
	t.Helper()
	requireCheckFindsFor(t, "", policyText, edit, kind)
}

// requireCheckFindsFor is requireCheckFinds with check's --envoy-version.
func requireCheckFindsFor(t *testing.T, envoyVersion, policyText string, edit func(*bootstrapv3.Bootstrap) error, kind check.Kind) {
	t.Helper()
	b, err := envoyconf.Load(repoFile(t, "envoy/envoy.yaml"))
	require.NoError(t, err)
	if edit != nil {
		require.NoError(t, edit(b))
	}
	js, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(b)
	require.NoError(t, err)
	p, err := policy.Parse([]byte(policyText))
	require.NoError(t, err)
	rep, err := check.Run(p, []check.Input{{Name: "edited.json", Data: js}}, check.Options{EnvoyVersion: envoyVersion})
	require.NoError(t, err)
	for _, f := range rep.Findings {
		if f.Kind == kind {
			require.Equal(t, check.Error, f.Severity)
			return
		}
	}
	require.Failf(t, "check does not report the setting", "want %s, have %v", kind, rep.Findings)
}

// harmStack checks the setting, then runs the stack with it.
func harmStack(t *testing.T, kind check.Kind, policyText string, edit func(*bootstrapv3.Bootstrap) error, o stackOptions) *stack {
	t.Helper()
	requireCheckFinds(t, policyText, edit, kind)
	o.policy, o.envoy = policyText, edit
	return newStack(t, o)
}

// runsTwice sends the same keyed request twice, one after the other, and requires that the
// upstream ran it twice: the second was not replayed.
func runsTwice(t *testing.T, s *stack, c call) {
	t.Helper()
	for range 2 {
		r := s.do(c)
		require.Less(t, r.status, 500, "body: %s", r.body)
	}
	require.Equal(t, 2, s.up.Ran(c.key), "the upstream ran the request twice")
}

// replayedOnce sends the same keyed request twice and returns the second answer, after requiring
// that the upstream ran it once.
func replayedOnce(t *testing.T, s *stack, c call) (first, second reply) {
	t.Helper()
	first = s.do(c)
	second = s.do(c)
	require.Equal(t, 1, s.up.Ran(c.key))
	return first, second
}

func extProcEdit(fn func(*filterextproc.ExternalProcessor)) func(*bootstrapv3.Bootstrap) error {
	return func(b *bootstrapv3.Bootstrap) error { return envoyconf.MutateExtProc(b, fn) }
}

// The shipped bootstrap replays a duplicate: the harm tests below change one setting each.
func TestHarmBaseline(t *testing.T) {
	t.Parallel()
	s := newStack(t, stackOptions{policy: harmPolicy})
	_, second := replayedOnce(t, s, call{path: "/v1/documents", key: "base-1", body: `{"a":1}`})
	require.Equal(t, "true", second.header.Get("X-Idempotency-Replayed"))
}

// failure_mode_allow: true lets requests through when the processor is gone: a duplicate runs.
func TestHarmFailureModeAllow(t *testing.T) {
	t.Parallel()
	s := harmStack(t, check.Kind("failure-mode-allow"), harmPolicy, extProcEdit(func(f *filterextproc.ExternalProcessor) {
		f.FailureModeAllow = true
	}), stackOptions{})
	for _, p := range s.procs {
		<-p.signal(9)
	}
	runsTwice(t, s, call{path: "/v1/documents", key: "fma-1", body: `{}`})
}

// observability_mode: Envoy ignores the processor's answers: a duplicate runs again.
func TestHarmObservabilityMode(t *testing.T) {
	t.Parallel()
	s := harmStack(t, check.Kind("observability-mode"), harmPolicy, extProcEdit(func(f *filterextproc.ExternalProcessor) {
		f.ObservabilityMode = true
	}), stackOptions{})
	runsTwice(t, s, call{path: "/v1/documents", key: "obs-1", body: `{}`})
}

// disable_immediate_response: the replay cannot be sent, and the duplicate is not answered with
// the stored response.
func TestHarmDisableImmediateResponse(t *testing.T) {
	t.Parallel()
	s := harmStack(t, check.Kind("disable-immediate-response"), harmPolicy, extProcEdit(func(f *filterextproc.ExternalProcessor) {
		f.DisableImmediateResponse = true
	}), stackOptions{})
	c := call{path: "/v1/documents", key: "dir-1", body: `{}`}
	first := s.do(c)
	require.Equal(t, http.StatusOK, first.status)
	second := s.do(c)
	require.NotEqual(t, "true", second.header.Get("X-Idempotency-Replayed"), "no replay reaches the client")
	require.False(t, second.status == first.status && string(second.body) == string(first.body) && s.up.Ran(c.key) == 1,
		"the duplicate got neither the stored response nor a run: %d %s", second.status, second.body)
}

// request_header_mode SKIP: the processor never sees the request: a duplicate runs again.
func TestHarmRequestHeadersSkipped(t *testing.T) {
	t.Parallel()
	s := harmStack(t, check.Kind("request-header-mode"), harmPolicy, extProcEdit(func(f *filterextproc.ExternalProcessor) {
		f.ProcessingMode.RequestHeaderMode = filterextproc.ProcessingMode_SKIP
	}), stackOptions{})
	runsTwice(t, s, call{path: "/v1/documents", key: "skip-1", body: `{}`})
}

// A per-route processing_mode that skips request headers: the route runs unprotected.
func TestHarmRouteRequestHeadersSkipped(t *testing.T) {
	t.Parallel()
	edit := func(b *bootstrapv3.Bootstrap) error {
		return envoyconf.MutateExtProcPerRoute(b, "refunds", func(pr *filterextproc.ExtProcPerRoute) {
			pr.GetOverrides().ProcessingMode = &filterextproc.ProcessingMode{
				RequestHeaderMode: filterextproc.ProcessingMode_SKIP, RequestBodyMode: filterextproc.ProcessingMode_BUFFERED,
				RequestTrailerMode: filterextproc.ProcessingMode_SEND, ResponseHeaderMode: filterextproc.ProcessingMode_SEND,
				ResponseBodyMode: filterextproc.ProcessingMode_BUFFERED, ResponseTrailerMode: filterextproc.ProcessingMode_SKIP,
			}
		})
	}
	s := harmStack(t, check.Kind("route-request-header-skip"), harmPolicy, edit, stackOptions{})
	runsTwice(t, s, call{path: "/v1/refunds", key: "rskip-1", body: `{}`})
}

// forward_rules that hide the key header: every request looks keyless and runs.
func TestHarmForwardRulesHideTheKey(t *testing.T) {
	t.Parallel()
	s := harmStack(t, check.Kind("forward-rules-hide"), harmPolicy, extProcEdit(func(f *filterextproc.ExternalProcessor) {
		f.ForwardRules = &filterextproc.HeaderForwardingRules{DisallowedHeaders: &matcherv3.ListStringMatcher{
			Patterns: []*matcherv3.StringMatcher{{MatchPattern: &matcherv3.StringMatcher_Exact{Exact: "idempotency-key"}}},
		}}
	}), stackOptions{})
	runsTwice(t, s, call{path: "/v1/documents", key: "fwd-1", body: `{}`})
}

// local_reply_config rewrites replays, which are local replies: the duplicate gets another body.
func TestHarmLocalReplyConfig(t *testing.T) {
	t.Parallel()
	edit := func(b *bootstrapv3.Bootstrap) error {
		return envoyconf.MutateHCM(b, func(hcm *hcmv3.HttpConnectionManager) error {
			hcm.LocalReplyConfig = &hcmv3.LocalReplyConfig{BodyFormat: &corev3.SubstitutionFormatString{
				Format: &corev3.SubstitutionFormatString_TextFormatSource{TextFormatSource: &corev3.DataSource{
					Specifier: &corev3.DataSource_InlineString{InlineString: "rewritten %RESPONSE_CODE%\n"},
				}},
			}}
			return nil
		})
	}
	s := harmStack(t, check.Kind("local-reply-config"), harmPolicy, edit, stackOptions{})
	first, second := replayedOnce(t, s, call{path: "/v1/documents", key: "lrc-1", body: `{}`})
	require.Equal(t, http.StatusOK, second.status)
	require.NotEqual(t, string(first.body), string(second.body), "the replay is not the stored response")
	require.Equal(t, "rewritten 200\n", string(second.body))
}

// mutation_rules refusing the replay header: the replay reaches the client without it.
func TestHarmMutationRulesRefuseTheReplayHeader(t *testing.T) {
	t.Parallel()
	s := harmStack(t, check.Kind("mutation-rules-refuse"), harmPolicy, extProcEdit(func(f *filterextproc.ExternalProcessor) {
		f.MutationRules = &mutationrulesv3.HeaderMutationRules{DisallowExpression: &matcherv3.RegexMatcher{Regex: "x-idempotency-replayed"}}
	}), stackOptions{})
	_, second := replayedOnce(t, s, call{path: "/v1/documents", key: "mut-1", body: `{}`})
	require.Empty(t, second.header.Get("X-Idempotency-Replayed"), "the client cannot tell the replay from a first answer")
}

// routeNamePolicy covers only the documents route, by its Envoy route name; everything else
// passes through.
const routeNamePolicy = `defaults:
  enabled: false
routes:
  - name: documents
    enabled: true
    match: { route_name_exact: documents }
`

// Without xds.route_name in request_attributes, a route_name_* matcher never matches: the route
// runs unprotected.
func TestHarmRouteNameNotSent(t *testing.T) {
	t.Parallel()
	s := harmStack(t, check.Kind("route-name-attribute-missing"), routeNamePolicy, extProcEdit(func(f *filterextproc.ExternalProcessor) {
		f.RequestAttributes = slices.DeleteFunc(f.RequestAttributes, func(a string) bool { return a == "xds.route_name" })
	}), stackOptions{})
	runsTwice(t, s, call{path: "/v1/documents", key: "rn-1", body: `{}`})
}

// A policy route whose route name matches no Envoy route (the route renamed) protects nothing.
func TestHarmRouteNameMatchesNothing(t *testing.T) {
	t.Parallel()
	edit := func(b *bootstrapv3.Bootstrap) error {
		return envoyconf.MutateRoute(b, "documents", func(r *routev3.Route) error { r.Name = "docs"; return nil })
	}
	s := harmStack(t, check.Kind("route-name-matches-nothing"), routeNamePolicy, edit, stackOptions{})
	runsTwice(t, s, call{path: "/v1/documents", key: "rnm-1", body: `{}`})
}

// Without the ext_proc filter nothing reaches the processor: a duplicate runs again.
func TestHarmNoExtProc(t *testing.T) {
	t.Parallel()
	edit := func(b *bootstrapv3.Bootstrap) error {
		return envoyconf.MutateHCM(b, func(hcm *hcmv3.HttpConnectionManager) error {
			hcm.HttpFilters = slices.DeleteFunc(hcm.HttpFilters, func(f *hcmv3.HttpFilter) bool {
				return f.GetName() == "envoy.filters.http.ext_proc"
			})
			return nil
		})
	}
	requireCheckFinds(t, harmPolicy, edit, check.Kind("no-ext-proc"))
	withoutExtProc(t)
}

// withoutExtProc runs a duplicate through Envoy without the ext_proc filter: it runs again. The
// emulator needs an ext_proc filter: one that sends nothing stands for none.
func withoutExtProc(t *testing.T) {
	t.Helper()
	s := newStack(t, stackOptions{policy: harmPolicy, envoy: extProcEdit(func(f *filterextproc.ExternalProcessor) {
		f.ProcessingMode = &filterextproc.ProcessingMode{RequestHeaderMode: filterextproc.ProcessingMode_SKIP,
			ResponseHeaderMode: filterextproc.ProcessingMode_SKIP, RequestTrailerMode: filterextproc.ProcessingMode_SKIP,
			ResponseTrailerMode: filterextproc.ProcessingMode_SKIP}
	})})
	runsTwice(t, s, call{path: "/v1/documents", key: "none-1", body: `{}`})
}

// Without response.code_details, a policy that stores 503 stores Envoy's own 503 (the upstream
// never reached): the retry is replayed Envoy's error instead of running.
func TestHarmCodeDetailsMissing(t *testing.T) {
	t.Parallel()
	const stores503 = "defaults:\n  store_statuses: [2xx, 503]\n" + "routes:\n  - name: documents\n    match: { path_prefix: /v1/documents }\n"
	s := harmStack(t, check.Kind("code-details-missing"), stores503, extProcEdit(func(f *filterextproc.ExternalProcessor) {
		f.ResponseAttributes = slices.DeleteFunc(f.ResponseAttributes, func(a string) bool { return a == "response.code_details" })
	}), stackOptions{upstream: "http://127.0.0.1:1", localReplies: true})
	c := call{path: "/v1/documents", key: "cd-1", body: `{}`}
	first := s.do(c)
	require.Equal(t, http.StatusServiceUnavailable, first.status, "Envoy answers: the upstream is not there")
	require.Eventually(t, func() bool {
		return s.do(c).header.Get("X-Idempotency-Replayed") == "true"
	}, 5*time.Second, 50*time.Millisecond, "the retry gets Envoy's 503 replayed instead of running")
}

// response_body_mode NONE: responses are stored without their body: a duplicate gets 409
// response-not-replayable instead of the replay.
func TestHarmResponseBodyNone(t *testing.T) {
	t.Parallel()
	s := harmStack(t, check.Kind("response-body-mode"), harmPolicy, extProcEdit(func(f *filterextproc.ExternalProcessor) {
		f.ProcessingMode.ResponseBodyMode = filterextproc.ProcessingMode_NONE
	}), stackOptions{})
	_, second := replayedOnce(t, s, call{path: "/v1/documents", key: "rbn-1", body: `{}`})
	requireProblem(t, second, http.StatusConflict, "response-not-replayable")
}

// A per-route response_body_mode NONE where the policy route stores bodies: the same.
func TestHarmRouteResponseBodyNone(t *testing.T) {
	t.Parallel()
	edit := func(b *bootstrapv3.Bootstrap) error {
		return envoyconf.MutateExtProcPerRoute(b, "refunds", func(pr *filterextproc.ExtProcPerRoute) {
			pr.GetOverrides().ProcessingMode = &filterextproc.ProcessingMode{
				RequestHeaderMode: filterextproc.ProcessingMode_SEND, RequestBodyMode: filterextproc.ProcessingMode_BUFFERED,
				RequestTrailerMode: filterextproc.ProcessingMode_SEND, ResponseHeaderMode: filterextproc.ProcessingMode_SEND,
				ResponseBodyMode: filterextproc.ProcessingMode_NONE, ResponseTrailerMode: filterextproc.ProcessingMode_SKIP,
			}
		})
	}
	s := harmStack(t, check.Kind("route-response-body-none"), harmPolicy, edit, stackOptions{})
	_, second := replayedOnce(t, s, call{path: "/v1/refunds", key: "rrbn-1", body: `{}`})
	requireProblem(t, second, http.StatusConflict, "response-not-replayable")
}

// routeMode is a per-route processing_mode: the shipped one with the given changes.
func routeMode(reqHeader filterextproc.ProcessingMode_HeaderSendMode, reqBody, respBody filterextproc.ProcessingMode_BodySendMode, respHeader filterextproc.ProcessingMode_HeaderSendMode) *filterextproc.ProcessingMode {
	return &filterextproc.ProcessingMode{
		RequestHeaderMode: reqHeader, RequestBodyMode: reqBody, RequestTrailerMode: filterextproc.ProcessingMode_SEND,
		ResponseHeaderMode: respHeader, ResponseBodyMode: respBody, ResponseTrailerMode: filterextproc.ProcessingMode_SKIP,
	}
}

const (
	send     = filterextproc.ProcessingMode_SEND
	skip     = filterextproc.ProcessingMode_SKIP
	buffered = filterextproc.ProcessingMode_BUFFERED
	none     = filterextproc.ProcessingMode_NONE
)

// response_header_mode SKIP: the processor never sees the response; the stream ends with the
// outcome unknown, and under unknown_outcome release (the default) the retry runs again.
func TestHarmResponseHeadersSkipped(t *testing.T) {
	t.Parallel()
	s := harmStack(t, check.Kind("response-header-mode"), harmPolicy, extProcEdit(func(f *filterextproc.ExternalProcessor) {
		f.ProcessingMode.ResponseHeaderMode = skip
	}), stackOptions{})
	runsTwice(t, s, call{path: "/v1/documents", key: "rhs-1", body: `{}`})
}

// The same, per route.
func TestHarmRouteResponseHeadersSkipped(t *testing.T) {
	t.Parallel()
	edit := func(b *bootstrapv3.Bootstrap) error {
		return envoyconf.MutateExtProcPerRoute(b, "refunds", func(pr *filterextproc.ExtProcPerRoute) {
			pr.GetOverrides().ProcessingMode = routeMode(send, buffered, buffered, skip)
		})
	}
	s := harmStack(t, check.Kind("route-response-header-skip"), harmPolicy, edit, stackOptions{})
	runsTwice(t, s, call{path: "/v1/refunds", key: "rrhs-1", body: `{}`})
}

// request_body_mode NONE where the policy fingerprints the body: a covered request with a body
// is answered 500 body-not-available instead of running.
func TestHarmRequestBodyNone(t *testing.T) {
	t.Parallel()
	s := harmStack(t, check.Kind("request-body-mode"), harmPolicy, extProcEdit(func(f *filterextproc.ExternalProcessor) {
		f.ProcessingMode.RequestBodyMode = none
	}), stackOptions{})
	requireProblem(t, s.do(call{path: "/v1/documents", key: "rbn-1", body: `{"a":1}`}), http.StatusInternalServerError, "body-not-available")
	require.Zero(t, s.up.Total())
}

// The same, per route.
func TestHarmRouteRequestBodyNone(t *testing.T) {
	t.Parallel()
	edit := func(b *bootstrapv3.Bootstrap) error {
		return envoyconf.MutateExtProcPerRoute(b, "refunds", func(pr *filterextproc.ExtProcPerRoute) {
			pr.GetOverrides().ProcessingMode = routeMode(send, none, buffered, send)
		})
	}
	s := harmStack(t, check.Kind("route-request-body-none"), harmPolicy, edit, stackOptions{})
	requireProblem(t, s.do(call{path: "/v1/refunds", key: "rrbn-2", body: `{"a":1}`}), http.StatusInternalServerError, "body-not-available")
}

// No processing_mode: Envoy's defaults send headers only, so the body the policy fingerprints
// never comes: 500 body-not-available.
func TestHarmProcessingModeMissing(t *testing.T) {
	t.Parallel()
	s := harmStack(t, check.Kind("processing-mode-missing"), harmPolicy, extProcEdit(func(f *filterextproc.ExternalProcessor) {
		f.ProcessingMode = nil
		f.AllowedOverrideModes = nil
	}), stackOptions{})
	requireProblem(t, s.do(call{path: "/v1/documents", key: "pmm-1", body: `{"a":1}`}), http.StatusInternalServerError, "body-not-available")
}

// retryOn gives the documents route the router retry policy rp.
func retryOn(rp *routev3.RetryPolicy) func(*bootstrapv3.Bootstrap) error {
	return func(b *bootstrapv3.Bootstrap) error {
		return envoyconf.MutateRoute(b, "documents", func(r *routev3.Route) error {
			r.GetRoute().RetryPolicy = rp
			return nil
		})
	}
}

// A router retry on 5xx: the upstream answered (it ran the request) and the router sends it
// again under the same lease; the client sent it once.
func TestHarmRouterRetry(t *testing.T) {
	t.Parallel()
	s := harmStack(t, check.Kind("router-retry"), harmPolicy, retryOn(&routev3.RetryPolicy{RetryOn: "5xx"}), stackOptions{})
	r := s.do(call{path: "/v1/documents", key: "rr-1", body: `{}`, headers: map[string]string{"x-test-status": "503"}})
	require.Equal(t, http.StatusServiceUnavailable, r.status)
	require.Equal(t, 2, s.up.Ran("rr-1"), "one request, run twice by the router's retry")
}

// A router retry on a status the policy stores: the upstream ran the request and produced an
// outcome worth keeping, and the router runs it again.
func TestHarmRouterRetryOnAStoredStatus(t *testing.T) {
	t.Parallel()
	s := harmStack(t, check.Kind("router-retry-stored-status"), harmPolicy, retryOn(&routev3.RetryPolicy{
		RetryOn: "retriable-status-codes", RetriableStatusCodes: []uint32{202}, NumRetries: wrapperspb.UInt32(2),
	}), stackOptions{})
	r := s.do(call{path: "/v1/documents", key: "rrs-1", body: `{}`, headers: map[string]string{"x-test-status": "202"}})
	require.Equal(t, http.StatusAccepted, r.status)
	require.Equal(t, 3, s.up.Ran("rrs-1"), "one request, run three times")
}

// A Gateway API HTTPRoute retry (GEP-1731: codes and attempts) becomes the router's
// retry_policy on the rule's routes, retrying those statuses: check refuses it on a rule an
// EnvoyExtensionPolicy reaches, and that retry policy runs the request again.
func TestHarmGatewayAPIRetry(t *testing.T) {
	t.Parallel()
	eg := string(readRepoFile(t, "envoy/envoy-gateway.yaml"))
	const rule = "  - name: refunds\n    matches:\n    - path: { type: PathPrefix, value: /v1/refunds }\n"
	require.Contains(t, eg, rule)
	eg = strings.Replace(eg, rule, rule+"    retry: { codes: [503], attempts: 2 }\n", 1)
	p, err := policy.Parse(readRepoFile(t, "envoy/policy.yaml"))
	require.NoError(t, err)
	rep, err := check.Run(p, []check.Input{{Name: "eg.yaml", Data: []byte(eg)}}, check.Options{})
	require.NoError(t, err)
	require.Contains(t, kinds(rep), check.Kind("gateway-api-retry"), "%v", rep.Findings)

	// The router's policy for those codes and attempts.
	s := newStack(t, stackOptions{policy: harmPolicy, envoy: retryOn(&routev3.RetryPolicy{
		RetryOn: "retriable-status-codes", RetriableStatusCodes: []uint32{503}, NumRetries: wrapperspb.UInt32(2),
	})})
	r := s.do(call{path: "/v1/documents", key: "gw-1", body: `{}`, headers: map[string]string{"x-test-status": "503"}})
	require.Equal(t, http.StatusServiceUnavailable, r.status)
	require.Equal(t, 3, s.up.Ran("gw-1"), "one request, run three times")
}

func kinds(rep check.Report) []check.Kind {
	var out []check.Kind
	for _, f := range rep.Findings {
		out = append(out, f.Kind)
	}
	return out
}

// jwtHarm runs envoy/policy.yaml's transfers route, which scopes by the verified subject and
// requires it, with the bootstrap changed by edit: a caller with a valid token is answered 401
// scope-missing, since the processor gets no claims, and the transfer never runs.
func jwtHarm(t *testing.T, kind check.Kind, policyText string, edit func(*bootstrapv3.Bootstrap) error) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	jwks := jwksOf(t, &key.PublicKey)
	s := harmStack(t, kind, policyText, func(b *bootstrapv3.Bootstrap) error {
		if err := setDemoJWKS(b, jwks); err != nil {
			return err
		}
		return edit(b)
	}, stackOptions{})
	token := signES256(t, key, map[string]any{
		"iss": "https://issuer.example.com", "aud": "payments", "sub": "alice", "jti": "1",
		"iat": time.Now().Unix(), "exp": time.Now().Add(time.Hour).Unix(),
	})
	r := s.do(call{path: "/v1/transfers", key: "jwt-1", body: `{}`, headers: map[string]string{"Authorization": "Bearer " + token}})
	requireProblem(t, r, http.StatusUnauthorized, "scope-missing")
	require.Zero(t, s.up.Total(), "a caller with a valid token is refused")
}

// jwtFilter edits envoy.yaml's jwt_authn filter.
func jwtFilter(fn func(*jwtauthnv3.JwtAuthentication)) func(*bootstrapv3.Bootstrap) error {
	return func(b *bootstrapv3.Bootstrap) error {
		return envoyconf.MutateHCM(b, func(hcm *hcmv3.HttpConnectionManager) error {
			for _, f := range hcm.GetHttpFilters() {
				if f.GetName() != "envoy.filters.http.jwt_authn" {
					continue
				}
				c := &jwtauthnv3.JwtAuthentication{}
				if err := f.GetTypedConfig().UnmarshalTo(c); err != nil {
					return err
				}
				fn(c)
				a, err := anypb.New(c)
				if err != nil {
					return err
				}
				f.ConfigType = &hcmv3.HttpFilter_TypedConfig{TypedConfig: a}
			}
			return nil
		})
	}
}

func shippedPolicyText(t *testing.T) string { return string(readRepoFile(t, "envoy/policy.yaml")) }

// Without jwt_authn's namespace in forwarding_namespaces, the processor gets no claims.
func TestHarmJWTPayloadNotForwarded(t *testing.T) {
	t.Parallel()
	jwtHarm(t, check.Kind("jwt-payload-not-forwarded"), shippedPolicyText(t), extProcEdit(func(f *filterextproc.ExternalProcessor) {
		f.MetadataOptions.ForwardingNamespaces = nil
	}))
}

// Without a jwt_authn filter before ext_proc, nobody verifies the token: no claims.
func TestHarmNoJWTAuthn(t *testing.T) {
	t.Parallel()
	jwtHarm(t, check.Kind("jwt-authn-missing"), shippedPolicyText(t), func(b *bootstrapv3.Bootstrap) error {
		return envoyconf.MutateHCM(b, func(hcm *hcmv3.HttpConnectionManager) error {
			hcm.HttpFilters = slices.DeleteFunc(hcm.HttpFilters, func(f *hcmv3.HttpFilter) bool {
				return f.GetName() == "envoy.filters.http.jwt_authn"
			})
			return nil
		})
	})
}

// A jwt_authn whose providers write no payload_in_metadata: no claims.
func TestHarmJWTPayloadNotWritten(t *testing.T) {
	t.Parallel()
	jwtHarm(t, check.Kind("jwt-payload-missing"), shippedPolicyText(t), jwtFilter(func(c *jwtauthnv3.JwtAuthentication) {
		for _, p := range c.GetProviders() {
			p.PayloadInMetadata = ""
		}
	}))
}

// A route's jwt_payload_key no provider writes: no claims.
func TestHarmJWTPayloadKeyNotWritten(t *testing.T) {
	t.Parallel()
	policyText := strings.Replace(shippedPolicyText(t), "    require_scope: true", "    require_scope: true\n    jwt_payload_key: other", 1)
	require.Contains(t, policyText, "jwt_payload_key: other")
	jwtHarm(t, check.Kind("jwt-payload-key"), policyText, func(*bootstrapv3.Bootstrap) error { return nil })
}

// disallow_is_error with a rule refusing a header the processor sets on a fresh response (the
// replay header, false, under replay_header_fresh): the upstream ran, and Envoy answers 500.
func TestHarmMutationDisallowIsError(t *testing.T) {
	t.Parallel()
	s := harmStack(t, check.Kind("mutation-disallow-is-error"), harmPolicy, extProcEdit(func(f *filterextproc.ExternalProcessor) {
		f.MutationRules = &mutationrulesv3.HeaderMutationRules{
			DisallowExpression: &matcherv3.RegexMatcher{Regex: "x-idempotency-replayed"},
			DisallowIsError:    wrapperspb.Bool(true),
		}
	}), stackOptions{})
	r := s.do(call{path: "/v1/documents", key: "die-1", body: `{}`})
	require.Equal(t, http.StatusInternalServerError, r.status, "body: %s", r.body)
	require.Equal(t, 1, s.up.Ran("die-1"), "the upstream ran: the client was told it failed")
}

// A message_timeout that a duplicate's in_flight_wait outlasts: the processor holds its answer
// while the duplicate waits for the first request's outcome, and Envoy gives up first: 504,
// where the policy promises a replay or 409.
func TestHarmMessageTimeoutBelowInFlightWait(t *testing.T) {
	t.Parallel()
	const waits = "defaults:\n  in_flight_wait: 3s\nroutes:\n  - name: documents\n    match: { path_prefix: /v1/documents }\n"
	s := harmStack(t, check.Kind("message-timeout-in-flight-wait"), waits, extProcEdit(func(f *filterextproc.ExternalProcessor) {
		// 2 s: below in_flight_wait, and above what a message of the first request may wait
		// on a loaded machine.
		f.MessageTimeout = durationpb.New(2 * time.Second)
	}), stackOptions{})
	c := call{path: "/v1/documents", key: "mt-1", body: `{}`, headers: map[string]string{"x-test-delay": "6s"}}
	done := make(chan reply, 1)
	go func() {
		r, _ := s.try(c)
		done <- r
	}()
	require.Eventually(t, func() bool { return s.up.Active() == 1 }, 10*time.Second, 10*time.Millisecond, "the first request runs")
	dup := s.do(c)
	require.Equal(t, http.StatusGatewayTimeout, dup.status, "the duplicate gets Envoy's 504: body %s", dup.body)
	require.Equal(t, 1, s.up.Count("mt-1"))
	<-done
}

// A BUFFERED response path whose buffer is below max_response_bytes: a response between the two
// is answered 500 by Envoy after the upstream ran it, and its retry gets 409
// response-not-replayable, never the response.
func TestHarmResponseOverTheBufferLimit(t *testing.T) {
	t.Parallel()
	const large = "defaults:\n  max_response_bytes: 4194304\nroutes:\n  - name: documents\n    match: { path_prefix: /v1/documents }\n"
	s := harmStack(t, check.Kind("response-buffer-limit"), large, nil, stackOptions{})
	c := call{path: "/v1/documents", key: "buf-1", body: `{}`, headers: map[string]string{"X-Test-Body-Bytes": strconv.Itoa(2 << 20)}}
	r := s.do(c)
	require.Equal(t, http.StatusInternalServerError, r.status, "the upstream answered 2 MiB, within max_response_bytes")
	require.Equal(t, 1, s.up.Ran("buf-1"))
}

// An EnvoyExtensionPolicy that reaches none of the policy's routes leaves them without the
// filter: in Envoy terms, ext_proc disabled on the route the policy names, which runs
// unprotected.
func TestHarmExtensionPolicyTargetsNothing(t *testing.T) {
	t.Parallel()
	p, err := policy.Parse([]byte("routes:\n  - name: refunds\n    match: { path_prefix: /v1/refunds }\n"))
	require.NoError(t, err)
	eg := readRepoFile(t, "envoy/envoy-gateway.yaml")
	rep, err := check.Run(p, []check.Input{{Name: "eg.yaml", Data: eg}}, check.Options{})
	require.NoError(t, err)
	require.Contains(t, kinds(rep), check.Kind("extension-policy-targets-nothing"), "%v", rep.Findings)

	s := newStack(t, stackOptions{policy: harmPolicy, envoy: func(b *bootstrapv3.Bootstrap) error {
		return envoyconf.MutateRoute(b, "documents", func(r *routev3.Route) error {
			a, err := anypb.New(&routev3.FilterConfig{Disabled: true})
			if err != nil {
				return err
			}
			r.TypedPerFilterConfig = map[string]*anypb.Any{"envoy.filters.http.ext_proc": a}
			return nil
		})
	}})
	runsTwice(t, s, call{path: "/v1/documents", key: "eep-1", body: `{}`})
}

// An EnvoyFilter value that cannot be read (Istio refuses it too) leaves the gateway without the
// filter it adds: in Envoy terms, no ext_proc filter, and a duplicate runs again.
func TestHarmUnreadableEnvoyFilter(t *testing.T) {
	t.Parallel()
	istio := strings.Replace(string(readRepoFile(t, "envoy/istio-envoyfilter.yaml")), "message_timeout: 0.5s", "message_timeout: soon", 1)
	p, err := policy.Parse(readRepoFile(t, "envoy/policy.yaml"))
	require.NoError(t, err)
	rep, err := check.Run(p, []check.Input{{Name: "istio.yaml", Data: []byte(istio)}}, check.Options{})
	require.NoError(t, err)
	require.Contains(t, kinds(rep), check.Kind("unreadable-value"), "%v", rep.Findings)
	withoutExtProc(t)
}

// A SecurityPolicy whose providers do not include a route's jwt_payload_key: Envoy Gateway writes
// each payload under its provider's name, so the route reads a payload nobody writes (in Envoy
// terms, payload_in_metadata other than the key): no claims.
func TestHarmGatewayJWTProviderName(t *testing.T) {
	t.Parallel()
	policyText := strings.Replace(shippedPolicyText(t), "    require_scope: true", "    require_scope: true\n    jwt_payload_key: other", 1)
	p, err := policy.Parse([]byte(policyText))
	require.NoError(t, err)
	rep, err := check.Run(p, []check.Input{{Name: "eg.yaml", Data: readRepoFile(t, "envoy/envoy-gateway.yaml")}}, check.Options{})
	require.NoError(t, err)
	require.Contains(t, kinds(rep), check.Kind("gateway-jwt-provider"), "%v", rep.Findings)
	jwtHarm(t, check.Kind("jwt-payload-key"), policyText, func(*bootstrapv3.Bootstrap) error { return nil })
}

// mtls returns a server TLS config requiring client certificates of a new CA, and a client
// for each SPIFFE ID, presenting a certificate with it as its URI SAN.
func mtls(t *testing.T, ids ...string) (*tls.Config, []*http.Client) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test ca"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	require.NoError(t, err)
	ca, err := x509.ParseCertificate(caDER)
	require.NoError(t, err)
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	leaf := func(serial int64, usage x509.ExtKeyUsage, uris []*url.URL) tls.Certificate {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		require.NoError(t, err)
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "leaf"},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
			ExtKeyUsage: []x509.ExtKeyUsage{usage}, KeyUsage: x509.KeyUsageDigitalSignature,
			IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, URIs: uris}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		require.NoError(t, err)
		return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
	}
	server := &tls.Config{Certificates: []tls.Certificate{leaf(2, x509.ExtKeyUsageServerAuth, nil)}, ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert}
	var clients []*http.Client
	for i, id := range ids {
		u, err := url.Parse(id)
		require.NoError(t, err)
		tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{leaf(int64(3+i), x509.ExtKeyUsageClientAuth, []*url.URL{u})}}}
		t.Cleanup(tr.CloseIdleConnections)
		clients = append(clients, &http.Client{Transport: tr, Timeout: 30 * time.Second})
	}
	return server, clients
}

// Without connection.uri_san_peer_certificate in request_attributes, a policy that scopes by the
// mTLS peer reads an empty scope: a second caller with the same key is replayed the first
// caller's response.
func TestHarmPeerIdentityNotSent(t *testing.T) {
	t.Parallel()
	const byPeer = "defaults:\n  scope: [peer_identity]\nroutes:\n  - name: documents\n    match: { path_prefix: /v1/documents }\n"
	server, clients := mtls(t, "spiffe://cluster.local/ns/a/sa/alice", "spiffe://cluster.local/ns/b/sa/bob")
	s := harmStack(t, check.Kind("peer-identity-attribute-missing"), byPeer, extProcEdit(func(f *filterextproc.ExternalProcessor) {
		f.RequestAttributes = slices.DeleteFunc(f.RequestAttributes, func(a string) bool { return a == "connection.uri_san_peer_certificate" })
	}), stackOptions{tls: server, client: clients[0]})
	c := call{path: "/v1/documents", key: "peer-1", body: `{}`}
	alice := s.do(c)
	require.Equal(t, http.StatusOK, alice.status)
	s.client = clients[1]
	bob := s.do(c)
	require.Equal(t, "true", bob.header.Get("X-Idempotency-Replayed"), "bob is replayed alice's response")
	require.Equal(t, string(alice.body), string(bob.body))
	require.Equal(t, 1, s.up.Ran("peer-1"))
}

// A message_timeout not above store_timeout: a store call that takes longer than the message
// timeout but ends within store_timeout (writes paused on Redis) would have claimed the key, and
// Envoy answers 504 first.
func TestHarmMessageTimeoutBelowStoreTimeout(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t, redistest.Options{})
	const slow = "store_timeout: 5s\nroutes:\n  - name: documents\n    match: { path_prefix: /v1/documents }\n"
	s := harmStack(t, check.Kind("message-timeout"), slow, extProcEdit(func(f *filterextproc.ExternalProcessor) {
		f.MessageTimeout = durationpb.New(time.Second)
	}), stackOptions{args: redisArgs(srv)})
	opts, err := redis.ParseURL(srv.URL())
	require.NoError(t, err)
	rdb := redis.NewClient(opts)
	t.Cleanup(func() { _ = rdb.Close() })
	// Writes wait 3 s: the claim would end within store_timeout (5 s), after message_timeout (1 s).
	require.NoError(t, rdb.Do(context.Background(), "CLIENT", "PAUSE", "3000", "WRITE").Err())
	r := s.do(call{path: "/v1/documents", key: "mts-1", body: `{}`})
	require.Equal(t, http.StatusGatewayTimeout, r.status, "Envoy gives up on the processor: body %s", r.body)
	require.Zero(t, s.up.Ran("mts-1"), "the request never ran, though the store would have claimed it")
}
