package extproc

import (
	"context"
	"errors"
	"strconv"
	"time"

	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/rs/zerolog"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// state is where one request is in its life. It is the stream's only state: everything else a
// stream holds is data about the request, or what it owes Envoy.
type state uint8

const (
	// stateStart: nothing seen yet.
	stateStart state = iota
	// statePass: not covered. Every later message is answered with CONTINUE (or, in a
	// FULL_DUPLEX_STREAMED direction, echoed).
	statePass
	// stateCollect: covered, and claimed at the end of the request body, which is being
	// collected; the answers that would let any of it reach the upstream are withheld.
	stateCollect
	// stateRunning: claimed; the lease is held and the request goes upstream.
	stateRunning
	// stateCapture: the upstream's response will be stored; its body is being captured.
	stateCapture
	// stateUnprotected: covered, but it went upstream without a lease (the store failed under
	// fail_mode: open, or its body never reached the processor): its response gets the replay
	// header, and nothing is stored.
	stateUnprotected
	// stateSettled: the outcome is settled; later messages are answered with CONTINUE (or
	// echoed).
	stateSettled
)

var stateNames = [...]string{"start", "pass", "collect", "running", "capture", "unprotected", "settled"}

func (s state) String() string { return stateNames[s] }

// event is what moves a stream from one state to the next.
type event uint8

const (
	evPass        event = iota // the request is not covered
	evAnswer                   // the server answered the request itself: a problem or a replay
	evAwaitBody                // covered; the claim waits for the end of the body
	evRun                      // claimed: the lease is held
	evUnprotected              // it goes upstream without a lease
	evStore                    // a storable response whose body follows
	evSettle                   // the response was recorded, or the lease released or left
)

var eventNames = [...]string{"pass", "answer", "await-body", "run", "unprotected", "store", "settle"}

func (e event) String() string { return eventNames[e] }

// transitions is the stream's whole state machine (SPEC §4, §8). A move not listed here is a
// bug: fire logs it and settles the request, whose lease finish then handles.
//
//	from         on           to           when
//	start        pass         pass         request_headers: not covered (route, method, no key, gRPC), or shadow mode
//	start        answer       settled      request_headers: 400, or the claim at the headers answered
//	start        await-body   collect      request_headers: the claim needs the whole body
//	start        run          running      request_headers: claimed (no body, or the route needs none)
//	start        unprotected  unprotected  request_headers: store failed under fail_mode: open, or NONE body mode under open
//	collect      pass         pass         shadow mode: the body's end, where enforcement would have answered
//	collect      answer       settled      the body's end: 409/422/replay/503; 413 over max_request_bytes or partial
//	collect      run          running      the body's end: claimed
//	collect      unprotected  unprotected  the body's end: store failed under fail_mode: open; response headers before the body's end
//	running      store        capture      response_headers: a storable status via the upstream, body follows
//	running      settle       settled      response_headers: stored whole (no body), or released, or an ambiguous outcome
//	running      settle       settled      the stream ends before response headers: unknown_outcome
//	capture      settle       settled      the body's end (or trailers): completed; the stream ends first: completed without body
//	unprotected  settle       settled      response_headers
var transitions = []struct {
	from state
	on   event
	to   state
}{
	{stateStart, evPass, statePass},
	{stateStart, evAnswer, stateSettled},
	{stateStart, evAwaitBody, stateCollect},
	{stateStart, evRun, stateRunning},
	{stateStart, evUnprotected, stateUnprotected},
	{stateCollect, evPass, statePass},
	{stateCollect, evAnswer, stateSettled},
	{stateCollect, evRun, stateRunning},
	{stateCollect, evUnprotected, stateUnprotected},
	{stateRunning, evStore, stateCapture},
	{stateRunning, evSettle, stateSettled},
	{stateCapture, evSettle, stateSettled},
	{stateUnprotected, evSettle, stateSettled},
}

// next returns the state e moves from to, and whether the move is in the table.
func next(from state, e event) (state, bool) {
	for _, t := range transitions {
		if t.from == from && t.on == e {
			return t.to, true
		}
	}
	return stateSettled, false
}

// extProcAttributes is the key of Envoy's attributes map (reference §2.2).
const extProcAttributes = "envoy.filters.http.ext_proc"

// The attributes the processor reads (reference §17.2).
const (
	attrCodeDetails  = "response.code_details"
	attrAttemptCount = "upstream.request_attempt_count"
)

// maxStreamedChunk bounds the chunks the processor sends back in a FULL_DUPLEX_STREAMED request
// body (reference §17.2 recommends at most 64 KiB).
const maxStreamedChunk = 64 << 10

// stream is one HTTP request. Its methods run on the stream's goroutine, except the renewal,
// which shares only the lease and is stopped before the lease changes.
type stream struct {
	s     *Server
	ctx   context.Context
	start time.Time

	state   state
	outcome Outcome
	covered bool
	// out collects the answers of the message being handled, in order.
	out []*extprocv3.ProcessingResponse

	requestID string
	route     *policy.Route
	rs        *routeState // the route's metric series and fixed answers
	params    []string
	scope     scope
	headers   headers
	method    []byte
	path      []byte
	bodyHash  bool
	key       string
	ttl       time.Duration

	storeKey string
	keyHash  string
	lease    cache.Lease
	renewal  *renewal

	// The body modes Envoy announced in the stream's first message (they include per-route
	// overrides); when it announced none (Envoy before 1.32), the shipped BUFFERED modes are
	// assumed.
	seen             bool
	requestBodyMode  filterextproc.ProcessingMode_BodySendMode
	responseBodyMode filterextproc.ProcessingMode_BodySendMode
	bodyBeforeAnswer bool // send_body_without_waiting_for_header_response

	// What the claim at the body's end owes Envoy: the header answer (when Envoy sends the body
	// without waiting for it), the body chunks' answers, the trailers' answer. reqBody holds the
	// body collected so far; reqEnded says whether its last chunk came.
	owedHeaders  bool
	owedChunks   int
	owedTrailers bool
	reqBody      []byte
	reqEnded     bool
	// reqHeld: Envoy holds the request's headers until the body's answer, so nothing of it has
	// reached the upstream yet (holdsRequestHeaders). Only a request that announces body bytes (content-length above 0) is known to get a body
	// message: one with trailers and no data gets none, and under request_trailer_mode SKIP
	// Envoy sends it upstream without another message (Filter::onTrailers).
	reqHeld bool

	// The response being captured.
	status      int
	respHeaders []cache.Header
	body        []byte
	omitted     bool

	completed     bool
	releaseReason string
	// overrideSent is the mode_override this stream sent, to tell when Envoy refused it.
	overrideSent *filterextproc.ProcessingMode
	// sentOutcome and sentReason are what the dynamic metadata last told Envoy.
	sentOutcome Outcome
	sentReason  string
	// inStore is set while a store call runs on the stream's goroutine: a panic that leaves it
	// set came from inside the store (see Server.StreamInterceptor).
	inStore bool
	// span is the request's trace span and spanCtx its context; nil without a tracer.
	span    trace.Span
	spanCtx context.Context
}

func newStream(s *Server, ctx context.Context) *stream {
	return &stream{s: s, ctx: ctx, start: time.Now(), outcome: Passthrough}
}

// fire moves the stream on e, following transitions.
func (st *stream) fire(e event) {
	to, ok := next(st.state, e)
	if !ok {
		st.event(st.s.log.Error()).Stringer("state", st.state).Stringer("event", e).Msg("stream state machine: move not in the table; the request is settled")
	}
	st.state = to
}

// event adds the request's identity to a log event: its request id, route and the hash of its
// stored key, never the key itself. It is safe on a disabled (nil) event.
func (st *stream) event(e *zerolog.Event) *zerolog.Event {
	if e == nil {
		return nil
	}
	e = e.Str("request_id", st.requestID)
	if st.route != nil {
		e = e.Str("route", st.route.Name)
	}
	if st.keyHash != "" {
		e = e.Str("key_hash", st.keyHash)
	}
	return e
}

// send queues the answer r.
func (st *stream) send(r reply) {
	if r.kind == kindRequestBody || r.kind == kindRequestTrailers {
		st.reqHeld = false
	}
	st.out = append(st.out, st.render(r))
}

// handle answers one message: zero answers (withheld until the claim), one, or several (the
// withheld ones, in order). It never panics on a message out of order; a message of no known
// kind gets ok false, which ends the stream.
func (st *stream) handle(req *extprocv3.ProcessingRequest) (answers []*extprocv3.ProcessingResponse, ok bool) {
	st.out = st.out[:0]
	if !st.seen {
		// protocol_config comes on the stream's first message only (reference §2.2).
		st.seen = true
		st.requestBodyMode, st.responseBodyMode = filterextproc.ProcessingMode_BUFFERED, filterextproc.ProcessingMode_BUFFERED
		if pc := req.GetProtocolConfig(); pc != nil {
			st.requestBodyMode, st.responseBodyMode = pc.GetRequestBodyMode(), pc.GetResponseBodyMode()
			st.bodyBeforeAnswer = pc.GetSendBodyWithoutWaitingForHeaderResponse()
		}
	}
	switch r := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		st.requestHeaders(req, r.RequestHeaders)
	case *extprocv3.ProcessingRequest_RequestBody:
		st.requestBody(r.RequestBody.GetBody(), r.RequestBody.GetEndOfStream())
	case *extprocv3.ProcessingRequest_RequestTrailers:
		st.requestTrailers()
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		st.responseHeaders(r.ResponseHeaders, req.GetAttributes())
	case *extprocv3.ProcessingRequest_ResponseBody:
		st.responseBody(r.ResponseBody.GetBody(), r.ResponseBody.GetEndOfStream())
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		st.responseTrailers()
	default:
		return nil, false
	}
	return st.out, true
}

