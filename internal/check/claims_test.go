package check

import (
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// A route that scopes by a claim a token may carry as a number gets one warning per claim: a
// number of 2^53 or more (or a fraction) is refused with 400 scope-claim-ambiguous. The claims
// Envoy accepts only as strings (sub, iss, jti, aud) and disabled routes get none; the warning is
// never an error.
func TestRunWarnsOfNumericClaims(t *testing.T) {
	const policyText = `
routes:
  - name: transfers
    match: { path_prefix: /v1/transfers }
    scope: [{ jwt_claim: sub }, { jwt_claim: iss }, { jwt_claim: jti }, { jwt_claim: aud }, { jwt_claim: uid }]
  - name: refunds
    match: { path_prefix: /v1/refunds }
    scope: [{ jwt_claim: tenant }]
  - name: old
    match: { path_prefix: /v1/old }
    scope: [{ jwt_claim: account }]
    enabled: false
`
	for _, tc := range []struct {
		file, resource, field string
	}{
		{"envoy.yaml", bootstrapListener, bootstrapFilter + ".metadata_options.forwarding_namespaces.untyped"},
		{"istio-envoyfilter.yaml", istioResource, istioFilterPath + ".metadata_options.forwarding_namespaces.untyped"},
		{"envoy-gateway.yaml", egTransfers, "extProc[0].metadata.accessibleNamespaces"},
	} {
		t.Run(tc.file, func(t *testing.T) {
			rep, err := Run(parsePolicy(t, policyText), shippedInputs(t, tc.file), Options{})
			require.NoError(t, err)
			var claims []string
			for _, f := range rep.Findings {
				if !strings.Contains(f.Problem, "scope-claim-ambiguous") {
					continue
				}
				require.Equal(t, Warning, f.Severity)
				if f.Resource == tc.resource {
					require.Equal(t, tc.field, f.Field)
				}
				require.Contains(t, f.Fix, "as a string")
				claims = append(claims, f.Problem[strings.Index(f.Problem, "route "):strings.Index(f.Problem, ", which")])
			}
			slices.Sort(claims)
			claims = slices.Compact(claims)
			require.Equal(t, []string{`route "refunds" scopes by jwt_claim "tenant"`, `route "transfers" scopes by jwt_claim "uid"`}, claims)
		})
	}
}
