package check

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
)

// writeTemp writes text to a file in a fresh temporary directory and returns its path.
func writeTemp(t testing.TB, name, text string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	require.NoError(t, os.WriteFile(p, []byte(text), 0o600))
	return p
}

// checkEnvoyGateway is the verdict on envoy-gateway.yaml: every generated filter validates, meets
// the contract (CheckSpec) and breaks no protection under envoy/policy.yaml, its processor's circuit
// breakers are far above 1024 and both buffer limits hold a 1 MiB body.
func checkEnvoyGateway(t testing.TB, path string) error {
	t.Helper()
	pols, limits, err := EnvoyGateway(path)
	if err != nil {
		return err
	}
	var errs []error
	for _, p := range pols {
		errs = append(errs,
			Validate(p.Deployment.Filter),
			WithoutGatewayGaps(CheckSpec(p.Deployment.Filter, storeTimeout)),
			CheckProtection(p.Deployment, shippedPolicy(t)),
			checkLimits(p.CircuitBreaker, limits.ClientBufferLimit, limits.BackendBufferLimit))
	}
	return errors.Join(errs...)
}

func TestEnvoyGatewayMeetsSpec(t *testing.T) {
	path := envoyFile(t, "envoy-gateway.yaml")
	require.NoError(t, checkEnvoyGateway(t, path))

	pols, limits, err := EnvoyGateway(path)
	require.NoError(t, err)
	require.Equal(t, EGLimits{ClientBufferLimit: 1 << 20, BackendBufferLimit: 1 << 20}, limits)
	require.Len(t, pols, 2, "one EnvoyExtensionPolicy per HTTPRoute rule")
	// The one gap Envoy Gateway cannot close under Buffered (WithoutGatewayGaps) is there, and
	// it is the only departure from the contract.
	for _, p := range pols {
		err := CheckSpec(p.Deployment.Filter, storeTimeout)
		require.ErrorIs(t, err, errRequestTrailersSkipped)
		require.NoError(t, WithoutGatewayGaps(err))
	}
	for i, want := range []struct{ name, route string }{
		{"payments/idempotency-transfers", "httproute/payments/payments-api/rule/0/match/0/api_example_com"},
		{"payments/idempotency-refunds", "httproute/payments/payments-api/rule/1/match/0/api_example_com"},
	} {
		p := pols[i]
		require.Equal(t, want.name, p.Name)
		f := p.Deployment.Filter
		require.NoError(t, f.ValidateAll())
		egMode := proto.CloneOf(shippedMode)
		egMode.RequestTrailerMode = filterextproc.ProcessingMode_SKIP // the gap above
		require.True(t, proto.Equal(egMode, f.GetProcessingMode()), "processing_mode: %v", f.GetProcessingMode())
		require.True(t, f.GetAllowModeOverride())
		require.Empty(t, f.GetAllowedOverrideModes(), "Envoy Gateway does not expose allowed_override_modes")
		require.False(t, f.GetFailureModeAllow())
		require.False(t, f.GetObservabilityMode())
		require.Equal(t, 500*time.Millisecond, f.GetMessageTimeout().AsDuration())
		require.Equal(t, shippedRequestAttributes, f.GetRequestAttributes())
		require.Equal(t, shippedResponseAttributes, f.GetResponseAttributes())
		require.Equal(t, []string{jwtNamespace}, f.GetMetadataOptions().GetForwardingNamespaces().GetUntyped())
		require.Equal(t, []string{defaultOutcomeNamespace}, f.GetMetadataOptions().GetReceivingNamespaces().GetUntyped())
		require.Equal(t, "envoyextensionpolicy/"+want.name+"/extproc/0", f.GetGrpcService().GetEnvoyGrpc().GetClusterName())
		require.Equal(t, 10*time.Second, f.GetGrpcService().GetTimeout().AsDuration())
		require.Equal(t, Thresholds{100000, 100000, 100000, 1024}, p.CircuitBreaker)
		require.Len(t, p.Deployment.Routes, 1)
		require.Equal(t, want.route, p.Deployment.Routes[0].Name)
	}
	// The two policies differ in their target only.
	a, b := proto.Clone(pols[0].Deployment.Filter).(*filterextproc.ExternalProcessor), pols[1].Deployment.Filter
	a.GrpcService.GetEnvoyGrpc().ClusterName = b.GetGrpcService().GetEnvoyGrpc().GetClusterName()
	require.True(t, proto.Equal(a, b), "the policies of the two rules disagree:\n%v\n%v", a, b)

	// The SecurityPolicy verifies JWTs on the transfers rule, the one whose policy route scopes by
	// a claim; its provider's name is the payload's key in the jwt_authn namespace.
	docs, err := readDocs(path)
	require.NoError(t, err)
	sp, err := only(docs, "gateway.envoyproxy.io", "SecurityPolicy")
	require.NoError(t, err)
	require.NotNil(t, sp)
	var spec struct {
		TargetRefs []egTargetRef `yaml:"targetRefs"`
		JWT        struct {
			Providers []struct {
				Name string `yaml:"name"`
			} `yaml:"providers"`
		} `yaml:"jwt"`
	}
	require.NoError(t, sp.Spec.Decode(&spec))
	require.Equal(t, []egTargetRef{{"gateway.networking.k8s.io", "HTTPRoute", "payments-api", "transfers"}}, spec.TargetRefs)
	require.Len(t, spec.JWT.Providers, 1)
	require.Equal(t, "demo", spec.JWT.Providers[0].Name)
}

