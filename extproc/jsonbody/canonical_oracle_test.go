package jsonbody

import (
	"bytes"
	"io"
	"strconv"

	"github.com/go-json-experiment/json/jsontext"
)

// canonicalTwoPass is the canonical form as the package first wrote it, in two passes: the tokens
// copied to an encoder, then jsontext's own RFC 8785 ordering. It is the oracle FuzzCanonical
// holds Canonical to.
//
// It appends to dst the RFC 8785 (JCS) canonical form of body with the members at ignore
// left out: members ordered by their names' UTF-16 code units, no insignificant whitespace,
// strings in their shortest escaping. Numbers are written as RFC 8785 writes them (an IEEE 754
// double in ECMAScript's shortest form) where that form has the written value; otherwise they
// keep their value exactly ([exactNumber]), so that 9007199254740993 and 9007199254740992 stay
// two numbers. It returns ErrNotJSON or ErrTooDeep for a body it cannot read.
func canonicalTwoPass(dst, body []byte, ignore []Pointer) ([]byte, error) {
	d := getDecoder(body)
	defer putDecoder(d)
	var buf bytes.Buffer
	e := jsontext.NewEncoder(&buf)
	c := twoPass{d: d.d, e: e, ignore: ignore}
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

// twoPass copies a body's tokens to an encoder, leaving out ignored members and writing
// each number in its canonical or exact form.
type twoPass struct {
	d      *jsontext.Decoder
	e      *jsontext.Encoder
	ignore []Pointer
	path   []string
}

// ignored tells whether the current path is ignored, and whether it leads to an ignored member.
func (c *twoPass) ignored() (here, below bool) {
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
func (c *twoPass) skip(depth int) error {
	w := walker{d: c.d}
	return w.value(depth, false)
}

func (c *twoPass) value(depth int, track bool) error {
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
func (c *twoPass) container(depth int, track bool) error {
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
func (c *twoPass) pathToken(object bool, name jsontext.Token, i int) string {
	if object {
		return name.String()
	}
	return strconv.Itoa(i)
}
