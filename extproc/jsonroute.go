package extproc

import (
	"bytes"
	"errors"
	"net/http"
	"strconv"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/jsonbody"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// Routes that read their request body's members (key_json, json scope entries,
// fingerprint_ignore_json, json_rpc): what a body gives them, as functions of plain values, and
// how a JSON-RPC route's answers carry the request's id. A route that reads no member compiles
// no jsonRoute, and its requests pay one nil check.

// jsonRoute is what a route reads of its bodies, compiled once at load.
type jsonRoute struct {
	// ptrs are read in one pass: the key_json pointers, then the json scope entries', then
	// /id on a JSON-RPC route, then match.json's.
	ptrs         []jsonbody.Pointer
	keys, scopes int
	id           bool
	// match are the members match.json asks for, read last.
	match []policy.JSONMatch
	// members: the route needs the body's members (a key, a scope value, a JSON-RPC id), so a
	// body that is not JSON is refused. A route that only fingerprints the canonical form
	// fingerprints such a body raw.
	members bool
	// ignore are the members the canonical fingerprint leaves out; canonical says whether the
	// fingerprint (and a body-hash key) is over the canonical form at all.
	ignore    []jsonbody.Pointer
	canonical bool
	rpc       bool
}

var rpcID = mustPointer("/id")

func mustPointer(s string) jsonbody.Pointer {
	p, err := jsonbody.ParsePointer(s)
	if err != nil {
		panic(err) // a constant
	}
	return p
}

// compileJSON returns what r reads of its bodies; nil when it reads nothing.
func compileJSON(r *policy.Route) *jsonRoute {
	if !r.ReadsJSON() {
		return nil
	}
	j := &jsonRoute{keys: len(r.KeyJSON), scopes: len(r.ScopeJSON), rpc: r.JSONRPC}
	j.ptrs = append(append(j.ptrs, r.KeyJSON...), r.ScopeJSON...)
	j.ignore = append(j.ignore, r.FingerprintIgnoreJSON...)
	if r.JSONRPC {
		j.ptrs = append(j.ptrs, rpcID)
		j.ignore = append(j.ignore, rpcID)
		j.id = true
	}
	j.members = len(j.ptrs) > 0
	j.match = r.MatchJSON()
	for _, m := range j.match {
		j.ptrs = append(j.ptrs, m.Pointer)
	}
	// missing_key: body-hash hashes the same bytes as the fingerprint, so that a JSON-RPC retry's
	// new id is the same key.
	j.canonical = len(j.ignore) > 0 && (r.FingerprintsBody() || r.MissingKey == policy.MissingKeyBodyHash)
	return j
}

// bodyRead is what a body gives its route.
type bodyRead struct {
	// problem, when set, answers the request: the body is not JSON, or its key is invalid.
	problem *problem
	// batch: a JSON-RPC batch, which is not covered.
	batch bool
	// matched: the body is a JSON object with the members match.json asks for.
	matched bool
	// key is the first body key ("" when there is none).
	key string
	// scope are the json scope values, aligned with the route's ScopeJSON (nil: missing).
	scope [][]byte
	// id is the JSON-RPC request's id as the client wrote it (1.0 stays 1.0), to send back; nil
	// when it has none.
	id []byte
	// fingerprint is what the fingerprint hashes as the body: the canonical form without the
	// ignored members, or the raw body.
	fingerprint []byte
}

// readJSON reads what j needs from body, in one pass: the members, and the canonical form.
func readJSON(j *jsonRoute, body []byte) bodyRead {
	out := bodyRead{fingerprint: body}
	if j.rpc && isBatch(body) {
		return bodyRead{batch: true}
	}
	if len(j.ptrs) > 0 {
		var values [][]byte
		var err error
		if j.canonical {
			out.fingerprint, values, err = jsonbody.CanonicalValues(nil, body, j.ignore, j.ptrs)
		} else {
			values, err = jsonbody.Values(body, j.ptrs)
		}
		if err != nil {
			// Not JSON: no match.json holds. Too deep: this route's if its match.json members
			// hold, refused there when it reads members, else fingerprinted raw.
			if errors.Is(err, jsonbody.ErrTooDeep) {
				out.matched, out.id = deepRead(j, body)
			}
			if j.members {
				return bodyRead{problem: problemInvalidJSON, matched: out.matched, id: out.id}
			}
			return out
		}
		out.matched = matches(j.match, values[len(values)-len(j.match):], body)
		if !j.members {
			return out
		}
		out.scope = values[j.keys : j.keys+j.scopes]
		if j.id {
			out.id = requestID(body, values[j.keys+j.scopes])
		}
		for _, v := range values[:j.keys] {
			s, ok := jsonbody.String(v)
			if !ok || s == "" {
				continue
			}
			if out.key, ok = checkKey(s); !ok {
				return bodyRead{problem: problemInvalidKey, matched: out.matched, id: out.id}
			}
			break
		}

	}
	if j.canonical && len(j.ptrs) == 0 {
		if c, err := jsonbody.Canonical(nil, body, j.ignore); err == nil {
			out.fingerprint = c
		}
	}
	return out
}

// matches reports whether body is a JSON object whose members read as values are those ms asks
// for.
func matches(ms []policy.JSONMatch, values [][]byte, body []byte) bool {
	if b := bytes.TrimLeft(body, " \t\r\n"); len(b) == 0 || b[0] != '{' {
		return false
	}
	for i, m := range ms {
		if !bytes.Equal(values[i], m.Value) {
			return false
		}
	}
	return true
}

// deepRead is what a body too deep for Values still tells, its other members skipped: whether
// its match.json members hold, and its JSON-RPC id (nil when unread).
func deepRead(j *jsonRoute, body []byte) (matched bool, id []byte) {
	values, err := jsonbody.Lookup(body, j.ptrs)
	if err != nil {
		return false, nil
	}
	if j.id {
		id = requestID(body, values[j.keys+j.scopes])
	}
	return len(j.match) > 0 && matches(j.match, values[len(values)-len(j.match):], body), id
}

// requestID is the id a JSON-RPC request's answers carry: as the client wrote it (1.0 stays 1.0,
// "\u0031" stays escaped), else, for an id written over several lines (which an event stream's
// data lines cannot carry), its canonical form; nil when the request has none.
func requestID(body, canonical []byte) []byte {
	if canonical == nil {
		return nil
	}
	if raw := jsonbody.ID(body); raw != nil && !bytes.ContainsAny(raw, "\r\n") {
		return raw
	}
	return canonical
}

// isBatch reports whether body is a JSON-RPC batch: a top-level array.
func isBatch(body []byte) bool {
	b := bytes.TrimLeft(body, " \t\r\n")
	return len(b) > 0 && b[0] == '['
}

// keyFromBody settles a request's key once its body key is known: a header key and a different
// body key conflict; without a header key, the body's is the key. covered is false when there
// is no key at all and the route passes such requests through.
func keyFromBody(r *policy.Route, a admission, bodyKey string) (admission, bool) {
	switch {
	case a.key != "":
		if bodyKey != "" && bodyKey != a.key {
			a.problem = problemKeyConflict
		}
	case bodyKey != "":
		a.key = bodyKey
	case r.MissingKey == policy.MissingKeyOptional:
		return a, false
	case r.MissingKey == policy.MissingKeyRequired:
		a.problem = problemMissingKey
	}
	return a, true
}

// rpcProblem is a problem answered as JSON-RPC 2.0 error response: HTTP 200, the request's id
// (null when it is not known), error.code -32000, error.message the problem's title and
// error.data the problem object; Retry-After kept.
func rpcProblem(p *problem, r *policy.Route, id []byte) *extprocv3.ProcessingResponse {
	if len(id) == 0 {
		id = []byte("null")
	}
	data := bytes.TrimRight(p.body, "\n")
	body := make([]byte, 0, len(data)+len(id)+96)
	body = append(body, `{"jsonrpc":"2.0","id":`...)
	body = append(body, id...)
	body = append(body, `,"error":{"code":-32000,"message":`...)
	body = strconv.AppendQuote(body, reasonPhrase(p.status))
	body = append(body, `,"data":`...)
	body = append(body, data...)
	body = append(body, "}}\n"...)
	set := []*corev3.HeaderValueOption{setHeader(headerCT, []byte("application/json"))}
	if r.ReplayHeaderFresh {
		set = append(set, setHeader(r.ReplayHeader, valueFalse))
	}
	if p.retryAfter {
		set = append(set, setHeader(headerRetryAfter, valueOne))
	}
	return immediate(http.StatusOK, set, body, "idempotency_"+p.code)
}

// rpcReplay returns the stored response with the current request's id in its body: the
// top-level id of a JSON body, or that of each JSON-RPC response message of a
// text/event-stream body. A record without a body, or a request without an id, is unchanged.
// ok is false when the body holds a response whose id cannot be rewritten.
func rpcReplay(rec *cache.Record, id []byte) (_ *cache.Record, ok bool) {
	if len(id) == 0 || len(rec.Response.Body) == 0 {
		return rec, true
	}
	var body []byte
	if eventStream(rec.Response.Headers) {
		if body, ok = jsonbody.ReplaceEventIDs(rec.Response.Body, id); !ok {
			return rec, false
		}
	} else {
		var rw jsonbody.Rewrite
		switch body, rw = jsonbody.ReplaceID(rec.Response.Body, id); rw {
		case jsonbody.IDKept:
			return rec, true
		case jsonbody.IDUnreplaceable:
			return rec, false
		}
	}
	out := *rec
	out.Response.Body = body
	return &out, true
}

// eventStream reports whether a stored response's content-type is text/event-stream.
func eventStream(hs []cache.Header) bool {
	for _, h := range hs {
		if h.Name == headerCT {
			mt, _, _ := bytes.Cut(h.Value, []byte(";"))
			return bytes.EqualFold(bytes.TrimSpace(mt), []byte("text/event-stream"))
		}
	}
	return false
}
