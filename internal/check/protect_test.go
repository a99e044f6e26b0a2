package check

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/internal/check/checktest"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	xdscorev3 "github.com/cncf/xds/go/xds/core/v3"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	mutationrulesv3 "github.com/envoyproxy/go-control-plane/envoy/config/common/mutation_rules/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	accesslogstream "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/stream/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	jwtauthnv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/jwt_authn/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// Field paths of the shipped envoy.yaml that the refusals name.
const (
	filterPath  = "http_filters[envoy.filters.http.ext_proc].typed_config"
	routePath   = "route_config.virtual_hosts[0].routes[%d].typed_per_filter_config[envoy.filters.http.ext_proc]"
	refundsIdx  = 2 // the refunds route, which names its policy route with x-idempotency-route
	defaultIdx  = 4 // the catch-all route, which has no per-route config
	extProcName = "envoy.filters.http.ext_proc"
)

func routeAt(i int) string { return fmt.Sprintf(routePath, i) }

// futureNeeds is what a policy may read besides the shipped one's fields (route names, the
// mTLS peer, JWT claims): the shipped configurations must satisfy it already.
func futureNeeds(p *policy.Policy) policyNeeds {
	n := needsOf(p)
	n.routeNameAttribute, n.peerIdentity = true, true
	n.jwtKeys = append(n.jwtKeys, routeJWTKey{route: "any"})
	return n
}

// shippedDeployments are the three shipped deployments: the standalone bootstrap, the Istio
// EnvoyFilter and each Envoy Gateway policy.
func shippedDeployments(t *testing.T) []Deployment {
	t.Helper()
	b, err := load(envoyFile(t, "envoy.yaml"))
	require.NoError(t, err)
	standalone, err := bootstrapDeployment(b, "envoy/envoy.yaml")
	require.NoError(t, err)
	istio, err := IstioDeployment(envoyFile(t, "istio-envoyfilter.yaml"))
	require.NoError(t, err)
	pols, _, err := EnvoyGateway(envoyFile(t, "envoy-gateway.yaml"))
	require.NoError(t, err)
	out := []Deployment{standalone, istio}
	for _, p := range pols {
		out = append(out, p.Deployment)
	}
	return out
}

func TestShippedDeploymentsProtect(t *testing.T) {
	for _, d := range shippedDeployments(t) {
		t.Run(d.Source, func(t *testing.T) {
			spec := CheckSpec(d.Filter, storeTimeout)
			if strings.Contains(d.Source, "envoy-gateway.yaml") {
				spec = WithoutGatewayGaps(spec)
			}
			require.NoError(t, spec)
			require.NoError(t, CheckProtection(d, shippedPolicy(t)))
			require.NoError(t, checkProtection(d, futureNeeds(shippedPolicy(t))))
			// Under the built-in defaults only envoy.yaml's refunds route is refused: it names a
			// policy route that only envoy/policy.yaml defines.
			var fields []string
			for _, r := range refusalsIn(CheckProtection(d, policy.Default())) {
				fields = append(fields, r.Field)
			}
			if d.Source == "envoy/envoy.yaml" {
				require.Equal(t, []string{routeAt(refundsIdx) + ".overrides.grpc_initial_metadata[0]"}, fields)
			} else {
				require.Empty(t, fields)
			}
		})
	}
	require.ErrorContains(t, CheckProtection(Deployment{Source: "x"}, policy.Default()), "x: no ext_proc filter config")
	require.ErrorContains(t, CheckProtection(shippedDeployments(t)[0], nil), "no policy")
}

// The standalone envoy.yaml shows every mesh-native setting: named routes, a route naming its
// policy route, jwt_authn before ext_proc, the outcome in the access log.
func TestEnvoyYAMLMeshNative(t *testing.T) {
	b, err := load(envoyFile(t, "envoy.yaml"))
	require.NoError(t, err)
	d, err := bootstrapDeployment(b, "envoy.yaml")
	require.NoError(t, err)
	var names []string
	for _, r := range d.Routes {
		names = append(names, r.Name)
	}
	require.Equal(t, []string{"healthz", "transfers", "refunds", "documents", "default"}, names, "every route has a name")
	require.True(t, d.Routes[0].Config.GetDisabled(), "healthz skips the processor")
	require.Nil(t, d.Routes[1].Config)

	// refunds names its policy route, which envoy/policy.yaml defines.
	md := d.Routes[refundsIdx].Config.GetOverrides().GetGrpcInitialMetadata()
	require.Len(t, md, 1)
	require.Equal(t, routeMetadataKey, md[0].GetKey())
	require.Equal(t, "refunds", md[0].GetValue())
	require.Contains(t, needsOf(shippedPolicy(t)).routes, "refunds")
	require.Nil(t, d.Routes[refundsIdx].Config.GetOverrides().GetProcessingMode(), "the override changes the name only")

	hcm, err := firstHCM(b)
	require.NoError(t, err)
	var filters []string
	for _, hf := range hcm.GetHttpFilters() {
		filters = append(filters, hf.GetName())
	}
	require.Equal(t, []string{"envoy.filters.http.jwt_authn", extProcName, "envoy.filters.http.router"}, filters,
		"jwt_authn runs before ext_proc, which sees the verified payload")
	jwt := &jwtauthnv3.JwtAuthentication{}
	require.NoError(t, hcm.GetHttpFilters()[0].GetTypedConfig().UnmarshalTo(jwt))
	provider := jwt.GetProviders()["demo"]
	require.NotNil(t, provider)
	require.Equal(t, "demo", provider.GetPayloadInMetadata())
	require.Equal(t, "demo", jwt.GetRequirementMap()["demo"].GetProviderName())

	routes := hcm.GetRouteConfig().GetVirtualHosts()[0].GetRoutes()
	req := &jwtauthnv3.PerRouteConfig{}
	require.NoError(t, routes[1].GetTypedPerFilterConfig()["envoy.filters.http.jwt_authn"].UnmarshalTo(req))
	require.Equal(t, "demo", req.GetRequirementName(), "transfers requires the demo provider")
	require.EqualValues(t, 16<<20, routes[3].GetRequestBodyBufferLimit().GetValue(), "documents buffers 16 MiB (Envoy 1.36+)")

	// The access log prints the route and the outcome the processor writes.
	log := &accesslogstream.StdoutAccessLog{}
	require.NoError(t, hcm.GetAccessLog()[0].GetTypedConfig().UnmarshalTo(log))
	requireOutcomeLogged(t, log.GetLogFormat().GetTextFormatSource().GetInlineString())
}

