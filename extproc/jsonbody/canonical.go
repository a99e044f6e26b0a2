package jsonbody

import (
	"bytes"
	"cmp"
	"io"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/go-json-experiment/json/jsontext"
)

// Canonical appends to dst the RFC 8785 (JCS) canonical form of body with the members at ignore
// left out: members ordered by their names' UTF-16 code units, no insignificant whitespace,
// strings in their shortest escaping. Numbers are written as RFC 8785 writes them (an IEEE 754
// double in ECMAScript's shortest form) where that form has the written value; otherwise they
// keep their value exactly ([exactNumber]), so that 9007199254740993 and 9007199254740992 stay
// two numbers. It returns ErrNotJSON or ErrTooDeep for a body it cannot read.
//
// It reads body once, writing each value in its final form as it goes; an object whose members
// came out of order is reordered in place when it ends.
func Canonical(dst, body []byte, ignore []Pointer) ([]byte, error) {
	out, _, err := CanonicalValues(dst, body, ignore, nil)
	return out, err
}

// CanonicalValues is Canonical and Values in one pass over body: it appends the canonical form
// of body without the members at ignore to dst, and returns the canonical text of the value at
// each of ptrs (nil where body has none), whether or not it is ignored.
func CanonicalValues(dst, body []byte, ignore, ptrs []Pointer) ([]byte, [][]byte, error) {
	if holdsIgnored(ptrs, ignore) {
		// A value with ignored members in it is read whole, as Values reads it: in a pass of
		// its own.
		values, err := Values(body, ptrs)
		if err != nil {
			return dst, nil, err
		}
		out, err := Canonical(dst, body, ignore)
		return out, values, err
	}
	d := getDecoder(body)
	defer putDecoder(d)
	c := canonicalizer{d: d.d, body: body, out: dst, ignore: ignore, want: ptrs, values: make([][]byte, len(ptrs))}
	if err := c.value(0, len(ignore) > 0 || len(ptrs) > 0); err != nil {
		return dst, nil, readErr(err)
	}
	if _, err := d.d.ReadToken(); err != io.EOF {
		return dst, nil, ErrNotJSON
	}
	for i, p := range ptrs {
		if len(p.tokens) == 0 {
			c.values[i] = slices.Clone(c.out[len(dst):])
		}
	}
	return c.out, c.values, nil
}

// holdsIgnored reports whether the value at one of ptrs has a member at one of ignore below it.
func holdsIgnored(ptrs, ignore []Pointer) bool {
	for _, p := range ptrs {
		for _, ig := range ignore {
			if len(p.tokens) < len(ig.tokens) && equalTokens(p.tokens, ig.tokens[:len(p.tokens)]) {
				return true
			}
		}
	}
	return false
}

// canonicalizer writes a body's values in their canonical form, leaving out ignored members.
type canonicalizer struct {
	d      *jsontext.Decoder
	body   []byte
	out    []byte
	ignore []Pointer
	// want are the pointers whose values are kept in values.
	want   []Pointer
	values [][]byte
	path   []string
	// scratch holds an unescaped string, and an object's members while they are reordered.
	scratch []byte
}

// on tells whether path is one of ptrs, and whether it leads to one.
func on(ptrs []Pointer, path []string) (here, below bool) {
	for _, p := range ptrs {
		if len(p.tokens) < len(path) {
			continue
		}
		if equalTokens(p.tokens[:len(path)], path) {
			if len(p.tokens) == len(path) {
				here = true
			} else {
				below = true
			}
		}
	}
	return here, below
}

// enter adds a member's reference token to the path and tells what to do with its value: leave
// it out (ignored), keep its text (wanted), and whether the path below it still matters.
func (c *canonicalizer) enter(tok string) (ignored, wanted, track bool) {
	c.path = append(c.path, tok)
	ignored, ignoreBelow := on(c.ignore, c.path)
	wanted, wantBelow := on(c.want, c.path)
	return ignored, wanted, ignoreBelow || wantBelow
}

// skip reads an ignored value and drops it, counting its depth and keeping the wanted values in
// it.
func (c *canonicalizer) skip(depth int) error {
	w := walker{d: c.d, body: c.body, ptrs: c.want, out: c.values, path: c.path}
	return w.value(depth, len(c.want) > 0)
}