// fullDuplex reports whether a direction's body travels in FULL_DUPLEX_STREAMED mode.
func (st *stream) fullDuplex(k msgKind) bool {
	mode := st.requestBodyMode
	if k >= kindResponseHeaders {
		mode = st.responseBodyMode
	}
	return mode == filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
}

// pass answers a message that needs nothing from the processor: CONTINUE, or the same chunk
// back in a FULL_DUPLEX_STREAMED direction.
func (st *stream) pass(k msgKind, chunk []byte, eos bool) {
	if (k == kindRequestBody || k == kindResponseBody) && st.fullDuplex(k) {
		st.send(reply{kind: k, stream: true, chunk: chunk, eos: eos})
		return
	}
	st.send(reply{kind: k})
}

// The metadata the processor reads: the jwt_authn payload forwarded in metadata_context, and the
// policy route an Envoy route names in the stream's initial metadata (SPEC §9).
const (
	jwtAuthnNamespace = "envoy.filters.http.jwt_authn"
	namedRouteHeader  = "x-idempotency-route"
	attrRouteName     = "xds.route_name"
	attrPeerIdentity  = "connection.uri_san_peer_certificate"
)

func (st *stream) requestHeaders(req *extprocv3.ProcessingRequest, m *extprocv3.HttpHeaders) {
	if st.state != stateStart {
		st.pass(kindRequestHeaders, nil, false)
		return
	}
	h := headers(m.GetHeaders().GetHeaders())
	st.headers = h
	st.method = h.get(":method")
	st.path = h.get(":path")
	st.requestID = string(h.get("x-request-id"))
	attrs := req.GetAttributes()
	sel := policy.Selector{Path: string(splitPath(st.path))}
	sel.RouteName, _ = stringAttribute(attrs, attrRouteName)
	// ValueFromIncomingContext reads the one key; FromIncomingContext would copy the stream's
	// whole metadata on every request.
	if v := metadata.ValueFromIncomingContext(st.ctx, namedRouteHeader); len(v) > 0 {
		sel.Named = v[0]
	}
	r, params, err := st.s.policy.Select(sel)
	if err != nil {
		st.unknownRoute(sel.Named, err)
		return
	}
	st.route, st.rs, st.params = r, st.s.routes[r], params

	if !r.Enabled || !r.Covers(string(st.method)) || isGRPC(h) {
		// A gRPC request is never covered: Envoy turns every ImmediateResponse into a
		// trailers-only gRPC reply, so a replay could not be faithful (SPEC §8).
		st.passThrough()
		return
	}
	key, present, err := parseKey(h, r.KeyHeaders)
	switch {
	case err != nil:
		st.reject(problemInvalidKey)
		return
	case !present && r.MissingKey == policy.MissingKeyOptional:
		st.passThrough()
		return
	case !present && r.MissingKey == policy.MissingKeyRequired:
		st.reject(problemMissingKey)
		return
	case !present:
		st.bodyHash = true
	}
	st.covered = true
	st.beginSpan()
	st.key = key
	st.ttl = r.TTL
	if r.TTLHeader != "" {
		if v, ok := h.lookup(r.TTLHeader); ok {
			ttl, err := parseTTL(v, r.MaxTTL)
			if err != nil {
				st.reject(problemInvalidTTL)
				return
			}
			st.ttl = ttl
		}
	}
	st.scope = scope{headers: h, params: params}
	st.scope.peer, _ = stringAttribute(attrs, attrPeerIdentity)
	if usesClaims(r) {
		payload, ok := jwtPayload(req.GetMetadataContext().GetFilterMetadata()[jwtAuthnNamespace], r.JWTPayloadKey)
		if !ok {
			st.s.misconfigured(MisconfigScopeAmbiguous, func() {
				st.event(st.s.log.Error()).Msg("jwt_authn forwarded several payloads and the route scopes by jwt_claim without jwt_payload_key; name the payload (the provider's payload_in_metadata) in jwt_payload_key")
			})
			st.reject(problemScopeAmbiguous)
			return
		}
		st.scope.jwt = payload
	}
	if r.RequireScope && scopeEmpty(r, st.scope) {
		st.reject(problemScopeMissing)
		return
	}
	if m.GetEndOfStream() || !st.needsBody() {
		// Nothing to wait for: claim now, so that a duplicate's answer comes before its body is
		// uploaded (SPEC §8).
		st.reqHeld = !m.GetEndOfStream() && contentLength(h) > 0 && holdsRequestHeaders(st.requestBodyMode)
		st.owedHeaders = true
		st.claim(nil)
		return
	}
	switch st.requestBodyMode {
	case filterextproc.ProcessingMode_NONE:
		st.bodyNotAvailable()
		return
	case filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED:
		// Envoy sends the body without waiting for this answer, and may be kept waiting for it
		// (reference §17.2): withheld, the headers do not reach the upstream before the claim.
		st.owedHeaders = true
	case filterextproc.ProcessingMode_STREAMED:
		st.owedHeaders = st.bodyBeforeAnswer
	}
	st.fire(evAwaitBody)
	if !st.owedHeaders {
		// Envoy sends the body only after this answer (reference §3).
		st.send(reply{kind: kindRequestHeaders})
	}
}