// requireOutcomeLogged holds an access log format to what operators read: the Envoy route and every field of
// the outcome the processor writes, and no header that carries a key or a credential.
func requireOutcomeLogged(t *testing.T, format string) {
	t.Helper()
	for _, op := range []string{"%ROUTE_NAME%", "%DYNAMIC_METADATA(idempotency:outcome)%", "%DYNAMIC_METADATA(idempotency:route)%",
		"%DYNAMIC_METADATA(idempotency:key_hash)%", "%DYNAMIC_METADATA(idempotency:replayed)%",
		"%DYNAMIC_METADATA(idempotency:release_reason)%"} {
		require.Contains(t, format, op)
	}
	require.NotContains(t, strings.ToLower(format), "authorization")
	require.NotContains(t, strings.ToLower(format), "idempotency-key")
}

// The Istio and Envoy Gateway files log the outcome too, each in its own form: an EnvoyFilter
// patch that MERGEs an access log into the gateway's connection manager, and the EnvoyProxy's
// telemetry.accessLog. Each logs exactly what envoy.yaml logs.
func TestMeshFilesLogTheOutcome(t *testing.T) {
	b, err := load(envoyFile(t, "envoy.yaml"))
	require.NoError(t, err)
	hcm, err := firstHCM(b)
	require.NoError(t, err)
	standalone, err := accessLogFormats(hcm.GetAccessLog())
	require.NoError(t, err)
	require.Len(t, standalone, 1)

	istio, err := IstioAccessLogFormats(envoyFile(t, "istio-envoyfilter.yaml"))
	require.NoError(t, err)
	eg, err := envoyGatewayAccessLogFormats(envoyFile(t, "envoy-gateway.yaml"))
	require.NoError(t, err)
	for name, formats := range map[string][]string{"istio": istio, "envoy gateway": eg} {
		require.Len(t, formats, 1, name)
		requireOutcomeLogged(t, formats[0])
		require.Equal(t, standalone[0], formats[0], "%s logs what envoy.yaml logs", name)
	}
}

func any1(t testing.TB, m proto.Message) *anypb.Any {
	t.Helper()
	a, err := anypb.New(m)
	require.NoError(t, err)
	return a
}

func exact(s string) *matcherv3.StringMatcher {
	return &matcherv3.StringMatcher{MatchPattern: &matcherv3.StringMatcher_Exact{Exact: s}}
}

func regex(s string) *matcherv3.StringMatcher {
	return &matcherv3.StringMatcher{MatchPattern: &matcherv3.StringMatcher_SafeRegex{SafeRegex: &matcherv3.RegexMatcher{Regex: s}}}
}

func forward(allowed, disallowed []*matcherv3.StringMatcher) func(*filterextproc.ExternalProcessor) {
	return func(f *filterextproc.ExternalProcessor) {
		f.ForwardRules = &filterextproc.HeaderForwardingRules{}
		if allowed != nil {
			f.ForwardRules.AllowedHeaders = &matcherv3.ListStringMatcher{Patterns: allowed}
		}
		if disallowed != nil {
			f.ForwardRules.DisallowedHeaders = &matcherv3.ListStringMatcher{Patterns: disallowed}
		}
	}
}

func mutationRules(r *mutationrulesv3.HeaderMutationRules) func(*filterextproc.ExternalProcessor) {
	return func(f *filterextproc.ExternalProcessor) { f.MutationRules = r }
}

// mode spells out a per-route processing mode: request header, request body, request trailer,
// response header, response body, response trailer.
func mode(rh filterextproc.ProcessingMode_HeaderSendMode, rb filterextproc.ProcessingMode_BodySendMode, rt filterextproc.ProcessingMode_HeaderSendMode,
	sh filterextproc.ProcessingMode_HeaderSendMode, sb filterextproc.ProcessingMode_BodySendMode, st filterextproc.ProcessingMode_HeaderSendMode,
) *filterextproc.ProcessingMode {
	return &filterextproc.ProcessingMode{
		RequestHeaderMode: rh, RequestBodyMode: rb, RequestTrailerMode: rt,
		ResponseHeaderMode: sh, ResponseBodyMode: sb, ResponseTrailerMode: st,
	}
}

const (
	send, skip, dflt                    = filterextproc.ProcessingMode_SEND, filterextproc.ProcessingMode_SKIP, filterextproc.ProcessingMode_DEFAULT
	none, buffered, streamed, partial   = filterextproc.ProcessingMode_NONE, filterextproc.ProcessingMode_BUFFERED, filterextproc.ProcessingMode_STREAMED, filterextproc.ProcessingMode_BUFFERED_PARTIAL
	fullDuplex, grpcBody                = filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED, filterextproc.ProcessingMode_GRPC
	fingerprintWithoutBody              = "routes:\n  - name: refunds\n    match: { path_prefix: /v1/refunds }\n    fingerprint: [method, path]\n"
	refundsRoute                        = "routes:\n  - name: refunds\n    match: { path_prefix: /v1/refunds }\n"
	envoyReplayHeader                   = "defaults:\n  replay_header: x-envoy-replayed\n" + refundsRoute
	fingerprintHeaderPolicy             = "defaults:\n  fingerprint_headers: [x-tenant]\n" + refundsRoute
	refundsNamed, defaultRoute, nowhere = "refunds", "default", ""
)

