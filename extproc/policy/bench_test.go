package policy_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// BenchmarkSelect measures choosing the route of /v1/payments when a later route matches it, after
// a disabled prefix route and a path_regex route (the policy the user bench runs), and when the
// only route matches it.
func BenchmarkSelect(b *testing.B) {
	for _, c := range []struct{ name, src string }{
		{"one-route", "routes:\n  - name: payments\n    match: { path_prefix: /v1/payments }\n"},
		{"after-regex", `routes:
  - name: health
    match: { path_prefix: /healthz }
    enabled: false
  - name: ledger-transactions
    match: { path_regex: '^/v1/organizations/(?P<org>[^/]+)/ledgers/(?P<ledger>[^/]+)/transactions' }
    scope_path_params: [org, ledger]
  - name: payments
    match: { path_prefix: /v1/payments }
`},
	} {
		p, err := policy.Parse([]byte(c.src))
		require.NoError(b, err)
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				r, _, _ := p.Select(policy.Selector{Path: "/v1/payments", RouteName: "payments"})
				if r.Name != "payments" {
					b.Fatal(r.Name)
				}
			}
		})
	}
}
