package extproc

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

const jsonRoutes = `
routes:
  - name: tools
    match: {path_prefix: /mcp, json: {/method: tools/call}}
    key_json: [/params/arguments/_idempotency_key, /params/_meta/idempotencyKey]
    scope: [{json: /params/name}]
    fingerprint_ignore_json: [/params/_meta]
    json_rpc: true
  - name: ignore-only
    match: {path_prefix: /ignore}
    fingerprint_ignore_json: [/meta]
  - name: plain
    match: {path_prefix: /plain}
`

func jsonPolicy(t *testing.T) *policy.Policy {
	t.Helper()
	p, err := policy.Parse([]byte(jsonRoutes))
	require.NoError(t, err)
	return p
}

func namedRoute(t *testing.T, p *policy.Policy, name string) *policy.Route {
	t.Helper()
	r, _, err := p.Select(policy.Selector{Named: name})
	require.NoError(t, err)
	return r
}

func TestCompileJSON(t *testing.T) {
	p := jsonPolicy(t)
	require.Nil(t, compileJSON(namedRoute(t, p, "plain")), "a route without json fields reads nothing")
	require.Nil(t, compileJSON(p.Default))
	j := compileJSON(namedRoute(t, p, "tools"))
	require.True(t, j.members && j.canonical && j.rpc)
	require.Equal(t, 2, j.keys)
	require.Equal(t, 1, j.scopes)
	require.Len(t, j.ptrs, 5, "two keys, a scope value, the id and the match.json member, read in one pass")
	require.Equal(t, []string{"/params/_meta", "/id"}, []string{j.ignore[0].String(), j.ignore[1].String()})
	ig := compileJSON(namedRoute(t, p, "ignore-only"))
	require.False(t, ig.members, "fingerprint_ignore_json alone needs no member")
	require.True(t, ig.canonical)
}