// perRouteMode sets a per-route processing_mode on route name.
func perRouteMode(name string, pm *filterextproc.ProcessingMode) func(*bootstrapv3.Bootstrap) error {
	return func(b *bootstrapv3.Bootstrap) error {
		return checktest.MutateExtProcPerRoute(b, name, func(c *filterextproc.ExtProcPerRoute) {
			o := c.GetOverrides()
			if o == nil {
				o = &filterextproc.ExtProcOverrides{}
			}
			o.ProcessingMode = pm
			c.Override = &filterextproc.ExtProcPerRoute_Overrides{Overrides: o}
		})
	}
}

func perRouteOverrides(name string, fn func(*filterextproc.ExtProcOverrides)) func(*bootstrapv3.Bootstrap) error {
	return func(b *bootstrapv3.Bootstrap) error {
		return checktest.MutateExtProcPerRoute(b, name, func(c *filterextproc.ExtProcPerRoute) {
			o := c.GetOverrides()
			if o == nil {
				o = &filterextproc.ExtProcOverrides{}
			}
			fn(o)
			c.Override = &filterextproc.ExtProcPerRoute_Overrides{Overrides: o}
		})
	}
}

// routeOnly is the path of the route at index i of the shipped envoy.yaml.
func routeOnly(i int) string { return fmt.Sprintf("route_config.virtual_hosts[0].routes[%d]", i) }

// routeRetry sets the router's retry_policy on route name.
func routeRetry(name string, rp *routev3.RetryPolicy) func(*bootstrapv3.Bootstrap) error {
	return func(b *bootstrapv3.Bootstrap) error {
		return checktest.MutateRoute(b, name, func(r *routev3.Route) error {
			r.GetRoute().RetryPolicy = rp
			return nil
		})
	}
}

func extProc(fn func(*filterextproc.ExternalProcessor)) func(*bootstrapv3.Bootstrap) error {
	return func(b *bootstrapv3.Bootstrap) error { return checktest.MutateExtProc(b, fn) }
}

// failOpenPerRoute is an ExtProcPerRoute whose overrides fail open.
func failOpenPerRoute(t testing.TB) *anypb.Any {
	return any1(t, &filterextproc.ExtProcPerRoute{Override: &filterextproc.ExtProcPerRoute_Overrides{
		Overrides: &filterextproc.ExtProcOverrides{FailureModeAllow: wrapperspb.Bool(true)},
	}})
}

