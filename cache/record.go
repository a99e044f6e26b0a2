package cache

import (
	"encoding/binary"
	"fmt"
)

// responseFormat is the first byte of every encoded response this version writes. A later version
// that changes the layout writes a new byte and keeps decoding this one.
const responseFormat byte = 1

// responseSealed is the first byte of a sealed response: the envelope (package seal) of a
// response encoded as above follows, sealed under the record's stored key. See sealed.go.
const responseSealed byte = 2

// The flags byte of an encoded response.
const (
	flagBodyOmitted    byte = 1 << 0
	flagOutcomeUnknown byte = 1 << 1 // implies flagBodyOmitted; status may be 0
)

// normalized returns r as stores keep it: no body when it is omitted, and neither headers nor
// body for an outcome-unknown record.
func (r Response) normalized() Response {
	if r.OutcomeUnknown {
		r.BodyOmitted, r.Headers = true, nil
	}
	if r.BodyOmitted {
		r.Body = nil
	}
	return r
}

// appendResponse appends the encoding of r to dst:
//
//	format byte (1) | status uvarint | flags byte | header count uvarint |
//	per header: name length uvarint, name, value length uvarint, value | body (the rest)
func appendResponse(dst []byte, r Response) []byte {
	dst = append(dst, responseFormat)
	dst = binary.AppendUvarint(dst, uint64(r.Status))
	var flags byte
	if r.BodyOmitted || r.OutcomeUnknown {
		flags |= flagBodyOmitted
	}
	if r.OutcomeUnknown {
		flags |= flagOutcomeUnknown
	}
	dst = append(dst, flags)
	dst = binary.AppendUvarint(dst, uint64(len(r.Headers)))
	for _, h := range r.Headers {
		dst = binary.AppendUvarint(dst, uint64(len(h.Name)))
		dst = append(dst, h.Name...)
		dst = binary.AppendUvarint(dst, uint64(len(h.Value)))
		dst = append(dst, h.Value...)
	}
	if flags&flagBodyOmitted == 0 {
		dst = append(dst, r.Body...)
	}
	return dst
}

// encodedResponseSize returns len(appendResponse(nil, r)) without encoding.
func encodedResponseSize(r Response) int {
	n := 1 + uvarintLen(uint64(r.Status)) + 1 + uvarintLen(uint64(len(r.Headers)))
	for _, h := range r.Headers {
		n += uvarintLen(uint64(len(h.Name))) + len(h.Name) + uvarintLen(uint64(len(h.Value))) + len(h.Value)
	}
	if !r.BodyOmitted && !r.OutcomeUnknown {
		n += len(r.Body)
	}
	return n
}

func uvarintLen(v uint64) int {
	n := 1
	for v >= 0x80 {
		v >>= 7
		n++
	}
	return n
}

// decodeResponse decodes what appendResponse wrote. Header values and the body share memory with
// b, so b must not change afterwards. Any malformed input yields an error wrapping ErrCorrupt.
func decodeResponse(b []byte) (Response, error) {
	var r Response
	if len(b) == 0 {
		return r, fmt.Errorf("%w: empty response", ErrCorrupt)
	}
	if b[0] != responseFormat {
		return r, fmt.Errorf("%w: response format %d is not supported by this version", ErrCorrupt, b[0])
	}
	d := decoder{b: b[1:]}
	status := d.uvarint()
	flags := d.byte()
	n := d.uvarint()
	if d.err != nil {
		return r, d.err
	}
	if flags&^(flagBodyOmitted|flagOutcomeUnknown) != 0 {
		return r, fmt.Errorf("%w: unknown flags %#x", ErrCorrupt, flags)
	}
	unknown := flags&flagOutcomeUnknown != 0
	if unknown && flags&flagBodyOmitted == 0 {
		return r, fmt.Errorf("%w: an outcome-unknown response with a body", ErrCorrupt)
	}
	if (status < 100 || status > 999) && !(unknown && status == 0) {
		return r, fmt.Errorf("%w: status %d", ErrCorrupt, status)
	}
	// Every header takes at least two bytes, which bounds the allocation for hostile input.
	if n > uint64(len(d.b))/2 {
		return r, fmt.Errorf("%w: %d headers in %d bytes", ErrCorrupt, n, len(d.b))
	}
	r.Status = int(status)
	r.BodyOmitted = flags&flagBodyOmitted != 0
	r.OutcomeUnknown = unknown
	if n > 0 {
		r.Headers = make([]Header, n)
		for i := range r.Headers {
			r.Headers[i].Name = string(d.bytes())
			r.Headers[i].Value = d.bytes()
		}
	}
	if d.err != nil {
		return Response{}, d.err
	}
	if len(d.b) > 0 {
		if r.BodyOmitted {
			return Response{}, fmt.Errorf("%w: body present on a response marked as omitted", ErrCorrupt)
		}
		r.Body = d.b
	}
	return r, nil
}

type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(what string) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: truncated %s", ErrCorrupt, what)
	}
	d.b = nil
}

func (d *decoder) uvarint() uint64 {
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.fail("number")
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) byte() byte {
	if len(d.b) == 0 {
		d.fail("flags")
		return 0
	}
	c := d.b[0]
	d.b = d.b[1:]
	return c
}

func (d *decoder) bytes() []byte {
	n := d.uvarint()
	if d.err != nil {
		return nil
	}
	if n > uint64(len(d.b)) {
		d.fail("field")
		return nil
	}
	if n == 0 {
		return nil
	}
	v := d.b[:n:n]
	d.b = d.b[n:]
	return v
}
