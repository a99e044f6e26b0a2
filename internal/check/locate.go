package check

import (
	"regexp"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// specPath follows path (mapping keys as strings, sequence indexes as ints) from n and returns
// the node there (the key's node for a key); nil when the path does not lead through n.
func specPath(n *yaml.Node, path ...any) *yaml.Node {
	at := resolve(n)
	for _, p := range path {
		n = resolve(n)
		switch k := p.(type) {
		case string:
			kv := mapKey(n, k)
			if kv == nil {
				return nil
			}
			at, n = kv.key, kv.value
		case int:
			if n == nil || n.Kind != yaml.SequenceNode || k < 0 || k >= len(n.Content) {
				return nil
			}
			n = n.Content[k]
			at = resolve(n)
		}
	}
	return at
}

// fieldSteps splits a finding's field path (a.b[0].c[envoy.filters.http.ext_proc].d) into its
// steps: keys, indexes (ints) and bracketed names (nameStep). ok is false for a field that is
// not a path (it holds spaces: a description of where the setting is).
type nameStep string

func fieldSteps(field string) (steps []any, ok bool) {
	if i := strings.Index(field, " ("); i >= 0 {
		field = field[:i]
	}
	if field == "" || strings.ContainsAny(field, " ") {
		return nil, false
	}
	var cur strings.Builder
	flush := func() {
		if cur.Len() > 0 {
			steps = append(steps, cur.String())
			cur.Reset()
		}
	}
	for i := 0; i < len(field); i++ {
		switch c := field[i]; c {
		case '.':
			flush()
		case '[':
			flush()
			end := strings.IndexByte(field[i:], ']')
			if end < 0 {
				return nil, false
			}
			inner := field[i+1 : i+end]
			if n, err := strconv.Atoi(inner); err == nil {
				steps = append(steps, n)
			} else {
				steps = append(steps, nameStep(inner))
			}
			i += end
		default:
			cur.WriteByte(c)
		}
	}
	flush()
	return steps, true
}

// walkField follows steps from n as far as they lead and returns the deepest node reached (the
// key's node for a key): the field itself, or the place it would go when it is missing. Keys are
// tried as written and in lowerCamelCase (protojson reads both); a bracketed name selects the item
// of a sequence whose name is it, or the key of a mapping.
func walkField(n *yaml.Node, steps []any) *yaml.Node {
	at := resolve(n)
	for _, s := range steps {
		n = resolve(n)
		if n == nil {
			break
		}
		var next, key *yaml.Node
		switch k := s.(type) {
		case string:
			kv := mapKey(n, k)
			if kv == nil {
				kv = mapKey(n, lowerCamel(k))
			}
			if kv != nil {
				key, next = kv.key, kv.value
			}
		case int:
			if n.Kind == yaml.SequenceNode && k >= 0 && k < len(n.Content) {
				next = n.Content[k]
			}
		case nameStep:
			switch n.Kind {
			case yaml.SequenceNode:
				for _, item := range n.Content {
					if v := mapValue(resolve(item), "name"); v != nil && v.Value == string(k) {
						next = item
						break
					}
				}
			case yaml.MappingNode:
				if kv := mapKey(n, string(k)); kv != nil {
					key, next = kv.key, kv.value
				}
			}
		}
		if next == nil {
			break
		}
		n = next
		if key != nil {
			at = key
		} else {
			at = resolve(next)
		}
	}
	return at
}

func lowerCamel(s string) string {
	parts := strings.Split(s, "_")
	for i := 1; i < len(parts); i++ {
		if parts[i] != "" {
			parts[i] = strings.ToUpper(parts[i][:1]) + parts[i][1:]
		}
	}
	return strings.Join(parts, "")
}

// locator finds the line and column of findings' fields in the inputs they name.
type locator struct {
	docs map[string][]*yaml.Node // input name → its documents
	objs []*object
}

func newLocator(inputs []Input, objs []*object, maxBytes int64) *locator {
	l := &locator{docs: map[string][]*yaml.Node{}, objs: objs}
	for _, in := range inputs {
		if docs, err := yamlDocuments(in.Data, maxBytes); err == nil {
			l.docs[in.Name] = docs
		}
	}
	return l
}

// locate sets f's Line and Column, unless they are set or f names no place of an input.
func (l *locator) locate(f *Finding) {
	if f.Column > 0 {
		return
	}
	root, spec := l.root(f.File, f.Resource)
	if root == nil {
		return
	}
	at := root
	if steps, ok := fieldSteps(f.Field); ok {
		if spec && len(steps) > 0 && steps[0] == "spec" {
			steps = steps[1:]
		}
		at = walkField(root, steps)
	}
	if at != nil && at.Line > 0 {
		f.Line, f.Column = at.Line, at.Column
	}
}

// root is the node a finding's field starts from: the spec of a Kubernetes object, a listener
// or cluster of a bootstrap, the document of a policy file.
func (l *locator) root(file, resource string) (n *yaml.Node, spec bool) {
	for _, o := range l.objs {
		if o.File == file && o.ref() == resource {
			return o.Spec, true
		}
	}
	docs := l.docs[file]
	if len(docs) != 1 {
		return nil, false
	}
	doc := docRoot(docs[0])
	for _, kind := range []struct{ prefix, list string }{{"listener ", "listeners"}, {"cluster ", "clusters"}} {
		name, ok := strings.CutPrefix(resource, kind.prefix)
		if !ok {
			continue
		}
		if unq, err := strconv.Unquote(name); err == nil {
			name = unq
		}
		if item := findItem(doc, kind.list, name); item != nil {
			return resolve(item), false
		}
	}
	if rest, ok := strings.CutPrefix(resource, "static_resources.listeners["); ok {
		if i, err := strconv.Atoi(strings.TrimSuffix(rest, "]")); err == nil {
			if n := specPath(doc, "static_resources", "listeners", i); n != nil {
				return n, false
			}
		}
	}
	return doc, false
}

// findItem returns the item of static_resources.<list> named name, nil when there is none.
func findItem(doc *yaml.Node, list, name string) *yaml.Node {
	sr := mapValue(resolve(doc), "static_resources")
	if sr == nil {
		sr = mapValue(resolve(doc), "staticResources")
	}
	items := resolve(mapValue(resolve(sr), list))
	if items == nil || items.Kind != yaml.SequenceNode {
		return nil
	}
	for _, item := range items.Content {
		if v := mapValue(resolve(item), "name"); v != nil && v.Value == name {
			return item
		}
	}
	return nil
}

// pgvStep is one step of a protoc-gen-validate message: "invalid Message.Field[index]".
var pgvStep = regexp.MustCompile(`invalid [A-Za-z0-9_]+\.([A-Za-z0-9_]+)(\[[^\]]*\])?`)

// validationPath returns the field path (snake_case, as the YAML spells it) of the first error
// of Validate(m) where m's full name is root: the path Validate puts in front (typed_configs'
// types left out), then the fields protoc-gen-validate names, each "invalid Message.Field[i]".
// "" when err does not read so.
func validationPath(err error, root string) string {
	msg, _, _ := strings.Cut(err.Error(), "\n")
	where, rest, ok := strings.Cut(msg, ": ")
	if !ok {
		return ""
	}
	where, ok = strings.CutPrefix(where, root)
	if !ok {
		return ""
	}
	for {
		i := strings.IndexByte(where, '<')
		j := strings.IndexByte(where, '>')
		if i < 0 || j < i {
			break
		}
		where = where[:i] + where[j+1:]
	}
	path := strings.TrimPrefix(where, ".")
	for _, m := range pgvStep.FindAllStringSubmatch(rest, -1) {
		path = join(path, snake(m[1])) + m[2]
	}
	return path
}

// snake turns a Go field name (RouteConfig) into its proto name (route_config).
func snake(s string) string {
	var b strings.Builder
	for i, r := range s {
		if 'A' <= r && r <= 'Z' {
			if i > 0 {
				b.WriteByte('_')
			}
			r += 'a' - 'A'
		}
		b.WriteRune(r)
	}
	return b.String()
}