// unknownRoute answers a request whose Envoy route names a policy route that does not exist, or
// one whose path parameters the request's path does not have: 500, never the defaults, which
// would protect it under another route's scope and settings (SPEC §9). Each name is logged once.
func (st *stream) unknownRoute(name string, err error) {
	st.route, st.rs = st.s.policy.Default, st.s.routes[st.s.policy.Default]
	st.s.misconfigured(MisconfigUnknownRoute, nil)
	if st.s.firstUnknownRoute(name) {
		st.event(st.s.log.Error()).Str("named_route", name).Err(err).Msg("x-idempotency-route names a route the policy cannot apply to this request; answering 500 unknown-idempotency-route")
	}
	p := problemUnknownRoute
	if errors.Is(err, policy.ErrPathParams) {
		p = problemRouteMismatch
	}
	st.reject(p)
}

// usesClaims reports whether the route's scope reads the jwt_authn payload.
func usesClaims(r *policy.Route) bool {
	for _, src := range r.Scope {
		if src.Kind == policy.ScopeJWTClaim {
			return true
		}
	}
	return false
}

// jwtPayload returns the payload jwt_authn verified, from its metadata namespace: the one under
// key, or the only one there when key is empty; ok is false when there are several and no key
// says which.
func jwtPayload(ns *structpb.Struct, key string) (payload *structpb.Struct, ok bool) {
	fields := ns.GetFields()
	if key != "" {
		return fields[key].GetStructValue(), true
	}
	for _, v := range fields {
		if payload != nil {
			return nil, false
		}
		payload = v.GetStructValue()
	}
	return payload, true
}

