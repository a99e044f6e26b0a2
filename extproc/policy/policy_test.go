package policy_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// annotatedExample is an annotated policy file: the defaults' first fields, a route scoped by
// path parameters and a disabled route.
const annotatedExample = `
defaults:                          # every route inherits these; a route overrides field by field
  methods: [POST, PUT, PATCH]
  key_headers: [idempotency-key, x-idempotency-key, x-idempotency]
  missing_key: optional            # optional | required | body-hash
  ttl: 24h
  ttl_header: x-ttl                # "" turns per-request TTL off
  max_ttl: 24h
  lock_ttl: 30s
  fingerprint: [method, path, body]
  fingerprint_headers: []
  scope_headers: [authorization]
  store_statuses: ["2xx"]          # classes ("2xx") or codes (409)
  unknown_outcome: release         # release | keep | record
  max_response_bytes: 1048576
  replay_header: x-idempotency-replayed
  exclude_response_headers: []
  key_prefix: "idempotency:"
routes:                            # first match on the path (query excluded) wins
  - name: ledger-transactions
    match: { path_regex: '^/v1/organizations/(?P<org>[^/]+)/ledgers/(?P<ledger>[^/]+)/transactions' }
    scope_path_params: [org, ledger]
    missing_key: body-hash
    ttl: 300s
  - name: health
    match: { path_prefix: /healthz }   # also path_exact
    enabled: false
fail_mode: closed                  # closed | open
store_timeout: 100ms
`

func TestDefaults(t *testing.T) {
	for name, p := range map[string]*policy.Policy{"Default()": policy.Default(), "empty file": mustParse(t, "")} {
		t.Run(name, func(t *testing.T) {
			d := p.Default
			require.Equal(t, "default", d.Name)
			require.True(t, d.Enabled)
			require.Equal(t, []string{"POST", "PUT", "PATCH"}, d.Methods)
			require.Equal(t, []string{"idempotency-key", "x-idempotency-key", "x-idempotency"}, d.KeyHeaders)
			require.Equal(t, policy.MissingKeyOptional, d.MissingKey)
			require.Equal(t, 24*time.Hour, d.TTL)
			require.Equal(t, "x-ttl", d.TTLHeader)
			require.Equal(t, 24*time.Hour, d.MaxTTL)
			require.Equal(t, 30*time.Second, d.LockTTL)
			require.Equal(t, []policy.Part{policy.PartMethod, policy.PartPath, policy.PartBody}, d.Fingerprint)
			require.Empty(t, d.FingerprintHeaders)
			require.Equal(t, []string{"authorization"}, d.ScopeHeaders)
			require.True(t, d.StoreStatuses.Has(200))
			require.True(t, d.StoreStatuses.Has(299))
			require.False(t, d.StoreStatuses.Has(300))
			require.False(t, d.StoreStatuses.Has(199))
			require.Equal(t, policy.UnknownOutcomeRelease, d.UnknownOutcome)
			require.Equal(t, 1048576, d.MaxResponseBytes)
			require.Equal(t, "x-idempotency-replayed", d.ReplayHeader)
			require.Empty(t, d.ExcludeResponseHeaders)
			require.Equal(t, "idempotency:", d.KeyPrefix)
			require.Equal(t, policy.FailClosed, p.FailMode)
			require.Equal(t, 100*time.Millisecond, p.StoreTimeout)
			require.Empty(t, p.Routes)

			require.Equal(t, policy.ModeEnforce, d.Mode)
			require.Equal(t, []policy.ScopeSource{{Kind: policy.ScopeHeader, Name: "authorization"}}, d.Scope)
			require.Empty(t, d.ScopePathParams)
			require.False(t, d.RequireScope)
			require.Empty(t, d.JWTPayloadKey)
			require.Zero(t, d.InFlightWait)
			require.Equal(t, "x-idempotency-expires", d.ExpiresHeader)
			require.Equal(t, "x-idempotency-first-sent", d.FirstSentHeader)
			require.True(t, d.ReplayHeaderFresh)
			require.True(t, d.StoreBody)
			require.Equal(t, policy.DefaultMaxRequestBytes, d.MaxRequestBytes)
			require.Nil(t, d.Problems)
			require.Nil(t, p.Problems)
			require.Equal(t, "idempotency", p.MetadataNamespace)
		})
	}
}

func mustParse(t *testing.T, src string) *policy.Policy {
	t.Helper()
	p, err := policy.Parse([]byte(src))
	require.NoError(t, err)
	return p
}

