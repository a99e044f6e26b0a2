package deploytest

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// grpcVirtualService routes the gRPC method of envoy/grpc-policy.yaml at an ingress gateway, as
// envoy/istio-envoyfilter.yaml does: its http route's name is the Envoy route name.
const grpcVirtualService = `apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: { name: payments-grpc, namespace: payments }
spec:
  hosts: [grpc.example.com]
  gateways: [payments-gateway]
  http:
  - name: payments-grpc
    match: [{ uri: { exact: /payments.v1.Payments/Charge } }]
    route: [{ destination: { host: payments-grpc.payments.svc.cluster.local, port: { number: 9000 } } }]
    retries: { attempts: 0 }
`

// istio.grpcRoutes gives each named route the gRPC processing modes: the rendered EnvoyFilter,
// with a VirtualService naming that route, passes `idempotency-extproc check` under
// envoy/grpc-policy.yaml; without the value the route keeps the filter's modes, and check refuses
// its withheld response trailers.
func TestChartIstioGRPCRoutes(t *testing.T) {
	const base = `
istio:
  enabled: true
  namespace: istio-system
  context: GATEWAY
  workloadSelector: { istio: ingressgateway }
`
	for _, tc := range []struct {
		name, values string
		pass         bool
	}{
		{"grpcRoutes names the route", base + "  grpcRoutes: [payments-grpc]\n", true},
		{"no grpcRoutes", base, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			objs, err := decodeAll(mustRender(t, parseValues(t, tc.values)))
			require.NoError(t, err, "the rendered objects decode strictly")
			r := rendered{objs: objs}
			meshes := writeDocs(t, r, "networking.istio.io/v1alpha3/EnvoyFilter", "networking.istio.io/v1/DestinationRule")
			vs := filepath.Join(t.TempDir(), "virtualservice.yaml")
			require.NoError(t, os.WriteFile(vs, []byte(grpcVirtualService), 0o600))
			out, stderr, code := runChecker(t, "", "--config", filepath.Join(repoRoot, "envoy", "grpc-policy.yaml"), meshes, vs)
			if tc.pass {
				require.Zero(t, code, "%s\n%s", out, stderr)
				require.NotContains(t, out, ": error: ")
				return
			}
			require.Equal(t, 1, code, "%s\n%s", out, stderr)
			require.Contains(t, out, "processing_mode.response_trailer_mode: error: is SKIP on a gRPC route")
		})
	}
}
