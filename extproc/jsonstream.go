package extproc

import (
	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// The stream's side of routes that read their request body's members (jsonroute.go): the hooks
// the stream calls at the request headers, at the body's end, and to render an answer.

// jsonState is what the stream keeps of a request whose route reads its body's members, in its
// requestInfo: only such requests allocate it. Before the body's end only a request whose route
// match.json decides has one (stream.admit), which readBody chooses the route with, by sel; the
// others get theirs from readBody, at the body's end.
type jsonState struct {
	sel policy.Selector
	// maxBytes bounds the body while its route is not chosen: the largest max_request_bytes of
	// the routes it may take.
	maxBytes int
	// rpcID is the JSON-RPC request's id, read from the body of a json_rpc route.
	rpcID []byte
	// scope are the json scope values, aligned with the route's ScopeJSON (nil: missing).
	scope [][]byte
}

// maxRequestBytes bounds the request body the stream collects: its route's max_request_bytes, or,
// while match.json has not chosen the route (a jsonState before the body's end), the largest of
// the routes it may take.
func (st *stream) maxRequestBytes() int {
	if js := st.req.info.body; js != nil {
		return js.maxBytes
	}
	return st.req.route.MaxRequestBytes
}

// rpcID is the JSON-RPC request's id; nil when none was read.
func (st *stream) rpcID() []byte {
	if js := st.req.info.body; js != nil {
		return js.rpcID
	}
	return nil
}

// rpcVerdict puts the request's JSON-RPC id in the record a replay answers with; the stream asks
// on a json_rpc route only. A stored response whose id cannot be rewritten is answered 409
// response-not-replayable (as a JSON-RPC error, with the request's id), never replayed with
// another request's id.
func (st *stream) rpcVerdict(v verdict, rec *cache.Record) (verdict, *cache.Record) {
	if v.act != actReplay || rec == nil {
		return v, rec
	}
	out, ok := rpcReplay(rec, st.rpcID())
	if !ok {
		st.call.event(st.s.log.Warn()).Msg("the stored response's JSON-RPC id cannot be rewritten; answering response-not-replayable")
		return verdict{act: actRefuse, problem: problemNotReplayable}, rec
	}
	return v, out
}

// readBody learns, at the end of a request's body, what its route reads from it: the route
// itself (match.json), the key, the json scope values and the JSON-RPC id. It returns what the
// fingerprint hashes as the body, and false when it settled the request instead (passed it
// through, or answered a problem).
func (st *stream) readBody(body []byte) ([]byte, bool) {
	read, readFor, ok := st.chooseRoute(body)
	if !ok {
		return nil, false
	}
	a, r := st.req, st.req.route
	if r.json == nil {
		return body, true
	}
	if readFor != r {
		read = readJSON(r.json, body)
	}
	if read.batch {
		r.batches.Inc() // made for every json_rpc route, and readJSON finds batches only on those
		st.settleAtBody(nil)
		return nil, false
	}
	if a.info.body == nil {
		a.info.body = &jsonState{}
	}
	a.info.body.rpcID, a.info.body.scope = read.id, read.scope
	if read.problem != nil {
		st.settleAtBody(read.problem)
		return nil, false
	}
	adm, covered := admitBody(r.Route, a.adm, a.info, read.key)
	a.adm = adm
	if !covered || adm.problem != nil {
		st.settleAtBody(adm.problem)
		return nil, false
	}
	return read.fingerprint, true
}

// chooseRoute chooses, for a request whose route match.json decides, the route its body takes,
// and admits the request on it; read is what the body gave the route readFor, the last whose
// match.json was tested, so that the route that takes it reads the body once. ok is false when
// it settled the request instead.
func (st *stream) chooseRoute(body []byte) (read bodyRead, readFor *route, ok bool) {
	a := st.req
	js := a.info.body
	if js == nil {
		return read, nil, true
	}
	r, params, _ := st.s.policy.SelectBy(js.sel, func(c *policy.Route) bool {
		readFor = st.s.routes[c]
		read = readJSON(readFor.json, body)
		return read.matched
	})
	a.route, a.info.params = st.s.routes[r], params
	if a.adm = admit(a.route, a.info); !a.adm.covered || a.adm.problem != nil {
		st.settleAtBody(a.adm.problem)
		return read, readFor, false
	}
	if !requestBodyRows[st.pc.GetRequestBodyMode()].oneMessage && len(body) > a.route.MaxRequestBytes {
		// Held by the processor under the bound of every route it might take: now the chosen
		// route's applies. (A body Envoy buffers is bounded by Envoy.)
		if readFor == a.route {
			js.rpcID = read.id // the refusal carries the request's id
		}
		st.settleAtBody(problemTooLarge)
		return read, readFor, false
	}
	return read, readFor, true
}

// settleAtBody answers a request with p once its body was read or, when p is nil, lets it pass
// through uncovered: the answers withheld for the body go out, and nothing is stored.
func (st *stream) settleAtBody(p *problem) {
	if p != nil {
		st.reject(p)
		return
	}
	st.req.adm.covered = false
	if st.state == stateStart {
		st.passThrough()
		return
	}
	st.flush(evPass)
}

// admitBody settles the admission of a request whose route reads its body's members, once its
// body key is known and its json scope values are in info.body: the key (keyFromBody), then
// require_scope over every scope value. covered is false when the request passes through.
// stream.readBody and KeyHash both admit a body by it.
func admitBody(r *policy.Route, adm admission, info requestInfo, bodyKey string) (admission, bool) {
	adm, covered := keyFromBody(r, adm, bodyKey)
	if covered && adm.problem == nil && r.RequireScope && scopeEmpty(r, info, adm.jwt) {
		adm.problem = problemScopeMissing
	}
	return adm, covered
}
