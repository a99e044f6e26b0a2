package docs_test

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/check"
)

// Every YAML snippet of README.md and docs/*.md says, in an HTML comment on the line before its
// fence, what it is, and passes as that:
//
//	<!-- check: WHERE [policy=FILE] [finding=KIND] -->
//
// WHERE is where the snippet goes: "file" (a whole Envoy bootstrap or Kubernetes objects),
// "envoy.yaml:http_filter" (in place of the ext_proc filter of envoy/envoy.yaml),
// "envoy.yaml:cluster" (in place of the cluster of its name there), "envoy.yaml:route" (a route
// inserted before the catch-all route "default" of envoy/envoy.yaml),
// "envoy-gateway.yaml:EnvoyProxy.spec" (its keys set in the spec of envoy/envoy-gateway.yaml's
// EnvoyProxy; any KIND.spec likewise), "policy" (a policy file, loaded as the server loads it),
// "config" (a configuration file of docs/configuration.md, which cmd/idempotency-extproc's
// tests load), or "none" (YAML check does not read: Helm values, a NetworkPolicy). The Envoy, Istio and
// Envoy Gateway snippets are checked with `check` against the policy (envoy/policy.yaml unless
// policy= names another file of the repository): each passes with no error, unless it is a
// deliberately wrong example, marked finding=KIND, and then it produces exactly that error.
var marker = regexp.MustCompile(`^<!-- check: ([a-z.:_A-Z-]+)((?: [a-z]+=[^ ]+)*) -->$`)

// snippet is one YAML block of a document.
type snippet struct {
	doc, where, policy, finding string
	line                        int
	text                        string
}

// yamlSnippets returns the YAML blocks of the repository's Markdown files, with their markers;
// an unmarked block fails t.
func yamlSnippets(t *testing.T) []snippet {
	t.Helper()
	files := []string{filepath.Join(root, "README.md")}
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	require.NoError(t, err)
	files = append(files, docs...)
	var out []snippet
	for _, f := range files {
		data, err := os.ReadFile(f)
		require.NoError(t, err)
		lines := strings.Split(string(data), "\n")
		for i := 0; i < len(lines); i++ {
			trimmed := strings.TrimSpace(lines[i])
			if !strings.HasPrefix(trimmed, "```") {
				continue
			}
			lang := strings.TrimPrefix(trimmed, "```")
			indent := lines[i][:len(lines[i])-len(strings.TrimLeft(lines[i], " "))]
			end := i + 1
			for end < len(lines) && strings.TrimSpace(lines[end]) != "```" {
				end++
			}
			body := lines[i+1 : min(end, len(lines))]
			start := i
			i = end
			if lang != "yaml" {
				continue
			}
			var text strings.Builder
			for _, l := range body {
				text.WriteString(strings.TrimPrefix(l, indent) + "\n")
			}
			s := snippet{doc: f, line: start + 1, text: text.String(), policy: "envoy/policy.yaml"}
			m := marker.FindStringSubmatch(strings.TrimSpace(prevLine(lines, start)))
			if m == nil {
				t.Errorf("%s:%d: a YAML snippet without a <!-- check: WHERE --> comment on the line before it", f, start+1)
				continue
			}
			s.where = m[1]
			for _, opt := range strings.Fields(m[2]) {
				k, v, _ := strings.Cut(opt, "=")
				switch k {
				case "policy":
					s.policy = v
				case "finding":
					s.finding = v
				default:
					t.Errorf("%s:%d: unknown option %q", f, start+1, k)
				}
			}
			out = append(out, s)
		}
	}
	return out
}

// prevLine is the last non-blank line before line i.
func prevLine(lines []string, i int) string {
	for j := i - 1; j >= 0; j-- {
		if strings.TrimSpace(lines[j]) != "" {
			return lines[j]
		}
	}
	return ""
}

