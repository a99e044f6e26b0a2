package policy_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// FuzzParse feeds arbitrary YAML to the policy parser: it never panics, and a policy it accepts
// answers every path with a route whose settings hold the invariants the server relies on.
func FuzzParse(f *testing.F) {
	f.Add([]byte(specExample))
	f.Add([]byte("defaults: {ttl: 1h, max_ttl: 2h}\nroutes: [{name: a, match: {path_exact: /a}}]\n"))
	f.Add([]byte("routes: [{name: r, match: {path_regex: '^/(?P<org>[^/]+)'}, scope_path_params: [org]}]\n"))
	f.Add([]byte("defaults: {store_statuses: [2xx, 409, \"5XX\"], fingerprint: []}\nfail_mode: open\n"))
	f.Add([]byte("{{{"))
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := policy.Parse(data)
		if err != nil {
			require.Nil(t, p)
			return
		}
		for _, path := range []string{"/", "/v1/organizations/o/ledgers/l/transactions", "/a", "/healthz", ""} {
			r, params := p.Match(path)
			require.NotNil(t, r)
			require.Len(t, params, len(r.ScopePathParams))
			require.Positive(t, r.LockTTL)
			require.Positive(t, r.TTL)
			require.LessOrEqual(t, r.TTL, r.MaxTTL)
			require.GreaterOrEqual(t, r.MaxResponseBytes, 0)
			require.NotEmpty(t, r.ReplayHeader)
		}
		require.Positive(t, p.StoreTimeout)
	})
}
