package check

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/idempotency-extproc/idempotency-extproc/internal/yamllimit"
)

// fileError is an input that cannot be read or parsed: the policy file or a FILE.
type fileError struct {
	// File is the input as the user named it; "-" is standard input.
	File string
	// Line and Column are where the bad field is, 0 when unknown.
	Line, Column int
	// Where names the document or the resource of the bad field, "" when the file has one.
	Where string
	// Field is the bad field's path in the document or resource, "" when unknown.
	Field string
	Err   error
}

func (e *fileError) Error() string {
	var b strings.Builder
	switch {
	case e.File != "" && e.Line > 0 && e.Column > 0:
		fmt.Fprintf(&b, "%s:%d:%d: ", e.File, e.Line, e.Column)
	case e.File != "" && e.Line > 0:
		fmt.Fprintf(&b, "%s:%d: ", e.File, e.Line)
	case e.File != "":
		b.WriteString(e.File + ": ")
	case e.Line > 0:
		fmt.Fprintf(&b, "line %d: ", e.Line)
	}
	if e.Where != "" {
		b.WriteString(e.Where + ": ")
	}
	if e.Field != "" {
		b.WriteString(e.Field + ": ")
	}
	b.WriteString(e.Err.Error())
	return b.String()
}

func (e *fileError) Unwrap() error { return e.Err }

// inputError makes an *InputError of err for file, taking the line and field of the first
// *located in err's chain.
func inputError(file string, err error) *fileError {
	var ie *fileError
	if errors.As(err, &ie) {
		return ie
	}
	var l *located
	if errors.As(err, &l) {
		// What wraps the located error names the document or the resource.
		outer := strings.TrimSuffix(strings.TrimSuffix(err.Error(), l.Error()), ": ")
		return &fileError{File: file, Line: l.Line, Column: l.Column, Where: outer, Field: l.Field, Err: l.Err}
	}
	return &fileError{File: file, Err: err}
}

// inFile is an error about an object read from file; its message is err's. Code that reads the
// objects of several files together says with it which file an error belongs to.
type inFile struct {
	file string
	err  error
}

func (e *inFile) Error() string { return e.err.Error() }
func (e *inFile) Unwrap() error { return e.err }

// located is an error at a known place of a document.
type located struct {
	Line   int    // 0 when unknown
	Column int    // 0 when unknown
	Field  string // "" when unknown
	Err    error
}

func (e *located) Error() string {
	var b strings.Builder
	if e.Line > 0 {
		fmt.Fprintf(&b, "line %d: ", e.Line)
	}
	if e.Field != "" {
		b.WriteString(e.Field + ": ")
	}
	b.WriteString(e.Err.Error())
	return b.String()
}

func (e *located) Unwrap() error { return e.Err }

// within puts the path of the node an error's field lies in before the field; an error without a
// field gets the path in front.
func within(path string, err error) error {
	if l, ok := err.(*located); ok {
		field := path
		switch {
		case l.Field == "":
		case strings.HasPrefix(l.Field, "["):
			field += l.Field
		default:
			field = join(path, l.Field)
		}
		return &located{Line: l.Line, Column: l.Column, Field: field, Err: l.Err}
	}
	return fmt.Errorf("%s: %w", path, err)
}

// prefixed puts where (a document, a resource) in front of err.
func prefixed(where string, err error) error {
	if where == "" {
		return err
	}
	return fmt.Errorf("%s: %w", where, err)
}

// boundError turns an error of yamllimit into a *located carrying its line.
func boundError(err error) error {
	var le *yamllimit.Error
	if errors.As(err, &le) {
		return &located{Line: le.Line, Err: errors.New(le.Problem)}
	}
	return err
}