// Each setting that breaks protection is refused, naming its field; what the processor handles
// passes. Every case mutates the shipped envoy.yaml.
func TestCheckProtectionRefuses(t *testing.T) {
	type want struct{ field, reason string }
	for _, tc := range []struct {
		name   string
		policy string // policy file; "" is envoy/policy.yaml
		change func(*bootstrapv3.Bootstrap) error
		want   []want // nil: accepted
	}{
		{"shipped", "", func(*bootstrapv3.Bootstrap) error { return nil }, nil},

		// local_reply_config
		{"local reply mapper", "", func(b *bootstrapv3.Bootstrap) error {
			return checktest.MutateHCM(b, func(h *hcmv3.HttpConnectionManager) error {
				h.LocalReplyConfig = &hcmv3.LocalReplyConfig{Mappers: []*hcmv3.ResponseMapper{{StatusCode: wrapperspb.UInt32(502)}}}
				return nil
			})
		}, []want{{"http_connection_manager.local_reply_config.mappers[0]", "replays and the processor's problem responses are local replies"}}},
		{"local reply body format", "", func(b *bootstrapv3.Bootstrap) error {
			return checktest.MutateHCM(b, func(h *hcmv3.HttpConnectionManager) error {
				h.LocalReplyConfig = &hcmv3.LocalReplyConfig{BodyFormat: &corev3.SubstitutionFormatString{
					Format: &corev3.SubstitutionFormatString_JsonFormat{JsonFormat: &structpb.Struct{}}}}
				return nil
			})
		}, []want{{"http_connection_manager.local_reply_config.body_format", "a replayed body would not be the stored one"}}},
		{"empty local reply config", "", func(b *bootstrapv3.Bootstrap) error {
			return checktest.MutateHCM(b, func(h *hcmv3.HttpConnectionManager) error {
				h.LocalReplyConfig = &hcmv3.LocalReplyConfig{}
				return nil
			})
		}, nil},

		// forward_rules
		{"scope header hidden", "", extProc(forward(nil, []*matcherv3.StringMatcher{exact("cookie"), exact("authorization")})),
			[]want{{filterPath + ".forward_rules.disallowed_headers.patterns[1]", `hides authorization from the processor`}}},
		{"key headers hidden by prefix", "", extProc(forward(nil, []*matcherv3.StringMatcher{{
			MatchPattern: &matcherv3.StringMatcher_Prefix{Prefix: "idempotency"}}})),
			[]want{{filterPath + ".forward_rules.disallowed_headers.patterns[0]", `idempotency-key is a key header of route "transfers": requests would look keyless`}}},
		{"every x- header hidden by regex", "", extProc(forward(nil, []*matcherv3.StringMatcher{regex("x-.*")})),
			[]want{{filterPath + ".forward_rules.disallowed_headers.patterns[0]", "hides x-idempotency-key, x-idempotency, x-ttl from"}}},
		{"ttl header hidden", "", extProc(forward(nil, []*matcherv3.StringMatcher{exact("x-ttl")})),
			[]want{{filterPath + ".forward_rules.disallowed_headers.patterns[0]", "per-request TTLs would be ignored"}}},
		{"fingerprint header hidden", fingerprintHeaderPolicy, extProc(forward(nil, []*matcherv3.StringMatcher{{
			MatchPattern: &matcherv3.StringMatcher_Contains{Contains: "tenant"}}})),
			[]want{{filterPath + ".forward_rules.disallowed_headers.patterns[0]", "instead of getting 422"}}},
		{"content-type hidden", "", extProc(forward(nil, []*matcherv3.StringMatcher{{
			MatchPattern: &matcherv3.StringMatcher_Suffix{Suffix: "-type"}}})),
			[]want{{filterPath + ".forward_rules.disallowed_headers.patterns[0]", "gRPC calls would be taken for HTTP requests"}}},
		{"status hidden", "", extProc(forward(nil, []*matcherv3.StringMatcher{exact(":status")})),
			[]want{{filterPath + ".forward_rules.disallowed_headers.patterns[0]", "which responses to store"}}},
		{"ignore_case matches lower-case keys", "", extProc(forward(nil, []*matcherv3.StringMatcher{{
			MatchPattern: &matcherv3.StringMatcher_Exact{Exact: "AUTHORIZATION"}, IgnoreCase: true}})),
			[]want{{filterPath + ".forward_rules.disallowed_headers.patterns[0]", "hides authorization"}}},
		{"case-sensitive upper-case pattern hides nothing", "", extProc(forward(nil, []*matcherv3.StringMatcher{exact("AUTHORIZATION")})), nil},
		{"headers the policy does not read may be hidden", "", extProc(forward(nil, []*matcherv3.StringMatcher{exact("cookie"), regex("x-internal-.*")})), nil},
		{"an allow list of request headers hides the response", "", extProc(forward([]*matcherv3.StringMatcher{
			exact(":method"), exact(":path"), exact("content-type"), exact("authorization"),
			exact("idempotency-key"), exact("x-idempotency-key"), exact("x-idempotency"), exact("x-ttl")}, nil)),
			[]want{{filterPath + ".forward_rules.allowed_headers", "hides :status, content-encoding"}}},
		{"an allow-everything list", "", extProc(forward([]*matcherv3.StringMatcher{regex(".*")}, []*matcherv3.StringMatcher{exact("cookie")})), nil},
		{"a custom matcher cannot be evaluated", "", extProc(forward(nil, []*matcherv3.StringMatcher{{
			MatchPattern: &matcherv3.StringMatcher_Custom{Custom: &xdscorev3.TypedExtensionConfig{Name: "x"}}}})),
			[]want{{filterPath + ".forward_rules", "cannot be evaluated"}}},

		// mutation_rules
		{"disallowed mutations are errors", "", extProc(mutationRules(&mutationrulesv3.HeaderMutationRules{DisallowIsError: wrapperspb.Bool(true)})),
			[]want{{filterPath + ".mutation_rules.disallow_is_error", "fails the request with 500 after the upstream ran"}}},
		{"replay header refused", "", extProc(mutationRules(&mutationrulesv3.HeaderMutationRules{
			DisallowExpression: &matcherv3.RegexMatcher{Regex: "x-idempotency-.*"}})),
			[]want{{filterPath + ".mutation_rules.disallow_expression", "refuses mutations of x-idempotency-replayed"}}},
		{"a stored header refused", "", extProc(mutationRules(&mutationrulesv3.HeaderMutationRules{
			DisallowExpression: &matcherv3.RegexMatcher{Regex: "set-cookie|location"}})),
			[]want{{filterPath + ".mutation_rules.disallow_expression", "location, set-cookie"}}},
		{"every mutation refused", "", extProc(mutationRules(&mutationrulesv3.HeaderMutationRules{DisallowAll: wrapperspb.Bool(true)})),
			[]want{{filterPath + ".mutation_rules.disallow_all", "x-idempotency-replayed, content-type, retry-after"}}},
		{"every mutation refused but the allowed expression", "", extProc(mutationRules(&mutationrulesv3.HeaderMutationRules{
			DisallowAll: wrapperspb.Bool(true), AllowExpression: &matcherv3.RegexMatcher{Regex: ".*"}})), nil},
		{"an operator's own headers refused", "", extProc(mutationRules(&mutationrulesv3.HeaderMutationRules{
			DisallowExpression: &matcherv3.RegexMatcher{Regex: "x-internal-.*"}, DisallowSystem: wrapperspb.Bool(true)})), nil},
		{"a bad regex", "", extProc(mutationRules(&mutationrulesv3.HeaderMutationRules{
			DisallowExpression: &matcherv3.RegexMatcher{Regex: "("}})),
			[]want{{filterPath + ".mutation_rules", "disallow_expression: regex"}}},
		{"a replay header Envoy's default rules refuse", envoyReplayHeader, func(*bootstrapv3.Bootstrap) error { return nil },
			[]want{{filterPath + ".mutation_rules.allow_envoy", "refuses mutations of x-envoy-replayed"}}},
		{"a replay header allowed by allow_envoy", envoyReplayHeader, extProc(mutationRules(&mutationrulesv3.HeaderMutationRules{
			AllowEnvoy: wrapperspb.Bool(true)})), nil},

		// attributes, metadata and request modifiers at filter level
		{"outcome namespace not received", "", extProc(func(f *filterextproc.ExternalProcessor) {
			f.MetadataOptions.ReceivingNamespaces = nil
		}), []want{{filterPath + ".metadata_options.receiving_namespaces.untyped", `lacks "idempotency"`}}},
		{"no metadata options", "", extProc(func(f *filterextproc.ExternalProcessor) {
			f.MetadataOptions = nil
		}), []want{
			{filterPath + ".metadata_options.forwarding_namespaces.untyped", `lacks "envoy.filters.http.jwt_authn"`},
			{filterPath + ".metadata_options.receiving_namespaces.untyped", "access logs and traces never show it"},
		}},
		{"request modifier", "", extProc(func(f *filterextproc.ExternalProcessor) {
			f.ProcessingRequestModifier = &corev3.TypedExtensionConfig{Name: "m", TypedConfig: any1(t, &structpb.Struct{})}
		}), []want{{filterPath + ".processing_request_modifier", "may rename"}}},

		// per route
		{"route failing open", "", perRouteOverrides(refundsNamed, func(o *filterextproc.ExtProcOverrides) {
			o.FailureModeAllow = wrapperspb.Bool(true)
		}), []want{{routeAt(refundsIdx) + ".overrides.failure_mode_allow", "bypass idempotency"}}},
		{"route failing closed explicitly", "", perRouteOverrides(refundsNamed, func(o *filterextproc.ExtProcOverrides) {
			o.FailureModeAllow = wrapperspb.Bool(false)
		}), nil},
		{"route skipping request headers", "", perRouteMode(defaultRoute, mode(skip, buffered, send, send, buffered, skip)),
			[]want{{routeAt(defaultIdx) + ".overrides.processing_mode.request_header_mode", "disabled: true"}}},
		{"route skipping response headers", "", perRouteMode(defaultRoute, mode(send, buffered, send, skip, none, skip)),
			[]want{{routeAt(defaultIdx) + ".overrides.processing_mode.response_header_mode", "the outcome unknown"}}},
		{"route with GRPC bodies", "", perRouteMode(defaultRoute, mode(send, grpcBody, skip, send, grpcBody, skip)), []want{
			{routeAt(defaultIdx) + ".overrides.processing_mode.request_body_mode", "is GRPC"},
			{routeAt(defaultIdx) + ".overrides.processing_mode.response_body_mode", "is GRPC"},
		}},
		{"route with an unknown body mode", "", perRouteMode(defaultRoute, mode(send, 9, skip, send, buffered, skip)),
			[]want{{routeAt(defaultIdx) + ".overrides.processing_mode.request_body_mode", "is 9"}}},
		{"no request body where the named route needs it", "", perRouteMode(refundsNamed, mode(send, none, skip, send, buffered, skip)),
			[]want{{routeAt(refundsIdx) + ".overrides.processing_mode.request_body_mode", "500 body-not-available"}}},
		{"no request body where the named route fingerprints without it", fingerprintWithoutBody,
			perRouteMode(refundsNamed, mode(send, none, skip, send, buffered, skip)), nil},
		{"no request body on a route that names no policy route", fingerprintWithoutBody,
			perRouteMode(defaultRoute, mode(send, none, skip, send, buffered, skip)),
			[]want{{routeAt(defaultIdx) + ".overrides.processing_mode.request_body_mode", "is NONE"}}},
		{"full duplex without trailers", "", perRouteMode(defaultRoute, mode(send, fullDuplex, skip, send, fullDuplex, dflt)), []want{
			{routeAt(defaultIdx) + ".overrides.processing_mode.request_trailer_mode", "FULL_DUPLEX_STREAMED needs SEND"},
			{routeAt(defaultIdx) + ".overrides.processing_mode.response_trailer_mode", "FULL_DUPLEX_STREAMED needs SEND"},
		}},
		{"full duplex with trailers", "", perRouteMode(defaultRoute, mode(send, fullDuplex, send, send, fullDuplex, send)), nil},
		{"streamed with request trailers", "", perRouteMode(defaultRoute, mode(send, streamed, send, send, streamed, send)), nil},
		{"partial bodies, no response body", "", perRouteMode(defaultRoute, mode(send, partial, send, send, none, skip)), nil},
		{"partial responses", "", perRouteMode(defaultRoute, mode(send, buffered, send, send, partial, skip)), nil},
		{"buffered with request trailers", "", perRouteMode(defaultRoute, mode(send, buffered, send, send, buffered, skip)), nil},
		{"buffered, request trailers skipped", "", perRouteMode(defaultRoute, mode(send, buffered, skip, send, buffered, skip)),
			[]want{{routeAt(defaultIdx) + ".overrides.processing_mode.request_trailer_mode", "is SKIP, want SEND"}}},
		{"streamed, request trailers skipped", "", perRouteMode(defaultRoute, mode(send, streamed, skip, send, streamed, skip)),
			[]want{{routeAt(defaultIdx) + ".overrides.processing_mode.request_trailer_mode", "is SKIP, want SEND"}}},
		{"request trailers skipped where the named route fingerprints without the body", fingerprintWithoutBody,
			perRouteMode(refundsNamed, mode(send, buffered, skip, send, buffered, skip)), nil},
		{"DEFAULT header modes send", "", perRouteMode(defaultRoute, mode(dflt, buffered, send, dflt, buffered, dflt)), nil},
		{"DEFAULT request trailers skip", "", perRouteMode(defaultRoute, mode(dflt, buffered, dflt, dflt, buffered, dflt)),
			[]want{{routeAt(defaultIdx) + ".overrides.processing_mode.request_trailer_mode", "is DEFAULT, want SEND"}}},
		{"unknown policy route", "", perRouteOverrides(defaultRoute, func(o *filterextproc.ExtProcOverrides) {
			o.GrpcInitialMetadata = []*corev3.HeaderValue{{Key: "x-other", Value: "a"}, {Key: routeMetadataKey, Value: "nope"}}
		}), []want{{routeAt(defaultIdx) + ".overrides.grpc_initial_metadata[1]", `names policy route "nope"`}}},
		{"policy route named in raw_value", "", perRouteOverrides(defaultRoute, func(o *filterextproc.ExtProcOverrides) {
			o.GrpcInitialMetadata = []*corev3.HeaderValue{{Key: routeMetadataKey, RawValue: []byte("documents")}}
		}), nil},
		{"the default policy route may be named", "", perRouteOverrides(defaultRoute, func(o *filterextproc.ExtProcOverrides) {
			o.GrpcInitialMetadata = []*corev3.HeaderValue{{Key: routeMetadataKey, Value: "default"}}
		}), nil},
		{"route metadata options replace the lists", "", perRouteOverrides(refundsNamed, func(o *filterextproc.ExtProcOverrides) {
			o.MetadataOptions = &filterextproc.MetadataOptions{ForwardingNamespaces: &filterextproc.MetadataOptions_MetadataNamespaces{Untyped: []string{jwtNamespace}}}
		}), []want{{routeAt(refundsIdx) + ".overrides.metadata_options.receiving_namespaces.untyped", `lacks "idempotency"`}}},
		{"route request modifier", "", perRouteOverrides(refundsNamed, func(o *filterextproc.ExtProcOverrides) {
			o.ProcessingRequestModifier = &corev3.TypedExtensionConfig{Name: "m", TypedConfig: any1(t, &structpb.Struct{})}
		}), []want{{routeAt(refundsIdx) + ".overrides.processing_request_modifier", "may rename"}}},
		{"route disabled", "", func(b *bootstrapv3.Bootstrap) error {
			return checktest.MutateExtProcPerRoute(b, defaultRoute, func(c *filterextproc.ExtProcPerRoute) {
				c.Override = &filterextproc.ExtProcPerRoute_Disabled{Disabled: true}
			})
		}, nil},
		{"route config in a FilterConfig", "", func(b *bootstrapv3.Bootstrap) error {
			return checktest.MutateRoute(b, defaultRoute, func(r *routev3.Route) error {
				r.TypedPerFilterConfig = map[string]*anypb.Any{extProcName: any1(t, &routev3.FilterConfig{Config: failOpenPerRoute(t)})}
				return nil
			})
		}, []want{{routeAt(defaultIdx) + ".overrides.failure_mode_allow", "bypass idempotency"}}},
		{"virtual host config", "", func(b *bootstrapv3.Bootstrap) error {
			return checktest.MutateHCM(b, func(h *hcmv3.HttpConnectionManager) error {
				h.GetRouteConfig().GetVirtualHosts()[0].TypedPerFilterConfig = map[string]*anypb.Any{extProcName: failOpenPerRoute(t)}
				return nil
			})
		}, []want{{"route_config.virtual_hosts[0].typed_per_filter_config[envoy.filters.http.ext_proc].overrides.failure_mode_allow", "bypass idempotency"}}},
		{"weighted cluster config", "", func(b *bootstrapv3.Bootstrap) error {
			return checktest.MutateRoute(b, defaultRoute, func(r *routev3.Route) error {
				r.GetRoute().ClusterSpecifier = &routev3.RouteAction_WeightedClusters{WeightedClusters: &routev3.WeightedCluster{
					Clusters: []*routev3.WeightedCluster_ClusterWeight{{
						Name: "upstream_app", Weight: wrapperspb.UInt32(1),
						TypedPerFilterConfig: map[string]*anypb.Any{extProcName: failOpenPerRoute(t)},
					}},
				}}
				return nil
			})
		}, []want{{"route_config.virtual_hosts[0].routes[4].route.weighted_clusters.clusters[0].typed_per_filter_config[envoy.filters.http.ext_proc].overrides.failure_mode_allow", "bypass"}}},

		// the router's retries and hedging
		{"route retrying on 5xx", "", routeRetry(defaultRoute, &routev3.RetryPolicy{RetryOn: "5xx,connect-failure"}),
			[]want{{routeOnly(defaultIdx) + ".route.retry_policy.retry_on", `has "5xx"`}}},
		{"route retrying on a reset", "", routeRetry(defaultRoute, &routev3.RetryPolicy{RetryOn: "reset"}),
			[]want{{routeOnly(defaultIdx) + ".route.retry_policy.retry_on", `has "reset"`}}},
		{"route retrying only what never reached the upstream", "", routeRetry(defaultRoute, &routev3.RetryPolicy{RetryOn: "connect-failure,refused-stream,reset-before-request"}), nil},
		{"route retrying with no retries", "", routeRetry(defaultRoute, &routev3.RetryPolicy{RetryOn: "5xx", NumRetries: wrapperspb.UInt32(0)}), nil},
		{"route retrying a stored status", "", routeRetry(defaultRoute, &routev3.RetryPolicy{RetryOn: "retriable-status-codes", RetriableStatusCodes: []uint32{503, 201}}),
			[]want{{routeOnly(defaultIdx) + ".route.retry_policy.retry_on", "status 201, which the policy stores"}}},
		{"route retrying a released status", "", routeRetry(defaultRoute, &routev3.RetryPolicy{RetryOn: "retriable-status-codes,retriable-4xx", RetriableStatusCodes: []uint32{503}}), nil},
		{"retrying a disabled route", "", routeRetry("healthz", &routev3.RetryPolicy{RetryOn: "5xx"}), nil},
		{"virtual host retrying on gateway errors", "", func(b *bootstrapv3.Bootstrap) error {
			return checktest.MutateHCM(b, func(h *hcmv3.HttpConnectionManager) error {
				h.GetRouteConfig().GetVirtualHosts()[0].RetryPolicy = &routev3.RetryPolicy{RetryOn: "gateway-error"}
				return nil
			})
		}, []want{ // every route but healthz, where ext_proc is disabled
			{"route_config.virtual_hosts[0].retry_policy.retry_on", `has "gateway-error"`},
		}},
		{"a route's own policy replaces its virtual host's", "", func(b *bootstrapv3.Bootstrap) error {
			err := checktest.MutateHCM(b, func(h *hcmv3.HttpConnectionManager) error {
				vh := h.GetRouteConfig().GetVirtualHosts()[0]
				vh.RetryPolicy = &routev3.RetryPolicy{RetryOn: "gateway-error"}
				// Keep the virtual host's policy on one route only: the others get their own.
				for _, r := range vh.GetRoutes() {
					if r.GetName() != defaultRoute && r.GetRoute() != nil {
						r.GetRoute().RetryPolicy = &routev3.RetryPolicy{RetryOn: "connect-failure"}
					}
				}
				return nil
			})
			return err
		}, []want{{"route_config.virtual_hosts[0].retry_policy.retry_on", `has "gateway-error"`}}},
		{"a route's hedge policy leaves its virtual host's retries in force", "", func(b *bootstrapv3.Bootstrap) error {
			return checktest.MutateHCM(b, func(h *hcmv3.HttpConnectionManager) error {
				vh := h.GetRouteConfig().GetVirtualHosts()[0]
				vh.RetryPolicy = &routev3.RetryPolicy{RetryOn: "5xx"}
				for _, r := range vh.GetRoutes() {
					if r.GetRoute() != nil {
						r.GetRoute().HedgePolicy = &routev3.HedgePolicy{}
					}
				}
				return nil
			})
		}, []want{{"route_config.virtual_hosts[0].retry_policy.retry_on", `has "5xx"`}}},
		{"hedging on per-try timeouts", "", func(b *bootstrapv3.Bootstrap) error {
			return checktest.MutateRoute(b, defaultRoute, func(r *routev3.Route) error {
				r.GetRoute().HedgePolicy = &routev3.HedgePolicy{HedgeOnPerTryTimeout: true}
				return nil
			})
		}, []want{{routeOnly(defaultIdx) + ".route.hedge_policy", "may run twice"}}},
		// The router reads only hedge_on_per_try_timeout (FilterUtility::finalHedgingParams).
		{"initial_requests, which Envoy does not implement", "", func(b *bootstrapv3.Bootstrap) error {
			return checktest.MutateRoute(b, defaultRoute, func(r *routev3.Route) error {
				r.GetRoute().HedgePolicy = &routev3.HedgePolicy{InitialRequests: wrapperspb.UInt32(3)}
				return nil
			})
		}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := load(envoyFile(t, "envoy.yaml"))
			require.NoError(t, err)
			require.NoError(t, tc.change(b))
			p := shippedPolicy(t)
			if tc.policy != "" {
				p, err = policy.Parse([]byte(tc.policy))
				require.NoError(t, err)
			}
			d, err := bootstrapDeployment(b, "envoy.yaml")
			require.NoError(t, err)
			err = CheckProtection(d, p)
			if tc.want == nil {
				require.NoError(t, err)
				return
			}
			require.Error(t, err)
			t.Log(err)
			got := refusalsIn(err)
			var fields []string
			for _, r := range got {
				require.Equal(t, "envoy.yaml", r.Source)
				fields = append(fields, r.Field)
			}
			var wantFields []string
			for _, w := range tc.want {
				wantFields = append(wantFields, w.field)
				i := slices.Index(fields, w.field)
				require.GreaterOrEqual(t, i, 0, "no refusal of %s in %v", w.field, fields)
				require.Contains(t, got[i].Reason, w.reason)
				require.Contains(t, got[i].Error(), "envoy.yaml: "+w.field+": ")
			}
			require.ElementsMatch(t, wantFields, fields, "exactly the expected refusals")
		})
	}
}

