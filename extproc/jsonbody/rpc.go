package jsonbody

import (
	"bytes"
)

// ReplaceID returns msg, a JSON object, with the value of its top-level "id" member replaced
// by id (a JSON text, as Values returns it), and reports whether it had one. Everything else in
// msg is kept byte for byte. A msg that is not a JSON object, or has no "id", is returned as it
// is with false.
func ReplaceID(msg, id []byte) ([]byte, bool) {
	if len(bytes.TrimSpace(id)) == 0 {
		return msg, false // a request without an id (a notification) has none to give
	}
	d := getDecoder(msg)
	defer putDecoder(d)
	if d.d.PeekKind() != '{' {
		return msg, false
	}
	if _, err := d.d.ReadToken(); err != nil {
		return msg, false
	}
	w := walker{d: d.d}
	for d.d.PeekKind() == '"' {
		name, err := d.d.ReadToken()
		if err != nil {
			return msg, false
		}
		isID := name.String() == "id" // the token is valid until the next read
		start := d.d.InputOffset()
		if err := w.value(1, false); err != nil {
			return msg, false
		}
		if !isID {
			continue
		}
		end := d.d.InputOffset()
		// The value begins after the colon and any whitespace.
		v := msg[start:end]
		lead := len(v) - len(bytes.TrimLeft(v, " \t\r\n:"))
		out := make([]byte, 0, len(msg)-len(v)+lead+len(id))
		out = append(out, msg[:int(start)+lead]...)
		out = append(out, id...)
		out = append(out, msg[end:]...)
		return out, true
	}
	return msg, false
}

// ReplaceEventIDs returns a text/event-stream body with the id of every JSON-RPC response in it
// replaced by id: each event whose data (its data lines joined by "\n", as an event stream's
// reader joins them) is a JSON object with a "jsonrpc" member and a "result" or an "error"
// member. Lines may end in CRLF, LF or CR. Everything but the id is kept byte for byte.
func ReplaceEventIDs(body, id []byte) []byte {
	var out []byte
	changed := false
	for start := 0; start < len(body); {
		lines, end := eventLines(body, start)
		if replaced, ok := replaceEventID(body, lines, id); ok {
			if !changed {
				out = append(make([]byte, 0, len(body)+len(id)), body[:start]...)
				changed = true
			}
			out = append(out, replaced...)
		} else if changed {
			out = append(out, body[start:end]...)
		}
		start = end
	}
	if !changed {
		return body
	}
	return out
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
func replaceEventID(body []byte, lines []line, id []byte) ([]byte, bool) {
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
		return nil, false
	}
	replaced, ok := ReplaceID(joined, id)
	parts := bytes.Split(replaced, []byte("\n"))
	if !ok || len(parts) != len(data) {
		return nil, false
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
	return out, true
}

// isRPCResponse tells whether msg is a JSON-RPC response: an object with "jsonrpc" and
// "result" or "error" members.
func isRPCResponse(msg []byte) bool {
	if len(msg) == 0 || msg[0] != '{' {
		return false
	}
	v, err := Values(msg, rpcMembers)
	if err != nil {
		return false
	}
	return v[0] != nil && (v[1] != nil || v[2] != nil)
}

var rpcMembers = []Pointer{
	{text: "/jsonrpc", tokens: []string{"jsonrpc"}},
	{text: "/result", tokens: []string{"result"}},
	{text: "/error", tokens: []string{"error"}},
}
