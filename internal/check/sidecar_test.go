package check

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// replaceOnce replaces old, which must be in s, once.
func replaceOnce(t *testing.T, s, old, new string) string {
	t.Helper()
	require.Contains(t, s, old)
	return strings.Replace(s, old, new, 1)
}

// A processor next to Envoy, on a unix socket, is recognised as the processor: Envoy's cluster
// with a pipe address, the cluster an Istio EnvoyFilter adds with one, and an Envoy Gateway
// Backend with a unix endpoint (which needs no port). Its circuit breakers are the processor's:
// left at Envoy's default they are the warning every processor cluster gets, on the resource
// that sets them.
func TestRunProcessorOnAUnixSocket(t *testing.T) {
	const socket = "/var/run/idempotency/extproc.sock"
	cb := "circuit_breakers:\n  thresholds:\n  - priority: DEFAULT\n    max_connections: 100000\n    max_pending_requests: 100000\n    max_requests: 100000\n    max_retries: 100000\n"
	bootstrap := func(t *testing.T, breakers bool) string {
		s := readEnvoyFile(t, "envoy.yaml")
		s = replaceOnce(t, s, "socket_address: { address: extproc, port_value: 9002 }", "pipe: { path: "+socket+" }")
		s = replaceOnce(t, s, "  - name: idempotency_extproc\n    type: STRICT_DNS", "  - name: idempotency_extproc\n    type: STATIC")
		if !breakers {
			s = replaceOnce(t, s, "    "+strings.ReplaceAll(strings.TrimSuffix(cb, "\n"), "\n", "\n    ")+"\n", "")
		}
		return s
	}
	istio := func(t *testing.T, breakers bool) string {
		s := readEnvoyFile(t, "istio-envoyfilter.yaml")
		s = replaceOnce(t, s, "cluster_name: outbound|9002||idempotency-extproc.idempotency.svc.cluster.local", "cluster_name: idempotency_extproc_sidecar")
		cluster := "  - applyTo: CLUSTER\n    match: { context: GATEWAY }\n    patch:\n      operation: ADD\n      value:\n" +
			"        name: idempotency_extproc_sidecar\n        type: STATIC\n        connect_timeout: 1s\n"
		if breakers {
			cluster += "        " + strings.ReplaceAll(strings.TrimSuffix(cb, "\n"), "\n", "\n        ") + "\n"
		}
		cluster += "        load_assignment:\n          cluster_name: idempotency_extproc_sidecar\n          endpoints:\n" +
			"          - lb_endpoints:\n            - endpoint: { address: { pipe: { path: " + socket + " } } }\n"
		return replaceOnce(t, s, "  configPatches:\n", "  configPatches:\n"+cluster)
	}
	backend := "---\napiVersion: gateway.envoyproxy.io/v1alpha1\nkind: Backend\nmetadata:\n  name: idempotency-sidecar\n  namespace: idempotency\nspec:\n  endpoints:\n  - unix: { path: " + socket + " }\n"
	gateway := func(t *testing.T, ref string) string {
		s := readEnvoyFile(t, "envoy-gateway.yaml")
		for range 2 {
			s = replaceOnce(t, s, "  - backendRefs:\n    - name: idempotency-extproc\n      port: 9002\n", "  - backendRefs:\n"+ref)
		}
		return s + backend
	}
	sidecarRef := "    - group: gateway.envoyproxy.io\n      kind: Backend\n      name: idempotency-sidecar\n      namespace: idempotency\n"

	for _, tc := range []struct {
		name, file, text string
		// warned is the resource and field of the circuit breaker warning, "" for none.
		warned string
	}{
		{"envoy pipe", "envoy.yaml", bootstrap(t, true), ""},
		{"envoy pipe, default breakers", "envoy.yaml", bootstrap(t, false), `cluster "idempotency_extproc" circuit_breakers.thresholds (unset)`},
		{"istio pipe cluster", "istio-envoyfilter.yaml", istio(t, true), ""},
		{"istio pipe cluster, default breakers", "istio-envoyfilter.yaml", istio(t, false),
			"EnvoyFilter istio-system/idempotency-extproc configPatches[0].patch.value.circuit_breakers.thresholds (unset)"},
		{"envoy gateway backend", "envoy-gateway.yaml", gateway(t, sidecarRef), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep, err := Run(shippedPolicy(t), []Input{{Name: "envoy/" + tc.file, Data: []byte(tc.text)}}, Options{})
			require.NoError(t, err)
			require.Zero(t, rep.Errors(), "%v", rep.Findings)
			var breakers []string
			for _, f := range rep.Findings {
				if strings.Contains(f.Problem, "circuit breakers") {
					breakers = append(breakers, f.Resource+" "+f.Field)
				}
			}
			if tc.warned == "" {
				require.Empty(t, breakers)
			} else {
				require.Equal(t, []string{tc.warned}, breakers)
			}
		})
	}

	// A Service still needs its port; a Backend is in Envoy Gateway's group.
	for ref, want := range map[string]string{
		"    - name: idempotency-extproc\n":                      "needs a name and a port",
		"    - kind: Backend\n      name: idempotency-sidecar\n": "a Backend is in group gateway.envoyproxy.io",
	} {
		_, err := Run(shippedPolicy(t), []Input{{Name: "envoy/envoy-gateway.yaml", Data: []byte(gateway(t, ref))}}, Options{})
		require.ErrorContains(t, err, want)
	}
}
