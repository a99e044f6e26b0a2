package jsonbody

import (
	"bytes"
	"io"
	"strconv"
	"strings"

	"github.com/go-json-experiment/json/jsontext"
)

// Canonical appends to dst the RFC 8785 (JCS) canonical form of body with the members at ignore
// left out: members ordered by their names' UTF-16 code units, no insignificant whitespace,
// strings in their shortest escaping. Numbers are written as RFC 8785 writes them (an IEEE 754
// double in ECMAScript's shortest form) where that form has the written value; otherwise they
// keep their value exactly ([exactNumber]), so that 9007199254740993 and 9007199254740992 stay
// two numbers. It returns ErrNotJSON or ErrTooDeep for a body it cannot read.
func Canonical(dst, body []byte, ignore []Pointer) ([]byte, error) {
	d := getDecoder(body)
	defer putDecoder(d)
	var buf bytes.Buffer
	e := jsontext.NewEncoder(&buf)
	c := canonicalizer{d: d.d, e: e, ignore: ignore}
	if err := c.value(0, len(ignore) > 0); err != nil {
		return dst, readErr(err)
	}
	if _, err := d.d.ReadToken(); err != io.EOF {
		return dst, ErrNotJSON
	}
	// The members are ordered and the strings written by jsontext's own RFC 8785 form; the
	// numbers, already in their final form, are kept as they are.
	v := jsontext.Value(bytes.TrimRight(buf.Bytes(), "\n"))
	if err := v.Canonicalize(jsontext.CanonicalizeRawInts(false), jsontext.CanonicalizeRawFloats(false)); err != nil {
		return dst, ErrNotJSON
	}
	return append(dst, v...), nil
}

// canonicalizer copies a body's tokens to an encoder, leaving out ignored members and writing
// each number in its canonical or exact form.
type canonicalizer struct {
	d      *jsontext.Decoder
	e      *jsontext.Encoder
	ignore []Pointer
	path   []string
}

// ignored tells whether the current path is ignored, and whether it leads to an ignored member.
func (c *canonicalizer) ignored() (here, below bool) {
	for _, p := range c.ignore {
		if len(p.tokens) < len(c.path) {
			continue
		}
		if equalTokens(p.tokens[:len(c.path)], c.path) {
			if len(p.tokens) == len(c.path) {
				here = true
			} else {
				below = true
			}
		}
	}
	return here, below
}

// skip reads a value and drops it, counting its depth.
func (c *canonicalizer) skip(depth int) error {
	w := walker{d: c.d}
	return w.value(depth, false)
}

func (c *canonicalizer) value(depth int, track bool) error {
	switch c.d.PeekKind() {
	case '{', '[':
		return c.container(depth, track)
	case '0':
		tok, err := c.d.ReadToken()
		if err != nil {
			return err
		}
		return c.e.WriteValue(jsontext.Value(exactNumber(tok.String())))
	}
	tok, err := c.d.ReadToken()
	if err != nil {
		return err
	}
	return c.e.WriteToken(tok)
}

// container copies an object or an array, leaving out the members at ignored pointers.
func (c *canonicalizer) container(depth int, track bool) error {
	if depth == MaxDepth {
		return ErrTooDeep
	}
	open, err := c.d.ReadToken()
	if err != nil {
		return err
	}
	if err := c.e.WriteToken(open); err != nil {
		return err
	}
	object := open.Kind() == '{'
	end := jsontext.Kind(']')
	if object {
		end = '}'
	}
	for i := 0; c.d.PeekKind() != end; i++ {
		var name jsontext.Token
		if object {
			if name, err = c.d.ReadToken(); err != nil {
				return err
			}
		}
		below := false
		if track {
			c.path = append(c.path, c.pathToken(object, name, i))
			var here bool
			if here, below = c.ignored(); here {
				c.path = c.path[:len(c.path)-1]
				if err := c.skip(depth + 1); err != nil {
					return err
				}
				continue
			}
		}
		if object {
			if err := c.e.WriteToken(name); err != nil {
				return err
			}
		}
		err := c.value(depth+1, below)
		if track {
			c.path = c.path[:len(c.path)-1]
		}
		if err != nil {
			return err
		}
	}
	closing, err := c.d.ReadToken()
	if err != nil {
		return err
	}
	return c.e.WriteToken(closing)
}

// pathToken is a member's reference token: its name, or its index in an array.
func (c *canonicalizer) pathToken(object bool, name jsontext.Token, i int) string {
	if object {
		return name.String()
	}
	return strconv.Itoa(i)
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