// keep records the text written since start as the value of every wanted pointer at the path.
func (c *canonicalizer) keep(start int) {
	for i, p := range c.want {
		if equalTokens(p.tokens, c.path) {
			c.values[i] = slices.Clone(c.out[start:])
		}
	}
}

func (c *canonicalizer) value(depth int, track bool) error {
	switch c.d.PeekKind() {
	case '{':
		return c.object(depth, track)
	case '[':
		return c.array(depth, track)
	}
	v, err := c.d.ReadValue()
	if err != nil {
		return err
	}
	switch v.Kind() {
	case '0':
		c.out = append(c.out, exactNumber(string(v))...)
	case '"':
		c.out = c.appendString(c.out, v)
	default:
		c.out = append(c.out, v...)
	}
	return nil
}

// appendString appends the JSON string v in its shortest escaping: as it is when it escapes
// nothing (the decoder checked it), else unescaped and quoted again.
func (c *canonicalizer) appendString(dst []byte, v jsontext.Value) []byte {
	if bytes.IndexByte(v, '\\') < 0 {
		return append(dst, v...)
	}
	c.scratch, _ = jsontext.AppendUnquote(c.scratch[:0], v)
	dst, _ = jsontext.AppendQuote(dst, c.scratch)
	return dst
}

func (c *canonicalizer) array(depth int, track bool) error {
	if depth == MaxDepth {
		return ErrTooDeep
	}
	if _, err := c.d.ReadToken(); err != nil {
		return err
	}
	c.out = append(c.out, '[')
	n := 0
	for i := 0; c.d.PeekKind() != ']'; i++ {
		var tok string
		if track {
			tok = strconv.Itoa(i)
		}
		mark := len(c.out)
		if n > 0 {
			c.out = append(c.out, ',')
		}
		written, err := c.member(depth, track, tok)
		if err != nil {
			return err
		}
		if !written {
			c.out = c.out[:mark]
			continue
		}
		n++
	}
	if _, err := c.d.ReadToken(); err != nil {
		return err
	}
	c.out = append(c.out, ']')
	return nil
}

// member writes the value of an object's member or an array's element at the path's token tok
// (when track is set); written is false when it is ignored, and then nothing was written.
func (c *canonicalizer) member(depth int, track bool, tok string) (written bool, err error) {
	if !track {
		return true, c.value(depth+1, false)
	}
	ignored, wanted, below := c.enter(tok)
	defer func() { c.path = c.path[:len(c.path)-1] }()
	if ignored {
		return false, c.skip(depth + 1)
	}
	start := len(c.out)
	if err := c.value(depth+1, below); err != nil {
		return true, err
	}
	if wanted {
		c.keep(start)
	}
	return true, nil
}

// member is one member of an object being written: its name, and where its text (name and
// value, without a comma) is in the output.
type member struct {
	name       string
	start, end int
}

func (c *canonicalizer) object(depth int, track bool) error {
	if depth == MaxDepth {
		return ErrTooDeep
	}
	if _, err := c.d.ReadToken(); err != nil {
		return err
	}
	c.out = append(c.out, '{')
	var members []member
	for c.d.PeekKind() != '}' {
		raw, err := c.d.ReadValue()
		if err != nil {
			return err
		}
		mark := len(c.out)
		if len(members) > 0 {
			c.out = append(c.out, ',')
		}
		m := member{name: memberName(raw), start: len(c.out)}
		c.out = append(c.appendString(c.out, raw), ':')
		written, err := c.member(depth, track, m.name)
		if err != nil {
			return err
		}
		if !written {
			c.out = c.out[:mark] // neither its name nor its comma
			continue
		}
		m.end = len(c.out)
		members = append(members, m)
	}
	if _, err := c.d.ReadToken(); err != nil {
		return err
	}
	c.order(members)
	c.out = append(c.out, '}')
	return nil
}

// memberName is the name a member's raw JSON string stands for.
func memberName(raw jsontext.Value) string {
	if bytes.IndexByte(raw, '\\') < 0 {
		return string(raw[1 : len(raw)-1])
	}
	s, _ := jsontext.AppendUnquote(nil, raw)
	return string(s)
}

