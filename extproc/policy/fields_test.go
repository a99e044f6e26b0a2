package policy_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

func header(n string) policy.ScopeSource {
	return policy.ScopeSource{Kind: policy.ScopeHeader, Name: n}
}
func claim(n string) policy.ScopeSource {
	return policy.ScopeSource{Kind: policy.ScopeJWTClaim, Name: n}
}
func param(n string) policy.ScopeSource {
	return policy.ScopeSource{Kind: policy.ScopePathParam, Name: n}
}

var peer = policy.ScopeSource{Kind: policy.ScopePeerIdentity}

// route returns the route named name.
func route(t *testing.T, p *policy.Policy, name string) *policy.Route {
	t.Helper()
	r, _, err := p.Select(policy.Selector{Named: name})
	require.NoError(t, err)
	return r
}

func TestScope(t *testing.T) {
	p := mustParse(t, `
defaults:
  scope: [{header: Authorization}, {jwt_claim: sub}]
routes:
  - name: spec
    match: {path_regex: '^/v1/organizations/(?P<org>[^/]+)'}
    scope:
      - header: authorization
      - jwt_claim: sub
      - jwt_claim: iss
      - peer_identity
      - path_param: org
    require_scope: true
    jwt_payload_key: my-provider
  - name: shorthand
    match: {path_regex: '^/a/(?P<org>[^/]+)/(?P<ledger>[^/]+)'}
    scope_path_params: [ledger, org]
    scope_headers: [x-tenant, ":Authority"]
  - name: inherits-and-adds
    match: {path_regex: '^/b/(?P<org>[^/]+)'}
    scope_path_params: [org]
  - name: inherits
    match: {path_prefix: /c}
  - name: none
    match: {path_prefix: /d}
    scope: []
`)
	require.Equal(t, []policy.ScopeSource{header("authorization"), claim("sub")}, p.Default.Scope)
	require.Equal(t, []string{"authorization"}, p.Default.ScopeHeaders)

	r, params := p.Match("/v1/organizations/o1/x")
	require.Equal(t, "spec", r.Name)
	require.Equal(t, []policy.ScopeSource{header("authorization"), claim("sub"), claim("iss"), peer, param("org")}, r.Scope)
	require.Equal(t, []string{"authorization"}, r.ScopeHeaders)
	require.Equal(t, []string{"org"}, r.ScopePathParams)
	require.Equal(t, []string{"o1"}, params)
	require.True(t, r.RequireScope)
	require.Equal(t, "my-provider", r.JWTPayloadKey)

	r, params = p.Match("/a/o2/l3")
	require.Equal(t, "shorthand", r.Name)
	require.Equal(t, []policy.ScopeSource{header("x-tenant"), header(":authority"), param("ledger"), param("org")}, r.Scope,
		"the shorthand compiles into scope: headers first, then path parameters, each in its order")
	require.Equal(t, []string{"x-tenant", ":authority"}, r.ScopeHeaders)
	require.Equal(t, []string{"ledger", "org"}, r.ScopePathParams)
	require.Equal(t, []string{"l3", "o2"}, params)
	require.False(t, r.RequireScope, "inherited")

	r, params = p.Match("/b/o4")
	require.Equal(t, []policy.ScopeSource{header("authorization"), claim("sub"), param("org")}, r.Scope)
	require.Equal(t, []string{"o4"}, params)
	require.Equal(t, []policy.ScopeSource{header("authorization"), claim("sub")}, p.Default.Scope, "the defaults' scope is not changed by a route adding to it")

	require.Equal(t, p.Default.Scope, route(t, p, "inherits").Scope)
	none := route(t, p, "none")
	require.Empty(t, none.Scope)
	require.Empty(t, none.ScopeHeaders)
}