// isGRPC reports whether Envoy treats the request as gRPC, and so turns its local replies into
// trailers-only gRPC responses: exactly Grpc::Common::hasGrpcContentType
// (source/common/grpc/common.cc), a content-type of exactly application/grpc or beginning with
// application/grpc+ (case-sensitive; application/grpc-web and application/grpc;… are not gRPC).
func isGRPC(h headers) bool {
	ct := h.get(headerCT)
	const grpc = "application/grpc"
	return len(ct) >= len(grpc) && string(ct[:len(grpc)]) == grpc && (len(ct) == len(grpc) || ct[len(grpc)] == '+')
}

// needsBody reports whether the claim needs the request body: to fingerprint it or to derive its
// key from it.
func (st *stream) needsBody() bool {
	if st.bodyHash {
		return true
	}
	for _, p := range st.route.Fingerprint {
		if p == policy.PartBody {
			return true
		}
	}
	return false
}

// bodyNotAvailable settles a covered request whose body the processor will never see
// (request_body_mode NONE): 500, or unprotected under fail_mode: open (SPEC §8).
func (st *stream) bodyNotAvailable() {
	st.s.misconfigured(MisconfigBodyNotAvailable, func() {
		st.event(st.s.log.Error()).Msg("request_body_mode is NONE, so the processor never sees the bodies of covered requests that need them (fingerprint: body, or missing_key: body-hash); set request_body_mode BUFFERED, or drop body from this route's fingerprint")
	})
	if st.s.policy.FailMode == policy.FailOpen && !st.shadow() {
		st.outcome = Passthrough
		st.fire(evUnprotected)
		st.send(reply{kind: kindRequestHeaders})
		return
	}
	st.reject(problemBodyNotAvailable)
}

func (st *stream) requestBody(chunk []byte, eos bool) {
	if st.state != stateCollect {
		st.pass(kindRequestBody, chunk, eos)
		return
	}
	switch st.requestBodyMode {
	case filterextproc.ProcessingMode_BUFFERED:
		// The one body message holds the whole body, whatever end_of_stream says (reference
		// §2.4: it is false when trailers follow).
		st.owedChunks = 1
		st.claim(chunk)
		return
	case filterextproc.ProcessingMode_BUFFERED_PARTIAL:
		// A partial buffer (end_of_stream false: Envoy's buffer limit was reached, the rest
		// would pass unseen) can neither fingerprint the request nor stand for its key.
		// Trailers also make end_of_stream false: such requests are refused too, rather than
		// let one run unclaimed. (In shadow mode the buffer's answer is owed, and sent.)
		st.owedChunks = 1
		if !eos {
			st.reject(problemTooLarge)
			return
		}
		st.claim(chunk)
		return
	}
	// STREAMED and FULL_DUPLEX_STREAMED: Envoy may send the body as one message or as many,
	// pipelined (reference §17.1). Collect it, withholding every answer, and claim at its end.
	st.reqEnded = eos
	if len(st.reqBody)+len(chunk) > st.route.MaxRequestBytes {
		if st.shadow() {
			// The request goes on untouched: this chunk's answer is owed too, and in
			// FULL_DUPLEX_STREAMED the chunk itself, streamed back with what came before it.
			st.reqBody = append(st.reqBody, chunk...)
			st.owedChunks++
		} else {
			st.reqBody = nil
		}
		st.reject(problemTooLarge)
		return
	}
	st.reqBody = append(st.reqBody, chunk...)
	st.owedChunks++
	if eos {
		st.claim(st.reqBody)
	}
}

func (st *stream) requestTrailers() {
	if st.state != stateCollect {
		st.send(reply{kind: kindRequestTrailers})
		return
	}
	// Trailers end the body (SPEC §8): in the streamed modes after its chunks, and in the
	// buffered modes for a request that had trailers and no data.
	st.owedTrailers = true
	st.claim(st.reqBody)
}

// passThrough leaves the request alone and asks Envoy to skip every later phase. In a
// FULL_DUPLEX_STREAMED request Envoy ignores mode_override (reference §17.1): none is sent, and
// every later message is answered.
func (st *stream) passThrough() {
	st.outcome = Passthrough
	st.fire(evPass)
	if st.fullDuplex(kindRequestBody) || st.fullDuplex(kindResponseBody) {
		st.send(reply{kind: kindRequestHeaders})
		return
	}
	st.overrideSent = passThroughMode
	st.send(reply{kind: kindRequestHeaders, mode: passThroughMode})
}

// reject settles a covered request with a problem answered by the server (in shadow mode, it only
// counts it).
func (st *stream) reject(p *problem) {
	st.covered = true
	st.beginSpan()
	if st.shadow() {
		st.shadowed(p.outcome)
		return
	}
	st.outcome = p.outcome
	st.fire(evAnswer)
	st.send(reply{problem: p})
}

// flushOwed sends the answers the claim withheld, in Envoy's order: the headers, the body (the
// chunks' answers, or in FULL_DUPLEX_STREAMED the body itself, streamed back), the trailers.
func (st *stream) flushOwed() {
	if st.owedHeaders {
		st.send(reply{kind: kindRequestHeaders})
	}
	if st.fullDuplex(kindRequestBody) && st.owedChunks > 0 {
		// The body streamed back ends where Envoy's did: not at all yet when the response began
		// early or a shadowed request was too large, before the trailers when they came.
		body := st.reqBody
		for {
			n := min(len(body), maxStreamedChunk)
			last := n == len(body)
			st.send(reply{kind: kindRequestBody, stream: true, chunk: body[:n], eos: last && st.reqEnded && !st.owedTrailers})
			body = body[n:]
			if last {
				break
			}
		}
	} else {
		for range st.owedChunks {
			st.send(reply{kind: kindRequestBody})
		}
	}
	if st.owedTrailers {
		st.send(reply{kind: kindRequestTrailers})
	}
	st.owedHeaders, st.owedChunks, st.owedTrailers = false, 0, false
}