// order rewrites an object's members, the last text of the output, in the order of their
// names' UTF-16 code units, as RFC 8785 orders them.
func (c *canonicalizer) order(members []member) {
	if len(members) < 2 || slices.IsSortedFunc(members, compareMembers) {
		return
	}
	from := members[0].start
	c.scratch = append(c.scratch[:0], c.out[from:]...)
	slices.SortFunc(members, compareMembers)
	c.out = c.out[:from]
	for i, m := range members {
		if i > 0 {
			c.out = append(c.out, ',')
		}
		c.out = append(c.out, c.scratch[m.start-from:m.end-from]...)
	}
}

func compareMembers(a, b member) int { return compareUTF16(a.name, b.name) }

// compareUTF16 compares two strings by their UTF-16 code units.
func compareUTF16(a, b string) int {
	for a != "" && b != "" {
		ra, na := utf8.DecodeRuneInString(a)
		rb, nb := utf8.DecodeRuneInString(b)
		if ra != rb {
			ua, ub := firstUnit(ra), firstUnit(rb)
			if ua != ub {
				return cmp.Compare(ua, ub)
			}
			// Two supplementary characters with the same high surrogate: their low surrogates
			// compare as the characters do.
			return cmp.Compare(ra, rb)
		}
		a, b = a[na:], b[nb:]
	}
	return cmp.Compare(len(a), len(b))
}

// firstUnit is the first UTF-16 code unit of r.
func firstUnit(r rune) rune {
	if r < 0x10000 {
		return r
	}
	return 0xD800 + (r-0x10000)>>10
}

// exactNumber returns the JSON number text n in RFC 8785's form when that form has n's value,
// and otherwise n's exact value in a form of its own: an integer's digits when n is an integer
// of at most 400 digits, else D.DDDe±X with every significant digit. Equal values written
// differently (1.5e3 and 1500.0, 12345678901234567891 and 1.2345678901234567891e19) get equal
// texts either way.
func exactNumber(n string) string {
	v := jsontext.Value(n)
	if err := v.Canonicalize(); err != nil {
		return n
	}
	neg, digits, exp, ok := decimal(n)
	if !ok {
		return n
	}
	cneg, cdigits, cexp, cok := decimal(string(v))
	if cok && cneg == neg && cdigits == digits && cexp == exp {
		return string(v)
	}
	var b strings.Builder
	if neg {
		b.WriteByte('-')
	}
	switch {
	case exp >= 0 && len(digits)+exp <= 400:
		b.WriteString(digits)
		b.WriteString(strings.Repeat("0", exp))
	default:
		b.WriteString(digits[:1])
		if len(digits) > 1 {
			b.WriteByte('.')
			b.WriteString(digits[1:])
		}
		b.WriteByte('e')
		b.WriteString(strconv.Itoa(exp + len(digits) - 1))
	}
	return b.String()
}

// decimal reads a JSON number as sign, significant digits (no leading or trailing zeros) and the
// power of ten they are multiplied by: 1.50e2 is (false, "15", 1). Zero is (false, "0", 0)
// whatever its sign. ok is false for an exponent too large to hold.
func decimal(n string) (neg bool, digits string, exp int, ok bool) {
	if strings.HasPrefix(n, "-") {
		neg, n = true, n[1:]
	}
	mant, e, hasExp := strings.Cut(strings.ToLower(n), "e")
	if strings.Trim(mant, "0.") == "" {
		return false, "0", 0, true // zero, whatever its exponent
	}
	if hasExp {
		if len(strings.TrimLeft(strings.TrimLeft(e, "+-"), "0")) > 9 {
			return false, "", 0, false
		}
		x, err := strconv.Atoi(strings.TrimPrefix(e, "+"))
		if err != nil {
			return false, "", 0, false
		}
		exp = x
	}
	intPart, frac, _ := strings.Cut(mant, ".")
	digits = intPart + frac
	exp -= len(frac)
	digits = strings.TrimLeft(digits, "0")
	if digits == "" {
		return false, "0", 0, true
	}
	trimmed := strings.TrimRight(digits, "0")
	exp += len(digits) - len(trimmed)
	return neg, trimmed, exp, true
}
