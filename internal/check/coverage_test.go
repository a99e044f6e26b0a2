package check

import (
	"go/ast"
	"go/parser"
	"go/token"
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// errorsOf returns the findings of severity Error.
func errorsOf(rep Report) []Finding {
	var out []Finding
	for _, f := range rep.Findings {
		if f.Severity == Error {
			out = append(out, f)
		}
	}
	return out
}

// A policy route matched by route_name_* that matches no route the filter runs on protects
// nothing: an error on the policy file's line, which the shipped files do not have.
func TestRunRouteNameMatchesNothing(t *testing.T) {
	policyText := readEnvoyFile(t, "policy.yaml")
	renamed := mutate(t, readEnvoyFile(t, "envoy.yaml"), "name: transfers", "name: transfer", 1)
	opts := Options{Policy: Input{Name: "envoy/policy.yaml", Data: []byte(policyText)}}
	rep, err := Run(shippedPolicy(t), []Input{{Name: "copy/envoy.yaml", Data: []byte(renamed)}}, opts)
	require.NoError(t, err)
	errs := errorsOf(rep)
	require.Len(t, errs, 1, "%v", rep.Findings)
	f := errs[0]
	require.Equal(t, kindRouteNameMatchesNothing, f.Kind)
	require.Equal(t, "envoy/policy.yaml", f.File)
	require.Equal(t, `policy route "transfers"`, f.Resource)
	require.Equal(t, "routes[0].match", f.Field)
	require.Contains(t, f.Problem, "protects nothing")
	require.Contains(t, f.Problem, `"transfer"`, "it names the routes it saw")
	requireAtField(t, policyText, f)

	// Named outright by x-idempotency-route, a policy route protects what names it.
	named := mutate(t, renamed, "{ key: x-idempotency-route, value: refunds }", "{ key: x-idempotency-route, value: transfers }", 1)
	rep, err = Run(shippedPolicy(t), []Input{{Name: "copy/envoy.yaml", Data: []byte(named)}}, opts)
	require.NoError(t, err)
	require.NotContains(t, kindsOf(rep), kindRouteNameMatchesNothing, "%v", rep.Findings)

	// Routes that come from RDS cannot be compared: no finding then.
	for _, files := range [][]string{{"envoy.yaml"}, {"istio-envoyfilter.yaml"}, {"envoy-gateway.yaml"}} {
		rep, err := Run(shippedPolicy(t), shippedInputs(t, files...), opts)
		require.NoError(t, err)
		require.NotContains(t, kindsOf(rep), kindRouteNameMatchesNothing, "%v: %v", files, rep.Findings)
	}
}

func kindsOf(rep Report) []Kind {
	var out []Kind
	for _, f := range rep.Findings {
		out = append(out, f.Kind)
	}
	return out
}

// A Gateway API retry on a rule an EnvoyExtensionPolicy reaches is an error on its line; on a
// rule no ext_proc filter runs on, or with attempts: 0, it is none.
func TestRunGatewayAPIRetry(t *testing.T) {
	eg := readEnvoyFile(t, "envoy-gateway.yaml")
	const refundsRule = "  - name: refunds\n    matches:\n    - path: { type: PathPrefix, value: /v1/refunds }\n"
	for _, tc := range []struct {
		name, retry string
		want        bool
	}{
		{"codes", "    retry: { codes: [500, 502], attempts: 2 }\n", true},
		{"attempts unset", "    retry: { codes: [503] }\n", true},
		{"attempts 0", "    retry: { attempts: 0 }\n", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			text := mutate(t, eg, refundsRule, refundsRule+tc.retry, 1)
			rep, err := Run(shippedPolicy(t), []Input{{Name: "copy/eg.yaml", Data: []byte(text)}}, Options{})
			require.NoError(t, err)
			if !tc.want {
				require.Zero(t, rep.Errors(), "%v", rep.Findings)
				return
			}
			errs := errorsOf(rep)
			require.Len(t, errs, 1, "%v", rep.Findings)
			f := errs[0]
			require.Equal(t, kindGatewayAPIRetry, f.Kind)
			require.Equal(t, "HTTPRoute payments/payments-api", f.Resource)
			require.Equal(t, "rules[1].retry", f.Field)
			require.Contains(t, f.Problem, "the router retries after ext_proc")
			requireAtField(t, text, f)
		})
	}

	// Without the EnvoyExtensionPolicy of the refunds rule, no filter runs there.
	text := mutate(t, eg, refundsRule, refundsRule+"    retry: { codes: [500] }\n", 1)
	i := strings.Index(text, "  name: idempotency-refunds")
	start := strings.LastIndex(text[:i], "---\n")
	end := i + strings.Index(text[i:], "---\n")
	text = text[:start] + text[end:]
	rep, err := Run(shippedPolicy(t), []Input{{Name: "copy/eg.yaml", Data: []byte(text)}}, Options{})
	require.NoError(t, err)
	require.NotContains(t, kindsOf(rep), kindGatewayAPIRetry, "%v", rep.Findings)
}

