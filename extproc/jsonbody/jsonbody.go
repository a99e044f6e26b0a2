// Package jsonbody reads what a policy route needs from a JSON request body, and rewrites the
// JSON-RPC id of a replayed response: the values at RFC 6901 JSON Pointers (a key, a scope
// value, a match), the body's RFC 8785 canonical form without some members (a fingerprint), and
// a response's top-level "id" replaced by the current request's.
//
// Values stay exact: a number keeps its written digits where RFC 8785's double form would change
// its value (an integer beyond 2^53, more digits than a double holds), so two bodies that differ
// only there never read as the same. Every read is bounded by [MaxDepth]; a body deeper than that,
// or not JSON, is an error, never a panic.
//
// The tokens come from github.com/go-json-experiment/json/jsontext, whose decoder reads a body
// without building a tree and whose Value.Canonicalize orders members and writes strings as
// RFC 8785 asks. The functions are safe for concurrent use.
package jsonbody

import (
	"bytes"
	"errors"
	"io"
	"strconv"
	"strings"
	"sync"

	"github.com/go-json-experiment/json/jsontext"
)

// MaxDepth is the deepest nesting of objects and arrays a body may have.
const MaxDepth = 64

// Errors of the readers. Both mean the route cannot read the body's members.
var (
	// ErrNotJSON means the body is not one valid JSON value (RFC 8259, with duplicate member
	// names refused as RFC 8785 asks).
	ErrNotJSON = errors.New("jsonbody: the body is not valid JSON")
	// ErrTooDeep means the body nests objects and arrays deeper than MaxDepth.
	ErrTooDeep = errors.New("jsonbody: the body nests deeper than 64 levels")
)

// Pointer is a parsed RFC 6901 JSON Pointer. The zero Pointer is the whole document.
type Pointer struct {
	text   string
	tokens []string
}

// ParsePointer parses s: "" (the whole document) or "/" followed by reference tokens separated
// by "/", in which "~1" stands for "/" and "~0" for "~" and no other "~" may appear.
func ParsePointer(s string) (Pointer, error) {
	if s == "" {
		return Pointer{}, nil
	}
	if s[0] != '/' {
		return Pointer{}, errors.New("a JSON pointer starts with /")
	}
	p := Pointer{text: s}
	for _, tok := range strings.Split(s[1:], "/") {
		for i := 0; i < len(tok); i++ {
			if tok[i] == '~' && (i+1 == len(tok) || (tok[i+1] != '0' && tok[i+1] != '1')) {
				return Pointer{}, errors.New("in a JSON pointer ~ is followed by 0 or 1 (~0 for ~, ~1 for /)")
			}
		}
		if strings.Contains(tok, "~") {
			tok = strings.ReplaceAll(strings.ReplaceAll(tok, "~1", "/"), "~0", "~")
		}
		p.tokens = append(p.tokens, tok)
	}
	return p, nil
}

// String returns the pointer as it was written.
func (p Pointer) String() string { return p.text }

// decoders keeps decoders and their readers between calls: a decoder's buffers are the most
// of what a read allocates.
var decoders = sync.Pool{New: func() any { return &decoder{r: bytes.NewReader(nil)} }}

type decoder struct {
	r *bytes.Reader
	d *jsontext.Decoder
}

func getDecoder(body []byte) *decoder {
	d := decoders.Get().(*decoder)
	d.r.Reset(body)
	if d.d == nil {
		d.d = jsontext.NewDecoder(d.r)
	} else {
		d.d.Reset(d.r)
	}
	return d
}

func putDecoder(d *decoder) {
	d.r.Reset(nil)
	d.d.Reset(d.r)
	decoders.Put(d)
}

// readErr names what went wrong with a body.
func readErr(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, ErrTooDeep) {
		return ErrTooDeep
	}
	return ErrNotJSON
}

// Values returns the JSON text of the value at each of ptrs in body, in its canonical form (as
// Canonical writes it, so that equal values read alike however they were written), or nil where
// body has no such member. It reads body once,
// whole, so that a body that is not JSON or nests too deep is refused whatever the pointers.
func Values(body []byte, ptrs []Pointer) ([][]byte, error) {
	return values(body, ptrs, false)
}