func TestDocSnippetsPassCheck(t *testing.T) {
	snippets := yamlSnippets(t)
	require.NotEmpty(t, snippets)
	checked := 0
	for _, s := range snippets {
		t.Run(filepath.Base(s.doc)+":"+strconv.Itoa(s.line), func(t *testing.T) {
			switch s.where {
			case "policy":
				_, err := policy.Parse([]byte(s.text))
				require.NoError(t, err, "%s:%d", s.doc, s.line)
				return
			case "none":
				// Not configuration check reads (Helm values, a NetworkPolicy): it must say so
				// truthfully, and be YAML.
				for _, api := range []string{"type.googleapis.com/envoy", "networking.istio.io", "gateway.envoyproxy.io", "gateway.networking.k8s.io", "static_resources"} {
					require.NotContains(t, s.text, api, "%s:%d: an Envoy, Istio or Envoy Gateway snippet is checked: mark where it goes", s.doc, s.line)
				}
				var v any
				require.NoError(t, yaml.Unmarshal([]byte(s.text), &v), "%s:%d", s.doc, s.line)
				return
			case "config":
				// A configuration file of the server: cmd/idempotency-extproc's tests load each
				// YAML block of docs/configuration.md as the server does.
				require.True(t, strings.HasSuffix(s.doc, "configuration.md"), "%s:%d: config snippets live in docs/configuration.md", s.doc, s.line)
				return
			}
			policyText, err := os.ReadFile(filepath.Join(root, s.policy))
			require.NoError(t, err)
			p, err := policy.Parse(policyText)
			require.NoError(t, err)
			input := place(t, s)
			rep, err := check.Run(p, []check.Input{input}, check.Options{})
			require.NoError(t, err, "%s:%d: the snippet, in %s, cannot be read", s.doc, s.line, input.Name)
			var errs []string
			for _, f := range rep.Findings {
				if f.Severity == check.Error {
					errs = append(errs, string(f.Kind))
				}
			}
			if s.finding == "" {
				require.Empty(t, errs, "%s:%d: %v", s.doc, s.line, rep.Findings)
				return
			}
			require.Contains(t, check.Kinds(), check.Kind(s.finding), "%s:%d: finding=%s is no kind of finding", s.doc, s.line, s.finding)
			kinds := kindsOf(rep)
			require.Contains(t, kinds, s.finding, "%s:%d: the deliberately wrong example does not produce its finding: %v", s.doc, s.line, rep.Findings)
			for _, k := range errs {
				require.Equal(t, s.finding, k, "%s:%d: it produces another error too: %v", s.doc, s.line, rep.Findings)
			}
		})
		checked++
	}
	require.Equal(t, len(snippets), checked)
}

func kindsOf(rep check.Report) []string {
	var out []string
	for _, f := range rep.Findings {
		if !slices.Contains(out, string(f.Kind)) {
			out = append(out, string(f.Kind))
		}
	}
	return out
}

// place puts a snippet where its marker says, and returns the file check reads.
func place(t *testing.T, s snippet) check.Input {
	t.Helper()
	name := filepath.Base(s.doc) + ":" + strconv.Itoa(s.line)
	if s.where == "file" {
		return check.Input{Name: name, Data: []byte(s.text)}
	}
	file, at, ok := strings.Cut(s.where, ":")
	require.True(t, ok, "%s: unknown place %q", name, s.where)
	data, err := os.ReadFile(filepath.Join(root, "envoy", file))
	require.NoError(t, err)
	var snip yaml.Node
	require.NoError(t, yaml.Unmarshal([]byte(s.text), &snip), name)
	piece := snip.Content[0]
	var docs []*yaml.Node
	dec := yaml.NewDecoder(bytes.NewReader(data))
	for {
		var d yaml.Node
		if dec.Decode(&d) != nil {
			break
		}
		docs = append(docs, &d)
	}
	replaced := false
	switch at {
	case "http_filter", "cluster":
		require.Equal(t, yaml.SequenceNode, piece.Kind, "%s: a %s snippet is a list item", name, at)
		item := piece.Content[0]
		key, match := "http_filters", func(n *yaml.Node) bool {
			return strings.Contains(value(n, "typed_config", "@type"), "ExternalProcessor")
		}
		if at == "cluster" {
			key, match = "clusters", func(n *yaml.Node) bool { return value(n, "name") == value(item, "name") }
		}
		for _, d := range docs {
			walkMappings(d, func(m *yaml.Node) {
				for i := 0; i+1 < len(m.Content); i += 2 {
					if m.Content[i].Value != key || m.Content[i+1].Kind != yaml.SequenceNode {
						continue
					}
					for j, it := range m.Content[i+1].Content {
						if match(it) {
							m.Content[i+1].Content[j] = item
							replaced = true
						}
					}
				}
			})
		}
	case "route":
		require.Equal(t, yaml.SequenceNode, piece.Kind, "%s: a route snippet is a list item", name)
		for _, d := range docs {
			walkMappings(d, func(m *yaml.Node) {
				for i := 0; i+1 < len(m.Content); i += 2 {
					routes := m.Content[i+1]
					if m.Content[i].Value != "routes" || routes.Kind != yaml.SequenceNode {
						continue
					}
					for j, it := range routes.Content {
						if value(it, "name") == "default" && !replaced {
							routes.Content = append(routes.Content[:j:j], append(piece.Content, routes.Content[j:]...)...)
							replaced = true
							return
						}
					}
				}
			})
		}
	default:
		kind, ok := strings.CutSuffix(at, ".spec")
		require.True(t, ok, "%s: unknown place %q", name, s.where)
		for _, d := range docs {
			root := d.Content[0]
			if value(root, "kind") != kind {
				continue
			}
			spec := child(root, "spec")
			for i := 0; i+1 < len(piece.Content); i += 2 {
				set(spec, piece.Content[i], piece.Content[i+1])
			}
			replaced = true
		}
	}
	require.True(t, replaced, "%s: no place for it in envoy/%s", name, file)
	var buf bytes.Buffer
	enc := yaml.NewEncoder(&buf)
	for _, d := range docs {
		require.NoError(t, enc.Encode(d))
	}
	require.NoError(t, enc.Close())
	return check.Input{Name: name + " in envoy/" + file, Data: buf.Bytes()}
}

