package extproc_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
)

// Native to the mesh: routes chosen by Envoy, scope from verified identity, the outcome in Envoy's
// access log.

const meshPolicy = `
routes:
  - {name: by-path, match: {path_prefix: /v1/payments}, ttl: 1h}
  - {name: eg-orders, match: {route_name_prefix: "httproute/shop/orders/"}, ttl: 2h}
  - {name: exact, match: {route_name_exact: "refunds"}, ttl: 3h}
  - {name: regex, match: {route_name_regex: "^vs-.*-transfers$"}, ttl: 4h}
  - {name: named-only, match: {path_exact: /never}, ttl: 5h}
  - name: tenants
    match: {path_regex: '^/v1/tenants/(?P<tenant>[^/]+)/charges'}
    scope: [{path_param: tenant}, {header: authorization}]
`

// routeOf returns the route a request was counted under.
func routeOf(t *testing.T, res result) string {
	t.Helper()
	md := res.metadata(t)
	require.NotNil(t, md, "the dynamic metadata reaches Envoy's access log")
	return md["route"].(string)
}

// metadata returns the idempotency namespace of the dynamic metadata in Envoy's access log line
// for the request, nil when there is none.
func (r result) metadata(t *testing.T) map[string]any {
	t.Helper()
	return r.namespace("idempotency")
}

// namespace returns the namespace ns of the request's dynamic metadata in Envoy's access log
// line, nil when there is none.
func (r result) namespace(ns string) map[string]any {
	s := r.logged.DynamicMetadata[ns]
	if s == nil {
		return nil
	}
	return s.AsMap()
}

// withTap runs f on a server without TapHandle and on one with it, as the binary serves: the
// tap reads the route the stream's metadata names.
func withTap(t *testing.T, f func(t *testing.T, tap bool)) {
	for _, tap := range []bool{false, true} {
		t.Run(map[bool]string{false: "no tap", true: "tap"}[tap], func(t *testing.T) { f(t, tap) })
	}
}

func TestRoutesChosenByEnvoy(t *testing.T) { withTap(t, testRoutesChosenByEnvoy) }

func testRoutesChosenByEnvoy(t *testing.T, tap bool) {
	h := newHarness(t, harnessOptions{policy: meshPolicy, tap: tap})
	for _, tc := range []struct {
		name string
		req  request
		want string
	}{
		{"path", post("/v1/payments", "a", `{}`), "by-path"},
		{"Envoy Gateway route name", withRoute(post("/v1/orders", "b", `{}`), "httproute/shop/orders/rule/0/match/0/api_example_com"), "eg-orders"},
		{"route name exact", withRoute(post("/v1/anything", "c", `{}`), "refunds"), "exact"},
		{"route name regex", withRoute(post("/v1/anything", "d", `{}`), "vs-eu-transfers"), "regex"},
		{"first match in file order: the path beats a later route name", withRoute(post("/v1/payments", "e", `{}`), "refunds"), "by-path"},
		{"no route name sent: route-name matchers never hold", post("/v1/anything", "f", `{}`), "default"},
		{"named by metadata, over every match", named(withRoute(post("/v1/payments", "g", `{}`), "refunds"), "named-only"), "named-only"},
		{"metadata naming the defaults", named(post("/v1/payments", "h", `{}`), "default"), "default"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := h.do(tc.req, created)
			require.True(t, res.executed)
			require.Equal(t, tc.want, routeOf(t, res))
		})
	}
}

// A route Envoy names that the policy file lacks is 500 unknown-idempotency-route, logged once
// per name at error: never the defaults, whose scope and settings are another route's.
func TestUnknownNamedRoute(t *testing.T) { withTap(t, testUnknownNamedRoute) }

