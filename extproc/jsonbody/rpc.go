package jsonbody

import (
	"bytes"
)

// ReplaceID returns msg, a JSON object, with the value of its top-level "id" member replaced
// by id (a JSON text, as Values returns it), and reports whether it had one. Everything else in
// msg is kept byte for byte. A msg that is not a JSON object, or has no "id", is returned as it
// is with false.
func ReplaceID(msg, id []byte) ([]byte, bool) {
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
// replaced by id: each data line holding a JSON object with a "jsonrpc" member and a "result" or
// an "error" member. Other lines, and events of other kinds, are kept byte for byte.
func ReplaceEventIDs(body, id []byte) []byte {
	var out []byte
	rest := body
	changed := false
	for len(rest) > 0 {
		line := rest
		next := []byte(nil)
		if i := bytes.IndexByte(rest, '\n'); i >= 0 {
			line, next = rest[:i+1], rest[i+1:]
		}
		rest = next
		content := bytes.TrimRight(line, "\r\n")
		data, ok := bytes.CutPrefix(content, []byte("data:"))
		if ok {
			data = bytes.TrimPrefix(data, []byte(" "))
			if isRPCResponse(data) {
				if replaced, ok := ReplaceID(data, id); ok {
					if !changed {
						out = append(make([]byte, 0, len(body)+len(id)), body[:len(body)-len(line)-len(rest)]...)
						changed = true
					}
					out = append(out, content[:len(content)-len(data)]...)
					out = append(out, replaced...)
					out = append(out, line[len(content):]...)
					continue
				}
			}
		}
		if changed {
			out = append(out, line...)
		}
	}
	if !changed {
		return body
	}
	return out
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
