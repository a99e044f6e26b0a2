package check

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"reflect"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/idempotency-extproc/idempotency-extproc/internal/yamllimit"
)

// object is one Kubernetes object of an input: a document of its own, or an item of a List.
type object struct {
	APIVersion string
	Kind       string
	Name       string
	Namespace  string
	// File is the input the object came from.
	File string
	// Line is the line of the object's first key in File.
	Line int
	// Spec is the object's spec, nil when it has none. Its nodes keep File's line numbers.
	Spec *yaml.Node
}

// group returns the object's API group, "" for the core group.
func (o *object) group() string {
	group, _, ok := strings.Cut(o.APIVersion, "/")
	if !ok {
		return ""
	}
	return group
}

// ref names the object as findings and errors do: Kind namespace/name.
func (o *object) ref() string {
	if o.Namespace == "" {
		return o.Kind + " " + o.Name
	}
	return o.Kind + " " + o.Namespace + "/" + o.Name
}

// is reports whether the object is of kind in an API group starting with group.
func (o *object) is(group, kind string) bool {
	return o.Kind == kind && o.group() == group
}

// envelope is what every object carries besides its spec. Decoded strictly (readDocs), it
// refuses status and the fields an API server adds: the shipped files hold none.
type envelope struct {
	APIVersion string `yaml:"apiVersion"`
	Kind       string `yaml:"kind"`
	Metadata   struct {
		Name        string            `yaml:"name"`
		Namespace   string            `yaml:"namespace"`
		Labels      map[string]string `yaml:"labels"`
		Annotations map[string]string `yaml:"annotations"`
	} `yaml:"metadata"`
	Spec yaml.Node `yaml:"spec"`
}

// looseEnvelope reads what kubectl and helm print: any metadata, status, data, items.
type looseEnvelope struct {
	APIVersion string `yaml:"apiVersion"`
	Kind       string `yaml:"kind"`
	Metadata   struct {
		Name      string `yaml:"name"`
		Namespace string `yaml:"namespace"`
	} `yaml:"metadata"`
	Spec  yaml.Node   `yaml:"spec"`
	Items []yaml.Node `yaml:"items"`
}

// yamlDocuments returns the documents of data in order, empty ones left out. A YAML syntax error
// is a *located naming its line. Data is held to the bounds of an input of maxBytes
// (yamllimit): its values, counted before it is decoded and again with its aliases expanded, and
// its nesting, so that nothing after costs more than the bound allows.
func yamlDocuments(data []byte, maxBytes int64) ([]*yaml.Node, error) {
	if err := yamllimit.Screen(data, maxBytes); err != nil {
		return nil, boundError(err)
	}
	budget := yamllimit.MaxValues(maxBytes)
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var docs []*yaml.Node
	for {
		doc := &yaml.Node{}
		err := dec.Decode(doc)
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, tabAt(data, yamlError(err))
		}
		n, err := yamllimit.Check(doc, budget)
		if err != nil {
			return nil, boundError(err)
		}
		budget -= n
		if root := docRoot(doc); root != nil && !isNullNode(root) {
			docs = append(docs, doc)
		}
	}
}

// docRoot returns the content of a document node, nil when it has none.
func docRoot(doc *yaml.Node) *yaml.Node {
	if doc.Kind == yaml.DocumentNode {
		if len(doc.Content) != 1 {
			return nil
		}
		return doc.Content[0]
	}
	return doc
}

func isNullNode(n *yaml.Node) bool {
	return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null"
}

// isKubernetes reports whether a document is a Kubernetes object: a mapping with a kind.
func isKubernetes(doc *yaml.Node) bool {
	root := resolve(docRoot(doc))
	return root != nil && root.Kind == yaml.MappingNode && mapValue(root, "kind") != nil
}