// claim makes the one store round trip of a covered request and decides its fate: 422, 409, a
// replay, or running it under a fresh lease.
func (st *stream) claim(body []byte) {
	r := st.route
	d := newDigest(st.s.keyHash)
	if st.bodyHash {
		st.key = d.bodyHashKey(st.method, st.path, body)
	}
	st.storeKey, st.keyHash = d.storeKey(r, st.scope, st.key)
	fp := d.fingerprint(r, st.method, st.path, body, st.headers)
	if !st.fullDuplex(kindRequestBody) {
		st.reqBody = nil // Envoy holds the body; only a FULL_DUPLEX_STREAMED one is sent back
	}

	c := cache.Claim{Fingerprint: fp, LockTTL: r.LockTTL, TTL: st.ttl, Route: r.Name,
		Replicas: r.Durability.Replicas, ReplicaTimeout: r.Durability.Timeout}
	wait, preferred := st.waitBudget()
	var deadline time.Time
	for {
		lease, rec, err := st.s.acquire(st, c)
		switch {
		case err != nil && st.ctx.Err() != nil:
			// Envoy ended the stream during the call (the client went away): not the store's
			// failure, and nobody waits for an answer. The request never went upstream.
			st.event(st.s.log.Debug()).Err(err).Msg("stream ended during the store call")
			st.fire(evAnswer)
			return
		case errors.Is(err, cache.ErrCorrupt):
			// The record is there but cannot be read (a tampered or unknown-key sealed record, a
			// layout this build does not know): the request ran once, so it must not run again,
			// whatever fail_mode says.
			st.rs.unreadable.Inc()
			st.event(st.s.log.Error()).Err(err).Msg("stored record cannot be read; answering response-not-replayable")
			st.reject(problemNotReplayable)
			return
		case err != nil:
			st.storeFailed("acquire", err)
			switch {
			case st.shadow():
				st.shadowed(StoreError)
			case st.s.policy.FailMode == policy.FailOpen:
				// Its response headers still come, for the replay header.
				st.fire(evUnprotected)
				st.flushOwed()
			default:
				st.reject(problemStoreUnavailable)
			}
			return
		case rec == nil:
			st.run(lease)
			return
		case rec.State == cache.Pending && fingerprintMatches(r, fp, rec.Fingerprint) && wait > 0 && !st.shadow():
			// In flight: wait for the first request to complete rather than answer 409 at once
			// (SPEC §11), polling no faster than every waitPoll.
			now := st.s.clock.Now()
			if deadline.IsZero() {
				deadline = now.Add(wait)
			}
			if !now.Before(deadline) {
				st.reject(problemInProgress)
				return
			}
			if !st.sleep(min(waitPoll, deadline.Sub(now))) {
				st.fire(evAnswer) // Envoy gave up on the request: nobody waits for an answer
				return
			}
			st.rs.waitCalls.Inc()
			continue
		}
		waited := ""
		if preferred && !deadline.IsZero() {
			// RFC 7240 counts whole seconds: the budget rounded up, never above the client's N.
			waited = "wait=" + strconv.Itoa(int((wait+time.Second-1)/time.Second))
		}
		st.answerExisting(fp, rec, waited)
		return
	}
}

// waitPoll is the least time between two store calls of a waiting duplicate (SPEC §11).
const waitPoll = 50 * time.Millisecond

// waitBudget returns how long a duplicate of a request in flight may wait for its replay: the
// route's in_flight_wait, or less when the client's Prefer: wait=N asks for less (RFC 7240);
// preferred reports whether the client asked.
func (st *stream) waitBudget() (wait time.Duration, preferred bool) {
	wait = st.route.InFlightWait
	if wait == 0 {
		return 0, false
	}
	if n, ok := preferWait(st.headers); ok {
		return min(wait, time.Duration(n)*time.Second), true
	}
	return wait, false
}

// sleep waits d on the server's clock, and reports false when the stream ended first.
func (st *stream) sleep(d time.Duration) bool {
	done := make(chan struct{})
	t := st.s.clock.AfterFunc(d, func() { close(done) })
	select {
	case <-done:
		return true
	case <-st.ctx.Done():
		t.Stop()
		return false
	}
}

// run lets the claimed request go upstream under its lease.
func (st *stream) run(lease cache.Lease) {
	st.lease = lease
	st.outcome = Executed
	st.s.metrics.inflight.Inc()
	st.startRenewal()
	if st.shadow() {
		st.rs.shadow[Executed].Inc()
	}
	st.fire(evRun)
	st.flushOwed()
}

// answerExisting answers a request whose key already has a record. The mismatch check comes
// before the in-flight and replay checks (SPEC §4). waited is the Preference-Applied value of a
// duplicate that waited for the replay.
func (st *stream) answerExisting(fp []byte, rec *cache.Record, waited string) {
	switch {
	case !fingerprintMatches(st.route, fp, rec.Fingerprint):
		st.reject(problemReused)
	case rec.State == cache.Pending:
		st.reject(problemInProgress)
	case rec.Response.OutcomeUnknown:
		st.reject(problemOutcomeUnknown)
	case rec.Response.BodyOmitted:
		st.reject(problemNotReplayable)
	case st.shadow():
		st.shadowed(Replayed)
	default:
		st.outcome = Replayed
		st.fire(evAnswer)
		st.send(reply{replay: rec, waited: waited})
	}
}

// shadow reports whether the request's route is in shadow mode: claimed and recorded as under
// enforce, but never answered by the processor (SPEC §10).
func (st *stream) shadow() bool { return st.route != nil && st.route.Mode == policy.ModeShadow }