// Each route field added after the first version of the file (mode, in_flight_wait,
// expires_header, first_sent_header, replay_header_fresh, store_body, require_scope,
// jwt_payload_key) is inherited from defaults field by field, and a route overrides it.
func TestNewFieldsInherit(t *testing.T) {
	p := mustParse(t, `
defaults:
  mode: shadow
  in_flight_wait: 2s
  expires_header: X-Expires
  first_sent_header: ""
  replay_header_fresh: false
  store_body: false
  require_scope: true
  jwt_payload_key: provider
routes:
  - {name: inherits, match: {path_prefix: /i}}
  - name: overrides
    match: {route_name_exact: httproute/default/pay/rule/0/match/0/pay.example.com}
    mode: enforce
    in_flight_wait: 10s
    expires_header: ""
    first_sent_header: X-First-Sent
    replay_header_fresh: true
    store_body: true
    require_scope: false
    jwt_payload_key: ""
metadata_namespace: envoy.idempotency
`)
	for _, r := range []*policy.Route{p.Default, route(t, p, "inherits")} {
		require.Equal(t, policy.ModeShadow, r.Mode, r.Name)
		require.Equal(t, 2*time.Second, r.InFlightWait, r.Name)
		require.Equal(t, "x-expires", r.ExpiresHeader, r.Name)
		require.Empty(t, r.FirstSentHeader, r.Name)
		require.False(t, r.ReplayHeaderFresh, r.Name)
		require.False(t, r.StoreBody, r.Name)
		require.True(t, r.RequireScope, r.Name)
		require.Equal(t, "provider", r.JWTPayloadKey, r.Name)
	}
	r := route(t, p, "overrides")
	require.Equal(t, policy.ModeEnforce, r.Mode)
	require.Equal(t, 10*time.Second, r.InFlightWait)
	require.Empty(t, r.ExpiresHeader)
	require.Equal(t, "x-first-sent", r.FirstSentHeader)
	require.True(t, r.ReplayHeaderFresh)
	require.True(t, r.StoreBody)
	require.False(t, r.RequireScope)
	require.Empty(t, r.JWTPayloadKey)
	require.Equal(t, "envoy.idempotency", p.MetadataNamespace)
}

func TestSelect(t *testing.T) {
	p := mustParse(t, `
routes:
  - {name: by-path, match: {path_prefix: /v1/payments}}
  - {name: exact-name, match: {route_name_exact: pay}}
  - {name: prefix-name, match: {route_name_prefix: "httproute/default/"}}
  - {name: regex-name, match: {route_name_regex: '^vs-[a-z]+$'}}
  - name: scoped
    match: {path_regex: '^/orgs/(?P<org>[^/]+)'}
    scope_path_params: [org]
  - {name: catch-all, match: {path_prefix: /}}
`)
	cases := []struct {
		name   string
		sel    policy.Selector
		want   string
		params []string
	}{
		{"a path", policy.Selector{Path: "/v1/payments/1"}, "by-path", nil},
		{"the first route in file order wins over a later route-name match", policy.Selector{Path: "/v1/payments", RouteName: "pay"}, "by-path", nil},
		{"an exact route name", policy.Selector{Path: "/x", RouteName: "pay"}, "exact-name", nil},
		{"route_name_exact is exact", policy.Selector{Path: "/x", RouteName: "pay2"}, "catch-all", nil},
		{"a route-name prefix", policy.Selector{Path: "/x", RouteName: "httproute/default/orders/rule/0"}, "prefix-name", nil},
		{"a route-name regex", policy.Selector{Path: "/x", RouteName: "vs-orders"}, "regex-name", nil},
		{"route-name matchers never hold without a route name", policy.Selector{Path: "/x"}, "catch-all", nil},
		{"path parameters", policy.Selector{Path: "/orgs/o7/things"}, "scoped", []string{"o7"}},
		{"a named route wins over every match", policy.Selector{Path: "/v1/payments", RouteName: "pay", Named: "regex-name"}, "regex-name", nil},
		{"a named route reads its path parameters", policy.Selector{Path: "/orgs/o8", Named: "scoped"}, "scoped", []string{"o8"}},
		{"the defaults may be named", policy.Selector{Path: "/v1/payments", Named: "default"}, "default", nil},
		{"nothing matches", policy.Selector{Path: ""}, "default", nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r, params, err := p.Select(c.sel)
			require.NoError(t, err)
			require.Equal(t, c.want, r.Name)
			require.Equal(t, c.params, params)
			if c.sel.Named == "" && c.sel.RouteName == "" {
				mr, mparams := p.Match(c.sel.Path)
				require.Same(t, r, mr, "Match is Select by path")
				require.Equal(t, params, mparams)
			}
		})
	}

	r, params, err := p.Select(policy.Selector{Path: "/v1/payments", Named: "refunds"})
	require.Nil(t, r, "never the defaults")
	require.Nil(t, params)
	require.ErrorIs(t, err, policy.ErrUnknownRoute)
	var unknown *policy.UnknownRouteError
	require.ErrorAs(t, err, &unknown)
	require.Equal(t, "refunds", unknown.Name)
	require.False(t, errors.Is(err, policy.ErrPathParams))

	r, params, err = p.Select(policy.Selector{Path: "/elsewhere", Named: "scoped"})
	require.ErrorIs(t, err, policy.ErrPathParams, "a scope path parameter without a value must not scope by \"\"")
	require.Equal(t, "scoped", r.Name, "the route comes with the error, for its label")
	require.Nil(t, params)
}