// readObjects reads the Kubernetes objects of documents docs of file, the items of List kinds
// flattened. Strict refuses envelope fields other than apiVersion, kind, metadata (name,
// namespace, labels, annotations) and spec.
func readObjects(file string, docs []*yaml.Node, strict bool) ([]*object, error) {
	var out []*object
	var read func(n *yaml.Node, where string) error
	read = func(n *yaml.Node, where string) error {
		n = resolve(n)
		if n.Kind != yaml.MappingNode {
			return &located{Line: n.Line, Column: n.Column, Field: where, Err: errors.New("not a Kubernetes object (a mapping with apiVersion and kind)")}
		}
		if strict {
			var e envelope
			if err := decodeStrict(n, &e); err != nil {
				return prefixed(where, err)
			}
			if e.Kind == "" {
				return nil // an empty document
			}
			out = append(out, &object{APIVersion: e.APIVersion, Kind: e.Kind, Name: e.Metadata.Name, Namespace: e.Metadata.Namespace,
				File: file, Line: n.Line, Spec: specNode(&e.Spec)})
			return nil
		}
		var e looseEnvelope
		if err := n.Decode(&e); err != nil {
			return prefixed(where, yamlError(err))
		}
		if e.Kind == "" || e.APIVersion == "" {
			return &located{Line: n.Line, Column: n.Column, Field: where, Err: errors.New("a Kubernetes object needs apiVersion and kind")}
		}
		if strings.HasSuffix(e.Kind, "List") && e.Spec.Kind == 0 {
			for i := range e.Items {
				if err := read(&e.Items[i], join(where, "items["+strconv.Itoa(i)+"]")); err != nil {
					return err
				}
			}
			return nil
		}
		out = append(out, &object{APIVersion: e.APIVersion, Kind: e.Kind, Name: e.Metadata.Name, Namespace: e.Metadata.Namespace,
			File: file, Line: n.Line, Spec: specNode(&e.Spec)})
		return nil
	}
	for i, doc := range docs {
		where := ""
		if len(docs) > 1 {
			where = "document " + strconv.Itoa(i+1)
		}
		if err := read(docRoot(doc), where); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func specNode(n *yaml.Node) *yaml.Node {
	if n.Kind == 0 || isNullNode(n) {
		return nil
	}
	return n
}

// readDocs reads every object of the Kubernetes YAML file at path, strictly (readObjects).
func readDocs(path string) ([]*object, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	docs, err := yamlDocuments(data, DefaultMaxInputBytes)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	objs, err := readObjects(path, docs, true)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return objs, nil
}

// decodeSpec decodes the spec of o into a T, refusing fields T does not declare (decodeStrict).
// Its errors name lines of o's file.
func decodeSpec[T any](o *object) (T, error) {
	var spec T
	if o.Spec == nil {
		return spec, nil
	}
	if err := unknownKeys(o.Spec, reflect.TypeFor[T](), "spec"); err != nil {
		return spec, err
	}
	if err := o.Spec.Decode(&spec); err != nil {
		return spec, yamlError(err)
	}
	return spec, nil
}

// decodeLoose decodes the spec of o into a T, ignoring fields T does not declare.
func decodeLoose[T any](o *object) (T, error) {
	var spec T
	if o.Spec == nil {
		return spec, nil
	}
	if err := o.Spec.Decode(&spec); err != nil {
		return spec, yamlError(err)
	}
	return spec, nil
}

// only returns the single object of the given API group ("" for the core group) and kind, nil
// when there is none, and an error when there are several.
func only(objs []*object, apiGroup, kind string) (*object, error) {
	var found *object
	for _, o := range objs {
		if !o.is(apiGroup, kind) {
			continue
		}
		if found != nil {
			return nil, fmt.Errorf("more than one %s", kind)
		}
		found = o
	}
	return found, nil
}

// theDoc returns the one object of group and kind in the file at path, and an error when the
// file has none or several.
func theDoc(path, group, kind string) (*object, error) {
	objs, err := readDocs(path)
	if err != nil {
		return nil, err
	}
	o, err := only(objs, group, kind)
	switch {
	case err != nil:
		return nil, fmt.Errorf("%s: %w", path, err)
	case o == nil:
		return nil, fmt.Errorf("%s: no %s", path, kind)
	}
	return o, nil
}

// decodeStrict decodes n into v, a pointer, after refusing every mapping key, at any depth, that
// v's type does not declare: yaml.v3 checks known fields only in a Decoder over a whole stream,
// and an object's spec may be an item of a List. A field of type any or yaml.Node takes
// anything. The error names the key's line.
func decodeStrict(n *yaml.Node, v any) error {
	if err := unknownKeys(n, reflect.TypeOf(v).Elem(), ""); err != nil {
		return err
	}
	if err := n.Decode(v); err != nil {
		return yamlError(err)
	}
	return nil
}

// maxDepth bounds the aliases resolve follows and the nesting unknownKeys walks.
const maxDepth = 64

// unknownKeys refuses the keys of n that t does not declare. Each node is checked against a type
// once: aliases and merge keys that name a node many times (a billion laughs) cost no more.
func unknownKeys(n *yaml.Node, t reflect.Type, path string) error {
	type visit struct {
		n *yaml.Node
		t reflect.Type
	}
	seen := map[visit]bool{}
	var walk func(n *yaml.Node, t reflect.Type, path string, depth int) error
	walk = func(n *yaml.Node, t reflect.Type, path string, depth int) error {
		n = resolve(n)
		if n == nil || seen[visit{n, t}] {
			return nil
		}
		seen[visit{n, t}] = true
		if depth > maxDepth {
			return &located{Line: n.Line, Column: n.Column, Field: path, Err: errors.New("nested too deep")}
		}
		return unknownKeysOf(n, t, path, func(n *yaml.Node, t reflect.Type, path string) error {
			return walk(n, t, path, depth+1)
		})
	}
	return walk(n, t, path, 0)
}

// unknownKeysOf checks the keys of n itself against t, and calls walk on each value.
func unknownKeysOf(n *yaml.Node, t reflect.Type, path string, walk func(*yaml.Node, reflect.Type, string) error) error {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == reflect.TypeFor[yaml.Node]() {
		return nil
	}
	switch t.Kind() {
	case reflect.Struct:
		if n.Kind != yaml.MappingNode {
			return nil // Decode names the mismatch
		}
		fields := yamlFields(t)
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, val := n.Content[i], n.Content[i+1]
			if k.Value == "<<" && k.Tag == "!!merge" {
				for _, m := range mergeSources(val) {
					if err := walk(m, t, path); err != nil {
						return err
					}
				}
				continue
			}
			ft, ok := fields[k.Value]
			if !ok {
				return &located{Line: k.Line, Column: k.Column, Field: join(path, k.Value), Err: fmt.Errorf("field %s not found", k.Value)}
			}
			if err := walk(val, ft, join(path, k.Value)); err != nil {
				return err
			}
		}
	case reflect.Slice, reflect.Array:
		if n.Kind != yaml.SequenceNode {
			return nil
		}
		for i, item := range n.Content {
			if err := walk(item, t.Elem(), path+"["+strconv.Itoa(i)+"]"); err != nil {
				return err
			}
		}
	case reflect.Map:
		if n.Kind != yaml.MappingNode {
			return nil
		}
		for i := 0; i+1 < len(n.Content); i += 2 {
			if err := walk(n.Content[i+1], t.Elem(), join(path, n.Content[i].Value)); err != nil {
				return err
			}
		}
	}
	return nil
}

// yamlFields maps the YAML names of t's fields to their types, inline fields flattened.
func yamlFields(t reflect.Type) map[string]reflect.Type {
	out := map[string]reflect.Type{}
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		tag := f.Tag.Get("yaml")
		name, opts, _ := strings.Cut(tag, ",")
		if name == "-" {
			continue
		}
		if strings.Contains(opts, "inline") {
			ft := f.Type
			for ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if ft.Kind() == reflect.Struct {
				for k, v := range yamlFields(ft) {
					out[k] = v
				}
			}
			continue
		}
		if name == "" {
			name = strings.ToLower(f.Name)
		}
		out[name] = f.Type
	}
	return out
}