// shadowed counts and logs what enforcement would have answered, and lets the request go on
// untouched instead.
func (st *stream) shadowed(would Outcome) {
	st.rs.shadow[would].Inc()
	st.event(st.s.log.Info()).Str("would", string(would)).Msg("shadow mode: enforcement would have answered this request; it goes on untouched")
	st.outcome = Passthrough
	if st.state == stateStart {
		st.owedHeaders = false
		st.passThrough()
		return
	}
	st.fire(evPass)
	st.flushOwed()
}

// fingerprintMatches reports whether a record's fingerprint is this request's. A record without
// a fingerprint comes from a build before b740924, for a route with none: such a route accepts
// it, as that build did, until it expires.
func fingerprintMatches(r *policy.Route, fp, stored []byte) bool {
	return string(fp) == string(stored) || (len(r.Fingerprint) == 0 && len(stored) == 0)
}

func (st *stream) responseHeaders(m *extprocv3.HttpHeaders, attrs map[string]*structpb.Struct) {
	switch st.state {
	case stateRunning:
	case stateCollect:
		// The response began before the request's end reached the processor: Envoy answered it
		// itself (an overflow, a timeout), the upstream answered early, or Envoy sent the request
		// on without the body phase (trailers and no data under request_trailer_mode SKIP:
		// Filter::onTrailers continues when it has nothing buffered and sends no trailers). In
		// the last two the request ran without a lease (its outcome stays passthrough). Under
		// BUFFERED and BUFFERED_PARTIAL Envoy holds the headers until the body's answer, so only
		// the skipped trailers can explain it: a misconfiguration, counted. Under STREAMED and
		// FULL_DUPLEX_STREAMED the headers went upstream before the claim, and an upstream may
		// answer before the body ends. What was withheld is answered first.
		if o := originOf(attrs); !o.envoyMade || !o.attemptsKnown || o.attempts > 0 {
			if holdsRequestHeaders(st.requestBodyMode) {
				st.s.misconfigured(MisconfigUnclaimedRequest, func() {
					st.event(st.s.log.Warn()).Msg("the upstream answered a covered request whose end the processor never saw, so it ran without a lease; set request_trailer_mode: SEND in the ext_proc filter's processing_mode (requests with trailers and no body otherwise skip the body phase)")
				})
			} else {
				st.s.earlyAnswerLog.Do(func() {
					st.event(st.s.log.Info()).Msg("the upstream answered a streamed request before its body ended (Envoy sends a STREAMED request's headers on before the claim), so it ran without a lease; its outcome is passthrough")
				})
			}
			st.event(st.s.log.Debug()).Msg("the response began before the request body reached the processor whole; this request ran unprotected")
		}
		st.fire(evUnprotected)
		st.flushOwed()
		fallthrough
	case stateUnprotected:
		st.fire(evSettle)
		st.markResponse(false, false)
		return
	case statePass:
		if st.overrideSent == passThroughMode {
			st.overrideRefused()
		}
		st.pass(kindResponseHeaders, nil, false)
		return
	default:
		st.pass(kindResponseHeaders, nil, false)
		return
	}
	r := st.route
	h := headers(m.GetHeaders().GetHeaders())
	st.status = parseStatus(h.get(":status"))
	o := originOf(attrs)
	if !o.detailsKnown {
		st.s.misconfigured(MisconfigCodeDetailsMissing, func() {
			st.event(st.s.log.Warn()).Msg("a response came without response.code_details; add it to the ext_proc filter's response_attributes, or responses that would release the key are treated as possibly Envoy's (unknown outcomes)")
		})
	}
	if o.attemptsKnown && o.attempts > 1 {
		// Not a misconfiguration by itself: retries on connect-failure or refused-stream (Istio's
		// default policy has them) never reached the upstream. The config checks refuse the
		// retry conditions that may run a request twice.
		st.rs.retried.Inc()
		st.s.retriedLog.Do(func() {
			st.event(st.s.log.Info()).Int64("attempts", o.attempts).Msg("Envoy's router sent a covered request upstream more than once (retry_policy or hedge_policy): harmless after connect-failure or refused-stream, a possible second execution after reset, 5xx or a per-try timeout; counted in idempotency_upstream_retries_total")
		})
	}
	switch {
	case o.envoyMade || (!o.detailsKnown && !r.StoreStatuses.Has(st.status)):
		// Envoy made this response (a timeout, a refused connection, an overflow), or may have:
		// it is not the outcome of the request. Only when the request never reached the
		// upstream is it known that nothing ran (SPEC §8).
		switch {
		case o.attemptsKnown && o.attempts == 0:
			st.release(ReleaseEnvoyResponse)
		default:
			if !o.attemptsKnown {
				st.s.misconfigured(MisconfigAttemptCountMissing, func() {
					st.event(st.s.log.Warn()).Msg("an Envoy-made response came without upstream.request_attempt_count; add it to the ext_proc filter's response_attributes, or every such response is treated as an unknown outcome")
				})
			}
			st.unknownOutcome(st.status)
		}
		st.fire(evSettle)
		st.markResponse(false, false)
		return
	case !r.StoreStatuses.Has(st.status):
		st.release(ReleaseStatus)
		st.fire(evSettle)
		st.markResponse(false, false)
		return
	}
	st.respHeaders = replayableHeaders(h, r)
	switch {
	case m.GetEndOfStream():
		st.complete()
		st.fire(evSettle)
		st.markResponse(true, st.completed)
	case st.responseBodyMode == filterextproc.ProcessingMode_NONE:
		// Envoy will not send the body: record the outcome now, without it, so that the request
		// still runs at most once (duplicates get 409 response-not-replayable).
		st.omitted = true
		st.complete()
		st.fire(evSettle)
		st.markResponse(true, st.completed)
	case !r.StoreBody:
		// store_body: false keeps status and headers only (SPEC §12): nothing to capture.
		st.omitted = true
		st.complete()
		st.fire(evSettle)
		st.markResponse(false, st.completed)
	default:
		st.fire(evStore)
		st.markResponse(true, true)
	}
}