// The shipped configurations already carry what the contract-v2 policy will read; without it the
// checks refuse them.
// The shipped policy reads route names and JWT claims (its transfers route), a policy may read
// the mTLS peer: without what they need, the checks refuse the configuration.
func TestCheckProtectionFutureNeeds(t *testing.T) {
	n := futureNeeds(shippedPolicy(t))
	for _, tc := range []struct {
		name   string
		change func(*bootstrapv3.Bootstrap) error
		field  string
		reason string
	}{
		{"no route name", extProc(func(f *filterextproc.ExternalProcessor) {
			f.RequestAttributes = slices.DeleteFunc(f.RequestAttributes, func(s string) bool { return s == "xds.route_name" })
		}), filterPath + ".request_attributes", `lacks "xds.route_name"`},
		{"no peer identity", extProc(func(f *filterextproc.ExternalProcessor) {
			f.RequestAttributes = slices.DeleteFunc(f.RequestAttributes, func(s string) bool { return s == "connection.uri_san_peer_certificate" })
		}), filterPath + ".request_attributes", "every mTLS peer would share one scope"},
		{"no JWT payload", extProc(func(f *filterextproc.ExternalProcessor) {
			f.MetadataOptions.ForwardingNamespaces = nil
		}), filterPath + ".metadata_options.forwarding_namespaces.untyped", `lacks "envoy.filters.http.jwt_authn"`},
		{"route metadata options without the JWT payload", perRouteOverrides(refundsNamed, func(o *filterextproc.ExtProcOverrides) {
			o.MetadataOptions = &filterextproc.MetadataOptions{ReceivingNamespaces: &filterextproc.MetadataOptions_MetadataNamespaces{Untyped: []string{defaultOutcomeNamespace}}}
		}), routeAt(refundsIdx) + ".overrides.metadata_options.forwarding_namespaces.untyped", "JWT claims"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := load(envoyFile(t, "envoy.yaml"))
			require.NoError(t, err)
			require.NoError(t, tc.change(b))
			d, err := bootstrapDeployment(b, "envoy.yaml")
			require.NoError(t, err)
			got := refusalsIn(checkProtection(d, n))
			require.Len(t, got, 1)
			require.Equal(t, tc.field, got[0].Field)
			require.Contains(t, got[0].Reason, tc.reason)
			if tc.name != "no peer identity" {
				shipped := refusalsIn(CheckProtection(d, shippedPolicy(t)))
				require.Len(t, shipped, 1, "the shipped policy reads it")
				require.Equal(t, tc.field, shipped[0].Field)
			}
		})
	}
}