func TestProblems(t *testing.T) {
	p := mustParse(t, `
problems:
  request-in-progress:
    status: 409
    content_type: application/json
    body: '{"code":"0084","title":"Duplicate Idempotency Key","message":{{json .Detail}}}'
  store-unavailable: {status: 500}
routes:
  - name: stripe-like
    match: {path_prefix: /v1/charges}
    problems:
      request-in-progress:
        body: '{"error":{"type":"idempotency_error","code":"{{.Code}}","message":"{{.Title}}: {{.Detail}}","status":{{.Status}}}}'
  - {name: plain, match: {path_prefix: /}}
`)
	top := p.Problems["request-in-progress"]
	require.Equal(t, 409, top.Status)
	require.Equal(t, "application/json", top.ContentType)
	body, err := top.Render(policy.ProblemData{Code: "request-in-progress", Title: "Conflict", Detail: `A request with this key is "in progress".`, Status: 409})
	require.NoError(t, err)
	require.JSONEq(t, `{"code":"0084","title":"Duplicate Idempotency Key","message":"A request with this key is \"in progress\"."}`, string(body))

	require.Equal(t, p.Problems, p.Default.Problems, "the defaults get the top-level problems")
	require.Equal(t, p.Problems, route(t, p, "plain").Problems)

	r := route(t, p, "stripe-like")
	require.Len(t, r.Problems, 2, "route entries over top-level ones, per code")
	require.Same(t, p.Problems["store-unavailable"], r.Problems["store-unavailable"])
	own := r.Problems["request-in-progress"]
	require.Zero(t, own.Status, "the built-in status")
	require.Equal(t, "application/problem+json", own.ContentType)
	body, err = own.Render(policy.ProblemData{Code: "request-in-progress", Title: "Conflict", Detail: "In flight.", Status: 409})
	require.NoError(t, err)
	require.JSONEq(t, `{"error":{"type":"idempotency_error","code":"request-in-progress","message":"Conflict: In flight.","status":409}}`, string(body))
	require.Len(t, p.Problems, 2, "the top-level entries are not changed by a route's")

	su := p.Problems["store-unavailable"]
	require.Equal(t, 500, su.Status)
	require.Nil(t, su.Body, "the built-in body")

	require.Len(t, policy.ProblemCodes, 18)
	for _, code := range policy.ProblemCodes {
		mustParse(t, "problems: {"+code+": {status: 400}}\n")
	}
}