// markResponse answers response headers of a covered request: the replay header set to false
// (replay_header_fresh), and the record's expiry when the response is stored. A response whose
// body the processor need not see also has its body phase turned off, unless Envoy would ignore
// the override (FULL_DUPLEX_STREAMED, reference §17.1) or sends no body anyway. In shadow mode
// the response goes on untouched.
func (st *stream) markResponse(wantBody, stored bool) {
	var mode *filterextproc.ProcessingMode
	if !wantBody && !st.fullDuplex(kindResponseBody) && st.responseBodyMode != filterextproc.ProcessingMode_NONE {
		mode = noStoreMode
		st.overrideSent = noStoreMode
	}
	if st.shadow() {
		st.send(reply{kind: kindResponseHeaders, mode: mode})
		return
	}
	var expires time.Time
	if stored && st.route.ExpiresHeader != "" {
		expires = st.s.clock.Now().Add(st.ttl)
	}
	st.send(reply{kind: kindResponseHeaders, mark: true, mode: mode, expires: expires})
}

// overrideRefused notes that Envoy sent a phase a mode_override had turned off: every request
// then goes through every phase, buffered (SPEC §8).
func (st *stream) overrideRefused() {
	st.overrideSent = nil // once per stream
	st.s.misconfigured(MisconfigModeOverrideRefused, func() {
		st.event(st.s.log.Warn()).Msg("Envoy ignored this processor's mode_override: set allow_mode_override: true, list exactly the two SPEC §5 modes in allowed_override_modes (or none), and turn send_body_without_waiting_for_header_response off; until then every request's bodies go through the processor")
	})
}

func (st *stream) responseBody(chunk []byte, eos bool) {
	if st.state != stateCapture {
		if st.overrideSent == noStoreMode {
			st.overrideRefused()
		}
		st.pass(kindResponseBody, chunk, eos)
		return
	}
	last := eos
	switch st.responseBodyMode {
	case filterextproc.ProcessingMode_BUFFERED:
		// The one message holds the whole body, even when trailers follow (reference §2.4).
		last = true
	case filterextproc.ProcessingMode_BUFFERED_PARTIAL:
		// A partial buffer that does not end the body means the rest passed unseen.
		if !eos {
			st.omitted = true
		}
		last = true
	}
	switch {
	case st.omitted:
	case len(st.body)+len(chunk) > st.route.MaxResponseBytes:
		st.omitted, st.body = true, nil
	case st.body == nil:
		st.body = chunk
	default:
		st.body = append(st.body, chunk...)
	}
	if last {
		// Durability: the record is written before Envoy may pass the response's end on
		// (SPEC §4).
		st.complete()
		st.fire(evSettle)
	}
	st.pass(kindResponseBody, chunk, eos)
}

func (st *stream) responseTrailers() {
	if st.state == stateCapture {
		// Trailers end the body of a streamed response (reference §2.4).
		st.complete()
		st.fire(evSettle)
	}
	st.send(reply{kind: kindResponseTrailers})
}

// complete records the response and gives up the lease.
func (st *stream) complete() {
	st.renewal.stop()
	resp := cache.Response{Status: st.status, Headers: st.respHeaders, Body: st.body, BodyOmitted: st.omitted}
	// The client may already be gone; the record must still be written.
	err := st.s.complete(st, context.WithoutCancel(st.ctx), st.lease, resp)
	st.dropLease()
	if err != nil {
		st.storeFailed("complete", err)
		return
	}
	st.completed = true
}

// release frees the key so that a retry runs again.
func (st *stream) release(reason string) {
	st.renewal.stop()
	err := st.s.release(st, context.WithoutCancel(st.ctx), st.lease)
	st.dropLease()
	if err != nil {
		st.storeFailed("release", err)
		return
	}
	st.releaseReason = reason
	st.rs.releases[reason].Inc()
	st.event(st.s.log.Debug()).Str("reason", reason).Msg("lease released")
}

// unknownOutcome handles a lease whose request may or may not have run upstream, as the route's
// unknown_outcome says (SPEC §8); status is Envoy's, or 0 when no response was seen.
func (st *stream) unknownOutcome(status int) {
	r := st.route
	st.rs.unknown[r.UnknownOutcome].Inc()
	switch r.UnknownOutcome {
	case policy.UnknownOutcomeRelease:
		st.release(ReleaseUnknownOutcome)
	case policy.UnknownOutcomeRecord:
		st.renewal.stop()
		err := st.s.complete(st, context.WithoutCancel(st.ctx), st.lease, cache.Response{Status: status, OutcomeUnknown: true})
		st.dropLease()
		if err != nil {
			st.storeFailed("complete", err)
			return
		}
		st.event(st.s.log.Info()).Int("status", status).Msg("outcome unknown; recorded so that duplicates get 409 outcome-unknown")
	default:
		st.renewal.stop()
		st.dropLease()
		st.event(st.s.log.Info()).Dur("lock_ttl", r.LockTTL).Int("status", status).Msg("outcome unknown; lease kept until it expires")
	}
}

func (st *stream) dropLease() {
	if st.lease.Held() {
		st.lease = cache.Lease{}
		st.s.metrics.inflight.Dec()
	}
}