func TestNeedsOf(t *testing.T) {
	p, err := policy.Parse([]byte(`
defaults:
  fingerprint_headers: [x-tenant]
  ttl_header: ""
routes:
  - name: a
    match: { path_prefix: /a }
    key_headers: [k-a]
    fingerprint: [method, path]
  - name: hashed
    match: { path_prefix: /h }
    fingerprint: [method]
    missing_key: body-hash
    replay_header: x-replayed
  - name: off
    match: { path_prefix: /off }
    enabled: false
    key_headers: [k-off]
    replay_header: x-off
`))
	require.NoError(t, err)
	n := needsOf(p)
	require.Equal(t, []neededHeader{
		{"k-a", "key header", "a"},
		{"authorization", "scope header", "a"},
		{"x-tenant", "fingerprint header", "a"},
		{"idempotency-key", "key header", "hashed"},
		{"x-idempotency-key", "key header", "hashed"},
		{"x-idempotency", "key header", "hashed"},
	}, n.request, "enabled routes only, each header once, no ttl_header when it is off")
	require.Equal(t, map[string]bool{"a": false, "hashed": true, "off": false, "default": true}, n.routes)
	require.True(t, n.anyBody)
	require.Equal(t, []string{"x-idempotency-replayed", "x-replayed"}, n.replayHeaders)
	require.Equal(t, defaultOutcomeNamespace, n.outcomeNamespace)
	require.False(t, n.routeNameAttribute || n.peerIdentity || len(n.jwtKeys) > 0, "today's policy fields read none of them")

	p, err = policy.Parse([]byte("defaults:\n  fingerprint: [method, path]\n"))
	require.NoError(t, err)
	require.False(t, needsOf(p).anyBody)
}