func TestSpecExample(t *testing.T) {
	p := mustParse(t, annotatedExample)
	require.Len(t, p.Routes, 2)

	r, params := p.Match("/v1/organizations/o1/ledgers/l9/transactions/json")
	require.Equal(t, "ledger-transactions", r.Name)
	require.Equal(t, []string{"o1", "l9"}, params)
	require.Equal(t, policy.MissingKeyBodyHash, r.MissingKey)
	require.Equal(t, 300*time.Second, r.TTL)
	require.Equal(t, 24*time.Hour, r.MaxTTL, "inherited from defaults")
	require.Equal(t, []string{"authorization"}, r.ScopeHeaders, "inherited from defaults")

	r, _ = p.Match("/healthz/live")
	require.Equal(t, "health", r.Name)
	require.False(t, r.Enabled)

	r, params = p.Match("/v1/other")
	require.Equal(t, "default", r.Name)
	require.Nil(t, params)
}

func TestValidFiles(t *testing.T) {
	cases := []struct {
		name  string
		src   string
		check func(t *testing.T, p *policy.Policy)
	}{
		{"routes inherit edited defaults field by field", `
defaults: {ttl: 1h, max_ttl: 2h, methods: [post]}
routes:
  - {name: a, match: {path_exact: /a}, ttl: 2h}
`, func(t *testing.T, p *policy.Policy) {
			r, _ := p.Match("/a")
			require.Equal(t, 2*time.Hour, r.TTL)
			require.Equal(t, []string{"POST"}, r.Methods)
			r, _ = p.Match("/a/b")
			require.Equal(t, "default", r.Name, "path_exact must not match a longer path")
			require.Equal(t, time.Hour, r.TTL)
		}},
		{"an empty fingerprint turns the mismatch check off", `
routes: [{name: a, match: {path_prefix: /}, fingerprint: []}]
`, func(t *testing.T, p *policy.Policy) {
			r, _ := p.Match("/x")
			require.Empty(t, r.Fingerprint)
			require.Equal(t, []policy.Part{policy.PartMethod, policy.PartPath, policy.PartBody}, p.Default.Fingerprint)
		}},
		{"first match wins", `
routes:
  - {name: first, match: {path_prefix: /v1}}
  - {name: second, match: {path_prefix: /v1/payments}}
`, func(t *testing.T, p *policy.Policy) {
			r, _ := p.Match("/v1/payments")
			require.Equal(t, "first", r.Name)
		}},
		{"statuses mix classes and codes", `
defaults: {store_statuses: ["2xx", 409, "410", "4XX"]}
`, func(t *testing.T, p *policy.Policy) {
			s := p.Default.StoreStatuses
			for _, c := range []int{200, 201, 409, 410, 404, 499} {
				require.True(t, s.Has(c), c)
			}
			for _, c := range []int{500, 302, 100, -1, 1000} {
				require.False(t, s.Has(c), c)
			}
		}},
		{"grpc routes and their stored statuses, by name or number", `
routes:
  - {name: charge, match: {path_exact: /payments.v1.Payments/Charge}, grpc: true, store_grpc_statuses: [OK, not_found, 6]}
  - {name: plain, match: {path_prefix: /}}
`, func(t *testing.T, p *policy.Policy) {
			charge, plain := p.Routes[0], p.Routes[1]
			require.True(t, charge.GRPC)
			require.False(t, plain.GRPC, "grpc is false unless a route says so")
			for _, c := range []int{0, 5, 6} {
				require.True(t, charge.StoreGRPCStatuses.Has(c), c)
			}
			for _, c := range []int{1, 2, 10, 14, 16, 17, -1} {
				require.False(t, charge.StoreGRPCStatuses.Has(c), c)
			}
			require.True(t, plain.StoreGRPCStatuses.Has(0), "store_grpc_statuses defaults to [OK]")
			for c := 1; c < len(policy.GRPCStatusNames); c++ {
				require.False(t, plain.StoreGRPCStatuses.Has(c), c)
			}
		}},
		{"ttl_header can be turned off; names are lower-cased", `
defaults: {ttl_header: "", key_headers: [Idempotency-Key], replay_header: X-Replayed, scope_headers: []}
fail_mode: open
store_timeout: 250ms
`, func(t *testing.T, p *policy.Policy) {
			require.Empty(t, p.Default.TTLHeader)
			require.Equal(t, []string{"idempotency-key"}, p.Default.KeyHeaders)
			require.Equal(t, "x-replayed", p.Default.ReplayHeader)
			require.Empty(t, p.Default.ScopeHeaders)
			require.Equal(t, policy.FailOpen, p.FailMode)
			require.Equal(t, 250*time.Millisecond, p.StoreTimeout)
		}},
		{"disabled by default, enabled per route", `
defaults: {enabled: false}
routes: [{name: pay, match: {path_prefix: /pay}, enabled: true, unknown_outcome: keep, max_response_bytes: 0}]
`, func(t *testing.T, p *policy.Policy) {
			require.False(t, p.Default.Enabled)
			r, _ := p.Match("/pay")
			require.True(t, r.Enabled)
			require.Equal(t, policy.UnknownOutcomeKeep, r.UnknownOutcome)
			require.Equal(t, 0, r.MaxResponseBytes)
			require.Equal(t, 1048576, p.MaxResponseBytes())
		}},
		{"outcome-unknown records and the request body bound", `
defaults: {unknown_outcome: record, max_request_bytes: 4096}
routes: [{name: up, match: {path_prefix: /up}, max_request_bytes: 8388608}]
`, func(t *testing.T, p *policy.Policy) {
			require.Equal(t, policy.UnknownOutcomeRecord, p.Default.UnknownOutcome)
			require.Equal(t, 4096, p.Default.MaxRequestBytes)
			r, _ := p.Match("/up")
			require.Equal(t, policy.UnknownOutcomeRecord, r.UnknownOutcome)
			require.Equal(t, 8<<20, r.MaxRequestBytes)
			require.Equal(t, 8<<20, p.MaxRequestBytes())
			require.Equal(t, policy.DefaultMaxRequestBytes, policy.Default().Default.MaxRequestBytes)
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { c.check(t, mustParse(t, c.src)) })
	}
}

func TestInvalidFiles(t *testing.T) {
	cases := []struct {
		name string
		src  string
		want []string // each must appear in the error
	}{
		{"unknown top-level field", "retries: 3\n", []string{"policy: retries: unknown field (line 1)"}},
		{"a misspelt field is named with the nearest", "defaults: {lock_tll: 3s}\n", []string{"defaults.lock_tll: unknown field (did you mean lock_ttl?)"}},
		{"unknown route field", "routes: [{name: a, match: {path_prefix: /}, colour: red}]\n", []string{"routes[0] (a).colour: unknown field"}},
		{"unknown match field", "routes: [{name: a, match: {path_suffix: /x}}]\n", []string{"routes[0] (a).match.path_suffix: unknown field", "routes[0] (a).match: needs exactly one"}},
		{"a field given twice", "defaults:\n  ttl: 1h\n  ttl: 2h\n", []string{"defaults.ttl: is given twice (first on line 2) (line 3)"}},
		{"bad duration", "defaults: {ttl: 5 minutes}\n", []string{"defaults.ttl", `invalid duration "5 minutes"`}},
		{"negative duration", "defaults: {lock_ttl: -1s}\n", []string{"defaults.lock_ttl", "at least 1ms"}},
		{"host as a scope header", "defaults: {scope_headers: [authorization, Host]}\n", []string{"defaults.scope_headers", `"Host" never reaches the processor`, ":authority"}},
		{"a scope group named twice", "routes: [{name: a, match: {path_regex: '^/a/(?P<org>[^/]+)|^/b/(?P<org>[^/]+)'}, scope_path_params: [org]}]\n",
			[]string{"routes[0] (a).scope_path_params", `"org" names 2 groups`}},
		{"a field without a value", "defaults:\n  ttl_header:\n  key_prefix: ~\n", []string{"defaults.ttl_header: has no value", "defaults.key_prefix: has no value"}},
		{"a null beside a type error", "defaults: {ttl_header: ~, max_response_bytes: lots}\n", []string{"defaults.ttl_header: has no value", "defaults.max_response_bytes"}},
		{"ttl past ten years", "defaults: {ttl: 87601h, max_ttl: 87601h}\n", []string{"defaults.ttl", "defaults.max_ttl", "at most 87600h0m0s"}},
		{"route lock_ttl past ten years", "routes: [{name: a, match: {path_prefix: /}, lock_ttl: 2562047h}]\n", []string{"routes[0] (a).lock_ttl", "at most"}},
		{"bad store_timeout", "store_timeout: soon\n", []string{"store_timeout", "invalid duration"}},
		{"bad regex", "routes: [{name: a, match: {path_regex: '^/v1/(?P<x'}}]\n", []string{"routes[0] (a).match.path_regex", "invalid regular expression"}},
		{"unknown missing_key", "defaults: {missing_key: sometimes}\n", []string{"defaults.missing_key", `"sometimes"`}},
		{"unknown unknown_outcome", "defaults: {unknown_outcome: retry}\n", []string{"defaults.unknown_outcome"}},
		{"unknown fail_mode", "fail_mode: maybe\n", []string{"fail_mode", `"maybe"`}},
		{"unknown fingerprint part", "defaults: {fingerprint: [method, headers]}\n", []string{"defaults.fingerprint", `"headers"`}},
		{"values of the wrong type name their field", "defaults:\n  max_response_bytes: 1MiB\n  methods: POST\n  ttl: {hours: 1}\nroutes:\n  - name: a\n    match: {path_prefix: /}\n    enabled: a-long-word-for-yes\n",
			[]string{`defaults.max_response_bytes: must be a whole number, got "1MiB" (line 2)`, `defaults.methods: must be a list, got "POST" (line 3)`,
				"defaults.ttl: must be a string, got a mapping (line 4)", `routes[0] (a).enabled: must be true or false, got "a-long-word-for-yes" (line 8)`}},
		{"fingerprint headers without a fingerprint", "defaults: {fingerprint: [], fingerprint_headers: [x-a]}\n", []string{"defaults.fingerprint_headers", "mismatch check off"}},
		{"fingerprint headers on a route without a fingerprint", "defaults: {fingerprint: []}\nroutes: [{name: a, match: {path_prefix: /}, fingerprint_headers: [x-a]}]\n",
			[]string{"routes[0] (a).fingerprint_headers", "mismatch check off"}},
		{"bad status", "defaults: {store_statuses: [2xx, 700, teapot]}\n", []string{"700 is not an HTTP status", `"teapot"`}},
		{"bad grpc statuses", "defaults:\n  store_grpc_statuses: [OK, 17, TEAPOT, {a: 1}]\n", []string{
			"defaults.store_grpc_statuses[1]: 17 is not a gRPC status code (0 to 16) (line 2)", `defaults.store_grpc_statuses[2]: "TEAPOT" is not a gRPC status`,
			"defaults.store_grpc_statuses[3]"}},
		{"grpc is a boolean", "routes: [{name: a, match: {path_prefix: /}, grpc: yes-please}]\n", []string{`routes[0] (a).grpc: must be true or false, got "yes-please" (line 1)`}},
		{"bad header name", "defaults: {key_headers: [\"idempotency key\"]}\n", []string{"defaults.key_headers", "not a valid header name"}},
		{"no key headers", "defaults: {key_headers: []}\n", []string{"defaults.key_headers", "at least one"}},
		{"ttl above max_ttl", "defaults: {ttl: 48h}\n", []string{"defaults.ttl", "exceeds max_ttl"}},
		{"route without name", "routes: [{match: {path_prefix: /}}]\n", []string{"routes[0].name", "required"}},
		{"duplicate names", "routes: [{name: a, match: {path_prefix: /a}}, {name: a, match: {path_prefix: /b}}]\n", []string{"used twice"}},
		{"route without match", "routes: [{name: a}]\n", []string{"routes[0] (a).match", "required"}},
		{"two matchers", "routes: [{name: a, match: {path_prefix: /a, path_exact: /a}}]\n", []string{"exactly one"}},
		{"scope params need a regex", "routes: [{name: a, match: {path_prefix: /a}, scope_path_params: [org]}]\n", []string{"scope_path_params", "path_regex"}},
		{"scope param not a group", "routes: [{name: a, match: {path_regex: '^/(?P<org>[^/]+)'}, scope_path_params: [ledger]}]\n", []string{`"ledger" is not a named group`}},
		{"match in defaults", "defaults: {match: {path_prefix: /}}\n", []string{"defaults.match: belongs to routes, not defaults"}},
		{"scope_path_params in defaults", "defaults: {scope_path_params: [org]}\n", []string{"defaults.scope_path_params: belongs to routes"}},
		{"max_response_bytes out of range", "defaults: {max_response_bytes: -1}\n", []string{"max_response_bytes"}},
		{"max_request_bytes out of range", "defaults: {max_request_bytes: 268435457}\n", []string{"defaults.max_request_bytes", "between 0 and 268435456"}},
		{"type error", "defaults: {max_response_bytes: lots}\n", []string{`defaults.max_response_bytes: must be a whole number, got "lots"`}},
		{"two documents", "fail_mode: open\n---\nfail_mode: closed\n", []string{"one YAML document"}},
		{"every error at once", `
defaults: {ttl: forever, missing_key: never}
routes:
  - {name: a, match: {path_regex: '('}, lock_ttl: 1x}
fail_mode: sideways
unknown: 1
`, []string{"defaults.ttl", "defaults.missing_key", "routes[0] (a).match.path_regex", "routes[0] (a).lock_ttl", "fail_mode", "unknown: unknown field"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := policy.Parse([]byte(c.src))
			require.Error(t, err)
			for _, w := range c.want {
				require.ErrorContains(t, err, w)
			}
		})
	}
}

// A file of short values is refused before the YAML decoder holds a node for each.
func TestParseFileBoundsItsValues(t *testing.T) {
	_, _, err := policy.ParseFile([]byte("routes: ["+strings.Repeat("a,", 1<<17)+"a]\n"), nil)
	var fe *policy.FieldError
	require.ErrorAs(t, err, &fe)
	require.Contains(t, err.Error(), "policy: more than the 131072 YAML values an input of 4 MiB may hold")
}
