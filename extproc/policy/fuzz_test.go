package policy_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// FuzzParse feeds arbitrary YAML to the policy parser: it never panics, a file it refuses gives
// no policy, and a policy it accepts answers every selector with a route whose settings hold the
// invariants the server relies on.
func FuzzParse(f *testing.F) {
	f.Add([]byte(annotatedExample))
	f.Add([]byte("defaults: {ttl: 1h, max_ttl: 2h}\nroutes: [{name: a, match: {path_exact: /a}}]\n"))
	f.Add([]byte("routes: [{name: r, match: {path_regex: '^/(?P<org>[^/]+)'}, scope_path_params: [org]}]\n"))
	f.Add([]byte("defaults: {store_statuses: [2xx, 409, \"5XX\"], fingerprint: []}\nfail_mode: open\n"))
	f.Add([]byte("{{{"))
	f.Add([]byte(`
defaults:
  scope: [{header: authorization}, {jwt_claim: sub}, peer_identity]
  mode: shadow
  in_flight_wait: 2s
  expires_header: ""
  replay_header_fresh: false
  store_body: false
routes:
  - name: org
    match: {path_regex: '^/orgs/(?P<org>[^/]+)'}
    scope: [{header: x-tenant}, {path_param: org}]
    require_scope: true
    jwt_payload_key: provider
  - name: gw
    match: {route_name_prefix: httproute/default/}
    problems:
      request-in-progress: {status: 409, content_type: application/json, body: '{"code":"0084","message":{{json .Detail}}}'}
problems:
  store-unavailable: {status: 503, body: '{{.Title}}'}
metadata_namespace: idem
`))
	f.Add([]byte("base: &b {ttl: 1h}\ndefaults: {<<: *b, methods: &m [POST]}\nroutes: [{name: a, match: {route_name_regex: '^a'}, methods: *m}]\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := policy.Parse(data)
		if err != nil {
			require.Nil(t, p)
			return
		}
		require.Positive(t, p.StoreTimeout)
		require.NotEmpty(t, p.MetadataNamespace)
		names := []string{"", "default", "org", "gw", "a", "r", "ledger-transactions", "nope"}
		for _, r := range p.Routes {
			names = append(names, r.Name)
		}
		for _, path := range []string{"/", "/v1/organizations/o/ledgers/l/transactions", "/a", "/orgs/x", "/healthz", ""} {
			for _, routeName := range []string{"", "a", "httproute/default/x"} {
				for _, named := range names {
					r, params, err := p.Select(policy.Selector{Path: path, RouteName: routeName, Named: named})
					switch {
					case errors.Is(err, policy.ErrUnknownRoute):
						require.NotEmpty(t, named)
						require.Nil(t, r)
						continue
					case errors.Is(err, policy.ErrPathParams):
						require.NotEmpty(t, named)
						require.NotEmpty(t, r.ScopePathParams)
						require.Nil(t, params)
						continue
					}
					require.NoError(t, err)
					require.NotNil(t, r)
					if named != "" {
						require.Equal(t, named, r.Name)
					}
					checkRoute(t, r, params)
				}
			}
		}
	})
}

func checkRoute(t *testing.T, r *policy.Route, params []string) {
	require.Len(t, params, len(r.ScopePathParams))
	require.Positive(t, r.LockTTL)
	require.Positive(t, r.TTL)
	require.LessOrEqual(t, r.TTL, r.MaxTTL)
	require.LessOrEqual(t, r.InFlightWait, policy.MaxInFlightWait)
	require.GreaterOrEqual(t, r.InFlightWait, 0*policy.MaxInFlightWait)
	require.GreaterOrEqual(t, r.MaxResponseBytes, 0)
	require.NotEmpty(t, r.ReplayHeader)
	require.NotEmpty(t, r.KeyHeaders)
	require.Contains(t, []policy.Mode{policy.ModeEnforce, policy.ModeShadow}, r.Mode)
	require.False(t, r.RequireScope && len(r.Scope) == 0, "require_scope with an empty scope")
	headers, pathParams := 0, 0
	for _, s := range r.Scope {
		switch s.Kind {
		case policy.ScopeHeader:
			require.Equal(t, r.ScopeHeaders[headers], s.Name)
			headers++
		case policy.ScopePathParam:
			require.Equal(t, r.ScopePathParams[pathParams], s.Name)
			pathParams++
		case policy.ScopeJWTClaim:
			require.NotEmpty(t, s.Name)
		case policy.ScopePeerIdentity:
			require.Empty(t, s.Name)
		default:
			t.Fatalf("scope kind %q", s.Kind)
		}
	}
	require.Len(t, r.ScopeHeaders, headers)
	require.Len(t, r.ScopePathParams, pathParams)
	for code, pr := range r.Problems {
		require.Contains(t, policy.ProblemCodes, code)
		require.NotEmpty(t, pr.ContentType)
		require.True(t, pr.Status == 0 || pr.Status >= 200 && pr.Status <= 599)
	}
}
