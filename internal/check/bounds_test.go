package check

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// An input beyond a bound is refused with one line naming the bound, before it costs more.
func TestRunRefusesInputBeyondItsBounds(t *testing.T) {
	p, err := policy.Parse([]byte(fuzzPolicy))
	require.NoError(t, err)
	for _, tc := range []struct {
		name, data string
		maxBytes   int64
		want       string
	}{
		{"larger than the bound", "admin: {}\n", 4, "in.yaml: 10 bytes, more than the 4 bytes an input may hold"},
		{"too many values", "[" + strings.Repeat("a,", 200) + "a]", 1 << 10, "in.yaml: more than the 32 YAML values an input of 1 KiB may hold (one per 32 bytes)"},
		{"10,000 nested sequences", strings.Repeat("[", 10000) + strings.Repeat("]", 10000), 0,
			"in.yaml:1: mappings and sequences nested more than 100 deep, the most that is read"},
		{"nested in a second document", "admin: {}\n---\n" + strings.Repeat("[", 101) + strings.Repeat("]", 101), 0,
			"in.yaml:3: mappings and sequences nested more than 100 deep"},
		{"alias bomb", "a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\ne: [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n", 1 << 20,
			"in.yaml:5: more than 32768 YAML values, its aliases expanded"},
		{"a key given twice", "admin: {}\nadmin: {}\n", 0, `in.yaml:2: mapping key "admin" given again (first at line 1)`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Run(p, []Input{{Name: "in.yaml", Data: []byte(tc.data)}}, Options{MaxInputBytes: tc.maxBytes})
			require.Error(t, err)
			require.Contains(t, err.Error(), tc.want)
			require.NotContains(t, err.Error(), "\n", "one line")
		})
	}
}

// The decoders' messages are rewritten to quote only what the file holds: no JSON token made
// from the YAML, no YAML tag, no Go type.
func TestRunMessagesQuoteTheFile(t *testing.T) {
	p, err := policy.Parse([]byte(fuzzPolicy))
	require.NoError(t, err)
	for _, tc := range []struct{ name, data, want string }{
		{"a sequence for a document", "- a\n- b\n", "1:1: the document is a sequence, not an Envoy bootstrap (a mapping) nor Kubernetes objects (mappings with apiVersion and kind)"},
		{"a block sequence for a mapping", "admin:\n  - a\n", "1:1: admin: a sequence is not a value this field takes"},
		{"a word for a mapping", "admin: yes\n", "1:1: admin: `yes` is not a value this field takes"},
		{"a sequence for a number", "static_resources:\n  listeners:\n    - per_connection_buffer_limit_bytes:\n        - 1\n", "3:7: static_resources.listeners[0].per_connection_buffer_limit_bytes: a sequence is not a valid uint32"},
		{"a mapping for a list of items", "apiVersion: v1\nkind: List\nitems: {a: 1}\n", "3: a mapping where a sequence is wanted"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Run(p, []Input{{Name: "in.yaml", Data: []byte(tc.data)}}, Options{})
			require.EqualError(t, err, "in.yaml:"+tc.want)
		})
	}
}