func TestProblemBodyBound(t *testing.T) {
	p := mustParse(t, "problems: {scope-missing: {body: '{{.Detail}}'}}\n")
	_, err := p.Problems["scope-missing"].Render(policy.ProblemData{Detail: strings.Repeat("x", policy.MaxProblemBytes+1)})
	require.ErrorContains(t, err, "exceeds")
}

// Every new field's invalid values name the field.
func TestInvalidNewFields(t *testing.T) {
	r := func(fields string) string {
		return "routes: [{name: pay, match: {path_regex: '^/(?P<org>[^/]+)'}, " + fields + "}]\n"
	}
	cases := []struct {
		name string
		src  string
		want []string
	}{
		{"scope with scope_headers", r("scope: [{header: a}], scope_headers: [b]"), []string{"routes[0] (pay).scope_headers: is shorthand for scope"}},
		{"scope with scope_path_params", r("scope: [{header: a}], scope_path_params: [org]"), []string{"routes[0] (pay).scope_path_params: is shorthand for path_param entries"}},
		{"an unknown scope kind", r("scope: [{cookie: session}]"), []string{"routes[0] (pay).scope[0].cookie: unknown field"}},
		{"a bare word other than peer_identity", r("scope: [authorization]"), []string{`routes[0] (pay).scope[0]: must be peer_identity or one of`}},
		{"peer_identity as a mapping", r("scope: [{peer_identity: x}]"), []string{"routes[0] (pay).scope[0].peer_identity: is written bare"}},
		{"two kinds in one entry", r("scope: [{header: a, jwt_claim: b}]"), []string{"routes[0] (pay).scope[0]: must have exactly one field"}},
		{"an empty claim", r(`scope: [{jwt_claim: ""}]`), []string{"routes[0] (pay).scope[0].jwt_claim: must name a claim"}},
		{"host in scope", r("scope: [{header: Host}]"), []string{`routes[0] (pay).scope[0].header: "Host" never reaches the processor`}},
		{"a bad header name in scope", r(`scope: [{header: "a b"}]`), []string{`routes[0] (pay).scope[0].header: "a b" is not a valid header name`}},
		{"a source listed twice", r("scope: [peer_identity, {header: a}, peer_identity]"), []string{"routes[0] (pay).scope[2]: peer_identity is listed twice"}},
		{"a header listed twice through the shorthand", r("scope_headers: [a, A]"), []string{`routes[0] (pay).scope_headers: header "a" is listed twice`}},
		{"a path_param that is no group", r("scope: [{path_param: ledger}]"), []string{`routes[0] (pay).scope[0].path_param: "ledger" is not a named group of path_regex`}},
		{"a name that is a header in one route and a path_param in another of the same key_prefix",
			"routes:\n  - {name: h, match: {path_prefix: /h}, scope: [{header: org}]}\n  - {name: o, match: {path_regex: '/o/(?P<org>[^/]+)'}, scope: [{path_param: org}]}\n",
			[]string{`routes[1] (o).scope: "org" is a path_param here and a header in route "h", which shares key_prefix "idempotency:": their stored keys could collide; give one of them its own key_prefix`}},
		{"a path_param without a path_regex", "routes: [{name: a, match: {route_name_exact: x}, scope: [{path_param: org}]}]\n", []string{"routes[0] (a).scope[0].path_param: needs a path_regex"}},
		{"a path_param in defaults", "defaults: {scope: [{path_param: org}]}\n", []string{"defaults.scope[0].path_param: path_param needs a route's path_regex"}},
		{"require_scope with an empty scope", r("scope: [], require_scope: true"), []string{"routes[0] (pay).require_scope: is true while the scope is empty"}},
		{"require_scope in defaults with an empty scope", "defaults: {require_scope: true, scope_headers: []}\n", []string{"defaults.require_scope: is true while the scope is empty"}},
		{"scope not a list", r("scope: {header: a}"), []string{"routes[0] (pay).scope: must be a list, got a mapping"}},
		{"require_scope not a bool", r("require_scope: sometimes"), []string{`routes[0] (pay).require_scope: must be true or false, got "sometimes"`}},
		{"jwt_payload_key not a string", r("jwt_payload_key: [a]"), []string{"routes[0] (pay).jwt_payload_key: must be a string, got a list"}},
		{"two matchers of different kinds", "routes: [{name: a, match: {path_prefix: /, route_name_exact: a}}]\n", []string{"routes[0] (a).match: needs exactly one of path_prefix, path_exact, path_regex, route_name_exact, route_name_prefix or route_name_regex"}},
		{"an empty route-name matcher", "routes: [{name: a, match: {route_name_prefix: ''}}]\n", []string{"routes[0] (a).match.route_name_prefix: must not be empty"}},
		{"a bad route-name regex", "routes: [{name: a, match: {route_name_regex: '[a-'}}]\n", []string{"routes[0] (a).match.route_name_regex: invalid regular expression"}},
		{"an empty match", "routes: [{name: a, match: {}}]\n", []string{"routes[0] (a).match: needs exactly one of"}},
		{"an unknown mode", r("mode: dry-run"), []string{`routes[0] (pay).mode: must be enforce or shadow, got "dry-run"`}},
		{"in_flight_wait over 10s", r("in_flight_wait: 11s"), []string{"routes[0] (pay).in_flight_wait: must be at most 10s, got 11s"}},
		{"a negative in_flight_wait", "defaults: {in_flight_wait: -1s}\n", []string{"defaults.in_flight_wait: must not be negative"}},
		{"a bad in_flight_wait", "defaults: {in_flight_wait: soon}\n", []string{`defaults.in_flight_wait: invalid duration "soon"`}},
		{"a bad expires_header", `defaults: {expires_header: "x expires"}` + "\n", []string{"defaults.expires_header", "not a valid header name"}},
		{"a bad first_sent_header", r("first_sent_header: [a]"), []string{"routes[0] (pay).first_sent_header: must be a string, got a list"}},
		{"an empty replay_header", `defaults: {replay_header: ""}` + "\n", []string{`defaults.replay_header: "" is not a valid header name`}},
		{"replay_header_fresh not a bool", "defaults: {replay_header_fresh: 1}\n", []string{"defaults.replay_header_fresh: must be true or false"}},
		{"store_body not a bool", r("store_body: nope"), []string{`routes[0] (pay).store_body: must be true or false, got "nope"`}},
		{"an empty metadata_namespace", "metadata_namespace: ''\n", []string{`metadata_namespace: must be a name without spaces, got ""`}},
		{"a metadata_namespace with a space", "metadata_namespace: 'a b'\n", []string{"metadata_namespace: must be a name without spaces"}},
		{"an unknown problem code", "problems: {in-progress: {status: 409}}\n", []string{"problems.in-progress: unknown field"}},
		{"a problem status out of range", "problems: {request-in-progress: {status: 99}}\n", []string{"problems.request-in-progress.status: must be an HTTP status from 200 to 599, got 99"}},
		{"a problem status not a number", "problems: {request-in-progress: {status: conflict}}\n", []string{"problems.request-in-progress.status: must be a whole number"}},
		{"a template that does not parse", "problems: {request-in-progress: {body: '{{.Code'}}\n", []string{"problems.request-in-progress.body: invalid template"}},
		{"a template naming an unknown field", "problems: {request-in-progress: {body: '{{.Message}}'}}\n", []string{"problems.request-in-progress.body: the template fails", "Message"}},
		{"a template calling an unknown function", "routes: [{name: a, match: {path_prefix: /}, problems: {outcome-unknown: {body: '{{upper .Code}}'}}}]\n",
			[]string{"routes[0] (a).problems.outcome-unknown.body: invalid template", `"upper" not defined`}},
		{"a content type without a body", "problems: {request-in-progress: {content_type: application/json}}\n", []string{"problems.request-in-progress.content_type: needs a body"}},
		{"a bad content type", "problems: {request-in-progress: {content_type: 'json', body: x}}\n", []string{`problems.request-in-progress.content_type: "json" is not a media type`}},
		{"an empty problem", "problems: {request-in-progress: {}}\n", []string{"problems.request-in-progress: sets none of status, content_type and body"}},
		{"an unknown problem field", "problems: {request-in-progress: {title: x}}\n", []string{"problems.request-in-progress.title: unknown field"}},
		{"problems in defaults", "defaults: {problems: {request-in-progress: {status: 409}}}\n", []string{"defaults.problems: belongs at the top level"}},
		{"a null problems", "problems:\n", []string{"problems: has no value"}},
		{"an empty route name", "routes: [{name: '', match: {path_prefix: /}}]\n", []string{"routes[0].name: must not be empty"}},
		{"a route that is not a mapping", "routes: [pay]\n", []string{`routes[0]: must be a mapping, got "pay"`}},
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

// A route that is not a mapping is one error, not also a missing name and match.
func TestOneErrorForARouteThatIsNoMapping(t *testing.T) {
	_, err := policy.Parse([]byte("routes: [pay]\n"))
	require.EqualError(t, err, `policy: routes[0]: must be a mapping, got "pay" (line 1)`)
}

func TestFieldErrors(t *testing.T) {
	_, err := policy.Parse([]byte("routes:\n  - name: pay\n    match: {path_prefix: /pay}\n    ttl: soon\n"))
	var fe *policy.FieldError
	require.ErrorAs(t, err, &fe)
	require.Equal(t, policy.FieldError{Path: "routes[0] (pay).ttl", Line: 4, Msg: `invalid duration "soon" (use units such as 300ms, 30s, 24h)`}, *fe)
}

func TestErrorsInFileOrder(t *testing.T) {
	_, err := policy.Parse([]byte("fail_mode: sideways\ndefaults: {ttl: forever}\nstore_timeout: soon\n"))
	msg := err.Error()
	a, b, c := strings.Index(msg, "fail_mode"), strings.Index(msg, "defaults.ttl"), strings.Index(msg, "store_timeout")
	require.True(t, a < b && b < c, msg)
}

func TestYAMLFeatures(t *testing.T) {
	p := mustParse(t, `
defaults: &base
  ttl: 1h
  methods: &writes [POST, PUT]
routes:
  - <<: *base
    name: merged
    match: {path_prefix: /m}
    ttl: 2h
  - name: aliased
    match: {path_prefix: /a}
    methods: *writes
    enabled: yes
`)
	r := route(t, p, "merged")
	require.Equal(t, 2*time.Hour, r.TTL, "a mapping's own keys win over merged ones")
	require.Equal(t, []string{"POST", "PUT"}, r.Methods)
	require.True(t, route(t, p, "aliased").Enabled, "YAML 1.1 booleans, as yaml.v3 reads them")

	for name, src := range map[string]string{
		"a mapping that merges itself":  "defaults: &d {<<: *d}\n",
		"an alias to its own list":      "defaults: {methods: &m [*m]}\n",
		"a merge of something else":     "defaults: {<<: 3}\n",
		"a key that is not a name":      "defaults: {[a]: 1}\n",
		"two documents":                 "fail_mode: open\n---\nfail_mode: closed\n",
		"a top level that is a list":    "- a\n",
		"a syntax error":                "defaults: {ttl: 1h\n",
		"a route list that is a string": "routes: pay\n",
	} {
		_, err := policy.Parse([]byte(src))
		require.Error(t, err, name)
	}
	for _, src := range []string{"", "# only a comment\n", "---\n", "~\n"} {
		require.Equal(t, policy.Default().Default, mustParse(t, src).Default, "%q: the defaults", src)
	}
}

// A file that its aliases make enormous is refused once it expands past a bound, quickly.
func TestAliasExpansionIsBounded(t *testing.T) {
	var b strings.Builder
	b.WriteString("x: &m [")
	for i := range 600 {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString("POST")
	}
	b.WriteString("]\nr: &r {name: a, match: {path_prefix: /}, methods: *m}\nroutes: [")
	for i := range 600 {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString("*r")
	}
	b.WriteString("]\n")
	_, err := policy.Parse([]byte(b.String()))
	require.ErrorContains(t, err, "expands to more than")
}

// Every field the docs list is one the file takes, and each documented default is the built-in
// one: given explicitly, it changes nothing.
func TestFieldDocs(t *testing.T) {
	docs := policy.Fields()
	seen := map[string]bool{}
	def := policy.Default()
	for _, f := range docs {
		require.NotEmpty(t, f.Doc, f.Key)
		require.Contains(t, []string{"top level", "defaults, routes", "routes"}, f.Where, f.Key)
		seen[f.Where+" "+f.Key] = true
		if f.Default == "none" {
			continue
		}
		var src string
		switch f.Where {
		case "top level":
			src = f.Key + ": " + f.Default + "\n"
		case "defaults, routes":
			src = "defaults: {" + f.Key + ": " + f.Default + "}\n"
		}
		p := mustParse(t, src)
		require.Equal(t, def.Default, p.Default, f.Key)
		require.Equal(t, def.FailMode, p.FailMode, f.Key)
		require.Equal(t, def.StoreTimeout, p.StoreTimeout, f.Key)
		require.Equal(t, def.MetadataNamespace, p.MetadataNamespace, f.Key)
	}
	require.Len(t, seen, len(docs), "each field is listed once per level")
	for _, key := range []string{"top level problems", "routes problems", "defaults, routes scope", "routes match", "top level metadata_namespace",
		"defaults, routes in_flight_wait", "defaults, routes store_body", "defaults, routes mode", "defaults, routes expires_header",
		"top level durability", "routes durability"} {
		require.True(t, seen[key], key)
	}
}

// A header and a path parameter of one name are fine in routes of different key_prefix, whose
// stored keys never meet.
func TestScopeKindsApartUnderTheirOwnPrefix(t *testing.T) {
	_, err := policy.Parse([]byte("routes:\n  - {name: h, match: {path_prefix: /h}, scope: [{header: org}]}\n  - {name: o, key_prefix: 'orgs:', match: {path_regex: '/o/(?P<org>[^/]+)'}, scope: [{path_param: org}]}\n"))
	require.NoError(t, err)
}

// durability is a top-level field that a route overrides field by field.
func TestDurability(t *testing.T) {
	def := policy.Default()
	require.Equal(t, policy.Durability{Replicas: 0, Timeout: 50 * time.Millisecond}, def.Durability, "off by default")
	require.Equal(t, def.Durability, def.Default.Durability)

	p := mustParse(t, `
durability: {replicas: 1}
store_timeout: 200ms
routes:
  - {name: inherits, match: {path_prefix: /i}}
  - {name: more, match: {path_prefix: /m}, durability: {replicas: 2}}
  - {name: longer, match: {path_prefix: /l}, durability: {timeout: 200ms}}
  - {name: off, match: {path_prefix: /o}, durability: {replicas: 0}}
`)
	require.Equal(t, policy.Durability{Replicas: 1, Timeout: 50 * time.Millisecond}, p.Durability, "the timeout keeps its default")
	require.Equal(t, p.Durability, p.Default.Durability, "the defaults take the top level's")
	require.Equal(t, p.Durability, route(t, p, "inherits").Durability)
	require.Equal(t, policy.Durability{Replicas: 2, Timeout: 50 * time.Millisecond}, route(t, p, "more").Durability)
	require.Equal(t, policy.Durability{Replicas: 1, Timeout: 200 * time.Millisecond}, route(t, p, "longer").Durability, "as long as store_timeout, given after it")
	require.Equal(t, policy.Durability{Replicas: 0, Timeout: 50 * time.Millisecond}, route(t, p, "off").Durability)

	p = mustParse(t, "routes: [{name: on, match: {path_prefix: /}, durability: {replicas: 3, timeout: 1ms}}]\n")
	require.Equal(t, policy.Durability{}, policy.Durability{Replicas: p.Durability.Replicas}, "the top level stays off")
	require.Equal(t, policy.Durability{Replicas: 3, Timeout: time.Millisecond}, route(t, p, "on").Durability)
}

// Bad durability values name the field and its line; a wait longer than store_timeout is refused
// where it is given, or where it is inherited by a route that waits for replicas.
func TestInvalidDurability(t *testing.T) {
	cases := []struct {
		name string
		src  string
		want []string
	}{
		{"negative replicas", "durability: {replicas: -1}\n", []string{"durability.replicas: must be between 0 (off) and 1000, got -1 (line 1)"}},
		{"replicas not a number", "durability:\n  replicas: one\n", []string{`durability.replicas: must be a whole number, got "one" (line 2)`}},
		{"a zero timeout", "durability: {timeout: 0s}\n", []string{"durability.timeout: must be at least 1ms, got 0s"}},
		{"a bad timeout", "durability: {timeout: soon}\n", []string{`durability.timeout: invalid duration "soon"`}},
		{"an unknown field", "durability: {replica: 1}\n", []string{"durability.replica: unknown field (did you mean replicas?)"}},
		{"not a mapping", "durability: 1\n", []string{`durability: must be a mapping, got "1"`}},
		{"null", "durability:\n", []string{"durability: has no value"}},
		{"in defaults", "defaults: {durability: {replicas: 1}}\n", []string{"defaults.durability: belongs at the top level"}},
		{"a route's bad replicas", "routes: [{name: a, match: {path_prefix: /}, durability: {replicas: x}}]\n", []string{`routes[0] (a).durability.replicas: must be a whole number, got "x"`}},
		{"a timeout above store_timeout", "durability: {replicas: 1, timeout: 150ms}\nstore_timeout: 100ms\n",
			[]string{"durability.timeout: 150ms exceeds store_timeout 100ms, which bounds each store call, the wait for replicas included (line 1)"}},
		{"a timeout above store_timeout while off", "durability: {timeout: 150ms}\n", []string{"durability.timeout: 150ms exceeds store_timeout 100ms"}},
		{"a route's timeout above store_timeout", "routes:\n  - name: a\n    match: {path_prefix: /}\n    durability: {timeout: 1s}\n",
			[]string{"routes[0] (a).durability.timeout: 1s exceeds store_timeout 100ms", "(line 4)"}},
		{"an inherited timeout above store_timeout on a route that waits", "store_timeout: 20ms\nroutes:\n  - name: a\n    match: {path_prefix: /}\n    durability: {replicas: 1}\n",
			[]string{"routes[0] (a).durability.timeout: 50ms (inherited) exceeds store_timeout 20ms", "(line 5)"}},
		{"a default timeout above store_timeout at the top level that waits", "store_timeout: 20ms\ndurability: {replicas: 1}\n",
			[]string{"durability.timeout: 50ms (the default) exceeds store_timeout 20ms", "(line 2)"}},
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
	// A default timeout above store_timeout is fine where nothing waits.
	p := mustParse(t, "store_timeout: 20ms\nroutes: [{name: a, match: {path_prefix: /}, durability: {replicas: 1, timeout: 20ms}}]\n")
	require.Equal(t, 20*time.Millisecond, route(t, p, "a").Durability.Timeout)
}