func walkMappings(n *yaml.Node, fn func(*yaml.Node)) {
	if n.Kind == yaml.MappingNode {
		fn(n)
	}
	for _, c := range n.Content {
		walkMappings(c, fn)
	}
}

func child(m *yaml.Node, key string) *yaml.Node {
	if m == nil || m.Kind != yaml.MappingNode {
		return nil
	}
	for i := 0; i+1 < len(m.Content); i += 2 {
		if m.Content[i].Value == key {
			return m.Content[i+1]
		}
	}
	return nil
}

func value(n *yaml.Node, path ...string) string {
	for _, k := range path {
		n = child(n, k)
	}
	if n == nil {
		return ""
	}
	return n.Value
}

func set(m, key, val *yaml.Node) {
	for i := 0; i+1 < len(m.Content); i += 2 {
		if m.Content[i].Value == key.Value {
			m.Content[i+1] = val
			return
		}
	}
	m.Content = append(m.Content, key, val)
}

// findRoute returns the match of the route named name anywhere in v, a decoded YAML document.
func findRoute(v any, name string) (match any, ok bool) {
	switch v := v.(type) {
	case map[string]any:
		if v["name"] == name {
			if m, has := v["match"]; has {
				return m, true
			}
		}
		for _, e := range v {
			if m, ok := findRoute(e, name); ok {
				return m, true
			}
		}
	case []any:
		for _, e := range v {
			if m, ok := findRoute(e, name); ok {
				return m, true
			}
		}
	}
	return nil, false
}

// The gRPC methods section's route for a bootstrap of one's own matches what the shipped
// envoy/envoy-grpc.yaml matches, the unary method's exact path: a prefix would cover the
// service's streaming methods too, which that section says to leave out.
func TestGRPCRouteSnippetMatchesShipped(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(root, "envoy", "envoy-grpc.yaml"))
	require.NoError(t, err)
	var shipped any
	require.NoError(t, yaml.Unmarshal(data, &shipped))
	want, ok := findRoute(shipped, "payments-grpc")
	require.True(t, ok, "envoy/envoy-grpc.yaml has a route payments-grpc")
	found := 0
	for _, s := range yamlSnippets(t) {
		if s.where != "envoy.yaml:route" {
			continue
		}
		var doc any
		require.NoError(t, yaml.Unmarshal([]byte(s.text), &doc), "%s:%d", s.doc, s.line)
		if got, ok := findRoute(doc, "payments-grpc"); ok {
			require.Equal(t, want, got, "%s:%d: the route's match differs from envoy/envoy-grpc.yaml's", s.doc, s.line)
			found++
		}
	}
	require.Positive(t, found, "a route snippet named payments-grpc")
}
