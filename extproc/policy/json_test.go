package policy_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/jsonbody"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

const mcpPolicy = `
defaults:
  key_json: [/key]
routes:
  - name: mcp-tool-calls
    match:
      path_prefix: /mcp
      json: { /method: tools/call, /params/name: send_mail, "/params/~1odd~0name": 9007199254740993 }
    key_json: [/params/arguments/_idempotency_key, /params/_meta/idempotencyKey]
    scope:
      - jwt_claim: sub
      - json: /params/name
    fingerprint_ignore_json: [/params/_meta]
    json_rpc: true
  - name: mcp-other
    match: {path_prefix: /mcp, json: {/flag: true, /none: null, /n: 1.50}}
  - name: mcp
    match: {path_prefix: /mcp}
`

func TestJSONFields(t *testing.T) {
	p := mustParse(t, mcpPolicy)
	r := route(t, p, "mcp-tool-calls")
	require.True(t, r.DecidedByBody())
	require.True(t, r.ReadsJSON())
	require.True(t, r.JSONRPC)
	require.Equal(t, []string{"/params/arguments/_idempotency_key", "/params/_meta/idempotencyKey"}, pointerTexts(r.KeyJSON))
	require.Equal(t, []string{"/params/_meta"}, pointerTexts(r.FingerprintIgnoreJSON))
	require.Equal(t, []policy.ScopeSource{claim("sub"), {Kind: policy.ScopeJSON, Name: "/params/name"}}, r.Scope)
	require.Equal(t, []string{"/params/name"}, pointerTexts(r.ScopeJSON))
	var values []string
	for _, m := range r.MatchJSON() {
		values = append(values, m.Pointer.String()+"="+string(m.Value))
	}
	require.ElementsMatch(t, []string{`/method="tools/call"`, `/params/name="send_mail"`, `/params/~1odd~0name=9007199254740993`}, values,
		"values are canonical JSON texts, and a number keeps its digits")

	other := route(t, p, "mcp-other")
	require.Equal(t, []string{"/key"}, pointerTexts(other.KeyJSON), "key_json is inherited from the defaults")
	values = nil
	for _, m := range other.MatchJSON() {
		values = append(values, string(m.Value))
	}
	require.ElementsMatch(t, []string{"true", "null", "1.5"}, values)

	plain := route(t, p, "mcp")
	require.False(t, plain.DecidedByBody())
	require.True(t, plain.ReadsJSON(), "it inherits key_json")
	require.False(t, p.Default.DecidedByBody())
	require.False(t, policy.Default().Default.ReadsJSON(), "the built-in defaults read no JSON")
}

func pointerTexts(ps []jsonbody.Pointer) []string {
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = p.String()
	}
	return out
}

func TestInvalidJSONFields(t *testing.T) {
	r := func(fields string) string {
		return "routes: [{name: mcp, match: {path_prefix: /mcp}, " + fields + "}]\n"
	}
	cases := []struct {
		name string
		src  string
		want []string
	}{
		{"a pointer without its slash", r("key_json: [params/key]"), []string{`routes[0] (mcp).key_json[0]: "params/key" is not a JSON pointer: a JSON pointer starts with /`}},
		{"a bad escape", r("key_json: [/a~2b]"), []string{`routes[0] (mcp).key_json[0]: "/a~2b" is not a JSON pointer`}},
		{"the whole body", r(`fingerprint_ignore_json: [""]`), []string{"routes[0] (mcp).fingerprint_ignore_json[0]: must name a member of the body"}},
		{"key_json not a list", r("key_json: /key"), []string{"routes[0] (mcp).key_json: must be a list"}},
		{"a bad scope pointer", r("scope: [{json: name}]"), []string{`routes[0] (mcp).scope[0].json: "name" is not a JSON pointer`}},
		{"a json scope listed twice", r("scope: [{json: /a}, {json: /a}]"), []string{`routes[0] (mcp).scope[1].json: json "/a" is listed twice`}},
		{"json_rpc not a bool", r("json_rpc: yes-please"), []string{`routes[0] (mcp).json_rpc: must be true or false`}},
		{"ignoring members of a body the fingerprint leaves out", r("fingerprint: [method], fingerprint_ignore_json: [/id]"), []string{"routes[0] (mcp).fingerprint_ignore_json: is set while fingerprint leaves out body"}},
		{"a match.json value that is a list", "routes: [{name: a, match: {path_prefix: /, json: {/m: [1]}}}]\n", []string{"routes[0] (a).match.json./m: must be a string, number, bool or null, got a list"}},
		{"a match.json number JSON cannot write", "routes: [{name: a, match: {path_prefix: /, json: {/m: 0x1f}}}]\n", []string{`routes[0] (a).match.json./m: "0x1f" is not a JSON number; quote it to match a string`}},
		{"a match.json pointer", "routes: [{name: a, match: {path_prefix: /, json: {method: x}}}]\n", []string{`routes[0] (a).match.json.method: "method" is not a JSON pointer`}},
		{"an empty match.json", "routes: [{name: a, match: {path_prefix: /, json: {}}}]\n", []string{"routes[0] (a).match.json: must name at least one member"}},
		{"match.json alone", "routes: [{name: a, match: {json: {/m: x}}}]\n", []string{"routes[0] (a).match: needs exactly one of"}},
		{"match.json not a mapping", "routes: [{name: a, match: {path_prefix: /, json: /m}}]\n", []string{"routes[0] (a).match.json: must be a mapping"}},
		{"a line number", "routes:\n  - name: a\n    match: {path_prefix: /}\n    key_json: [x]\n", []string{"(line 4)"}},
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