// matchString follows Envoy's StringMatcher.
func TestMatchString(t *testing.T) {
	for _, tc := range []struct {
		m    *matcherv3.StringMatcher
		s    string
		want bool
	}{
		{exact("authorization"), "authorization", true},
		{exact("Authorization"), "authorization", false},
		{&matcherv3.StringMatcher{MatchPattern: &matcherv3.StringMatcher_Exact{Exact: "Authorization"}, IgnoreCase: true}, "authorization", true},
		{&matcherv3.StringMatcher{MatchPattern: &matcherv3.StringMatcher_Prefix{Prefix: "x-"}}, "x-ttl", true},
		{&matcherv3.StringMatcher{MatchPattern: &matcherv3.StringMatcher_Suffix{Suffix: "-KEY"}, IgnoreCase: true}, "idempotency-key", true},
		{&matcherv3.StringMatcher{MatchPattern: &matcherv3.StringMatcher_Contains{Contains: "tenant"}}, "x-tenant-id", true},
		{regex("auth"), "authorization", false},
		{regex("auth.*"), "authorization", true},
		{regex("a|authorization"), "authorization", true},
	} {
		got, err := matchString(tc.m, tc.s)
		require.NoError(t, err)
		require.Equal(t, tc.want, got, "%v on %q", tc.m, tc.s)
	}
	_, err := matchString(&matcherv3.StringMatcher{}, "x")
	require.ErrorContains(t, err, "cannot be evaluated")
	_, err = matchString(regex("("), "x")
	require.Error(t, err)
}