func testUnknownNamedRoute(t *testing.T, tap bool) {
	h := newHarness(t, harnessOptions{policy: meshPolicy, tap: tap})
	for range 2 {
		res := h.do(named(post("/v1/payments", "k", `{}`), "missing"), created)
		requireProblem(t, res, 500, "unknown-idempotency-route")
	}
	res := h.do(named(post("/v1/payments", "k", `{}`), "also-missing"), created)
	requireProblem(t, res, 500, "unknown-idempotency-route")
	logs := h.logs.String()
	require.Equal(t, 1, strings.Count(logs, `"named_route":"missing"`), "once per name")
	require.Equal(t, 1, strings.Count(logs, `"named_route":"also-missing"`))
	require.Equal(t, 3.0, h.counter("idempotency_envoy_misconfig_total", "kind", "unknown_route"))
	// A named route whose path parameters the request's path does not have.
	res = h.do(named(post("/v1/payments", "k", `{}`), "tenants"), created)
	requireProblem(t, res, 500, "unknown-idempotency-route")
	require.Zero(t, h.executions("k"))
}

func withRoute(r request, name string) request { r.routeName = name; return r }
func named(r request, name string) request     { r.named = name; return r }
func withJWT(r request, payloads map[string]map[string]any) request {
	r.jwt = payloads
	return r
}
func withPeer(r request, peer string) request { r.peer = peer; return r }

// Scope sources: each keeps callers apart, a client can forge none of the verified ones, and a
// value from one source never stands for the same value from another.
func TestScopeSources(t *testing.T) {
	t.Run("two JWT subjects never share a record", func(t *testing.T) {
		h := newHarness(t, harnessOptions{policy: "defaults: {scope: [{jwt_claim: sub}]}"})
		alice := map[string]map[string]any{"provider": {"sub": "alice", "iss": "https://idp"}}
		bob := map[string]map[string]any{"provider": {"sub": "bob", "iss": "https://idp"}}
		require.True(t, h.do(withJWT(post("/v1/payments", "k", `{}`), alice), created).executed)
		require.True(t, h.do(withJWT(post("/v1/payments", "k", `{}`), bob), created).executed, "another subject, another record")
		res := h.do(withJWT(post("/v1/payments", "k", `{}`, "authorization", "Bearer other-token"), alice), created)
		require.Equal(t, []string{"true"}, res.header(replayed), "the same subject, whatever its token")
	})
	t.Run("header x and jwt_claim x with equal values differ", func(t *testing.T) {
		store, err := cache.NewMemory(cache.MemoryOptions{})
		require.NoError(t, err)
		byHeader := newHarness(t, harnessOptions{store: store, policy: "defaults: {scope: [{header: x}]}"})
		byClaim := newHarness(t, harnessOptions{store: store, policy: "defaults: {scope: [{jwt_claim: x}]}"})
		require.True(t, byHeader.do(post("/v1/payments", "k", `{}`, "x", "same"), created).executed)
		require.True(t, byClaim.do(withJWT(post("/v1/payments", "k", `{}`), map[string]map[string]any{"p": {"x": "same"}}), created).executed,
			"a claim and a header with the same name and value are two scopes")
	})
	t.Run("claims that are not strings, and absent claims", func(t *testing.T) {
		h := newHarness(t, harnessOptions{policy: "defaults: {scope: [{jwt_claim: aud}, {jwt_claim: tenant}]}"})
		one := map[string]map[string]any{"p": {"aud": []any{"a", "b"}}}
		two := map[string]map[string]any{"p": {"aud": []any{"a", "b"}, "tenant": ""}}
		require.True(t, h.do(withJWT(post("/v1/payments", "k", `{}`), one), created).executed)
		require.True(t, h.do(withJWT(post("/v1/payments", "k", `{}`), two), created).executed, "an empty claim is not an absent one")
		require.Equal(t, []string{"true"}, h.do(withJWT(post("/v1/payments", "k", `{}`), one), created).header(replayed))
	})
	t.Run("jwt_payload_key picks one of several payloads; without it they are ambiguous", func(t *testing.T) {
		h := newHarness(t, harnessOptions{policy: `
defaults: {scope: [{jwt_claim: sub}]}
routes: [{name: keyed, match: {path_prefix: /v1/keyed}, jwt_payload_key: corp}]`})
		two := map[string]map[string]any{"corp": {"sub": "alice"}, "partner": {"sub": "mallory"}}
		requireProblem(t, h.do(withJWT(post("/v1/payments", "k", `{}`), two), created), 500, "scope-ambiguous")
		require.True(t, h.do(withJWT(post("/v1/keyed", "k", `{}`), two), created).executed)
		other := map[string]map[string]any{"corp": {"sub": "alice"}, "partner": {"sub": "eve"}}
		require.Equal(t, []string{"true"}, h.do(withJWT(post("/v1/keyed", "k", `{}`), other), created).header(replayed), "only corp's subject counts")
		require.Equal(t, 1.0, h.counter("idempotency_envoy_misconfig_total", "kind", "scope_ambiguous"))
	})
	t.Run("peer identity", func(t *testing.T) {
		h := newHarness(t, harnessOptions{policy: "defaults: {scope: [peer_identity]}"})
		a, b := "spiffe://cluster.local/ns/shop/sa/checkout", "spiffe://cluster.local/ns/shop/sa/refunds"
		require.True(t, h.do(withPeer(post("/v1/payments", "k", `{}`), a), created).executed)
		require.True(t, h.do(withPeer(post("/v1/payments", "k", `{}`), b), created).executed)
		require.Equal(t, []string{"true"}, h.do(withPeer(post("/v1/payments", "k", `{}`), a), created).header(replayed))
	})
	t.Run("path parameters with a header", func(t *testing.T) {
		h := newHarness(t, harnessOptions{policy: meshPolicy})
		require.True(t, h.do(post("/v1/tenants/t1/charges", "k", `{}`), created).executed)
		require.True(t, h.do(post("/v1/tenants/t2/charges", "k", `{}`), created).executed)
		require.True(t, h.do(post("/v1/tenants/t1/charges", "k", `{}`, "authorization", "Bearer x"), created).executed)
	})
}