func TestReadJSON(t *testing.T) {
	p := jsonPolicy(t)
	tools, ignore := compileJSON(namedRoute(t, p, "tools")), compileJSON(namedRoute(t, p, "ignore-only"))
	call := func(id, key, name, extra string) string {
		return `{"jsonrpc":"2.0","id":` + id + `,"method":"tools/call","params":{"name":` + name + `,"_meta":{"idempotencyKey":` + key + `},"arguments":{"to":"a@example.com"` + extra + `}}}`
	}
	canonicalOf := func(t *testing.T, j *jsonRoute, body string) string {
		t.Helper()
		r := readJSON(j, []byte(body))
		require.Nil(t, r.problem)
		return string(r.fingerprint)
	}
	t.Run("key, scope and id", func(t *testing.T) {
		r := readJSON(tools, []byte(call(`"a-1"`, `"k1"`, `"send_mail"`, "")))
		require.Nil(t, r.problem)
		require.Equal(t, "k1", r.key)
		require.Equal(t, [][]byte{[]byte(`"send_mail"`)}, r.scope)
		require.Equal(t, `"a-1"`, string(r.id))
		require.Equal(t, `{"jsonrpc":"2.0","method":"tools/call","params":{"arguments":{"to":"a@example.com"},"name":"send_mail"}}`, string(r.fingerprint),
			"the canonical form without _meta and id")
	})
	t.Run("match.json, read in the same pass", func(t *testing.T) {
		require.True(t, readJSON(tools, []byte(call("1", `"k"`, `"x"`, ""))).matched)
		list := readJSON(tools, []byte(`{"jsonrpc":"2.0","id":2,"method":"tools/list"}`))
		require.Nil(t, list.problem)
		require.False(t, list.matched)
		require.False(t, readJSON(tools, []byte(`{"method":"tools/call"`)).matched, "a body that is not JSON never matches")
		require.False(t, readJSON(ignore, []byte(`a=1`)).matched)
	})
	t.Run("the first key present counts", func(t *testing.T) {
		body := `{"id":1,"params":{"arguments":{"_idempotency_key":"first"},"_meta":{"idempotencyKey":"second"}}}`
		require.Equal(t, "first", readJSON(tools, []byte(body)).key)
		body = `{"id":1,"params":{"arguments":{"_idempotency_key":""},"_meta":{"idempotencyKey":"second"}}}`
		require.Equal(t, "second", readJSON(tools, []byte(body)).key, "an empty string does not count")
		body = `{"id":1,"params":{"arguments":{"_idempotency_key":7},"_meta":{"idempotencyKey":"second"}}}`
		require.Equal(t, "second", readJSON(tools, []byte(body)).key, "a number is not a key")
	})
	t.Run("a retry with a new id, other whitespace and member order fingerprints alike", func(t *testing.T) {
		a := canonicalOf(t, tools, call("1", `"k"`, `"send_mail"`, ""))
		b := canonicalOf(t, tools, "\n"+`{ "params" : {"arguments":{"to":"a@example.com"}, "_meta":{"idempotencyKey":"k","progressToken":9}, "name":"send_mail"}, "id":"retry-2", "method":"tools/call", "jsonrpc":"2.0" }`)
		require.Equal(t, a, b)
		require.NotEqual(t, a, canonicalOf(t, tools, call("1", `"k"`, `"send_mail"`, `,"cc":"b@example.com"`)), "a changed argument does not")
	})
	t.Run("numbers keep their digits", func(t *testing.T) {
		a := canonicalOf(t, tools, call("1", `"k"`, `"send_mail"`, `,"amount":9007199254740993`))
		b := canonicalOf(t, tools, call("1", `"k"`, `"send_mail"`, `,"amount":9007199254740992`))
		require.NotEqual(t, a, b, "two integers beyond 2^53 that one double holds")
		require.Equal(t, a, canonicalOf(t, tools, call("1", `"k"`, `"send_mail"`, `,"amount":9007199254740993.0`)), "one value written two ways")
		scope := readJSON(tools, []byte(call("1", `"k"`, `9007199254740993`, ""))).scope[0]
		require.Equal(t, "9007199254740993", string(scope))
	})
	for _, c := range []struct {
		name, body string
		want       *problem
	}{
		{"not JSON", `method=tools/call`, problemInvalidJSON},
		{"truncated", `{"id":1,"params":{`, problemInvalidJSON},
		{"empty", ``, problemInvalidJSON},
		{"10,000 levels deep", `{"id":1,"x":` + strings.Repeat("[", 10000) + strings.Repeat("]", 10000) + `}`, problemInvalidJSON},
		{"a duplicate member", `{"id":1,"id":2}`, problemInvalidJSON},
		{"a key a header could not carry", call("1", `"two words"`, `"x"`, ""), problemInvalidKey},
		{"a key too long", call("1", `"`+strings.Repeat("k", MaxKeyLength+1)+`"`, `"x"`, ""), problemInvalidKey},
	} {
		t.Run(c.name, func(t *testing.T) {
			require.Same(t, c.want, readJSON(tools, []byte(c.body)).problem)
		})
	}
	t.Run("a batch", func(t *testing.T) {
		r := readJSON(tools, []byte(" ["+call("1", `"k"`, `"x"`, "")+"]"))
		require.True(t, r.batch)
		require.Nil(t, r.problem)
	})
	t.Run("fingerprint_ignore_json alone fingerprints a body that is not JSON raw", func(t *testing.T) {
		r := readJSON(ignore, []byte("a=1&b=2"))
		require.Nil(t, r.problem)
		require.Equal(t, "a=1&b=2", string(r.fingerprint))
		require.Equal(t, `{"a":1}`, canonicalOf(t, ignore, `{"meta":{"t":1}, "a":1.0}`))
	})
}

func TestKeyFromBody(t *testing.T) {
	r := &policy.Route{MissingKey: policy.MissingKeyOptional}
	header := admission{covered: true, key: "h"}
	none := admission{covered: true}
	for _, c := range []struct {
		name       string
		missing    policy.MissingKey
		a          admission
		bodyKey    string
		wantKey    string
		wantHash   bool
		wantCover  bool
		wantProble *problem
	}{
		{"a header key alone", policy.MissingKeyOptional, header, "", "h", false, true, nil},
		{"the same key in both", policy.MissingKeyOptional, header, "h", "h", false, true, nil},
		{"a header key and a different body key", policy.MissingKeyOptional, header, "b", "h", false, true, problemKeyConflict},
		{"a body key alone", policy.MissingKeyOptional, none, "b", "b", false, true, nil},
		{"no key, optional", policy.MissingKeyOptional, none, "", "", true, false, nil},
		{"no key, required", policy.MissingKeyRequired, none, "", "", true, true, problemMissingKey},
		{"no key, body-hash", policy.MissingKeyBodyHash, none, "", "", true, true, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			r.MissingKey = c.missing
			a, covered := keyFromBody(r, c.a, c.bodyKey)
			require.Equal(t, c.wantCover, covered)
			if !covered {
				return
			}
			require.Equal(t, c.wantKey, a.key)
			require.Equal(t, c.wantHash, a.key == "")
			require.Same(t, c.wantProble, a.problem)
		})
	}
}

