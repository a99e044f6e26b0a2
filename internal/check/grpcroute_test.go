package check

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"
)

// grpcRouteObjs is a GRPCRoute for ledger.v1.Ledger/Post (rule "post", retry its YAML or "") and
// an EnvoyExtensionPolicy targeting target with the given request and response body modes.
func grpcRouteObjs(retry, target, reqBody, respBody string) string {
	if retry != "" {
		retry = "\n    retry: " + retry
	}
	return fmt.Sprintf(`apiVersion: gateway.networking.k8s.io/v1
kind: GRPCRoute
metadata: { name: ledger, namespace: payments }
spec:
  parentRefs: [{ name: eg }]
  rules:
  - name: post
    matches: [{ method: { service: ledger.v1.Ledger, method: Post } }]
    backendRefs: [{ name: ledger, port: 9000 }]%s
---
apiVersion: gateway.envoyproxy.io/v1alpha1
kind: EnvoyExtensionPolicy
metadata: { name: idempotency-ledger, namespace: payments }
spec:
  targetRefs: [%s]
  extProc:
  - backendRefs: [{ name: idempotency-extproc, port: 9002 }]
    backendSettings:
      circuitBreaker: { maxConnections: 100000, maxPendingRequests: 100000, maxParallelRequests: 100000 }
    messageTimeout: 500ms
    processingMode:
      allowModeOverride: true
      request: { body: %s, attributes: ["xds.route_name"] }
      response:
        body: %s
        attributes: ["response.code_details", "upstream.request_attempt_count"]
    metadata: { accessibleNamespaces: [envoy.filters.http.jwt_authn], writableNamespaces: [idempotency] }
`, retry, target, reqBody, respBody)
}

// grpcRouteRetries is a BackendTrafficPolicy whose retry on grpcRouteObjs' GRPCRoute has a gRPC
// condition.
const grpcRouteRetries = `---
apiVersion: gateway.envoyproxy.io/v1alpha1
kind: BackendTrafficPolicy
metadata: { name: ledger-retries, namespace: payments }
spec:
  targetRefs: [{ group: gateway.networking.k8s.io, kind: GRPCRoute, name: ledger }]
  retry:
    numRetries: 2
    retryOn: { triggers: [connect-failure, unavailable] }
`

// A GRPCRoute is read like an HTTPRoute: an EnvoyExtensionPolicy targeting it (whole or by
// sectionName) runs on its rules, which are gRPC routes, so the gRPC rules apply to them; a
// retry on a covered rule is refused; a policy none of whose routes match its methods reaches
// nothing. Each finding names the line and column of its field.
func TestRunGRPCRouteRules(t *testing.T) {
	const (
		whole   = "{ group: gateway.networking.k8s.io, kind: GRPCRoute, name: ledger }"
		section = "{ group: gateway.networking.k8s.io, kind: GRPCRoute, name: ledger, sectionName: post }"
		covers  = "routes:\n  - name: ledger\n    match: { path_prefix: /ledger.v1.Ledger/Post }\n"
		other   = "routes:\n  - name: orders\n    match: { path_prefix: /orders.v1.Orders/ }\n"
	)
	type at struct {
		field     string
		line, col int
		severity  Severity
	}
	cases := []struct {
		name, objs, policy string
		want               map[Kind]at // kind → its field and place
	}{
		{"whole route, full duplex both ways", grpcRouteObjs("", whole, "FullDuplexStreamed", "FullDuplexStreamed"), covers,
			map[Kind]at{}},
		{"buffered response: no response trailers", grpcRouteObjs("", whole, "FullDuplexStreamed", "Buffered"), covers,
			map[Kind]at{kindGRPCResponseTrailers: {"extProc[0].processingMode.response.body", 25, 9, Error}}},
		{"buffered request: a retry gets ALREADY_EXISTS, no replay", grpcRouteObjs("", section, "Buffered", "FullDuplexStreamed"), covers,
			map[Kind]at{kindGRPCReplayRefused: {"extProc[0].processingMode.request.body", 23, 18, Warning}}},
		{"a retry on the covered rule", grpcRouteObjs("{ codes: [14], attempts: 3 }", section, "FullDuplexStreamed", "FullDuplexStreamed"), covers,
			map[Kind]at{kindGatewayAPIRetry: {"rules[0].retry", 10, 5, Error}}},
		{"attempts 0 retries nothing", grpcRouteObjs("{ attempts: 0 }", whole, "FullDuplexStreamed", "FullDuplexStreamed"), covers,
			map[Kind]at{}},
		{"a BackendTrafficPolicy retrying unavailable on it", grpcRouteObjs("", whole, "FullDuplexStreamed", "FullDuplexStreamed") + grpcRouteRetries, covers,
			map[Kind]at{kindGRPCRouterRetry: {"retry.retryOn", 36, 5, Error}}},
		{"no policy route matches its method", grpcRouteObjs("", whole, "FullDuplexStreamed", "FullDuplexStreamed"), other,
			map[Kind]at{kindPolicyTargetsNothing: {"targetRefs", 15, 3, Error}}},
	}
	kinds := []Kind{kindGRPCResponseTrailers, kindGRPCReplayRefused, kindGRPCRouterRetry, kindGatewayAPIRetry, kindPolicyTargetsNothing}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rep, err := Run(parsePolicy(t, c.policy), []Input{{Name: "grpc.yaml", Data: []byte(c.objs)}}, Options{})
			require.NoError(t, err)
			for _, k := range kinds {
				got := findingsOfKind(rep, k)
				want, ok := c.want[k]
				if !ok {
					require.Empty(t, got, "%s: %v", k, got)
					continue
				}
				require.Len(t, got, 1, "%s: %v", k, rep.Findings)
				require.Equal(t, want.severity, got[0].Severity)
				require.Equal(t, want.field, got[0].Field)
				require.Equal(t, fmt.Sprintf("grpc.yaml:%d:%d", want.line, want.col), got[0].Place())
			}
		})
	}
}