// require_scope: a covered request whose scope values are all empty gets 401 scope-missing, and
// never reaches the store.
func TestRequireScope(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: "defaults: {scope: [{jwt_claim: sub}, {header: x-api-key}], require_scope: true}"})
	res := h.do(post("/v1/payments", "k", `{}`), created)
	requireProblem(t, res, 401, "scope-missing")
	requireProblem(t, h.do(post("/v1/payments", "k", `{}`, "x-api-key", ""), created), 401, "scope-missing")
	require.True(t, h.do(post("/v1/payments", "k", `{}`, "x-api-key", "key-1"), created).executed)
	require.True(t, h.do(withJWT(post("/v1/payments", "k", `{}`), map[string]map[string]any{"p": {"sub": "alice"}}), created).executed)
	require.Empty(t, h.do(post("/v1/payments", "", `{}`), created).header(replayed), "a request without a key is not covered: no scope needed")
	h.waitIdle(t)
	require.Equal(t, 2.0, h.counter("idempotency_requests_total", "route", "default", "outcome", "scope_missing"))
}

// Every outcome reaches Envoy's access log as dynamic metadata under the idempotency namespace,
// on the answer that settles the request: outcome, route, key_hash (the whole record name, as in
// the logs), replayed, and release_reason when the key was released.
func TestDynamicMetadataOnEveryOutcome(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: "defaults: {missing_key: optional}\nmetadata_namespace: idem\nroutes: [{name: strict, match: {path_prefix: /strict}, missing_key: required}]"})
	keyHash := strings.TrimPrefix(extproc.StoredKey(h.policy, "/v1/payments", "k"), "idempotency:")
	require.Len(t, keyHash, 64)
	get := func(res result) map[string]any {
		t.Helper()
		ns := res.namespace("idem")
		require.NotNil(t, ns, "metadata_namespace names the namespace")
		return ns
	}
	executed := get(h.do(post("/v1/payments", "k", `{}`), created))
	require.Equal(t, map[string]any{"outcome": "executed", "route": "default", "key_hash": keyHash, "replayed": false}, executed)
	require.Equal(t, map[string]any{"outcome": "replayed", "route": "default", "key_hash": keyHash, "replayed": true},
		get(h.do(post("/v1/payments", "k", `{}`), created)))
	require.Equal(t, "mismatch", get(h.do(post("/v1/payments", "k", `{"x":1}`), created))["outcome"])
	released := get(h.do(post("/v1/payments", "r", `{}`), upstream{status: 500}))
	require.Equal(t, "status", released["release_reason"])
	require.Equal(t, "executed", released["outcome"])
	require.Equal(t, map[string]any{"outcome": "passthrough", "route": "default", "replayed": false},
		get(h.do(post("/v1/payments", "", `{}`), created)), "uncovered requests are logged too")
	require.Equal(t, map[string]any{"outcome": "missing_key", "route": "strict", "replayed": false},
		get(h.do(post("/strict", "", `{}`), created)))
	require.Equal(t, "invalid", get(h.do(post("/v1/payments", "", `{}`, "idempotency-key", "bad key"), created))["outcome"])
	h.waitIdle(t) // a stream's log line is written once its handler ends
	require.Contains(t, h.logs.String(), `"key_hash":"`+keyHash+`"`, "logs carry the same whole key_hash")

	// A covered request's header answer, sent while its body is awaited, carries no outcome:
	// a client that leaves mid-body is not logged as passthrough.
	s := h.open()
	resp := s.send(requestHeaders(post("/v1/payments", "pending", `{}`)))
	require.NotNil(t, resp.GetRequestHeaders())
	require.Nil(t, resp.GetDynamicMetadata())
	s.send(requestBody([]byte(`{}`)))
	require.Equal(t, "in_progress", get(h.do(post("/v1/payments", "pending", `{}`), created))["outcome"])
	s.end()

	// The other outcomes.
	h2 := newHarness(t, harnessOptions{policy: `
metadata_namespace: idem
routes:
  - {name: small, match: {path_prefix: /small}, max_request_bytes: 1}
  - {name: scoped, match: {path_prefix: /scoped}, scope: [{header: x-tenant}], require_scope: true}
  - {name: bodiless, match: {path_prefix: /bodiless}, store_body: false}
  - {name: unsure, match: {path_prefix: /unsure}, unknown_outcome: record}
`})
	logged := func(r request) map[string]any { t.Helper(); return get(h2.do(r, created)) }
	big := h2.open()
	big.send(withBodyModes(requestHeaders(post("/small", "k", `{"a":1}`)), modeStreamed, modeBuffered))
	tooLarge := big.send(bodyMsg([]byte(`{"a":1}`), true))
	require.Equal(t, "too_large", tooLarge.GetDynamicMetadata().GetFields()["idem"].GetStructValue().AsMap()["outcome"])
	big.end()
	require.Equal(t, "scope_missing", logged(post("/scoped", "k", `{}`))["outcome"])
	misconfigured := logged(named(post("/v1/payments", "k", `{}`), "nowhere"))
	require.Equal(t, "misconfigured", misconfigured["outcome"])
	logged(post("/bodiless", "b", `{}`))
	require.Equal(t, "not_replayable", logged(post("/bodiless", "b", `{}`))["outcome"])
	u := h2.open()
	u.send(requestHeaders(post("/unsure", "u", `{}`)))
	u.send(requestBody([]byte(`{}`)))
	u.end()
	h2.waitIdle(t)
	require.Equal(t, "outcome_unknown", logged(post("/unsure", "u", `{}`))["outcome"])

	h3 := newHarness(t, harnessOptions{store: newFailingStore(t, false), policy: "metadata_namespace: idem"})
	res := h3.do(post("/v1/payments", "k", `{}`), created)
	require.Equal(t, "store_error", get(res)["outcome"])
}