// A GRPCRoute's retry on a rule an EnvoyExtensionPolicy targets is an error too.
func TestRunGRPCRouteRetry(t *testing.T) {
	const objs = `apiVersion: gateway.networking.k8s.io/v1
kind: GRPCRoute
metadata: { name: ledger, namespace: payments }
spec:
  parentRefs: [{ name: eg }]
  rules:
  - matches: [{ method: { service: ledger.v1.Ledger, method: Post } }]
    backendRefs: [{ name: ledger, port: 9000 }]
    retry: { codes: [503], attempts: 3 }
---
apiVersion: gateway.envoyproxy.io/v1alpha1
kind: EnvoyExtensionPolicy
metadata: { name: idempotency-ledger, namespace: payments }
spec:
  targetRefs: [{ group: gateway.networking.k8s.io, kind: GRPCRoute, name: ledger }]
  extProc:
  - backendRefs: [{ name: idempotency-extproc, port: 9002 }]
    backendSettings:
      circuitBreaker: { maxConnections: 100000, maxPendingRequests: 100000, maxParallelRequests: 100000 }
    messageTimeout: 500ms
    processingMode:
      allowModeOverride: true
      request: { body: FullDuplexStreamed, attributes: ["xds.route_name"] }
      response: { body: FullDuplexStreamed, attributes: ["response.code_details", "upstream.request_attempt_count"] }
    metadata: { accessibleNamespaces: [envoy.filters.http.jwt_authn], writableNamespaces: [idempotency] }
`
	rep, err := Run(parsePolicy(t, "routes:\n  - name: ledger\n    match: { path_prefix: /ledger.v1.Ledger/ }\n"), []Input{{Name: "grpc.yaml", Data: []byte(objs)}}, Options{})
	require.NoError(t, err)
	i := slices.IndexFunc(rep.Findings, func(f Finding) bool { return f.Kind == kindGatewayAPIRetry })
	require.GreaterOrEqual(t, i, 0, "%v", rep.Findings)
	f := rep.Findings[i]
	require.Equal(t, Error, f.Severity)
	require.Equal(t, "GRPCRoute payments/ledger", f.Resource)
	require.Equal(t, "rules[0].retry", f.Field)
	requireAtField(t, objs, f)
}

// An EnvoyExtensionPolicy whose targets reach only routes no policy route covers is an error.
func TestRunExtensionPolicyTargetsNothing(t *testing.T) {
	eg := readEnvoyFile(t, "envoy-gateway.yaml")
	// Only the refunds policy route, which matches its path: the transfers policy reaches rule
	// 0, which nothing but the default covers.
	p := parsePolicy(t, "routes:\n  - name: refunds\n    match: { path_prefix: /v1/refunds }\n")
	rep, err := Run(p, []Input{{Name: "eg.yaml", Data: []byte(eg)}}, Options{})
	require.NoError(t, err)
	errs := errorsOf(rep)
	require.Len(t, errs, 1, "%v", rep.Findings)
	require.Equal(t, kindPolicyTargetsNothing, errs[0].Kind)
	require.Equal(t, egTransfers, errs[0].Resource)
	require.Equal(t, "targetRefs", errs[0].Field)
	requireAtField(t, eg, errs[0])

	// The shipped policy names both rules.
	rep, err = Run(shippedPolicy(t), []Input{{Name: "eg.yaml", Data: []byte(eg)}}, Options{})
	require.NoError(t, err)
	require.Zero(t, rep.Errors(), "%v", rep.Findings)
}

