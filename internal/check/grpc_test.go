package check

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// grpcEnvoyRoute is a gRPC route for the shipped bootstrap, inserted before its catch-all;
// action is more of its route action, extra YAML under the route (indented 16 spaces).
func grpcEnvoyRoute(t *testing.T, match, action, extra string) string {
	t.Helper()
	route := "              - name: payments-grpc\n                match: " + match + "\n                route: { cluster: upstream_app, timeout: 30s" + action + " }\n" + extra
	return mutate(t, readEnvoyFile(t, "envoy.yaml"), "              - name: default\n", route+"              - name: default\n", 1)
}

const grpcDuplexMode = `                typed_per_filter_config:
                  envoy.filters.http.ext_proc:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute
                    overrides:
                      processing_mode:
                        request_header_mode: SEND
                        request_body_mode: FULL_DUPLEX_STREAMED
                        request_trailer_mode: SEND
                        response_header_mode: SEND
                        response_body_mode: BUFFERED
                        response_trailer_mode: SEND
`

// findingsOfKind returns the findings of kind k.
func findingsOfKind(rep Report, k Kind) []Finding {
	var out []Finding
	for _, f := range rep.Findings {
		if f.Kind == k {
			out = append(out, f)
		}
	}
	return out
}

// A route is gRPC to check when it matches with grpc: {}, or names (or is named by) a policy
// route with grpc: true. On it check refuses response trailers the processor never sees and the
// router's gRPC retry conditions, and says which replay the body mode and Envoy version give.
func TestRunGRPCRoutes(t *testing.T) {
	grpcPolicy := `routes:
  - {name: refunds, match: {path_prefix: /v1/refunds}}
  - {name: charge, match: {route_name_exact: payments-grpc}, grpc: true}
`
	cases := []struct {
		name, config, policy, version string
		want                          map[Kind]string // kind → the end of its field
	}{
		{"grpc match, the shipped modes, a gRPC retry", grpcEnvoyRoute(t, `{ prefix: "/payments.v1.Payments/", grpc: {} }`,
			`, retry_policy: { retry_on: "connect-failure,unavailable", num_retries: 2 }`, ""), "", "",
			map[Kind]string{
				kindGRPCResponseTrailers: "processing_mode.response_trailer_mode",
				kindGRPCRouterRetry:      "routes[4].route.retry_policy.retry_on",
				kindGRPCReplayRefused:    "processing_mode.request_body_mode",
			}},
		{"a policy route with grpc: true selects it by name; full duplex", grpcEnvoyRoute(t, `{ prefix: "/payments.v1.Payments/" }`, "", grpcDuplexMode), grpcPolicy, "1.38",
			map[Kind]string{}},
		{"the same on an Envoy before 1.37", grpcEnvoyRoute(t, `{ prefix: "/payments.v1.Payments/" }`, "", grpcDuplexMode), grpcPolicy, "1.36",
			map[Kind]string{kindGRPCStreamedReplay: "routes[4].typed_per_filter_config[envoy.filters.http.ext_proc].overrides.processing_mode.request_body_mode"}},
		{"x-idempotency-route names a policy route with grpc: true", readEnvoyFile(t, "envoy.yaml"),
			"routes: [{name: refunds, match: {path_prefix: /v1/refunds}, grpc: true}]\n", "",
			map[Kind]string{kindGRPCResponseTrailers: bootstrapFilter + ".processing_mode.response_trailer_mode", kindGRPCReplayRefused: bootstrapFilter + ".processing_mode.request_body_mode"}},
		{"full duplex on an Envoy before 1.37", grpcEnvoyRoute(t, `{ prefix: "/payments.v1.Payments/", grpc: {} }`, "", grpcDuplexMode), "", "1.36",
			map[Kind]string{kindGRPCStreamedReplay: "overrides.processing_mode.request_body_mode"}},
		{"not a gRPC route", grpcEnvoyRoute(t, `{ prefix: "/payments.v1.Payments/" }`, `, retry_policy: { retry_on: "unavailable" }`, ""), "", "",
			map[Kind]string{}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rep, err := Run(parsePolicy(t, c.policy), []Input{{Name: "envoy.yaml", Data: []byte(c.config)}}, Options{EnvoyVersion: c.version})
			require.NoError(t, err)
			for _, k := range []Kind{kindGRPCResponseTrailers, kindGRPCRouterRetry, kindGRPCReplayRefused, kindGRPCStreamedReplay} {
				got := findingsOfKind(rep, k)
				suffix, want := c.want[k]
				if !want {
					require.Empty(t, got, "%s: %v", k, got)
					continue
				}
				require.Len(t, got, 1, "%s: %v", k, rep.Findings)
				require.Contains(t, got[0].Field, suffix)
				require.NotZero(t, got[0].Line, "located in the file: %v", got[0])
			}
		})
	}
}