// Lookup is Values without MaxDepth for the members that lead to no pointer: it skips them with
// the decoder's own bounded skipping, so that a body nesting deeper than MaxDepth elsewhere still
// tells what its pointers hold (which route it takes), though Values refuses it.
func Lookup(body []byte, ptrs []Pointer) ([][]byte, error) {
	return values(body, ptrs, true)
}

func values(body []byte, ptrs []Pointer, skip bool) ([][]byte, error) {
	out := make([][]byte, len(ptrs))
	d := getDecoder(body)
	defer putDecoder(d)
	w := walker{d: d.d, body: body, ptrs: ptrs, out: out, skip: skip}
	if err := w.value(0, len(ptrs) > 0); err != nil {
		return nil, readErr(err)
	}
	if _, err := d.d.ReadToken(); err != io.EOF {
		return nil, ErrNotJSON
	}
	return out, nil
}

// walker reads one value after another, keeping the path to the current one.
type walker struct {
	d    *jsontext.Decoder
	body []byte
	ptrs []Pointer
	out  [][]byte
	path []string
	// skip: an object or array that leads to no pointer is skipped whole, its depth unchecked.
	skip bool
}

// wanted tells whether the current path is one of the pointers (and which), or a prefix of one.
func (w *walker) wanted() (at int, prefix bool) {
	at = -1
	for i, p := range w.ptrs {
		if len(p.tokens) < len(w.path) {
			continue
		}
		same := true
		for j, tok := range w.path {
			if p.tokens[j] != tok {
				same = false
				break
			}
		}
		if !same {
			continue
		}
		if len(p.tokens) == len(w.path) {
			at = i
		} else {
			prefix = true
		}
	}
	return at, prefix
}

// value reads the value at the current path, token by token so that its depth is counted;
// track says whether the path can still lead to a pointer (otherwise names are not kept).
func (w *walker) value(depth int, track bool) error {
	at, prefix := -1, false
	if track {
		at, prefix = w.wanted()
		track = prefix
	}
	start := w.d.InputOffset()
	if k := w.d.PeekKind(); k == '{' || k == '[' {
		if w.skip && at < 0 && !track {
			return w.d.SkipValue()
		}
		if err := w.members(depth, track, k == '{'); err != nil {
			return err
		}
	}
	// The scalar, or the end of the object or array.
	if _, err := w.d.ReadToken(); err != nil {
		return err
	}
	if at >= 0 {
		// Equal values read alike however they were written ("\u0061" and "a", 1.0 and 1).
		v, err := Canonical(nil, bytes.TrimLeft(w.body[start:w.d.InputOffset()], " \t\r\n:,"), nil)
		if err != nil {
			return err
		}
		for i, p := range w.ptrs {
			if equalTokens(p.tokens, w.path) {
				w.out[i] = v
			}
		}
	}
	return nil
}

// members reads an object's or an array's opening and members, up to its end.
func (w *walker) members(depth int, track, object bool) error {
	if depth == MaxDepth {
		return ErrTooDeep
	}
	if _, err := w.d.ReadToken(); err != nil {
		return err
	}
	end := jsontext.Kind(']')
	if object {
		end = '}'
	}
	for i := 0; w.d.PeekKind() != end; i++ {
		if object {
			name, err := w.d.ReadToken()
			if err != nil {
				return err
			}
			if track {
				w.path = append(w.path, name.String())
			}
		} else if track {
			w.path = append(w.path, strconv.Itoa(i))
		}
		err := w.value(depth+1, track)
		if track {
			w.path = w.path[:len(w.path)-1]
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func equalTokens(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// String decodes a JSON string value as Values returns it; ok is false for any other value.
func String(raw []byte) (string, bool) {
	if len(raw) == 0 || raw[0] != '"' {
		return "", false
	}
	tok, err := jsontext.NewDecoder(bytes.NewReader(raw)).ReadToken()
	if err != nil || tok.Kind() != '"' {
		return "", false
	}
	return tok.String(), true
}