// storeFailed logs a failed store operation and makes store_error the request's outcome.
func (st *stream) storeFailed(op string, err error) {
	st.outcome = StoreError
	ev := st.s.log.Error()
	if errors.Is(err, cache.ErrLeaseLost) {
		ev = st.s.log.Warn()
	}
	ev = st.event(ev)
	ev.Str("op", op).Err(err).Msg("store operation failed")
}

// newMetadata reports whether the request's dynamic metadata has news for Envoy: an outcome or a
// release reason that it has not been told. The first answer that settles, claims or passes a
// request carries it (SPEC §9).
func (st *stream) newMetadata() bool {
	// While the body is awaited a covered request has no outcome yet: the header answer carries
	// none, rather than a passthrough the access log would keep if the client left mid-body.
	if st.route == nil || st.state == stateCollect || (st.outcome == st.sentOutcome && st.releaseReason == st.sentReason) {
		return false
	}
	st.sentOutcome, st.sentReason = st.outcome, st.releaseReason
	return true
}

// metadata returns the request's dynamic metadata.
func (st *stream) metadata() *structpb.Struct {
	return metadataFields(st.s.metadataNamespace, st.rs.name, st.outcome, st.keyHash, st.releaseReason)
}

// finish runs when the stream ends, however it ends. A lease still held means the response was
// not seen whole: with storable response headers seen, the request ran and its record is
// completed without a body; with none, its outcome is unknown.
func (st *stream) finish() {
	if st.inStore {
		// The stream's goroutine is unwinding a panic from inside the store: make no further
		// store call (Server.recoverStream ends the process).
		st.s.storeBroken.Store(true)
		return
	}
	if st.lease.Held() {
		switch {
		case st.state == stateCapture:
			st.omitted = true
			st.complete()
		case st.reqHeld:
			// Envoy still held the request when the stream ended (the client left during a
			// BUFFERED upload claimed at its headers): it never reached the upstream.
			st.release(ReleaseNotSent)
		default:
			st.unknownOutcome(0)
		}
		st.fire(evSettle)
	}
	if st.route == nil {
		return
	}
	st.endSpan()
	st.rs.outcomes[st.outcome].Inc()
	if !st.covered {
		return
	}
	ev := st.s.log.Info()
	if st.outcome == StoreError {
		ev = st.s.log.Warn()
	}
	ev = st.event(ev)
	ev = ev.Str("outcome", string(st.outcome)).Bytes("method", st.method)
	if st.status != 0 {
		ev = ev.Int("status", st.status)
	}
	if st.outcome == Executed && !st.completed {
		ev = ev.Bool("response_seen", false)
	} else if st.completed && st.omitted {
		ev = ev.Bool("body_kept", false)
	}
	if st.releaseReason != "" {
		ev = ev.Str("release_reason", st.releaseReason)
	}
	ev.Float64("duration_ms", float64(time.Since(st.start).Microseconds())/1000).Msg("request")
}

func parseStatus(v []byte) int {
	n, err := strconv.Atoi(string(v))
	if err != nil {
		return 0
	}
	return n
}

// stringAttribute returns the string attribute name, if Envoy sent it.
func stringAttribute(attrs map[string]*structpb.Struct, name string) (string, bool) {
	v, ok := attrs[extProcAttributes].GetFields()[name]
	if !ok {
		return "", false
	}
	s, ok := v.GetKind().(*structpb.Value_StringValue)
	if !ok {
		return "", false
	}
	return s.StringValue, true
}

// numberAttribute returns the integer attribute name, if Envoy sent it. Envoy sends CEL integers
// as JSON numbers (reference §17.2); a decimal string is accepted too.
func numberAttribute(attrs map[string]*structpb.Struct, name string) (int64, bool) {
	v, ok := attrs[extProcAttributes].GetFields()[name]
	if !ok {
		return 0, false
	}
	switch k := v.GetKind().(type) {
	case *structpb.Value_NumberValue:
		return int64(k.NumberValue), true
	case *structpb.Value_StringValue:
		n, err := strconv.ParseInt(k.StringValue, 10, 64)
		return n, err == nil
	}
	return 0, false
}

// origin is what a response's attributes say about who made it (SPEC §8).
type origin struct {
	// detailsKnown: response.code_details came; envoyMade: it is not via_upstream.
	detailsKnown, envoyMade bool
	// attempts is upstream.request_attempt_count when attemptsKnown (0: never sent upstream).
	attempts      int64
	attemptsKnown bool
}

// originOf reads where a response came from out of the response attributes Envoy sent with it.
func originOf(attrs map[string]*structpb.Struct) origin {
	details, detailsKnown := stringAttribute(attrs, attrCodeDetails)
	attempts, attemptsKnown := numberAttribute(attrs, attrAttemptCount)
	return origin{detailsKnown: detailsKnown, envoyMade: detailsKnown && details != "via_upstream", attempts: attempts, attemptsKnown: attemptsKnown}
}

// holdsRequestHeaders reports whether Envoy holds a request's headers until its body's answer
// in request body mode m, so that nothing of the request reaches the upstream before then:
// BUFFERED and BUFFERED_PARTIAL (ProcessorState::handleHeadersResponse in processor_state.cc:
// "hold the headers while we buffer the body"). In STREAMED and FULL_DUPLEX_STREAMED the
// headers go on at once.
func holdsRequestHeaders(m filterextproc.ProcessingMode_BodySendMode) bool {
	return m == filterextproc.ProcessingMode_BUFFERED || m == filterextproc.ProcessingMode_BUFFERED_PARTIAL
}

// contentLength is the request's content-length, or -1 when it has none or it is not a number.
func contentLength(h headers) int64 {
	n, err := strconv.ParseInt(string(h.get("content-length")), 10, 64)
	if err != nil {
		return -1
	}
	return n
}