func TestRPCProblem(t *testing.T) {
	r := namedRoute(t, jsonPolicy(t), "tools")
	for _, p := range problems {
		t.Run(p.code, func(t *testing.T) {
			for _, id := range []string{`"call-2"`, `17`, ``} {
				resp := rpcProblem(p, r, []byte(id)).GetImmediateResponse()
				require.EqualValues(t, 200, resp.GetStatus().GetCode(), "JSON-RPC errors travel in HTTP 200")
				var msg struct {
					JSONRPC string          `json:"jsonrpc"`
					ID      json.RawMessage `json:"id"`
					Error   struct {
						Code    int            `json:"code"`
						Message string         `json:"message"`
						Data    map[string]any `json:"data"`
					} `json:"error"`
				}
				require.NoError(t, json.Unmarshal(resp.GetBody(), &msg), "%s", resp.GetBody())
				want := id
				if id == "" {
					want = "null"
				}
				require.Equal(t, "2.0", msg.JSONRPC)
				require.Equal(t, want, string(msg.ID))
				require.Equal(t, -32000, msg.Error.Code)
				require.Equal(t, reasonPhrase(p.status), msg.Error.Message)
				require.Equal(t, p.code, msg.Error.Data["code"])
				require.EqualValues(t, p.status, msg.Error.Data["status"])
				hs := map[string]string{}
				for _, h := range resp.GetHeaders().GetSetHeaders() {
					hs[h.GetHeader().GetKey()] = string(h.GetHeader().GetRawValue())
				}
				require.Equal(t, "application/json", hs["content-type"])
				require.Equal(t, "false", hs["x-idempotency-replayed"])
				if p.retryAfter {
					require.Equal(t, "1", hs["retry-after"])
				} else {
					require.NotContains(t, hs, "retry-after")
				}
			}
		})
	}
}

func TestRPCReplay(t *testing.T) {
	rec := func(ct, body string) *cache.Record {
		return &cache.Record{Response: cache.Response{Status: 200, Headers: []cache.Header{{Name: "content-type", Value: []byte(ct)}}, Body: []byte(body)}}
	}
	for _, c := range []struct {
		name, ct, body, id, want string
	}{
		{"a JSON body", "application/json", `{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"sent"}]}}`, `"call-2"`,
			`{"jsonrpc":"2.0","id":"call-2","result":{"content":[{"type":"text","text":"sent"}]}}`},
		{"the id's length changes", "application/json; charset=utf-8", `{"id": "a", "jsonrpc":"2.0","result":1}` + "\n", `123456789`,
			`{"id": 123456789, "jsonrpc":"2.0","result":1}` + "\n"},
		{"an event stream: every response message", "text/event-stream",
			"event: message\nid: s1_0\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{\"id\":1}}\n\nevent: message\nid: s1_1\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n\n", `7`,
			"event: message\nid: s1_0\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{\"id\":1}}\n\nevent: message\nid: s1_1\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{}}\n\n"},
		{"a notification has no id to give", "application/json", `{"jsonrpc":"2.0","id":1,"result":{}}`, ``, `{"jsonrpc":"2.0","id":1,"result":{}}`},
		{"a body that is not JSON", "application/json", `oops`, `2`, `oops`},
		{"a result deeper than a request may nest", "application/json", `{"jsonrpc":"2.0","result":` + strings.Repeat("[", 70) + strings.Repeat("]", 70) + `,"id":1}`, `2`,
			`{"jsonrpc":"2.0","result":` + strings.Repeat("[", 70) + strings.Repeat("]", 70) + `,"id":2}`},
	} {
		t.Run(c.name, func(t *testing.T) {
			stored := rec(c.ct, c.body)
			got, ok := rpcReplay(stored, []byte(c.id))
			require.True(t, ok)
			require.Equal(t, c.want, string(got.Response.Body))
			require.Equal(t, c.body, string(stored.Response.Body), "the stored record is not changed")
		})
	}
	// A response whose id cannot be rewritten is never replayed with the first call's.
	for name, c := range map[string]struct{ ct, body string }{
		"a JSON object the rewrite cannot read": {"application/json", `{"jsonrpc":"2.0","id":1,"result":` + strings.Repeat("[", 20000) + strings.Repeat("]", 20000) + `}`},
		"an event's id split over data lines":   {"text/event-stream", "data: {\"jsonrpc\":\"2.0\",\"id\":[1,\ndata: 2],\"result\":{}}\n\n"},
	} {
		_, ok := rpcReplay(rec(c.ct, c.body), []byte(`2`))
		require.False(t, ok, name)
	}
}

