package check

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// fuzzPolicy reads what every part of the checks can read: route names, JWT claims, the peer,
// a named route, a wait, a body that is stored.
const fuzzPolicy = `
defaults:
  in_flight_wait: 1s
  max_response_bytes: 2097152
routes:
  - name: transfers
    match: { route_name_prefix: transfers }
    scope: [{ jwt_claim: sub }, peer_identity]
  - name: refunds
    match: { path_prefix: /v1/refunds }
    store_body: false
`

// requireWellFormed holds a result of Run to its contract: an error is *InputErrors naming a
// file and no report; a report's findings are complete and errors come first.
func requireWellFormed(t *testing.T, rep Report, err error) {
	t.Helper()
	if err != nil {
		var ie *fileError
		require.True(t, errors.As(err, &ie), "%v", err)
		require.NotEmpty(t, ie.File)
		require.Zero(t, rep.Findings)
		return
	}
	warned := false
	for _, f := range rep.Findings {
		require.NotEmpty(t, f.File)
		require.NotEmpty(t, f.Resource)
		require.NotEmpty(t, f.Field)
		require.NotEmpty(t, f.Problem)
		require.NotEmpty(t, f.Fix)
		require.Contains(t, []Severity{Error, Warning}, f.Severity)
		if f.Severity == Warning {
			warned = true
		} else {
			require.False(t, warned, "an error after a warning")
		}
	}
}

// FuzzReadBootstrap feeds one arbitrary input, read as an Envoy bootstrap (or JSON): Run never
// panics, and answers with an *InputError or a well-formed report.
func FuzzReadBootstrap(f *testing.F) {
	f.Add([]byte(readEnvoyFile(f, "envoy.yaml")))
	f.Add([]byte(minimal))
	f.Add([]byte(`{"static_resources": {"listeners": [{"filter_chains": [{"filters": [{"name": "h", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager", "rds": {"route_config_name": "r"}, "http_filters": [{"name": "e", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"}}]}}]}]}]}}`))
	f.Add([]byte("a: &a [*a]\n"))
	f.Add([]byte("{{{"))
	// Past the bounds: nesting, aliases, keys.
	f.Add([]byte(strings.Repeat("[", 101) + strings.Repeat("]", 101)))
	f.Add([]byte("a: &a [x, x, x, x]\nb: &b [*a, *a, *a, *a]\nc: [*b, *b, *b, *b]\n"))
	f.Add([]byte("admin:\n  - a\nadmin: {}\n"))
	p, err := policy.Parse([]byte(fuzzPolicy))
	require.NoError(f, err)
	f.Fuzz(func(t *testing.T, data []byte) {
		rep, err := Run(p, []Input{{Name: "bootstrap.yaml", Data: data}}, Options{EnvoyVersion: "1.38"})
		requireWellFormed(t, rep, err)
	})
}

// FuzzReadKubernetes feeds two arbitrary inputs, read as Kubernetes YAML (many documents, List
// kinds, objects that refer to each other across inputs): Run never panics, and answers with an
// *InputError or a well-formed report.
func FuzzReadKubernetes(f *testing.F) {
	for _, n := range []string{"istio-envoyfilter.yaml", "envoy-gateway.yaml"} {
		f.Add([]byte(readEnvoyFile(f, n)), []byte("apiVersion: v1\nkind: Service\nmetadata: {name: s, namespace: n}\n"))
	}
	f.Add([]byte("apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: List\n  items: [{apiVersion: v1, kind: Service, metadata: {name: s}}]\n"), []byte("---\n---\n"))
	f.Add([]byte("apiVersion: gateway.envoyproxy.io/v1alpha1\nkind: EnvoyExtensionPolicy\nmetadata: {name: p, namespace: n}\nspec:\n  targetRefs: [{kind: Gateway, name: g}]\n  extProc: [{backendRefs: [{name: x, port: 1}]}, {backendRefs: [{name: y, port: 2}]}]\n"),
		[]byte("apiVersion: gateway.envoyproxy.io/v1alpha1\nkind: BackendTrafficPolicy\nmetadata: {name: b, namespace: n}\nspec:\n  targetRefs: [{kind: HTTPRoute, name: r, sectionName: s}]\n  retry: {}\n  connection: {bufferLimit: 1Ki}\n"))
	p, err := policy.Parse([]byte(fuzzPolicy))
	require.NoError(f, err)
	f.Fuzz(func(t *testing.T, a, b []byte) {
		rep, err := Run(p, []Input{{Name: "a.yaml", Data: a}, {Name: "b.yaml", Data: b}}, Options{})
		requireWellFormed(t, rep, err)
	})
}