// byteSize writes a bound in KiB or MiB.
func byteSize(n int64) string {
	if n >= 1<<20 && n%(1<<20) == 0 {
		return fmt.Sprintf("%d MiB", n>>20)
	}
	if n >= 1<<10 && n%(1<<10) == 0 {
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d bytes", n)
}

var yamlLine = regexp.MustCompile(`^(?:yaml: )?line (\d+): `)

// yamlError turns an error of the YAML decoder into a *located carrying its line, its messages
// in words of the file (typeMessage).
func yamlError(err error) error {
	var te *yaml.TypeError
	if errors.As(err, &te) {
		if len(te.Errors) == 1 {
			if m := yamlLine.FindStringSubmatch(te.Errors[0]); m != nil {
				line, _ := strconv.Atoi(m[1])
				return &located{Line: line, Err: errors.New(typeMessage(te.Errors[0][len(m[0]):]))}
			}
		}
		msgs := make([]string, len(te.Errors))
		for i, e := range te.Errors {
			msgs[i] = typeMessage(e)
		}
		return errors.New(strings.Join(msgs, "; "))
	}
	if m := yamlLine.FindStringSubmatch(err.Error()); m != nil {
		line, _ := strconv.Atoi(m[1])
		return &located{Line: line, Err: errors.New("YAML: " + err.Error()[len(m[0]):])}
	}
	return err
}

var (
	yamlCannotUnmarshal = regexp.MustCompile("cannot unmarshal (!!\\w+)(?: `[^`]*`)? into (\\S+)")
	yamlFieldNotFound   = regexp.MustCompile(`field (\S+) not found in type \S+`)
	yamlFieldSet        = regexp.MustCompile(`field (\S+) already set in type \S+`)
)

// typeMessage rewrites a message of the YAML decoder that names YAML tags and Go types
// ("cannot unmarshal !!map into []check.istioPatch") into words: "a mapping where a sequence
// is wanted".
func typeMessage(msg string) string {
	msg = yamlCannotUnmarshal.ReplaceAllStringFunc(msg, func(s string) string {
		m := yamlCannotUnmarshal.FindStringSubmatch(s)
		return tagWords(m[1]) + " where " + goTypeWords(m[2]) + " is wanted"
	})
	msg = yamlFieldNotFound.ReplaceAllString(msg, `unknown field "$1"`)
	return yamlFieldSet.ReplaceAllString(msg, `field "$1" given twice`)
}

// tagWords names a YAML tag's kind of value.
func tagWords(tag string) string {
	switch tag {
	case "!!map":
		return "a mapping"
	case "!!seq":
		return "a sequence"
	case "!!int", "!!float":
		return "a number"
	case "!!bool":
		return "true or false"
	case "!!null":
		return "an empty value"
	case "!!timestamp":
		return "a timestamp"
	}
	return "a string"
}

// goTypeWords names the kind of YAML value a Go type is decoded from.
func goTypeWords(t string) string {
	t = strings.TrimLeft(t, "*")
	switch {
	case strings.HasPrefix(t, "[]"):
		return "a sequence"
	case strings.HasPrefix(t, "map["):
		return "a mapping"
	case t == "string":
		return "a string"
	case t == "bool":
		return "true or false"
	case t == "time.Duration":
		return "a duration"
	case strings.HasPrefix(t, "int") || strings.HasPrefix(t, "uint"):
		return "a whole number"
	case strings.HasPrefix(t, "float"):
		return "a number"
	}
	return "a mapping"
}

// protoJSONPosition is the position protojson puts in its errors: a place in the JSON made from
// the YAML, which the user never sees. The protobuf module writes a space or, at random, a
// no-break space after "proto:", so that nobody relies on its messages' exact text.
var protoJSONPosition = regexp.MustCompile(`^proto:[ \x{00a0}](?:syntax error[ \x{00a0}])?\(line (\d+):(\d+)\):[ \x{00a0}]`)

// protoError turns an error of protojson.Unmarshal of the JSON made from doc (nodeToJSON) into a
// *located naming the YAML field and its line, when the JSON position maps back to doc.
func protoError(what string, doc *yaml.Node, err error) error {
	msg := err.Error()
	m := protoJSONPosition.FindStringSubmatch(msg)
	if m == nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	msg = msg[len(m[0]):]
	col, _ := strconv.Atoi(m[2])
	js, jerr := nodeToJSON(doc)
	if m[1] != "1" || jerr != nil {
		return fmt.Errorf("%s: %s", what, msg)
	}
	// protojson counts columns in runes.
	off := len(js)
	for i := range string(js) {
		if col--; col == 0 {
			off = i
			break
		}
	}
	path := jsonPathAt(js, off)
	n, value, field := yamlAt(doc, path)
	if n == nil {
		return fmt.Errorf("%s: %s", what, msg)
	}
	return &located{Line: n.Line, Column: n.Column, Field: field, Err: errors.New(protoMessage(msg, value, len(path) == 0))}
}

var protoInvalidValue = regexp.MustCompile(`^invalid value for (\w+) (?:field|type)\b`)

// protoMessage rewrites protojson's message about the value v, which quotes the JSON made from
// the YAML ("unexpected token [" for a block sequence), into one that names what the file holds.
func protoMessage(msg string, v *yaml.Node, root bool) string {
	if v == nil {
		return msg
	}
	switch {
	case root && strings.HasPrefix(msg, "unexpected token "):
		return "the document is " + describe(v) + ", not an Envoy bootstrap (a mapping) nor Kubernetes objects (mappings with apiVersion and kind)"
	case strings.HasPrefix(msg, "unexpected token "):
		return describe(v) + " is not a value this field takes"
	}
	if m := protoInvalidValue.FindStringSubmatch(msg); m != nil {
		return describe(v) + " is not a valid " + m[1]
	}
	return msg
}

// describe names what a YAML node holds in words that quote only the file: a scalar by its text,
// a collection by its kind.
func describe(n *yaml.Node) string {
	n = resolve(n)
	switch {
	case n == nil:
		return "an empty value"
	case n.Kind == yaml.SequenceNode:
		return "a sequence"
	case n.Kind == yaml.MappingNode:
		return "a mapping"
	case n.Kind == yaml.ScalarNode && n.Style&(yaml.LiteralStyle|yaml.FoldedStyle) != 0:
		return "a block of text"
	case n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null":
		return "an empty value"
	case n.Kind == yaml.ScalarNode && !strings.ContainsAny(n.Value, "\n`") && len(n.Value) <= 40:
		return "`" + n.Value + "`"
	case n.Kind == yaml.ScalarNode:
		return "a string"
	}
	return "a value"
}

// jsonPathAt returns the path (object keys as strings, array indexes as ints) of the key or value
// that starts at byte offset off of the JSON document js; nil when none does.
func jsonPathAt(js []byte, off int) []any {
	dec := json.NewDecoder(bytes.NewReader(js))
	var st jsonPathStack
	for {
		before := int(dec.InputOffset())
		tok, err := dec.Token()
		if err != nil {
			return nil
		}
		after := int(dec.InputOffset())
		hit := off >= before && off < after
		if top := st.top(); top != nil && top.object && top.expectKey {
			if key, ok := tok.(string); ok {
				top.key, top.expectKey = key, false
				if hit {
					return st.path()
				}
				continue
			}
		}
		switch tok {
		case json.Delim('}'), json.Delim(']'):
			if hit { // an error about the object or array as a whole: it is missing something
				return st[:len(st)-1].path()
			}
			st = st[:len(st)-1]
			st.advance()
			continue
		}
		if hit {
			return st.path()
		}
		switch tok {
		case json.Delim('{'):
			st = append(st, &jsonFrame{object: true, expectKey: true})
		case json.Delim('['):
			st = append(st, &jsonFrame{})
		default:
			st.advance()
		}
	}
}

// jsonFrame is an object or array jsonPathAt is in: the key it is at (expectKey while the next
// token is a key) or the index.
type jsonFrame struct {
	object    bool
	key       string
	index     int
	expectKey bool
}

// jsonPathStack are the frames jsonPathAt is in, outermost first.
type jsonPathStack []*jsonFrame

// top is the innermost frame, nil at the top level.
func (st jsonPathStack) top() *jsonFrame {
	if len(st) == 0 {
		return nil
	}
	return st[len(st)-1]
}

// path is the path of the frames: keys and indexes.
func (st jsonPathStack) path() []any {
	var p []any
	for _, f := range st {
		if f.object {
			p = append(p, f.key)
		} else {
			p = append(p, f.index)
		}
	}
	return p
}

// advance moves the innermost frame past a value: to its next key or index.
func (st jsonPathStack) advance() {
	if top := st.top(); top != nil {
		if top.object {
			top.expectKey = true
		} else {
			top.index++
		}
	}
}

// yamlAt follows a JSON path (jsonPathAt) in doc: the node there (the key's node for a key), the
// value there, and the path written as a field path. Nil when the path does not lead through
// doc: through the value of a type kept opaque, say.
func yamlAt(doc *yaml.Node, path []any) (*yaml.Node, *yaml.Node, string) {
	n := resolve(docRoot(doc))
	at := n
	field := ""
	for _, p := range path {
		switch k := p.(type) {
		case string:
			kv := mapKey(n, k)
			if kv == nil {
				return nil, nil, ""
			}
			at, n = kv.key, resolve(kv.value)
			if strings.ContainsAny(k, "./") {
				field += "[" + k + "]" // a map key, such as a typed_per_filter_config filter name
			} else {
				field = join(field, k)
			}
		case int:
			if n == nil || n.Kind != yaml.SequenceNode || k >= len(n.Content) {
				return nil, nil, ""
			}
			n = resolve(n.Content[k])
			at = n
			field += "[" + strconv.Itoa(k) + "]"
		}
	}
	if at == nil || at.Line == 0 {
		return nil, nil, ""
	}
	return at, n, field
}