// mergeSources returns the mappings a merge key (<<) takes: one mapping or a sequence of them.
func mergeSources(v *yaml.Node) []*yaml.Node {
	v = resolve(v)
	if v.Kind == yaml.SequenceNode {
		var out []*yaml.Node
		for _, m := range v.Content {
			out = append(out, resolve(m))
		}
		return out
	}
	return []*yaml.Node{v}
}

// resolve follows aliases.
func resolve(n *yaml.Node) *yaml.Node {
	for i := 0; n != nil && n.Kind == yaml.AliasNode && i < maxDepth; i++ {
		n = n.Alias
	}
	return n
}

// mapValue returns the value of key in mapping node m, merge keys followed, nil when absent.
func mapValue(m *yaml.Node, key string) *yaml.Node {
	k := mapKey(m, key)
	if k == nil {
		return nil
	}
	return k.value
}

type keyValue struct{ key, value *yaml.Node }

// mapKey returns the key node and the value of key in mapping node m: its own key, else the
// first merged mapping's (depth first, as YAML's merge keys give precedence), each mapping
// looked at once.
func mapKey(m *yaml.Node, key string) *keyValue {
	seen := map[*yaml.Node]bool{}
	var find func(m *yaml.Node, depth int) *keyValue
	find = func(m *yaml.Node, depth int) *keyValue {
		m = resolve(m)
		if m == nil || m.Kind != yaml.MappingNode || seen[m] || depth > maxDepth {
			return nil
		}
		seen[m] = true
		var merged []*yaml.Node
		for i := 0; i+1 < len(m.Content); i += 2 {
			k := m.Content[i]
			if k.Value == "<<" && k.Tag == "!!merge" {
				merged = append(merged, mergeSources(m.Content[i+1])...)
				continue
			}
			if k.Value == key {
				return &keyValue{k, m.Content[i+1]}
			}
		}
		for _, src := range merged {
			if kv := find(src, depth+1); kv != nil {
				return kv
			}
		}
		return nil
	}
	return find(m, 0)
}

// join appends key to a field path.
func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// tabAt moves an error about a tab in the indentation to the tab: the YAML decoder names the line
// before it (the context of the mapping the tab breaks).
func tabAt(data []byte, err error) error {
	l, ok := err.(*located)
	if !ok || l.Line == 0 || !strings.Contains(l.Err.Error(), "tab character") {
		return err
	}
	lines := strings.Split(string(data), "\n")
	for i := l.Line - 1; i >= 0 && i < len(lines); i++ {
		indent := lines[i][:len(lines[i])-len(strings.TrimLeft(lines[i], " \t"))]
		if c := strings.IndexByte(indent, '\t'); c >= 0 {
			return &located{Line: i + 1, Column: c + 1, Field: l.Field, Err: l.Err}
		}
	}
	return err
}