// forwardBlocker follows Envoy's headerCanBeForwarded; mutationBlocker its mutation Checker.
func TestRuleEvaluation(t *testing.T) {
	fr := &filterextproc.HeaderForwardingRules{
		AllowedHeaders:    &matcherv3.ListStringMatcher{Patterns: []*matcherv3.StringMatcher{regex("x-.*")}},
		DisallowedHeaders: &matcherv3.ListStringMatcher{Patterns: []*matcherv3.StringMatcher{exact("x-secret")}},
	}
	for name, want := range map[string]string{
		"x-ttl": "", "x-secret": "disallowed_headers.patterns[0]", "authorization": "allowed_headers",
	} {
		got, err := forwardBlocker(fr, name)
		require.NoError(t, err)
		require.Equal(t, want, got, name)
	}
	got, err := forwardBlocker(&filterextproc.HeaderForwardingRules{}, "anything")
	require.NoError(t, err)
	require.Empty(t, got, "empty rules forward everything")

	re := func(s string) *matcherv3.RegexMatcher { return &matcherv3.RegexMatcher{Regex: s} }
	for _, tc := range []struct {
		rules *mutationrulesv3.HeaderMutationRules
		name  string
		want  string
	}{
		{&mutationrulesv3.HeaderMutationRules{}, "x-idempotency-replayed", ""},
		{&mutationrulesv3.HeaderMutationRules{}, "x-envoy-upstream", "allow_envoy"},
		{&mutationrulesv3.HeaderMutationRules{AllowEnvoy: wrapperspb.Bool(true)}, "x-envoy-upstream", ""},
		{&mutationrulesv3.HeaderMutationRules{}, ":authority", "allow_all_routing"},
		{&mutationrulesv3.HeaderMutationRules{}, "host", "allow_all_routing"},
		{&mutationrulesv3.HeaderMutationRules{AllowAllRouting: wrapperspb.Bool(true)}, "host", ""},
		{&mutationrulesv3.HeaderMutationRules{DisallowSystem: wrapperspb.Bool(true)}, ":status", "disallow_system"},
		{&mutationrulesv3.HeaderMutationRules{DisallowAll: wrapperspb.Bool(true), AllowExpression: re("content-.*")}, "content-type", ""},
		{&mutationrulesv3.HeaderMutationRules{DisallowAll: wrapperspb.Bool(true), AllowExpression: re("content-.*")}, "etag", "disallow_all"},
		{&mutationrulesv3.HeaderMutationRules{DisallowExpression: re("content-type"), AllowExpression: re(".*")}, "content-type", "disallow_expression"},
		{&mutationrulesv3.HeaderMutationRules{AllowExpression: re("x-envoy-.*")}, "x-envoy-a", ""},
		{&mutationrulesv3.HeaderMutationRules{DisallowExpression: re("Content-Type")}, "Content-Type", ""},
	} {
		got, err := mutationBlocker(tc.rules, tc.name)
		require.NoError(t, err)
		require.Equal(t, tc.want, got, "%v on %q", tc.rules, tc.name)
	}
}

func TestRefusals(t *testing.T) {
	a, b := &refusal{Field: "a", Reason: "x"}, &refusal{Source: "s", Field: "b", Reason: "y"}
	err := errors.Join(errors.New("other"), fmt.Errorf("wrapped: %w", a), errors.Join(b))
	require.Equal(t, []*refusal{a, b}, refusalsIn(err))
	require.Nil(t, refusalsIn(nil))
	require.Equal(t, "a: x", a.Error())
	require.Equal(t, "s: b: y", b.Error())
}

// In every shipped deployment the Envoy route of /v1/transfers selects the policy route
// "transfers" by its xds.route_name (scoped by the verified JWT subject), and no other Envoy route
// does: Envoy Gateway's generated names included.
func TestShippedTransfersRouteIsSelectedByName(t *testing.T) {
	p := shippedPolicy(t)
	for _, d := range shippedDeployments(t) {
		var transfers []string
		for _, e := range d.Routes {
			if e.Name == "" {
				continue
			}
			r, _, err := p.Select(policy.Selector{RouteName: e.Name})
			require.NoError(t, err)
			if r.Name == "transfers" {
				transfers = append(transfers, e.Name)
			}
		}
		want := []string{"transfers"}
		switch {
		case strings.Contains(d.Source, "idempotency-transfers"):
			want = []string{"httproute/payments/payments-api/rule/0/match/0/api_example_com"}
		case strings.Contains(d.Source, "EnvoyExtensionPolicy"):
			want = nil
		}
		require.Equal(t, want, transfers, d.Source)
	}
}
