package yamllimit

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"
)

// nodes counts the nodes the YAML decoder makes of data, over all its documents.
func nodes(t *testing.T, data []byte) int {
	t.Helper()
	dec := yaml.NewDecoder(bytes.NewReader(data))
	n := 0
	for {
		var doc yaml.Node
		err := dec.Decode(&doc)
		if errors.Is(err, io.EOF) {
			return n
		}
		require.NoError(t, err)
		var count func(*yaml.Node)
		count = func(x *yaml.Node) {
			n++
			for _, c := range x.Content {
				count(c)
			}
		}
		count(&doc)
	}
}

// Values never falls below the decoder's count by more than a document's two nodes (the
// document and its root), on the shapes that pack the most values into the fewest bytes; the
// shipped configuration counts one value per 6 to 8 bytes, comments included.
func TestValuesBoundsTheDecodersNodes(t *testing.T) {
	dense := map[string]string{
		"flow sequence":      "[" + strings.Repeat("a,", 5000) + "a]",
		"empty sequences":    "[" + strings.Repeat("[],", 5000) + "[]]",
		"nested sequences":   strings.Repeat("[", 5000) + strings.Repeat("]", 5000),
		"empty values":       strings.Repeat("- \n", 5000),
		"bare dashes":        strings.Repeat("-\n", 5000),
		"null keys":          "{" + strings.Repeat("a,", 5000) + "a}",
		"null map values":    strings.Repeat("a:\n", 1) + "b:\n" + "c:\n",
		"flow pairs":         "[" + strings.Repeat("a: b,", 3000) + "a: b]",
		"complex keys":       strings.Repeat("?\n", 1) + "? a\n: b\n",
		"json":               `{"a":[1,2,3],"b":{"c":null,"d":"e"}}`,
		"documents":          strings.Repeat("---\n", 5000),
		"nested mappings":    "a:\n  b:\n    c:\n      d: {e: {f: [g]}}\n",
		"aliases unexpanded": "a: &x [b, c]\nd: *x\ne: *x\n",
	}
	for name, text := range dense {
		t.Run(name, func(t *testing.T) {
			docs := strings.Count(text, "---") + 1
			require.GreaterOrEqual(t, Values([]byte(text))+2*docs, nodes(t, []byte(text)))
		})
	}
	files, err := filepath.Glob("../../envoy/*.yaml")
	require.NoError(t, err)
	require.NotEmpty(t, files)
	for _, f := range files {
		data, err := os.ReadFile(f)
		require.NoError(t, err)
		got, want := Values(data), nodes(t, data)
		require.GreaterOrEqual(t, got+2*(bytes.Count(data, []byte("\n---"))+1), want, f)
		require.Less(t, got, len(data)/5, "%s: configuration holds one value per 6 to 8 bytes", f)
	}
}

func TestScreen(t *testing.T) {
	require.NoError(t, Screen([]byte("[a, b]"), 1024))
	err := Screen([]byte("["+strings.Repeat("a,", 100)+"a]"), 64)
	var e *Error
	require.ErrorAs(t, err, &e)
	require.Equal(t, "more than the 2 YAML values an input of 64 bytes may hold (one per 32 bytes): this is not a configuration file, or it needs a larger bound", err.Error())
}

func decode(t *testing.T, text string) *yaml.Node {
	t.Helper()
	var doc yaml.Node
	require.NoError(t, yaml.Unmarshal([]byte(text), &doc))
	return &doc
}

func TestCheck(t *testing.T) {
	for _, tc := range []struct {
		name, text string
		budget     int
		values     int
		err        string
	}{
		{"flat", "a: [b, c]\n", 100, 6, ""}, // document, mapping, a, sequence, b, c
		{"at the depth bound", strings.Repeat("[", MaxDepth) + strings.Repeat("]", MaxDepth), 1000, MaxDepth + 1, ""},
		{"one level deeper", strings.Repeat("[", MaxDepth+1) + strings.Repeat("]", MaxDepth+1), 1000, 0,
			"line 1: mappings and sequences nested more than 100 deep, the most that is read"},
		{"deep in block style", "a:\n" + func() string {
			var b strings.Builder
			for i := 1; i <= MaxDepth; i++ {
				b.WriteString(strings.Repeat(" ", i) + "- \n")
			}
			return b.String()
		}(), 1000, 0, "mappings and sequences nested more than 100 deep"},
		{"a key given twice", "a: 1\nb: 2\na: 3\n", 100, 0, `line 3: mapping key "a" given again (first at line 1)`},
		{"a wide mapping", "{" + func() string {
			var b strings.Builder
			for i := range MaxKeys {
				fmt.Fprintf(&b, "k%d: 1, ", i)
			}
			return b.String()
		}() + "}", 100000, 2 + 2*MaxKeys, ""},
		{"too wide a mapping", "{" + func() string {
			var b strings.Builder
			for i := range MaxKeys + 1 {
				fmt.Fprintf(&b, "k%d: 1, ", i)
			}
			return b.String()
		}() + "}", 100000, 0, "line 1: a mapping of more than 5000 keys"},
		{"aliases counted expanded", "a: &x [b, c]\nd: *x\ne: *x\n", 100, 14, ""},
		{"alias bomb", "a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n",
			1000, 0, "more than 1000 YAML values, its aliases expanded"},
		{"an alias deepens what it repeats", "a: &a " + strings.Repeat("[", 60) + strings.Repeat("]", 60) + "\nb: " + strings.Repeat("[", 50) + "*a" + strings.Repeat("]", 50) + "\n",
			10000, 0, "line 2: mappings and sequences nested more than 100 deep"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n, err := Check(decode(t, tc.text), tc.budget)
			if tc.err == "" {
				require.NoError(t, err)
				require.Equal(t, tc.values, n)
				return
			}
			var e *Error
			require.ErrorAs(t, err, &e)
			require.Contains(t, err.Error(), tc.err)
		})
	}
}

// An alias to a value that holds it is refused, not followed for ever.
func TestCheckAliasCycle(t *testing.T) {
	a := &yaml.Node{Kind: yaml.SequenceNode, Anchor: "a", Line: 1}
	a.Content = []*yaml.Node{{Kind: yaml.AliasNode, Value: "a", Alias: a, Line: 1}}
	_, err := Check(a, 100)
	require.EqualError(t, err, "line 1: alias *a refers to a value that holds it")
}