// A duration written as Istio accepts it (200ms) is a duration; a value check cannot read is a
// finding on its line, and the other files' findings are still reported (exit 1, not 2).
func TestRunIstioDurations(t *testing.T) {
	istio := readEnvoyFile(t, "istio-envoyfilter.yaml")
	goStyle := mutate(t, istio, "message_timeout: 0.5s", "message_timeout: 500ms", 1)
	rep, err := Run(shippedPolicy(t), []Input{{Name: "istio.yaml", Data: []byte(goStyle)}}, Options{})
	require.NoError(t, err)
	require.Empty(t, rep.Findings, "500ms is 0.5s")

	short := mutate(t, istio, "message_timeout: 0.5s", "message_timeout: 50ms", 1)
	rep, err = Run(shippedPolicy(t), []Input{{Name: "istio.yaml", Data: []byte(short)}}, Options{})
	require.NoError(t, err)
	require.Equal(t, []string{istioFilterPath + ".message_timeout"}, fieldsOf(rep, Error), "50ms is read, and is too short")

	bad := mutate(t, istio, "message_timeout: 0.5s", "message_timeout: soon", 1)
	broken := mutate(t, readEnvoyFile(t, "envoy.yaml"), "failure_mode_allow: false", "failure_mode_allow: true", 1)
	rep, err = Run(shippedPolicy(t), []Input{{Name: "istio.yaml", Data: []byte(bad)}, {Name: "envoy.yaml", Data: []byte(broken)}}, Options{})
	require.NoError(t, err, "a value check cannot read is no reason to stop")
	var unreadable, other *Finding
	for i, f := range rep.Findings {
		switch f.Kind {
		case kindUnreadable:
			unreadable = &rep.Findings[i]
		case kindFailureModeAllow:
			other = &rep.Findings[i]
		}
	}
	require.NotNil(t, unreadable, "%v", rep.Findings)
	require.NotNil(t, other, "the other file's finding is still reported: %v", rep.Findings)
	require.Equal(t, "istio.yaml", unreadable.File)
	require.Contains(t, unreadable.Problem, `"soon"`)
	requireAtField(t, bad, *unreadable)
	line := strings.Split(bad, "\n")[unreadable.Line-1]
	require.Contains(t, line, "message_timeout: soon")
}

// Every kind declared has a severity in the table, and every error kind one reason to be one.
func TestKindsTableComplete(t *testing.T) {
	fset := token.NewFileSet()
	file, err := parser.ParseFile(fset, "kinds.go", nil, 0)
	require.NoError(t, err)
	declared := 0
	for _, d := range file.Decls {
		g, ok := d.(*ast.GenDecl)
		if !ok || g.Tok != token.CONST {
			continue
		}
		for _, spec := range g.Specs {
			vs := spec.(*ast.ValueSpec)
			if id, ok := vs.Type.(*ast.Ident); !ok || id.Name != "Kind" {
				continue
			}
			for _, v := range vs.Values {
				lit := v.(*ast.BasicLit)
				k, err := strconv.Unquote(lit.Value)
				require.NoError(t, err)
				_, ok := kindSeverity[Kind(k)]
				require.True(t, ok, "kind %s has no severity in kindSeverity", k)
				declared++
			}
		}
	}
	require.Equal(t, declared, len(kindSeverity), "kindSeverity holds a kind that is not declared")
	require.Contains(t, slices.Collect(maps.Values(Kinds())), Error, "no kind is an error")
}

// An EnvoyExtensionPolicy value that cannot be read is a finding on its line; the other policies
// are still checked.
func TestRunGatewayUnreadableValue(t *testing.T) {
	eg := readEnvoyFile(t, "envoy-gateway.yaml")
	bad := mutate(t, eg, "messageTimeout: 500ms", "messageTimeout: soon", 1)
	bad = mutate(t, bad, "failOpen: false", "failOpen: true", 2) // the refunds policy's, still checked
	rep, err := Run(shippedPolicy(t), []Input{{Name: "eg.yaml", Data: []byte(bad)}}, Options{})
	require.NoError(t, err, "a value check cannot read is no reason to stop")
	var unread, other *Finding
	for i, f := range rep.Findings {
		switch {
		case f.Kind == kindUnreadable:
			unread = &rep.Findings[i]
		case f.Kind == kindFailureModeAllow:
			other = &rep.Findings[i]
		}
	}
	require.NotNil(t, unread, "%v", rep.Findings)
	require.NotNil(t, other, "the other policy is still checked: %v", rep.Findings)
	require.Equal(t, egTransfers, unread.Resource)
	require.Equal(t, "extProc[0].messageTimeout", unread.Field)
	requireAtField(t, bad, *unread)
	require.Contains(t, strings.Split(bad, "\n")[unread.Line-1], "messageTimeout: soon")
	require.Equal(t, "EnvoyExtensionPolicy payments/idempotency-refunds", other.Resource)
}
