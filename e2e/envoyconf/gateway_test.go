package envoyconf

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
)

// writeTemp writes text to a file in a fresh temporary directory and returns its path.
func writeTemp(t testing.TB, name, text string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	require.NoError(t, os.WriteFile(p, []byte(text), 0o600))
	return p
}

// checkEnvoyGateway is the verdict on envoy-gateway.yaml: the generated filter validates and
// meets SPEC §5, the processor's circuit breakers are far above 1024 and both buffer limits
// hold a 1 MiB body.
func checkEnvoyGateway(t testing.TB, path string) error {
	t.Helper()
	f, limits, err := EnvoyGatewayExtProc(path)
	if err != nil {
		return err
	}
	if err := Validate(f); err != nil {
		return err
	}
	if err := CheckSpec(f, storeTimeout); err != nil {
		return err
	}
	return checkLimits(limits.CircuitBreaker, limits.ClientBufferLimit, limits.BackendBufferLimit)
}

func TestEnvoyGatewayMeetsSpec(t *testing.T) {
	path := envoyFile(t, "envoy-gateway.yaml")
	require.NoError(t, checkEnvoyGateway(t, path))

	f, limits, err := EnvoyGatewayExtProc(path)
	require.NoError(t, err)
	require.NoError(t, f.ValidateAll())
	require.True(t, proto.Equal(shippedMode, f.GetProcessingMode()), "processing_mode: %v", f.GetProcessingMode())
	require.True(t, f.GetAllowModeOverride())
	require.Empty(t, f.GetAllowedOverrideModes(), "Envoy Gateway does not expose allowed_override_modes")
	require.False(t, f.GetFailureModeAllow())
	require.Equal(t, 500*time.Millisecond, f.GetMessageTimeout().AsDuration())
	require.Equal(t, []string{"request.id"}, f.GetRequestAttributes())
	require.Contains(t, f.GetResponseAttributes(), "response.code_details")
	require.Equal(t, "envoyextensionpolicy/payments/idempotency/extproc/0", f.GetGrpcService().GetEnvoyGrpc().GetClusterName())
	require.Equal(t, 10*time.Second, f.GetGrpcService().GetTimeout().AsDuration())

	require.Equal(t, EGLimits{
		CircuitBreaker:     Thresholds{100000, 100000, 100000, 1024},
		ClientBufferLimit:  1 << 20,
		BackendBufferLimit: 1 << 20,
	}, limits)
}

// A broken envoy-gateway.yaml must fail this test.
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
		{"request body streamed", "        body: Buffered\n        attributes: [\"request.id\"]",
			"        body: Streamed\n        attributes: [\"request.id\"]", 1,
			"processing_mode.request_body_mode is STREAMED, want BUFFERED"},
		{"unknown body mode", "body: Buffered", "body: Bufferd", 1, `unknown body mode "Bufferd"`},
		{"no response.code_details", `"response.code", "response.code_details", "response.flags"`,
			`"response.code", "response.flags"`, 1, `response_attributes lacks "response.code_details"`},
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
		{"backend stage", "  - backendRefs:", "  - stage: Backend\n    backendRefs:", 1, `stage "Backend"`},
		{"two processors", "  - backendRefs:\n    - name: idempotency-extproc\n      port: 9002",
			"  - backendRefs:\n    - name: idempotency-extproc\n      port: 9002\n    - name: other\n      port: 9002", 1,
			"want exactly one backendRef"},
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

// Omitting processingMode.response is Envoy Gateway's classic trap (envoyproxy/gateway#6827):
// response headers are then never sent, so nothing could ever be stored.
func TestEnvoyGatewayWithoutResponseBlock(t *testing.T) {
	const policy = `
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
	f, limits, err := EnvoyGatewayExtProc(writeTemp(t, "p.yaml", policy))
	require.NoError(t, err)
	require.Equal(t, filterextproc.ProcessingMode_SKIP, f.GetProcessingMode().GetResponseHeaderMode())
	require.Equal(t, EGLimits{CircuitBreaker: Thresholds{1024, 1024, 1024, 1024}, ClientBufferLimit: 32768, BackendBufferLimit: 32768}, limits)
	require.Nil(t, f.GetMessageTimeout(), "Envoy's 200ms default applies")
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
			_, _, err := EnvoyGatewayExtProc(writeTemp(t, "p.yaml", tc.text))
			require.ErrorContains(t, err, tc.want)
		})
	}
	_, _, err := EnvoyGatewayExtProc(filepath.Join(t.TempDir(), "missing.yaml"))
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

// checkIstio is the verdict on istio-envoyfilter.yaml: the embedded filter validates and meets
// SPEC §5, and the DestinationRule raises the processor cluster's circuit breakers far above 1024.
func checkIstio(t testing.TB, path string) error {
	t.Helper()
	f, err := IstioExtProc(path)
	if err != nil {
		return err
	}
	if err := Validate(f); err != nil {
		return err
	}
	if err := CheckSpec(f, storeTimeout); err != nil {
		return err
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

	f, err := IstioExtProc(path)
	require.NoError(t, err)
	require.NoError(t, f.ValidateAll())
	require.Equal(t, "outbound|9002||idempotency-extproc.idempotency.svc.cluster.local",
		f.GetGrpcService().GetEnvoyGrpc().GetClusterName())

	// The same filter as the standalone envoy.yaml, but for the cluster name.
	b, err := Load(envoyFile(t, "envoy.yaml"))
	require.NoError(t, err)
	standalone, err := ExtProc(b)
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
			"allowed_override_modes[0] is not a SPEC §5 mode: response_trailer_mode is DEFAULT, want SKIP"},
		{"unknown field in typed_config", "route_cache_action: RETAIN", "route_cache_action: RETAIN\n          bogus: 1", 1, "bogus"},
		{"unknown field in the patch", "applyTo: HTTP_FILTER", "applyTo: HTTP_FILTER\n    aplyTo: X", 1, "aplyTo"},
		{"message timeout", "message_timeout: 0.5s", "message_timeout: 0.1s", 1, "message_timeout 100ms is not above"},
		{"default circuit breakers", "http2MaxRequests: 100000", "http2MaxRequests: 1024", 1,
			"processor circuit breaker max_requests is not above 1024"},
		{"not an ext_proc patch", "ext_proc.v3.ExternalProcessor", "router.v3.Router", 1, "unknown field"},
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