// readJSON's match, as policy.SelectBy calls it for each route match.json decides (the stream's
// chooseRoute and KeyHash both pass it so): a body nested too deep to read whole still matches
// the route whose members it holds (which then refuses it, invalid-json-body), and falls through
// no further.
func TestSelectByBody(t *testing.T) {
	p, err := policy.Parse([]byte(`
defaults:
  key_json: [/key]
routes:
  - name: mcp-tool-calls
    match:
      path_prefix: /mcp
      json: { /method: tools/call, /params/name: send_mail, "/params/~1odd~0name": 9007199254740993 }
    key_json: [/params/arguments/_idempotency_key, /params/_meta/idempotencyKey]
    json_rpc: true
  - name: mcp-other
    match: {path_prefix: /mcp, json: {/flag: true, /none: null, /n: 1.50}}
  - name: mcp
    match: {path_prefix: /mcp}
`))
	require.NoError(t, err)
	selectBody := func(s policy.Selector, body []byte) (*policy.Route, []string, error) {
		return p.SelectBy(s, func(r *policy.Route) bool { return readJSON(compileJSON(r), body).matched })
	}
	call := `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"send_mail","/odd~name":9007199254740993}}`
	cases := []struct {
		name, path, body, want string
	}{
		{"every member equal", "/mcp", call, "mcp-tool-calls"},
		{"whitespace and member order do not count", "/mcp", ` { "params" : {"/odd~name":9007199254740993.0, "name":"send\u005fmail"}, "method":"tools/call"}`, "mcp-tool-calls"},
		{"a number beyond 2^53 keeps its digits", "/mcp", `{"method":"tools/call","params":{"name":"send_mail","/odd~name":9007199254740992}}`, "mcp"},
		{"another method falls through to the next route", "/mcp", `{"method":"initialize","params":{"name":"send_mail","/odd~name":9007199254740993}}`, "mcp"},
		{"a missing member falls through", "/mcp", `{"method":"tools/call"}`, "mcp"},
		{"bool, null and a number written another way", "/mcp", `{"flag":true,"none":null,"n":15e-1}`, "mcp-other"},
		{"a string is not the bool", "/mcp", `{"flag":"true","none":null,"n":1.5}`, "mcp"},
		{"a body that is not JSON", "/mcp", `method=tools/call`, "mcp"},
		{"an array (a batch)", "/mcp", `[` + call + `]`, "mcp"},
		{"an empty body", "/mcp", ``, "mcp"},
		{"too deep, its members there", "/mcp", `{"method":"tools/call","params":{"name":"send_mail","/odd~name":9007199254740993},"x":` + strings.Repeat("[", 70) + strings.Repeat("]", 70) + `}`, "mcp-tool-calls"},
		{"too deep, a member missing", "/mcp", `{"method":"tools/call","x":` + strings.Repeat("[", 70) + strings.Repeat("]", 70) + `}`, "mcp"},
		{"another path", "/other", call, "default"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r, _, err := selectBody(policy.Selector{Path: c.path}, []byte(c.body))
			require.NoError(t, err)
			require.Equal(t, c.want, r.Name)
		})
	}
	r, _, err := p.Select(policy.Selector{Path: "/mcp"})
	require.NoError(t, err)
	require.Equal(t, "mcp-tool-calls", r.Name, "at the headers, the first route whose path holds; its body decides")
	r, _, err = selectBody(policy.Selector{Path: "/mcp", Named: "mcp-other"}, []byte(call))
	require.NoError(t, err)
	require.Equal(t, "mcp-other", r.Name, "a named route is taken whatever its match.json says")
}