// The missing response trailers of an Envoy Gateway gRPC route are fixed in its terms.
func TestRunGRPCRouteTrailerFix(t *testing.T) {
	objs := grpcRouteObjs("", "{ kind: GRPCRoute, name: ledger }", "FullDuplexStreamed", "Streamed")
	rep, err := Run(parsePolicy(t, "routes:\n  - name: ledger\n    match: { path_prefix: /ledger.v1.Ledger/ }\n"), []Input{{Name: "grpc.yaml", Data: []byte(objs)}}, Options{})
	require.NoError(t, err)
	got := findingsOfKind(rep, kindGRPCResponseTrailers)
	require.Len(t, got, 1, "%v", rep.Findings)
	require.Contains(t, got[0].Problem, "is Streamed on a gRPC route")
	require.Contains(t, got[0].Fix, "FullDuplexStreamed")
	require.Equal(t, "EnvoyExtensionPolicy payments/idempotency-ledger", got[0].Resource)
}

// An EnvoyExtensionPolicy's GRPCRoute targets resolve to the xDS routes Envoy Gateway builds
// for its rules (grpcroute/namespace/name/rule/i/match/j/host), each a gRPC route; a sectionName
// takes one rule, and one that names none is refused.
func TestEnvoyGatewayGRPCRouteTargets(t *testing.T) {
	const route = `apiVersion: gateway.networking.k8s.io/v1
kind: GRPCRoute
metadata: { name: ledger, namespace: payments }
spec:
  hostnames: [grpc.example.com]
  rules:
  - name: post
    matches: [{ method: { service: ledger.v1.Ledger, method: Post } }, { method: { service: ledger.v1.Ledger, method: Get } }]
  - name: rest
---
`
	cases := []struct {
		name, target string
		want         []string
		err          string
	}{
		{"whole route", "{ kind: GRPCRoute, name: ledger }", []string{
			"grpcroute/payments/ledger/rule/0/match/0/grpc_example_com",
			"grpcroute/payments/ledger/rule/0/match/1/grpc_example_com",
			"grpcroute/payments/ledger/rule/1/match/-1/grpc_example_com",
		}, ""},
		{"one rule", "{ kind: GRPCRoute, name: ledger, sectionName: rest }", []string{"grpcroute/payments/ledger/rule/1/match/-1/grpc_example_com"}, ""},
		{"a sectionName naming no rule", "{ kind: GRPCRoute, name: ledger, sectionName: nope }", nil, `names no rule of GRPCRoute payments/ledger`},
		{"an HTTPRoute of the same name is another route", "{ kind: HTTPRoute, name: ledger }", nil, `HTTPRoute payments/ledger is not in the file`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pol := grpcRouteObjs("", c.target, "FullDuplexStreamed", "FullDuplexStreamed")
			pol = pol[strings.Index(pol, "apiVersion: gateway.envoyproxy.io"):]
			path := writeTemp(t, "eg.yaml", route+pol)
			pols, _, err := EnvoyGateway(path)
			if c.err != "" {
				require.ErrorContains(t, err, c.err)
				return
			}
			require.NoError(t, err)
			require.Len(t, pols, 1)
			var names []string
			for _, e := range pols[0].Deployment.Routes {
				require.True(t, e.GRPC, "%s is a gRPC route", e.Name)
				names = append(names, e.Name)
			}
			require.Equal(t, c.want, names)
		})
	}
}

// A GRPCRoute match stands for the path Envoy Gateway matches: /service/method exactly, the
// prefix /service/ for a service alone; no one path for a method alone or a regular expression.
func TestGRPCRouteMatchPath(t *testing.T) {
	cases := []struct {
		match, want string
		ok          bool
	}{
		{"{ method: { service: ledger.v1.Ledger, method: Post } }", "/ledger.v1.Ledger/Post", true},
		{"{ method: { type: Exact, service: ledger.v1.Ledger } }", "/ledger.v1.Ledger/", true},
		{"{ method: { method: Post } }", "", false},
		{"{ method: { type: RegularExpression, service: 'ledger\\..*', method: Post } }", "", false},
		{"{ headers: [{ name: x-tenant, value: a }] }", "/", true},
		{"{ path: { type: PathPrefix, value: /v1/refunds } }", "/v1/refunds", true},
	}
	for _, c := range cases {
		t.Run(c.match, func(t *testing.T) {
			var m gwMatch
			require.NoError(t, yaml.Unmarshal([]byte(c.match), &m))
			got, ok := m.path()
			require.Equal(t, c.ok, ok)
			require.Equal(t, c.want, got)
		})
	}
}