// The EnvoyProxy of envoy-gateway.yaml moves ext_proc after RBAC and the rate limits, which
// Envoy Gateway's default order puts after it (a replay would skip them).
func TestEnvoyGatewayFilterOrder(t *testing.T) {
	order, err := envoyGatewayFilterOrder(envoyFile(t, "envoy-gateway.yaml"))
	require.NoError(t, err)
	require.Len(t, order, 3)
	const (
		jwt, extProc, rbac = "envoy.filters.http.jwt_authn", "envoy.filters.http.ext_proc", "envoy.filters.http.rbac"
		local, global      = "envoy.filters.http.local_ratelimit", "envoy.filters.http.ratelimit"
		router             = "envoy.filters.http.router"
	)
	for _, tc := range []struct {
		name    string
		present []string
		order   []egFilterPosition
		want    []string
	}{
		{"Envoy Gateway's default", []string{router, global, rbac, extProc, jwt, local}, nil,
			[]string{jwt, extProc, rbac, local, global, router}},
		{"shipped order, every filter", []string{router, global, rbac, extProc, jwt, local}, order,
			[]string{jwt, rbac, local, global, extProc, router}},
		{"shipped order, RBAC only", []string{router, rbac, extProc, jwt}, order,
			[]string{jwt, rbac, extProc, router}},
		{"shipped order, no ext_proc", []string{router, rbac, jwt}, order,
			[]string{jwt, rbac, router}},
		{"before", []string{router, rbac, extProc, jwt}, []egFilterPosition{{Name: rbac, Before: jwt}},
			[]string{rbac, jwt, extProc, router}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := egFilterChain(tc.present, tc.order)
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
	_, err = egFilterChain([]string{"envoy.filters.http.bogus"}, nil)
	require.ErrorContains(t, err, "bogus")

	for _, tc := range []struct{ name, old, new, want string }{
		{"unknown filter", "after: envoy.filters.http.rbac", "after: envoy.filters.http.rbak", `"envoy.filters.http.rbak" is not a filter type`},
		{"router moved", "  - name: envoy.filters.http.ext_proc\n    after: envoy.filters.http.rbac",
			"  - name: envoy.filters.http.router\n    after: envoy.filters.http.rbac", "filterOrder[0].name"},
		{"both before and after", "after: envoy.filters.http.rbac", "after: envoy.filters.http.rbac\n    before: envoy.filters.http.cors",
			"exactly one of before and after"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := writeTemp(t, "eg.yaml", mutate(t, readEnvoyFile(t, "envoy-gateway.yaml"), tc.old, tc.new, 1))
			_, err := envoyGatewayFilterOrder(path)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// A broken envoy-gateway.yaml must fail this test. Mutations apply to the first policy (transfers).
func TestEnvoyGatewayBrokenVariantsFail(t *testing.T) {
	orig := readEnvoyFile(t, "envoy-gateway.yaml")
	for _, tc := range []struct {
		name, old, new string
		n              int
		want           string
	}{
		{"fail open", "failOpen: false", "failOpen: true", 1, "failure_mode_allow is true"},
		{"response body not sent", "        body: Buffered           # Streamed", "        # Streamed", 1,
			"processing_mode.response_body_mode is NONE"},
		{"no response block: response headers are never sent",
			"      response:\n        body: Buffered", "      responsex:\n        body: Buffered", 1, "responsex"},
		{"full duplex with fail open", "    failOpen: false\n    processingMode:\n      allowModeOverride: true\n      request:\n        body: Buffered",
			"    failOpen: true\n    processingMode:\n      allowModeOverride: true\n      request:\n        body: FullDuplexStreamed", 1,
			"processingMode.request.body: FullDuplexStreamed needs failOpen false"},
		{"shadow mode", "    failOpen: false", "    failOpen: false\n    shadowMode: true", 1, "observability_mode is true"},
		{"unknown body mode", "body: Buffered", "body: Bufferd", 1, `unknown body mode "Bufferd"`},
		{"no response.code_details", `"response.code", "response.code_details", "response.flags"`,
			`"response.code", "response.flags"`, 1, `response_attributes lacks "response.code_details"`},
		{"no attempt count", `, "upstream.request_attempt_count"]`, `]`, 1,
			`response_attributes lacks "upstream.request_attempt_count"`},
		{"attribute Envoy Gateway refuses", `"request.id", "xds.route_name"`, `"request.id", "xds.route_metadata", "metadata.x"`, 1,
			`"metadata.x" does not match`},
		{"outcome namespace not writable", "      writableNamespaces: [idempotency]", "      writableNamespaces: [other]", 1,
			`extProc[0].metadata_options.receiving_namespaces.untyped: lacks "idempotency"`},
		{"jwt_authn namespace made writable", "      writableNamespaces: [idempotency]", "      writableNamespaces: [idempotency, envoy.filters.http.jwt_authn]", 1,
			"well-known Envoy HTTP filter namespaces are refused"},
		{"no mode override", "allowModeOverride: true", "allowModeOverride: false", 1,
			"allow_mode_override is false"},
		{"message timeout below store timeout", "messageTimeout: 500ms", "messageTimeout: 50ms", 1,
			"message_timeout 50ms is not above store_timeout 100ms"},
		{"message timeout unset is 200ms, but a bad one fails", "messageTimeout: 500ms", "messageTimeout: 500", 1,
			"messageTimeout"},
		{"default circuit breaker", "maxParallelRequests: 100000", "maxParallelRequests: 1024", 1,
			"processor circuit breaker max_requests is not above 1024"},
		{"circuit breaker removed", "      circuitBreaker:", "      circuitBreakr:", 1, "circuitBreakr"},
		{"misspelt field", "failOpen: false", "failopen: false", 1, "failopen"},
		{"client buffer at the 32 KiB default", "bufferLimit: 1Mi             # request", "bufferLimit: 32Ki             # request", 1,
			"listener buffer limit below 1 MiB"},
		{"backend buffer unset", "  connection:\n    bufferLimit: 1Mi             # response bodies are BUFFERED: above this Envoy answers 500",
			"  connection: {}", 1,
			"upstream buffer limit below 1 MiB"},
		{"bad quantity", "bufferLimit: 1Mi             # request", "bufferLimit: 1MiB             # request", 1,
			`quantity "1MiB"`},
		{"no stage field in Envoy Gateway's ExtProc", "  - backendRefs:", "  - stage: Backend\n    backendRefs:", 1, "field stage not found"},
		{"two processors", "  - backendRefs:\n    - name: idempotency-extproc\n      port: 9002",
			"  - backendRefs:\n    - name: idempotency-extproc\n      port: 9002\n    - name: other\n      port: 9002", 1,
			"want exactly one backendRef"},
		{"sectionName naming no rule", "    sectionName: transfers", "    sectionName: transfer", 1,
			`sectionName "transfer" names no rule of HTTPRoute payments/payments-api`},
		{"two policies on one rule", "    sectionName: refunds", "    sectionName: transfers", 1,
			`both target rule "transfers"`},
		{"HTTPRoute missing", "    name: payments-api\n    sectionName: transfers", "    name: payments\n    sectionName: transfers", 1,
			"HTTPRoute payments/payments is not in the file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := writeTemp(t, "envoy-gateway.yaml", mutate(t, orig, tc.old, tc.new, tc.n))
			err := checkEnvoyGateway(t, path)
			require.Error(t, err, "a broken config must fail this test")
			t.Log(err)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// The modes Envoy Gateway can express and the processor handles pass; FullDuplexStreamed brings
// its trailers.
func TestEnvoyGatewayOtherBodyModes(t *testing.T) {
	orig := readEnvoyFile(t, "envoy-gateway.yaml")
	for _, mode := range []string{"Streamed", "BufferedPartial", "FullDuplexStreamed"} {
		t.Run(mode, func(t *testing.T) {
			path := writeTemp(t, "eg.yaml", mutate(t, orig, "        body: Buffered\n        # xds.route_name",
				"        body: "+mode+"\n        # xds.route_name", 1))
			require.NoError(t, checkEnvoyGateway(t, path))
			pols, _, err := EnvoyGateway(path)
			require.NoError(t, err)
			pm := pols[0].Deployment.Filter.GetProcessingMode()
			want := filterextproc.ProcessingMode_SKIP
			if mode == "FullDuplexStreamed" {
				want = filterextproc.ProcessingMode_SEND
			}
			require.Equal(t, want, pm.GetRequestTrailerMode())
		})
	}
}

// Policies targeting a rule win over one targeting the whole HTTPRoute, as in Envoy Gateway.
func TestEnvoyGatewayRuleTargetsWin(t *testing.T) {
	text := mutate(t, readEnvoyFile(t, "envoy-gateway.yaml"), "    name: payments-api\n    sectionName: refunds", "    name: payments-api", 1)
	text = mutate(t, text, "value: /v1/refunds }\n", "value: /v1/refunds }\n    - path: { type: PathPrefix, value: /v2/refunds }\n", 1)
	pols, _, err := EnvoyGateway(writeTemp(t, "eg.yaml", text))
	require.NoError(t, err)
	names := func(p EGPolicy) []string {
		var out []string
		for _, r := range p.Deployment.Routes {
			out = append(out, r.Name)
		}
		return out
	}
	require.Equal(t, []string{"httproute/payments/payments-api/rule/0/match/0/api_example_com"}, names(pols[0]))
	require.Equal(t, []string{
		"httproute/payments/payments-api/rule/1/match/0/api_example_com",
		"httproute/payments/payments-api/rule/1/match/1/api_example_com",
	}, names(pols[1]), "the whole-route policy gets the rules no rule policy took, one route per match")
}

// Omitting processingMode.response is Envoy Gateway's classic trap (envoyproxy/gateway#6827):
// response headers are then never sent, so nothing could ever be stored.
func TestEnvoyGatewayWithoutResponseBlock(t *testing.T) {
	const policy = `
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: { name: r, namespace: ns }
spec:
  rules:
  - backendRefs: [{ name: app, port: 80 }]
---
apiVersion: gateway.envoyproxy.io/v1alpha1
kind: EnvoyExtensionPolicy
metadata: { name: p, namespace: ns }
spec:
  targetRefs: [{ group: gateway.networking.k8s.io, kind: HTTPRoute, name: r }]
  extProc:
  - backendRefs: [{ name: idempotency-extproc, port: 9002 }]
    processingMode:
      allowModeOverride: true
      request: { body: Buffered }
`
	pols, limits, err := EnvoyGateway(writeTemp(t, "p.yaml", policy))
	require.NoError(t, err)
	require.Len(t, pols, 1)
	f := pols[0].Deployment.Filter
	require.Equal(t, filterextproc.ProcessingMode_SKIP, f.GetProcessingMode().GetResponseHeaderMode())
	require.Equal(t, EGLimits{ClientBufferLimit: 32768, BackendBufferLimit: 32768}, limits)
	require.Equal(t, Thresholds{1024, 1024, 1024, 1024}, pols[0].CircuitBreaker)
	require.Nil(t, f.GetMessageTimeout(), "Envoy's 200ms default applies")
	require.Equal(t, []string{"httproute/ns/r/rule/0/match/-1/*"}, []string{pols[0].Deployment.Routes[0].Name},
		"a rule without matches and a route without hostnames")
	err = CheckSpec(f, storeTimeout)
	require.ErrorContains(t, err, "processing_mode.response_header_mode is SKIP, want SEND")
	require.ErrorContains(t, err, "processing_mode.response_body_mode is NONE")
}

func TestEnvoyGatewayRejects(t *testing.T) {
	for _, tc := range []struct{ name, text, want string }{
		{"no policy", "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec: {}\n", "no EnvoyExtensionPolicy"},
		{"no extProc", "apiVersion: gateway.envoyproxy.io/v1alpha1\nkind: EnvoyExtensionPolicy\nmetadata: {name: p}\nspec: {}\n",
			"want exactly one extProc entry, have 0"},
		{"unknown top-level field", "apiVersion: v1\nkind: Service\nstatus: {}\n", "status"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := EnvoyGateway(writeTemp(t, "p.yaml", tc.text))
			require.ErrorContains(t, err, tc.want)
		})
	}
	_, _, err := EnvoyGateway(filepath.Join(t.TempDir(), "missing.yaml"))
	require.ErrorIs(t, err, os.ErrNotExist)
}

func TestParseQuantity(t *testing.T) {
	for in, want := range map[string]uint32{"1Mi": 1 << 20, "32Ki": 32768, "32768": 32768, "1M": 1e6, "2k": 2000, "3Gi": 3 << 30} {
		got, err := parseQuantity(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	for _, in := range []string{"", "Mi", "1.5Mi", "-1", "4Gi", "1e6", "1 Mi"} {
		_, err := parseQuantity(in)
		require.Error(t, err, in)
	}
}

// checkIstio is the verdict on istio-envoyfilter.yaml: the embedded filter validates, meets the
// contract and breaks no protection under envoy/policy.yaml, its HTTP_ROUTE patches match
// VirtualService routes, and the DestinationRule raises the processor cluster's circuit breakers far above 1024.
func checkIstio(t testing.TB, path string) error {
	t.Helper()
	d, err := IstioDeployment(path)
	if err != nil {
		return err
	}
	if err := Validate(d.Filter); err != nil {
		return err
	}
	if err := errors.Join(CheckSpec(d.Filter, storeTimeout), CheckProtection(d, shippedPolicy(t))); err != nil {
		return err
	}
	// Every HTTP_ROUTE patch must match a route the VirtualService makes, or it patches nothing.
	// A VirtualService's route is known by its retries' resource: a patch that gives it a
	// per-route config also gives it its path.
	vsRoutes := map[string]bool{}
	for _, r := range d.Routes {
		if strings.HasPrefix(r.RetryResource, "VirtualService ") {
			vsRoutes[r.Name] = true
		}
	}
	for _, r := range d.Routes {
		if strings.HasPrefix(r.Path, "configPatches") && !vsRoutes[r.Name] {
			return fmt.Errorf("%s matches route %q, which no VirtualService of the file names", r.Path, r.Name)
		}
	}
	docs, err := readDocs(path)
	if err != nil {
		return err
	}
	dr, err := only(docs, "networking.istio.io", "DestinationRule")
	if err != nil {
		return err
	}
	var spec struct {
		TrafficPolicy struct {
			ConnectionPool struct {
				TCP struct {
					MaxConnections uint32 `yaml:"maxConnections"`
				} `yaml:"tcp"`
				HTTP struct {
					HTTP1MaxPendingRequests uint32 `yaml:"http1MaxPendingRequests"`
					HTTP2MaxRequests        uint32 `yaml:"http2MaxRequests"`
				} `yaml:"http"`
			} `yaml:"connectionPool"`
		} `yaml:"trafficPolicy"`
	}
	if dr != nil {
		if err := dr.Spec.Decode(&spec); err != nil {
			return err
		}
	}
	// Istio leaves unset thresholds at its own high defaults, which differ between versions; the
	// shipped file must state them, so an absent value counts as 0 here.
	cp := spec.TrafficPolicy.ConnectionPool
	return checkLimits(Thresholds{
		MaxConnections:     cp.TCP.MaxConnections,
		MaxPendingRequests: cp.HTTP.HTTP1MaxPendingRequests,
		MaxRequests:        cp.HTTP.HTTP2MaxRequests,
	}, 1<<20, 1<<20)
}

func TestIstioMeetsSpec(t *testing.T) {
	path := envoyFile(t, "istio-envoyfilter.yaml")
	require.NoError(t, checkIstio(t, path))

	f, err := istioExtProc(path)
	require.NoError(t, err)
	require.NoError(t, f.ValidateAll())
	require.Equal(t, "outbound|9002||idempotency-extproc.idempotency.svc.cluster.local",
		f.GetGrpcService().GetEnvoyGrpc().GetClusterName())

	// The VirtualService names the routes the policy selects by name; the HTTP_ROUTE patch raises
	// the documents route's request buffer.
	d, err := IstioDeployment(path)
	require.NoError(t, err)
	var names []string
	for _, r := range d.Routes {
		names = append(names, r.Name)
	}
	require.Equal(t, []string{"transfers", "refunds", "documents", "default", "payments-grpc", "payments-grpc-other", "documents"}, names)
	require.Equal(t, "configPatches[1].patch.value", d.Routes[6].Path)
	require.Nil(t, d.Routes[6].Config, "the shipped HTTP_ROUTE patch leaves ext_proc as it is")
	// The gRPC route's patch is merged into the VirtualService's route, as Istio merges it.
	require.Equal(t, "configPatches[3].patch.value.typed_per_filter_config[envoy.filters.http.ext_proc]", d.Routes[4].Path)
	require.Equal(t, "FULL_DUPLEX_STREAMED", d.Routes[4].Config.GetOverrides().GetProcessingMode().GetRequestBodyMode().String())
	require.Equal(t, "VirtualService payments/payments-grpc http[0].retries", d.Routes[4].RetryPath)
	docs0, err := readDocs(path)
	require.NoError(t, err)
	ef, err := only(docs0, "networking.istio.io", "EnvoyFilter")
	require.NoError(t, err)
	spec0, err := decodeSpec[istioSpec](ef)
	require.NoError(t, err)
	route := &routev3.Route{}
	require.NoError(t, decodePatch(&spec0.ConfigPatches[1], route))
	require.EqualValues(t, 16<<20, route.GetRequestBodyBufferLimit().GetValue())
	require.Equal(t, "GATEWAY", spec0.ConfigPatches[0].Match.Context)

	// The same filter as the standalone envoy.yaml, but for the cluster name.
	b, err := load(envoyFile(t, "envoy.yaml"))
	require.NoError(t, err)
	standalone, err := bootstrapExtProc(b)
	require.NoError(t, err)
	standalone.GrpcService.GetEnvoyGrpc().ClusterName = f.GetGrpcService().GetEnvoyGrpc().GetClusterName()
	require.True(t, proto.Equal(standalone, f), "istio-envoyfilter.yaml and envoy.yaml disagree:\n%v\n%v", standalone, f)

	// The Service port is named grpc (and says appProtocol grpc) so Istio speaks HTTP/2 to it.
	docs, err := readDocs(path)
	require.NoError(t, err)
	svc, err := only(docs, "", "Service")
	require.NoError(t, err)
	require.NotNil(t, svc)
	var spec struct {
		Ports []struct {
			Name        string `yaml:"name"`
			AppProtocol string `yaml:"appProtocol"`
			Port        int    `yaml:"port"`
		} `yaml:"ports"`
	}
	require.NoError(t, svc.Spec.Decode(&spec))
	require.Contains(t, spec.Ports, struct {
		Name        string `yaml:"name"`
		AppProtocol string `yaml:"appProtocol"`
		Port        int    `yaml:"port"`
	}{"grpc", "grpc", 9002})
}

// A broken istio-envoyfilter.yaml must fail this test.
func TestIstioBrokenVariantsFail(t *testing.T) {
	orig := readEnvoyFile(t, "istio-envoyfilter.yaml")
	for _, tc := range []struct {
		name, old, new string
		n              int
		want           string
	}{
		{"after the router", "operation: INSERT_BEFORE", "operation: INSERT_AFTER", 1, "must INSERT_BEFORE envoy.filters.http.router"},
		{"before another filter", "name: envoy.filters.http.router", "name: envoy.filters.http.cors", 1, "must INSERT_BEFORE"},
		{"fail open", "failure_mode_allow: false", "failure_mode_allow: true", 1, "failure_mode_allow is true"},
		{"response body NONE", "response_body_mode: BUFFERED", "response_body_mode: NONE", 1,
			"processing_mode.response_body_mode is NONE"},
		{"override mode with DEFAULT", "response_trailer_mode: SKIP\n          - request_header_mode",
			"response_trailer_mode: DEFAULT\n          - request_header_mode", 1,
			"allowed_override_modes[0] is not one of the processor's modes: response_trailer_mode is DEFAULT, want SKIP"},
		{"unknown field in typed_config", "route_cache_action: RETAIN", "route_cache_action: RETAIN\n          bogus: 1", 1, "bogus"},
		{"unknown field in the patch", "applyTo: HTTP_FILTER", "applyTo: HTTP_FILTER\n    aplyTo: X", 1, "aplyTo"},
		{"message timeout", "message_timeout: 0.5s", "message_timeout: 0.1s", 1, "message_timeout 100ms is not above"},
		{"default circuit breakers", "http2MaxRequests: 100000", "http2MaxRequests: 1024", 1,
			"processor circuit breaker max_requests is not above 1024"},
		{"not an ext_proc patch", "ext_proc.v3.ExternalProcessor", "router.v3.Router", 1, "unknown field"},
		{"forward rules hiding the scope header", "route_cache_action: RETAIN",
			"route_cache_action: RETAIN\n          forward_rules: { disallowed_headers: { patterns: [{ exact: authorization }] } }", 1,
			`configPatches[0].patch.value.typed_config.forward_rules.disallowed_headers.patterns[0]: hides authorization`},
		{"outcome namespace not received", "untyped: [idempotency]", "untyped: [other]", 1,
			`configPatches[0].patch.value.typed_config.metadata_options.receiving_namespaces.untyped: lacks "idempotency"`},
		{"no attempt count", `, "upstream.request_attempt_count"]`, `]`, 1,
			`response_attributes lacks "upstream.request_attempt_count"`},
		{"route patch failing open", "        request_body_buffer_limit: 16777216",
			"        typed_per_filter_config:\n          envoy.filters.http.ext_proc:\n            \"@type\": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute\n            overrides: { failure_mode_allow: true }", 1,
			"configPatches[1].patch.value.typed_per_filter_config[envoy.filters.http.ext_proc].overrides.failure_mode_allow"},
		{"route patch naming no VirtualService route", "            name: documents", "            name: document", 1,
			`matches route "document", which no VirtualService of the file names`},
		{"route patch without a route name", "            name: documents", "            action: ANY", 1,
			"an HTTP_ROUTE patch must match routeConfiguration.vhost.route.name"},
		{"unknown field in the route patch", "request_body_buffer_limit: 16777216", "request_body_buffer_limits: 16777216", 1,
			"request_body_buffer_limits"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := writeTemp(t, "istio.yaml", mutate(t, orig, tc.old, tc.new, tc.n))
			err := checkIstio(t, path)
			require.Error(t, err, "a broken config must fail this test")
			t.Log(err)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// Istio gives every VirtualService route its default retry policy unless the route sets retries:
// it retries 503 and connection failures, which is safe (the policy releases 503). A retryOn that
// retries after the upstream may have run, or a stored status, is refused; attempts 0 turns
// retries off.
func TestIstioRetries(t *testing.T) {
	orig := readEnvoyFile(t, "istio-envoyfilter.yaml")
	const at = "  - name: transfers\n    match:\n    - uri: { prefix: /v1/transfers }\n"
	for _, tc := range []struct {
		name, retries, want string
	}{
		{"default policy", "", ""},
		{"attempts 0", "    retries: { attempts: 0, retryOn: 5xx }\n", ""},
		{"5xx", "    retries: { attempts: 3, retryOn: \"connect-failure,5xx\" }\n", `VirtualService payments/payments-api http[0].retries.retry_policy.retry_on: has "5xx"`},
		{"a stored status", "    retries: { attempts: 2, retryOn: \"503,201\" }\n", "status 201, which the policy stores"},
		{"released statuses", "    retries: { attempts: 2, retryOn: \"503,refused-stream\" }\n", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := writeTemp(t, "istio.yaml", mutate(t, orig, at, at+tc.retries, 1))
			err := checkIstio(t, path)
			if tc.want == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tc.want)
		})
	}
	d, err := IstioDeployment(envoyFile(t, "istio-envoyfilter.yaml"))
	require.NoError(t, err)
	require.Equal(t, "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes", d.Routes[0].Retry.GetRetryOn(), "Istio's default where retries are not set")
	require.Equal(t, []uint32{503}, d.Routes[0].Retry.GetRetriableStatusCodes())
}

// A BackendTrafficPolicy's retry becomes the router's retry_policy on the policies' routes: one
// that retries after the upstream may have run is refused.
func TestEnvoyGatewayRetries(t *testing.T) {
	orig := readEnvoyFile(t, "envoy-gateway.yaml")
	const at = "  connection:\n    bufferLimit: 1Mi             # response bodies"
	for _, tc := range []struct{ name, retry, want string }{
		{"default conditions", "  retry: { numRetries: 3 }\n", ""},
		{"reset", "  retry:\n    retryOn: { triggers: [connect-failure, reset] }\n", `BackendTrafficPolicy payments/idempotency-buffers.retry.retry_policy.retry_on: has "reset"`},
		{"a stored status", "  retry:\n    retryOn: { httpStatusCodes: [200] }\n", "status 200, which the policy stores"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := checkEnvoyGateway(t, writeTemp(t, "eg.yaml", mutate(t, orig, at, tc.retry+at, 1)))
			if tc.want == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// In a workload's sidecar (SIDECAR_INBOUND) the VirtualService's retries run in the caller's
// outbound sidecar, before this filter: each retry arrives as a duplicate with the same key, so
// they are not refused there.
func TestIstioSidecarRetriesAreDuplicates(t *testing.T) {
	orig := readEnvoyFile(t, "istio-envoyfilter.yaml")
	const filterPatch = "  - applyTo: HTTP_FILTER\n    match:\n      context: GATEWAY\n"
	const at = "  - name: transfers\n    match:\n    - uri: { prefix: /v1/transfers }\n"
	text := mutate(t, orig, at, at+"    retries: { attempts: 3, retryOn: 5xx }\n", 1)
	require.ErrorContains(t, checkIstio(t, writeTemp(t, "istio.yaml", text)), `has "5xx"`, "at the gateway the router retries")
	sidecar := mutate(t, text, filterPatch, strings.Replace(filterPatch, "GATEWAY", "SIDECAR_INBOUND", 1), 1)
	d, err := IstioDeployment(writeTemp(t, "istio.yaml", sidecar))
	require.NoError(t, err)
	require.NoError(t, CheckProtection(d, shippedPolicy(t)))
}

// A BackendTrafficPolicy's retry applies only to the routes of the HTTPRoute it targets.
func TestEnvoyGatewayRetriesFollowTargets(t *testing.T) {
	orig := readEnvoyFile(t, "envoy-gateway.yaml")
	const at = "  connection:\n    bufferLimit: 1Mi             # response bodies"
	text := mutate(t, orig, at, "  retry:\n    retryOn: { triggers: [reset] }\n"+at, 1)
	require.Error(t, checkEnvoyGateway(t, writeTemp(t, "eg.yaml", text)))
	pols, _, err := EnvoyGateway(writeTemp(t, "eg.yaml", mutate(t, text, "    name: payments-api\n  retry:", "    name: other-api\n  retry:", 1)))
	require.NoError(t, err)
	for _, p := range pols {
		for _, r := range p.Deployment.Routes {
			require.Nil(t, r.Retry, "%s is not a route of other-api", r.Name)
		}
	}
}

// istioExtProc returns the ExternalProcessor of the EnvoyFilter of the Istio file at path, as
// IstioDeployment reads it.
func istioExtProc(path string) (*filterextproc.ExternalProcessor, error) {
	d, err := IstioDeployment(path)
	if err != nil {
		return nil, err
	}
	return d.Filter, nil
}
