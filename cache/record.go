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
	// flagTrailers: a trailer count and the trailers follow the headers. A version that does
	// not know it refuses the record as unreadable (a duplicate gets response-not-replayable).
	flagTrailers byte = 1 << 2
)

// normalized returns r as stores keep it: no body when it is omitted, and neither headers nor
// body for an outcome-unknown record.
func (r Response) normalized() Response {
	if r.OutcomeUnknown {
		r.BodyOmitted, r.Headers, r.Trailers = true, nil, nil
	}
	if r.BodyOmitted {
		r.Body = nil
	}
	return r
}

// appendResponse appends the encoding of r to dst:
//
//	format byte (1) | status uvarint | flags byte | header count uvarint |
//	per header: name length uvarint, name, value length uvarint, value |
//	with flagTrailers: trailer count uvarint, the trailers as the headers | body (the rest)
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
	if len(r.Trailers) > 0 && !r.OutcomeUnknown {
		flags |= flagTrailers
	}
	dst = append(dst, flags)
	dst = appendFields(dst, r.Headers)
	if flags&flagTrailers != 0 {
		dst = appendFields(dst, r.Trailers)
	}
	if flags&flagBodyOmitted == 0 {
		dst = append(dst, r.Body...)
	}
	return dst
}

// appendFields appends a count and the header fields hs.
func appendFields(dst []byte, hs []Header) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(hs)))
	for _, h := range hs {
		dst = binary.AppendUvarint(dst, uint64(len(h.Name)))
		dst = append(dst, h.Name...)
		dst = binary.AppendUvarint(dst, uint64(len(h.Value)))
		dst = append(dst, h.Value...)
	}
	return dst
}

// fieldsSize returns len(appendFields(nil, hs)).
func fieldsSize(hs []Header) int {
	n := uvarintLen(uint64(len(hs)))
	for _, h := range hs {
		n += uvarintLen(uint64(len(h.Name))) + len(h.Name) + uvarintLen(uint64(len(h.Value))) + len(h.Value)
	}
	return n
}

// encodedResponseSize returns len(appendResponse(nil, r)) without encoding.
func encodedResponseSize(r Response) int {
	n := 1 + uvarintLen(uint64(r.Status)) + 1 + fieldsSize(r.Headers)
	if len(r.Trailers) > 0 && !r.OutcomeUnknown {
		n += fieldsSize(r.Trailers)
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
	if d.err != nil {
		return r, d.err
	}
	if flags&^(flagBodyOmitted|flagOutcomeUnknown|flagTrailers) != 0 {
		return r, fmt.Errorf("%w: unknown flags %#x", ErrCorrupt, flags)
	}
	unknown := flags&flagOutcomeUnknown != 0
	if unknown && flags&flagBodyOmitted == 0 {
		return r, fmt.Errorf("%w: an outcome-unknown response with a body", ErrCorrupt)
	}
	if unknown && flags&flagTrailers != 0 {
		return r, fmt.Errorf("%w: an outcome-unknown response with trailers", ErrCorrupt)
	}
	if (status < 100 || status > 999) && !(unknown && status == 0) {
		return r, fmt.Errorf("%w: status %d", ErrCorrupt, status)
	}
	r.Status = int(status)
	r.BodyOmitted = flags&flagBodyOmitted != 0
	r.OutcomeUnknown = unknown
	r.Headers = d.fields("headers")
	if flags&flagTrailers != 0 {
		if r.Trailers = d.fields("trailers"); d.err == nil && len(r.Trailers) == 0 {
			return Response{}, fmt.Errorf("%w: trailers flagged and none", ErrCorrupt)
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

// fields reads a count and that many header fields; nil when there are none.
func (d *decoder) fields(what string) []Header {
	n := d.uvarint()
	if d.err != nil || n == 0 {
		return nil
	}
	// Every field takes at least two bytes, which bounds the allocation for hostile input.
	if n > uint64(len(d.b))/2 {
		d.err = fmt.Errorf("%w: %d %s in %d bytes", ErrCorrupt, n, what, len(d.b))
		d.b = nil
		return nil
	}
	hs := make([]Header, n)
	for i := range hs {
		hs[i].Name = string(d.bytes())
		hs[i].Value = d.bytes()
	}
	return hs
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
