package jsonbody

import (
	"bytes"
	"errors"
	"io"
)

// Rewrite is what ReplaceID did to a message.
type Rewrite int

const (
	// IDKept: there was nothing to rewrite (no id given, or a message that is no JSON-RPC
	// response, or one without an "id"); the message is returned as it is.
	IDKept Rewrite = iota
	// IDReplaced: the message's id is the one given.
	IDReplaced
	// IDUnreplaceable: the message is a JSON object the rewrite cannot read (invalid, or
	// nesting deeper than the decoder's own limit); it is returned as it is, with the id it had.
	IDUnreplaceable
)

// ReplaceID returns msg, a JSON-RPC response (a JSON object with "jsonrpc" and "result" or
// "error" members), with the value of its top-level "id" member replaced by id (a JSON text, as
// ID returns it). Any other message, {"id":"order-77"} among them, is kept as it is. Everything
// else in msg is kept byte for byte. The
// members it does not rewrite are skipped with the decoder's own skipping, so a stored response
// may nest deeper than MaxDepth, which bounds request bodies only.
func ReplaceID(msg, id []byte) ([]byte, Rewrite) {
	if len(bytes.TrimSpace(id)) == 0 {
		return msg, IDKept // a request without an id (a notification) has none to give
	}
	top, err := readTop(msg)
	switch {
	case errors.Is(err, errNotObject):
		return msg, IDKept
	case err != nil:
		return msg, IDUnreplaceable
	case !top.response() || top.id == nil:
		return msg, IDKept
	}
	out := make([]byte, 0, len(msg)-len(top.id)+len(id))
	out = append(out, msg[:top.idAt]...)
	out = append(out, id...)
	out = append(out, msg[top.idAt+len(top.id):]...)
	return out, IDReplaced
}

// errNotObject: the message does not begin as a JSON object.
var errNotObject = errors.New("jsonbody: not a JSON object")

// top is what readTop reads of a JSON object's top-level members.
type top struct {
	// id is the "id" member's value as written, at msg[idAt:]; nil when there is none.
	id   []byte
	idAt int
	// jsonrpc, result, errorMember: whether those members are there.
	jsonrpc, result, errorMember bool
}

// response tells whether the object is a JSON-RPC response.
func (t top) response() bool { return t.jsonrpc && (t.result || t.errorMember) }

// ID returns the JSON text of a JSON object's top-level "id" member as it is written (a JSON-RPC
// request's id, to be sent back as the client wrote it: 1.0 stays 1.0), or nil when msg has none
// or is not one JSON object.
func ID(msg []byte) []byte {
	t, err := readTop(msg)
	if err != nil {
		return nil
	}
	return t.id
}

// readTop reads msg, one JSON object and nothing after it, skipping the values of its members
// with the decoder's own skipping (no MaxDepth).
func readTop(msg []byte) (top, error) {
	var t top
	d := getDecoder(msg)
	defer putDecoder(d)
	if d.d.PeekKind() != '{' {
		return t, errNotObject
	}
	if _, err := d.d.ReadToken(); err != nil {
		return t, err
	}
	for d.d.PeekKind() == '"' {
		name, err := d.d.ReadToken()
		if err != nil {
			return t, err
		}
		n := name.String() // the token is valid until the next read
		start := int(d.d.InputOffset())
		if err := d.d.SkipValue(); err != nil {
			return t, err
		}
		switch n {
		case "id":
			// The value begins after the colon and any whitespace.
			v := msg[start:d.d.InputOffset()]
			lead := len(v) - len(bytes.TrimLeft(v, " \t\r\n:"))
			t.id, t.idAt = v[lead:], start+lead
		case "jsonrpc":
			t.jsonrpc = true
		case "result":
			t.result = true
		case "error":
			t.errorMember = true
		}
	}
	if tok, err := d.d.ReadToken(); err != nil || tok.Kind() != '}' {
		return t, ErrNotJSON
	}
	if _, err := d.d.ReadToken(); err != io.EOF {
		return t, ErrNotJSON
	}
	return t, nil
}

// ReplaceEventIDs returns a text/event-stream body with the id of every JSON-RPC response in it
// replaced by id: each event whose data (its data lines joined by "\n", as an event stream's
// reader joins them) is a JSON object with a "jsonrpc" member and a "result" or an "error"
// member. Lines may end in CRLF, LF or CR. Everything but the id is kept byte for byte. ok is
// false when a response's id could not be replaced (it spans data lines), and then body is
// returned as it is.
func ReplaceEventIDs(body, id []byte) (_ []byte, ok bool) {
	var out []byte
	changed := false
	for start := 0; start < len(body); {
		lines, end := eventLines(body, start)
		replaced, rw := replaceEventID(body, lines, id)
		switch {
		case rw == IDUnreplaceable:
			return body, false
		case rw == IDReplaced:
			if !changed {
				out = append(make([]byte, 0, len(body)+len(id)), body[:start]...)
				changed = true
			}
			out = append(out, replaced...)
		case changed:
			out = append(out, body[start:end]...)
		}
		start = end
	}
	if !changed {
		return body, true
	}
	return out, true
}

// line is one line of an event stream: body[from:to] is its content, body[to:next] its end.
type line struct{ from, to, next int }

// eventLines returns the lines of the event that starts at body[start:], the blank line that
// ends it included, and where the next event starts.
func eventLines(body []byte, start int) ([]line, int) {
	var lines []line
	for i := start; i < len(body); {
		l := line{from: i, to: len(body), next: len(body)}
		if j := bytes.IndexAny(body[i:], "\r\n"); j >= 0 {
			l.to, l.next = i+j, i+j+1
			if body[l.to] == '\r' && l.next < len(body) && body[l.next] == '\n' {
				l.next++
			}
		}
		lines = append(lines, l)
		i = l.next
		if l.to == l.from {
			break // a blank line ends the event
		}
	}
	end := len(body)
	if len(lines) > 0 {
		end = lines[len(lines)-1].next
	}
	return lines, end
}

// replaceEventID rewrites one event's data, when it is a JSON-RPC response, and returns the
// event's bytes with the new id.
func replaceEventID(body []byte, lines []line, id []byte) ([]byte, Rewrite) {
	var data [][]byte
	var dataLines []int
	for k, l := range lines {
		if v, ok := bytes.CutPrefix(body[l.from:l.to], []byte("data:")); ok {
			data = append(data, bytes.TrimPrefix(v, []byte(" ")))
			dataLines = append(dataLines, k)
		}
	}
	joined := bytes.Join(data, []byte("\n"))
	if !isRPCResponse(joined) {
		return nil, IDKept
	}
	replaced, rw := ReplaceID(joined, id)
	if rw != IDReplaced {
		return nil, rw
	}
	parts := bytes.Split(replaced, []byte("\n"))
	if len(parts) != len(data) {
		return nil, IDUnreplaceable // the id spanned data lines
	}
	var out []byte
	d := 0
	for k, l := range lines {
		if d < len(dataLines) && dataLines[d] == k {
			content := body[l.from:l.to]
			out = append(out, content[:len(content)-len(data[d])]...)
			out = append(out, parts[d]...)
			out = append(out, body[l.to:l.next]...)
			d++
			continue
		}
		out = append(out, body[l.from:l.next]...)
	}
	return out, IDReplaced
}

// isRPCResponse tells whether msg is a JSON-RPC response: an object with "jsonrpc" and
// "result" or "error" members, read however deep it nests.
func isRPCResponse(msg []byte) bool {
	t, err := readTop(msg)
	return err == nil && t.response()
}
