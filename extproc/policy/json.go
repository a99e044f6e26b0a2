package policy

import (
	"encoding/json"

	"go.yaml.in/yaml/v3"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/jsonbody"
)

// JSONMatch is one member match.json asks for: the body's member at Pointer must be Value, a
// JSON text in its canonical form (as jsonbody.Values reads members).
type JSONMatch struct {
	Pointer jsonbody.Pointer
	Value   []byte
}

// MatchJSON returns the members the route's match.json asks for; nil when it has none.
func (r *Route) MatchJSON() []JSONMatch { return r.match.json }

// DecidedByBody reports whether the route's match reads the request body (match.json): a
// request that Select gives this route is decided when its body arrives, by SelectBy.
func (r *Route) DecidedByBody() bool { return len(r.match.json) > 0 }

// ReadsJSON reports whether the route reads members of the request body: match.json, key_json,
// a json scope entry, fingerprint_ignore_json or json_rpc. Its requests need their body.
func (r *Route) ReadsJSON() bool {
	return len(r.match.json) > 0 || len(r.KeyJSON) > 0 || len(r.ScopeJSON) > 0 ||
		len(r.FingerprintIgnoreJSON) > 0 || r.JSONRPC
}

// SelectBy returns the route for a request whose body decides it, as Select does, except that a
// route with match.json holds only when matches(r) reports that the body holds its members; a
// route named by Selector.Named is taken whatever its match.json says. matches is given r, a
// route whose other matcher holds; it is called in file order, and not again once it reports
// true.
func (p *Policy) SelectBy(s Selector, matches func(r *Route) bool) (*Route, []string, error) {
	if s.Named != "" {
		return p.Select(s)
	}
	for _, r := range p.Routes {
		m, ok := r.match.holds(s)
		if ok && (len(r.match.json) == 0 || matches(r)) {
			return r, r.params(m), nil
		}
	}
	return p.Default, nil, nil
}

// MaxRequestBytesBy returns the largest max_request_bytes of the routes SelectBy may choose for
// s, whatever the body: the body of a request whose route match.json decides is held up to it,
// and bounded by the chosen route's at its end.
func (p *Policy) MaxRequestBytesBy(s Selector) int {
	if s.Named != "" {
		r, _, err := p.Select(s)
		if err != nil {
			return p.Default.MaxRequestBytes
		}
		return r.MaxRequestBytes
	}
	n := 0
	for _, r := range p.Routes {
		if _, ok := r.match.holds(s); ok {
			n = max(n, r.MaxRequestBytes)
			if len(r.match.json) == 0 {
				return n
			}
		}
	}
	return max(n, p.Default.MaxRequestBytes)
}

// pointer reads an RFC 6901 JSON Pointer that names a member (not the whole body).
func (d *decoder) pointer(v *yaml.Node, path string) (jsonbody.Pointer, bool) {
	s, ok := d.str(v, path)
	if !ok {
		return jsonbody.Pointer{}, false
	}
	if s == "" {
		d.fail(v, path, "must name a member of the body, such as /params/name (\"\" is the whole body)")
		return jsonbody.Pointer{}, false
	}
	ptr, err := jsonbody.ParsePointer(s)
	if err != nil {
		d.fail(v, path, "%q is not a JSON pointer: %v", s, err)
		return jsonbody.Pointer{}, false
	}
	return ptr, true
}

// pointers reads a list of JSON Pointers.
func (d *decoder) pointers(v *yaml.Node, path string) ([]jsonbody.Pointer, bool) {
	out := []jsonbody.Pointer{}
	ok := d.list(v, path, func(item *yaml.Node, at string) {
		if ptr, ok := d.pointer(item, at); ok {
			out = append(out, ptr)
		}
	})
	return out, ok
}

// setPointers is for key_json and fingerprint_ignore_json.
func setPointers(assign func(*Route, []jsonbody.Pointer)) func(*decoder, *draft, *yaml.Node, string) {
	return func(d *decoder, x *draft, v *yaml.Node, path string) {
		if ptrs, ok := d.pointers(v, path); ok {
			assign(x.r, ptrs)
		}
	}
}

// matchJSON reads match.json: a mapping of JSON Pointers to the scalar values the members must
// equal.
func (d *decoder) matchJSON(v *yaml.Node, path string) []JSONMatch {
	var out []JSONMatch
	d.fields(v, path, func(key string, k, mv *yaml.Node, at string) {
		ptr, ok := d.pointer(k, at)
		if !ok {
			return
		}
		value, ok := d.jsonScalar(mv, at)
		if ok {
			out = append(out, JSONMatch{Pointer: ptr, Value: value})
		}
	})
	if v.Kind == yaml.MappingNode && len(v.Content) == 0 {
		d.fail(v, path, "must name at least one member, such as {/method: tools/call}")
	}
	return out
}

// jsonScalar reads a YAML scalar as the canonical JSON text of a string, number, bool or null.
func (d *decoder) jsonScalar(v *yaml.Node, path string) ([]byte, bool) {
	if v = d.value(v); v.Kind != yaml.ScalarNode {
		d.fail(v, path, "must be a string, number, bool or null, got %s", describe(v))
		return nil, false
	}
	var text []byte
	switch v.ShortTag() {
	case "!!null":
		text = []byte("null")
	case "!!bool":
		var b bool
		if v.Decode(&b) != nil {
			d.fail(v, path, "%q is not a bool", v.Value)
			return nil, false
		}
		text = []byte("false")
		if b {
			text = []byte("true")
		}
	case "!!int", "!!float":
		text = []byte(v.Value)
	default:
		text, _ = json.Marshal(v.Value)
	}
	canonical, err := jsonbody.Canonical(nil, text, nil)
	if err != nil {
		d.fail(v, path, "%q is not a JSON number; quote it to match a string", v.Value)
		return nil, false
	}
	return canonical, true
}
