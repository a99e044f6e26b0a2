package extproc

import (
	"cmp"
	"context"
	"errors"
	"net/http"
	"strconv"
	"time"

	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// The stream is the Envoy side of one HTTP request: the order of Envoy's messages, the body
// modes, the answers the claim withholds and then owes, mode_override, and which answer carries
// the outcome. What the request is and what happens to its key is decided by the functions of
// decide.go; the stream reads their inputs out of Envoy's messages and carries their verdicts
// out as answers (answer.go) and as store calls, which its leaseCall makes (leasecall.go).

// state is where one request is in its life. It is the stream's one control value: what a
// message does follows from it, and the request's outcome is settled by the move that leaves it
// in pass or settled (stream.move). What the stream still owes Envoy (chunks, end) and what its
// store calls did (leaseCall) are values, not flags beside it.
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

// transitions is the stream's whole state machine. A move not in it is a bug: fire counts it in
// idempotency_internal_errors_total{kind="illegal_transition"}, logs it, and settles the request,
// whose lease finish then handles.
//
//	from         on           to           when
//	start        pass         pass         request_headers: not covered (route, method, no key, gRPC), or shadow mode
//	start        answer       settled      request_headers: 400, or the claim at the headers answered
//	start        await-body   collect      request_headers: the claim needs the whole body
//	start        run          running      request_headers: claimed (no body, or the route needs none)
//	start        unprotected  unprotected  request_headers: store failed under fail_mode: open, or NONE body mode under open
//	collect      pass         pass         shadow mode: the body's end, where enforcement would have answered
//	collect      answer       settled      the body's end: 409/422/replay/503; 413 over max_request_bytes or partial; the stream ends first
//	collect      run          running      the body's end: claimed
//	collect      unprotected  unprotected  the body's end: store failed under fail_mode: open; response headers before the body's end
//	running      store        capture      response_headers: a storable status via the upstream, body follows
//	running      settle       settled      response_headers: stored whole (no body), or released, or an ambiguous outcome
//	running      settle       settled      the stream ends before response headers: unknown_outcome
//	running      settle       settled      a gRPC body of several messages Envoy held with its headers: released, refused
//	capture      settle       settled      the body's end (or trailers): completed; the stream ends first: completed without body
//	unprotected  settle       settled      response_headers, or the stream ends first
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

// bodyEnd is how far a covered request's body has come, as far as the stream needs to know.
type bodyEnd uint8

const (
	// bodyOpen: more may come, or none will.
	bodyOpen bodyEnd = iota
	// bodyEnded: its last chunk came (end_of_stream).
	bodyEnded
	// bodyTrailers: trailers ended it; their answer is owed with the body's.
	bodyTrailers
	// bodyHeld: the request was claimed at its headers, and Envoy holds them until the body's
	// answer, so nothing of it has reached the upstream yet (holdsHeaders). Only a request that
	// announces body bytes (content-length above 0) is known to get a body message: one with
	// trailers and no data gets none, and under request_trailer_mode SKIP Envoy sends it
	// upstream without another message (Filter::onTrailers in ext_proc.cc).
	bodyHeld
)

// requestBodyRow is how the Envoy side takes a covered request's body in one request body mode.
// The decision never sees the mode: it gets the whole body, or a 413.
type requestBodyRow struct {
	// oneMessage: the body comes in one message, whatever end_of_stream says (BUFFERED: it is
	// false when trailers follow). partial: end_of_stream false means Envoy's buffer limit cut
	// it (BUFFERED_PARTIAL): too large, since the rest would pass unseen.
	oneMessage, partial bool
	// holdsHeaders: Envoy holds the request headers until the body's answer
	// (ProcessorState::handleHeadersResponse in processor_state.cc: "hold the headers while we
	// buffer the body"). Otherwise they go upstream at once.
	holdsHeaders bool
	// withholdHeaders: the header answer waits for the claim, since Envoy sends the body
	// without waiting for it (FULL_DUPLEX_STREAMED always, STREAMED with bodyFirst).
	withholdHeaders, withholdIfBodyFirst bool
	// none: no body message ever comes.
	none bool
}

// The other modes (STREAMED, and any Envoy adds) collect the body chunk by chunk, pipelined,
// and claim at its end (end_of_stream, or the trailers).
var requestBodyRows = map[filterextproc.ProcessingMode_BodySendMode]requestBodyRow{
	filterextproc.ProcessingMode_BUFFERED:             {oneMessage: true, holdsHeaders: true},
	filterextproc.ProcessingMode_BUFFERED_PARTIAL:     {oneMessage: true, partial: true, holdsHeaders: true},
	filterextproc.ProcessingMode_STREAMED:             {withholdIfBodyFirst: true},
	filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED: {withholdHeaders: true},
	filterextproc.ProcessingMode_NONE:                 {none: true},
}

// shippedModes is the protocol_config of an Envoy that announces none (before 1.32): the
// shipped BUFFERED modes. Nothing changes it.
var shippedModes = &extprocv3.ProtocolConfiguration{
	RequestBodyMode:  filterextproc.ProcessingMode_BUFFERED,
	ResponseBodyMode: filterextproc.ProcessingMode_BUFFERED,
}

// fullDuplex is the body mode whose chunks the processor echoes, and in which Envoy ignores
// mode_override.
const fullDuplex = filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED

// extProcAttributes is the key of Envoy's attributes map (Filter::addAttributes in ext_proc.cc).
const extProcAttributes = "envoy.filters.http.ext_proc"

// The attributes and metadata the processor reads: where a response came from, the route Envoy
// chose, the mTLS peer, the payload jwt_authn verified, and the policy route an Envoy route names
// in the stream's initial metadata.
const (
	attrCodeDetails   = "response.code_details"
	attrAttemptCount  = "upstream.request_attempt_count"
	attrRouteName     = "xds.route_name"
	attrPeerIdentity  = "connection.uri_san_peer_certificate"
	jwtAuthnNamespace = "envoy.filters.http.jwt_authn"
	namedRouteHeader  = "x-idempotency-route"
)

// maxStreamedChunk bounds the chunks the processor sends back in a FULL_DUPLEX_STREAMED request
// body (Envoy's ext_proc documentation recommends at most 64 KiB per streamed_response).
const maxStreamedChunk = 64 << 10

// admitted is what the request headers fixed, once: the route, the request's identity, what the
// decision admitted, and the request's trace span. The stream and its leaseCall point to it;
// nothing changes it after the request headers, except on a route that reads its body's members,
// whose route, key and scope the body's end settles (jsonstream.go) before any store call.
type admitted struct {
	route *route
	// id is the request's x-request-id, cut to maxLoggedRequestID.
	id    string
	info  requestInfo
	adm   admission
	start time.Time
	// span is the request's trace span; nil without a tracer, or for a request not covered.
	span trace.Span
	// named is the policy route the stream's initial metadata names (x-idempotency-route), ""
	// for none.
	named string
}

// stream is one HTTP request: what it needs to answer Envoy's next message. Its methods run on
// the stream's goroutine, except the renewal (renewal.go), which shares only the hold.
type stream struct {
	s *Server
	// call owns the request's store calls and knows what became of them (leasecall.go); req is
	// what the request headers fixed (route nil until they came).
	call *leaseCall
	req  *admitted

	state state
	// pc is the protocol_config of the stream's first message: the body modes Envoy announced,
	// per-route overrides included; shippedModes when it announced none (Envoy before 1.32). nil
	// until the first message.
	pc *extprocv3.ProtocolConfiguration
	// What the stream owes Envoy for a request whose claim waits for the body's end, and what it
	// holds of that body: how many body chunks' answers are owed, the body collected so far
	// (STREAMED, FULL_DUPLEX_STREAMED), and how far it has come. flush pays it, in Envoy's
	// order; whether the request headers' answer is owed follows from where the stream was and
	// the body mode (flush).
	chunks int
	body   []byte
	end    bodyEnd
	// out collects the answers of the message being handled, in order.
	out []*extprocv3.ProcessingResponse

	// outcome is settled once, by the move into pass or settled (move).
	outcome Outcome
	// sentOverride is the mode_override this stream sent, to tell when Envoy refused it.
	sentOverride *filterextproc.ProcessingMode
}

// newStream returns the stream of a request whose context is ctx, and whose first-message
// context is first (nil on a server without TapHandle, limits.go).
func newStream(s *Server, ctx context.Context, first *firstMessageContext) *stream {
	// One allocation for the stream, its store calls and its request. The answers' slice is not
	// in it: a slice that grew out of an array there would leave the array holding the first
	// answers, a FULL_DUPLEX_STREAMED body's included, for the stream's life.
	b := &struct {
		st   stream
		call leaseCall
		req  admitted
	}{}
	b.call = leaseCall{s: s, req: &b.req, ctx: ctx}
	b.st = stream{s: s, call: &b.call, req: &b.req}
	// The route the stream's metadata names: as the tap read it, or from the context, where
	// ValueFromIncomingContext reads the one key (FromIncomingContext would copy the stream's
	// whole metadata).
	if first != nil {
		b.req.named = first.named
	} else if v := metadata.ValueFromIncomingContext(ctx, namedRouteHeader); len(v) > 0 {
		b.req.named = v[0]
	}
	return &b.st
}

// move moves the stream on e, following transitions, and sends a, the answer that goes with the
// move (none when a is nil: the stream ended, or nothing is owed yet). The move into pass or
// settled settles the request's outcome (settleOutcome), and a carries its dynamic metadata to
// Envoy. A move not in the table is a bug: it is counted, logged, and settles the request.
func (st *stream) move(e event, a answer) {
	from, to, ok := st.state, stateSettled, false
	for _, t := range transitions {
		if t.from == from && t.on == e {
			to, ok = t.to, true
			break
		}
	}
	if !ok {
		st.s.metrics.internalErrors.WithLabelValues(internalIllegalTransition).Inc()
		st.call.event(st.s.log.Error()).Stringer("state", from).Stringer("event", e).Msg("stream state machine: move not in the table; the request is settled")
	}
	st.state = to
	var md []byte
	if st.outcome == "" && (to == statePass || to == stateSettled) {
		md = st.settleOutcome(e, from, a)
	}
	if a != nil {
		st.send(a, md)
	}
}

// settleOutcome settles the request's outcome, once, on the move on e from the state from that
// leaves the stream in pass or settled, a the answer that goes with the move: here and only here,
// and only move calls it. The metric, the log line, the span and the dynamic metadata all read
// the outcome; settleOutcome returns the metadata, which a carries.
func (st *stream) settleOutcome(e event, from state, a answer) []byte {
	var answered Outcome
	switch a := a.(type) {
	case refuse:
		answered = a.p.outcome
	case replay:
		answered = Replayed
		if a.refused {
			answered = NotReplayable
		}
	}
	st.outcome = settle(e, from, answered, st.call.err)
	return st.req.route.metadata.encode(st.outcome, st.call.released(), st.call.keyHash)
}

// send queues the answer a; md, when not nil, is the dynamic metadata of the outcome the move it
// goes with settled (move).
func (st *stream) send(a answer, md []byte) {
	if st.end == bodyHeld {
		if k := a.answers(); k == kindRequestBody || k == kindRequestTrailers {
			st.end = bodyOpen // Envoy sends the request on
		}
	}
	if st.req.adm.grpc && st.sendGRPC(a, md) {
		return
	}
	r := st.req.route
	var resp *extprocv3.ProcessingResponse
	var own bool
	if p, ok := a.(refuse); ok && r.JSONRPC {
		// On a json_rpc route a problem is a JSON-RPC error with the request's id (a replay's
		// id was rewritten by rpcVerdict).
		resp, own = rpcProblem(p.p, r.Route, st.rpcID()), true
	} else {
		resp, own = render(r, a)
	}
	if md != nil {
		resp = withMetadata(resp, own, md)
	}
	st.out = append(st.out, resp)
}

// handle answers one message: zero answers (withheld until the claim), one, or several (the
// withheld ones, in order). It never panics on a message out of order; a message of no known
// kind gets ok false, which ends the stream.
func (st *stream) handle(req *extprocv3.ProcessingRequest) (answers []*extprocv3.ProcessingResponse, ok bool) {
	st.out = st.out[:0]
	if st.pc == nil {
		// protocol_config comes on the stream's first message only (Filter::sendRequest in
		// ext_proc.cc).
		st.pc = cmp.Or(req.GetProtocolConfig(), shippedModes)
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
		if st.state == stateCapture {
			// Trailers end the body of a streamed response: the record is written before their
			// answer lets the response's end go on.
			if st.req.adm.grpc {
				st.grpcTrailers(r.ResponseTrailers)
			} else {
				st.call.complete()
			}
			st.move(evSettle, proceed(kindResponseTrailers))
			break
		}
		st.send(proceed(kindResponseTrailers), nil)
	default:
		return nil, false
	}
	return st.out, true
}

// withholdsHeaders reports whether the answer to a covered request's headers waits for the claim
// at the body's end: Envoy sends the body without waiting for it (FULL_DUPLEX_STREAMED, or
// STREAMED with send_body_without_waiting_for_header_response).
func (st *stream) withholdsHeaders() bool {
	row := requestBodyRows[st.pc.GetRequestBodyMode()]
	return row.withholdHeaders || (row.withholdIfBodyFirst && st.pc.GetSendBodyWithoutWaitingForHeaderResponse())
}

// pass is the answer to a message that needs nothing from the processor: CONTINUE, or the same
// chunk back in a FULL_DUPLEX_STREAMED direction. In body mode GRPC (one message per body
// message) too: grpc-go's ext_proc client fails the call on a body answer without
// streamed_response (validateBodyResponse in grpc-go's
// internal/xds/httpfilter/extproc/ext_proc.go), and its half-close (a body with
// end_of_stream_without_message) is answered with one.
func (st *stream) pass(k msgKind, chunk []byte, eos bool) answer {
	if k != kindRequestBody && k != kindResponseBody {
		return proceed(k)
	}
	mode := st.pc.GetRequestBodyMode()
	if k == kindResponseBody {
		mode = st.pc.GetResponseBodyMode()
	}
	switch mode {
	case filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED:
		return echo{k: k, chunk: chunk, eos: eos}
	case filterextproc.ProcessingMode_GRPC:
		return echo{k: k, chunk: chunk, eos: eos, noMessage: eos && len(chunk) == 0}
	}
	return proceed(k)
}

func (st *stream) requestHeaders(req *extprocv3.ProcessingRequest, m *extprocv3.HttpHeaders) {
	if st.state != stateStart {
		st.send(proceed(kindRequestHeaders), nil)
		return
	}
	h := headers(m.GetHeaders().GetHeaders())
	if !st.admit(req, h) {
		return
	}
	if st.s.tracer != nil {
		st.beginSpan()
	}
	row := requestBodyRows[st.pc.GetRequestBodyMode()]
	if m.GetEndOfStream() || !st.req.adm.needsBody {
		// Nothing to wait for: claim now, so that a duplicate's answer comes before its body is
		// uploaded.
		if !m.GetEndOfStream() && contentLength(h) > 0 && row.holdsHeaders {
			st.end = bodyHeld
		}
		st.claim(nil)
		return
	}
	if row.none {
		st.bodyNotAvailable()
		return
	}
	var a answer
	if !st.withholdsHeaders() {
		a = proceed(kindRequestHeaders) // Envoy sends the body only after this answer
	}
	st.move(evAwaitBody, a)
}

// admit reads the request headers h into the request (its route, identity and admission), and
// answers a request that is not to be claimed: not covered, or refused at once. It reports
// whether a claim follows.
func (st *stream) admit(req *extprocv3.ProcessingRequest, h headers) bool {
	a := st.req
	a.start = time.Now()
	id := h.get("x-request-id") // cut: a log line quotes it, escaping what is not UTF-8
	a.id = string(id[:min(len(id), maxLoggedRequestID)])
	// Envoy's attributes; a missing one, or one not a string, reads as "".
	attrs := req.GetAttributes()[extProcAttributes].GetFields()
	a.info = requestInfo{headers: h, method: h.get(":method"), path: h.get(":path")}
	sel := policy.Selector{Path: string(splitPath(a.info.path)), RouteName: attrs[attrRouteName].GetStringValue()}
	sel.Named = a.named
	r, params, err := st.s.policy.Select(sel)
	if err != nil {
		st.unknownRoute(sel.Named, err)
		return false
	}
	a.route, a.info.params = st.s.routes[r], params
	a.info.peer = attrs[attrPeerIdentity].GetStringValue()
	// A route match.json decides may hand the request to one that scopes by jwt_claim.
	if a.route.claims || a.route.decidedByBody {
		a.info.jwtAuthn = req.GetMetadataContext().GetFilterMetadata()[jwtAuthnNamespace]
	}
	if a.route.decidedByBody && !isGRPC(h) {
		// The body decides the route (match.json): readBody chooses it, by sel, and admits the
		// request at the body's end.
		a.info.body = &jsonState{sel: sel, maxBytes: st.s.policy.MaxRequestBytesBy(sel)}
		a.adm = admission{covered: true, needsBody: true}
	} else if a.adm = admit(a.route, a.info); a.adm.grpc {
		a.adm = grpcAdmit(a.adm, st.pc.GetRequestBodyMode())
	}
	switch {
	case !a.adm.covered:
		st.passThrough()
		return false
	case a.adm.problem == problemScopeAmbiguous:
		st.s.misconfigured(MisconfigScopeAmbiguous, func() {
			st.call.event(st.s.log.Error()).Msg("jwt_authn forwarded several payloads and the route scopes by jwt_claim without jwt_payload_key; name the payload (the provider's payload_in_metadata) in jwt_payload_key")
		})
		fallthrough
	case a.adm.problem != nil:
		st.reject(a.adm.problem)
		return false
	}
	return true
}

// unknownRoute answers a request whose Envoy route names a policy route that does not exist, or
// one whose path parameters the request's path does not have: 500, never the defaults, which
// would protect it under another route's scope and settings. Each name is logged once while
// remembered.
func (st *stream) unknownRoute(name string, err error) {
	st.req.route = st.s.routes[st.s.policy.Default]
	st.s.misconfigured(MisconfigUnknownRoute, nil)
	if st.s.firstUnknownRoute(name) {
		st.call.event(st.s.log.Error()).Str("named_route", name[:min(len(name), maxLoggedRouteName)]).Err(err).Msg("x-idempotency-route names a route the policy cannot apply to this request; answering 500 unknown-idempotency-route")
	}
	p := problemUnknownRoute
	if errors.Is(err, policy.ErrPathParams) {
		p = problemRouteMismatch
	}
	st.req.adm = admission{covered: true, problem: p}
	st.reject(p)
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

// bodyNotAvailable settles a covered request whose body the processor will never see
// (request_body_mode NONE): 500, or unprotected under fail_mode: open.
func (st *stream) bodyNotAvailable() {
	st.s.misconfigured(MisconfigBodyNotAvailable, func() {
		st.call.event(st.s.log.Error()).Msg("request_body_mode is NONE, so the processor never sees the bodies of covered requests that need them (fingerprint: body, or missing_key: body-hash); set request_body_mode BUFFERED, or drop body from this route's fingerprint")
	})
	if st.s.policy.FailMode == policy.FailOpen && !st.req.route.shadow {
		st.move(evUnprotected, proceed(kindRequestHeaders))
		return
	}
	st.reject(problemBodyNotAvailable)
}

func (st *stream) requestBody(chunk []byte, eos bool) {
	if st.state != stateCollect {
		if !st.notUnaryHeld(chunk) {
			st.send(st.pass(kindRequestBody, chunk, eos), nil)
		}
		return
	}
	if row := requestBodyRows[st.pc.GetRequestBodyMode()]; row.oneMessage {
		// A partial buffer can neither fingerprint the request nor stand for its key. Trailers
		// also make end_of_stream false: such requests are refused too, rather than let one run
		// unclaimed. (In shadow mode the buffer's answer is owed, and sent.)
		st.chunks = 1
		if row.partial && !eos {
			st.reject(problemTooLarge)
			return
		}
		st.claim(chunk)
		return
	}
	// Envoy may send the body as one message or as many, pipelined (a body complete during the
	// header call comes whole: Filter::handleCompleteBodyAvailable). Collect it, withholding
	// every answer, and claim at its end.
	if eos {
		st.end = bodyEnded
	}
	if len(st.body)+len(chunk) > st.maxRequestBytes() {
		if st.req.route.shadow {
			// The request goes on untouched: this chunk's answer is owed too, and in
			// FULL_DUPLEX_STREAMED the chunk itself, streamed back with what came before it.
			st.body = append(st.body, chunk...)
			st.chunks++
		} else {
			st.body = nil
		}
		st.reject(problemTooLarge)
		return
	}
	st.body = append(st.body, chunk...)
	st.chunks++
	if eos {
		st.claim(st.body)
	}
}

func (st *stream) requestTrailers() {
	if st.state != stateCollect {
		st.send(proceed(kindRequestTrailers), nil)
		return
	}
	// Trailers end the body: in the streamed modes after its chunks, and in the buffered modes
	// for a request that had trailers and no data.
	st.end = bodyTrailers
	st.claim(st.body)
}

// passThrough leaves the request alone and asks Envoy to skip every later phase. In a
// FULL_DUPLEX_STREAMED request Envoy ignores mode_override (Filter::onHeaders in ext_proc.cc
// merges it only outside that mode), and grpc-go's client reads none (noPath): none is sent, and
// every later message is answered.
func (st *stream) passThrough() {
	if st.pc.GetRequestBodyMode() == fullDuplex || st.pc.GetResponseBodyMode() == fullDuplex || st.noPath() {
		st.move(evPass, proceed(kindRequestHeaders))
		return
	}
	st.sentOverride = passThroughMode
	st.move(evPass, passOn{})
}

// reject settles a covered request with a problem answered by the server (in shadow mode, it only
// counts it).
func (st *stream) reject(p *problem) {
	if st.s.tracer != nil {
		st.beginSpan()
	}
	if st.req.route.shadow {
		st.shadowed(p.outcome)
		return
	}
	st.move(evAnswer, refuse{p})
}

// flush moves the stream on e and sends the answers the claim withheld, in Envoy's order, the
// first going with the move: the headers (owed when the claim came at them, or when Envoy sent
// the body without waiting for their answer), the body (the chunks' answers, or in
// FULL_DUPLEX_STREAMED the body itself, streamed back), the trailers.
func (st *stream) flush(e event) {
	from, moved := st.state, false
	send := func(a answer) {
		if !moved {
			st.move(e, a)
			moved = true
		} else {
			st.send(a, nil)
		}
	}
	if from == stateStart || st.withholdsHeaders() {
		send(proceed(kindRequestHeaders))
	}
	if st.pc.GetRequestBodyMode() == fullDuplex && st.chunks > 0 {
		// The body streamed back ends where Envoy's did: not at all yet when the response began
		// early or a shadowed request was too large, before the trailers when they came.
		body := st.body
		for {
			n := min(len(body), maxStreamedChunk)
			last := n == len(body)
			send(echo{k: kindRequestBody, chunk: body[:n], eos: last && st.end == bodyEnded})
			body = body[n:]
			if last {
				break
			}
		}
		// Sent back, the body is Envoy's again: the stream must not keep it for the whole
		// upstream call.
		st.body = nil
	} else {
		for range st.chunks {
			send(proceed(kindRequestBody))
		}
	}
	if st.end == bodyTrailers {
		send(proceed(kindRequestTrailers))
	}
	st.chunks = 0
	if !moved {
		st.move(e, nil)
	}
}

// claim makes the claims of a covered request (claimOnce), judges each result (judgeClaim), and
// carries out the verdict: 422, 409, a replay, a wait and another claim, or running it under a
// fresh lease.
func (st *stream) claim(body []byte) {
	if st.req.adm.grpc && st.notUnary(body) {
		return
	}
	fpBody := body
	if st.req.info.body != nil || st.req.route.json != nil {
		// The route reads its body's members, or match.json chooses it (jsonstream.go).
		var ok bool
		if fpBody, ok = st.readBody(body); !ok {
			return
		}
	}
	r := st.req.route
	key, fp := st.keys(body, fpBody)
	if st.pc.GetRequestBodyMode() != fullDuplex {
		st.body = nil // Envoy holds the body; only a FULL_DUPLEX_STREAMED one is sent back
	}
	c := cache.Claim{Fingerprint: fp, LockTTL: r.LockTTL, TTL: st.req.adm.ttl, Route: r.Name,
		Replicas: r.Durability.Replicas, ReplicaTimeout: r.Durability.Timeout}
	failOpen := st.s.policy.FailMode == policy.FailOpen
	// A duplicate of a request in flight may wait for its replay: the route's in_flight_wait, or
	// less when the client's Prefer: wait=N asks for less (RFC 7240).
	wait, preferred := r.InFlightWait, false
	if wait > 0 {
		if n, ok := preferWait(st.req.info.headers); ok {
			wait, preferred = min(wait, time.Duration(n)*time.Second), true
		}
	}
	var deadline time.Time
	calls := 0
	for rounds := 0; ; rounds++ {
		res := st.claimOnce(key, c, rounds, &calls)
		var now time.Time
		if wait > 0 {
			if now = st.s.clock.Now(); deadline.IsZero() {
				deadline = now.Add(wait)
			}
			res.mayWait = now.Before(deadline)
		}
		v := judgeClaim(r.Route, fp, r.shadow, failOpen, res)
		if v.act != actWait {
			waited := ""
			if preferred && rounds > 0 {
				// RFC 7240 counts whole seconds: the budget rounded up, never above the client's N.
				waited = "wait=" + strconv.Itoa(int((wait+time.Second-1)/time.Second))
			}
			st.carryOut(v, res.rec, waited)
			return
		}
		// In flight: wait for the first request to complete rather than answer 409 at once,
		// polling no faster than every waitPoll.
		if !sleep(st.s.clock, st.call.ctx, min(waitPoll, deadline.Sub(now))) {
			st.move(evAnswer, nil) // Envoy gave up on the request: nobody waits for an answer
			return
		}
	}
}

// keys returns the request's stored key and fingerprint, body being its whole body and fpBody
// what the fingerprint hashes of it (readBody), and gives the key's hash to the request's store
// calls.
func (st *stream) keys(body, fpBody []byte) (key string, fp []byte) {
	a, r := st.req, st.req.route
	d := st.s.digests.Get().(*digest)
	k := a.adm.key
	if k == "" { // missing_key: body-hash
		if r.json != nil {
			body = fpBody // a JSON route's key hashes what its fingerprint does: /id left out
		}
		k = d.bodyHashKey(a.info.method, a.info.path, body)
	}
	key, st.call.keyHash = d.storeKey(r.Route, a.info, a.adm.jwt, k)
	fp = d.fingerprint(st.call.fp[:0], r.Route, a.info.method, a.info.path, fpBody, a.info.headers)
	st.s.digests.Put(d)
	return key, fp
}

// claimOnce makes one claim of key with c, in the round-th round: none when the route asks for
// more replicas than the store has (the first round only, as the verdict then ends the claim);
// none when this replica holds the key itself, whose hold answers as the pending record it is
// (whatever the store says, a record it lost in an outage, a purge, the request is not started
// twice here); else the store's, counted in calls.
func (st *stream) claimOnce(key string, c cache.Claim, round int, calls *int) claimResult {
	r := st.req.route
	if round == 0 && r.Durability.Replicas > 0 && st.call.undurable(r.Durability.Replicas) {
		return claimResult{err: errDurabilityUnmet}
	}
	if h := st.s.holds.get(key); h != nil {
		return claimResult{rec: h.record()}
	}
	if *calls++; *calls > 1 {
		r.waitCalls.Inc()
	}
	rec, err := st.call.acquire(key, c)
	return claimResult{err: err, gone: err != nil && st.call.ctx.Err() != nil, rec: rec}
}

// carryOut turns a claim's verdict into the stream's move and answers; rec is the record a replay
// sends, waited the Preference-Applied of a duplicate that waited for it.
func (st *stream) carryOut(v verdict, rec *cache.Record, waited string) {
	if st.req.adm.grpc {
		v = st.grpcVerdict(v, rec)
	}
	if st.req.route.JSONRPC {
		v, rec = st.rpcVerdict(v, rec)
	}
	switch v.act {
	case actRun:
		if st.req.route.shadow {
			st.req.route.shadowCounts[Executed].Inc()
		}
		st.flush(evRun)
	case actUnprotected:
		// Its response headers still come, for the replay header.
		st.flush(evUnprotected)
	case actReplay:
		st.move(evAnswer, replay{rec: rec, waited: waited, refused: st.req.adm.grpc && !st.grpcReplayable(rec)})
	case actRefuse:
		st.move(evAnswer, refuse{v.problem})
	case actShadow:
		st.shadowed(v.would)
	default:
		st.move(evAnswer, nil) // the stream ended: nobody waits for an answer
	}
}

// waitPoll is the least time between two store calls of a waiting duplicate.
const waitPoll = 50 * time.Millisecond

// shadowed counts and logs what enforcement would have answered, and lets the request go on
// untouched instead.
func (st *stream) shadowed(would Outcome) {
	st.req.route.shadowCounts[would].Inc()
	st.call.event(st.s.log.Info()).Str("would", string(would)).Msg("shadow mode: enforcement would have answered this request; it goes on untouched")
	if st.state == stateStart {
		st.passThrough()
		return
	}
	st.flush(evPass)
}

func (st *stream) responseHeaders(m *extprocv3.HttpHeaders, attrs map[string]*structpb.Struct) {
	switch st.state {
	case stateRunning:
		st.respond(m, attrs)
	case stateCollect:
		st.earlyResponse(attrs)
		st.move(evSettle, st.markResponse(false, false))
	case stateUnprotected:
		st.move(evSettle, st.markResponse(false, false))
	case statePass:
		if st.sentOverride == passThroughMode {
			st.overrideRefused()
		}
		st.send(proceed(kindResponseHeaders), nil)
	default:
		st.send(proceed(kindResponseHeaders), nil)
	}
}

// respond carries out what the response to a request that runs under its lease does to the
// lease (judgeResponse): release it, follow unknown_outcome, record the response now, or capture
// its body.
func (st *stream) respond(m *extprocv3.HttpHeaders, attrs map[string]*structpb.Struct) {
	r, c := st.req.route, st.call
	h := headers(m.GetHeaders().GetHeaders())
	v := h.get(":status")
	status, err := strconv.Atoi(string(v))
	switch {
	case v == nil && st.proxyless():
		// grpc-go's ext_proc client sends none: its response headers are the call's metadata.
		status = http.StatusOK
	case err != nil:
		status = 0
	}
	o := originOf(attrs)
	if !o.detailsKnown || o.attempts > 1 {
		st.noteOrigin(o)
	}
	bodySent := st.pc.GetResponseBodyMode() != filterextproc.ProcessingMode_NONE
	resp := response{status: status, origin: o, endOfStream: m.GetEndOfStream(), bodySent: bodySent}
	what, reason, omitted := judgeResponse(r.Route, resp)
	if st.req.adm.grpc {
		what, reason, omitted = st.judgeGRPC(resp, h)
	}
	c.resp.Status = status
	switch what {
	case settleRelease:
		c.release(reason)
	case settleUnknown:
		if !o.attemptsKnown && !st.proxyless() {
			st.s.misconfigured(MisconfigAttemptCountMissing, func() {
				c.event(st.s.log.Warn()).Msg("an Envoy-made response came without upstream.request_attempt_count; add it to the ext_proc filter's response_attributes, or every such response is treated as an unknown outcome")
			})
		}
		st.unknownOutcome(status)
	case settleRecord:
		c.resp.Headers, c.resp.BodyOmitted = replayableHeaders(h, r.Route), omitted
		c.complete()
		st.move(evSettle, st.markResponse(!omitted || !bodySent, c.fate == leaseRecorded))
		return
	case settleCapture:
		c.resp.Headers = replayableHeaders(h, r.Route)
		// A gRPC call's trailers say whether it is stored: no expiry before them.
		st.move(evStore, st.markResponse(true, !st.req.adm.grpc))
		return
	}
	st.move(evSettle, st.markResponse(false, false))
}

// noteOrigin counts what the attributes of a response show of Envoy's configuration:
// response.code_details missing, or a request the router sent upstream more than once. respond
// calls it only when one of them shows.
func (st *stream) noteOrigin(o origin) {
	if !o.detailsKnown && !st.proxyless() {
		st.s.misconfigured(MisconfigCodeDetailsMissing, func() {
			st.call.event(st.s.log.Warn()).Msg("a response came without response.code_details; add it to the ext_proc filter's response_attributes, or responses that would release the key are treated as possibly Envoy's (unknown outcomes)")
		})
	}
	if o.attemptsKnown && o.attempts > 1 {
		// Not a misconfiguration by itself: retries on connect-failure or refused-stream (Istio's
		// default policy has them) never reached the upstream. The config checks refuse the
		// retry conditions that may run a request twice.
		st.req.route.retried.Inc()
		st.s.retriedLog.Do(func() {
			st.call.event(st.s.log.Info()).Int64("attempts", o.attempts).Msg("Envoy's router sent a covered request upstream more than once (retry_policy or hedge_policy): harmless after connect-failure or refused-stream, a possible second execution after reset, 5xx or a per-try timeout; counted in idempotency_upstream_retries_total")
		})
	}
}

// earlyResponse handles response headers that came before the request's end reached the
// processor: Envoy answered it itself (an overflow, a timeout), the upstream answered early, or
// Envoy sent the request on without the body phase (trailers and no data under
// request_trailer_mode SKIP: Filter::onTrailers continues when it has nothing buffered and sends
// no trailers). In the last two the request ran without a lease (its outcome stays passthrough).
// Under BUFFERED and BUFFERED_PARTIAL Envoy holds the headers until the body's answer, so only
// the skipped trailers can explain it: a misconfiguration, counted. Under STREAMED and
// FULL_DUPLEX_STREAMED the headers went upstream before the claim, and an upstream may answer
// before the body ends. What was withheld is answered first.
func (st *stream) earlyResponse(attrs map[string]*structpb.Struct) {
	if o := originOf(attrs); !o.envoyMade || !o.attemptsKnown || o.attempts > 0 {
		if requestBodyRows[st.pc.GetRequestBodyMode()].holdsHeaders {
			st.s.misconfigured(MisconfigUnclaimedRequest, func() {
				st.call.event(st.s.log.Warn()).Msg("the upstream answered a covered request whose end the processor never saw, so it ran without a lease; set request_trailer_mode: SEND in the ext_proc filter's processing_mode (requests with trailers and no body otherwise skip the body phase)")
			})
		} else {
			st.s.earlyAnswerLog.Do(func() {
				st.call.event(st.s.log.Info()).Msg("the upstream answered a streamed request before its body ended (Envoy sends a STREAMED request's headers on before the claim), so it ran without a lease; its outcome is passthrough")
			})
		}
		st.call.event(st.s.log.Debug()).Msg("the response began before the request body reached the processor whole; this request ran unprotected")
	}
	st.flush(evUnprotected)
}

// markResponse is the answer to the response headers of a covered request: the replay header
// set to false (replay_header_fresh), and the record's expiry when the response is stored. A
// response whose body the processor need not see also has its body phase turned off, unless
// Envoy would ignore the override (FULL_DUPLEX_STREAMED) or sends no body anyway. In shadow mode
// the response goes on untouched.
func (st *stream) markResponse(wantBody, stored bool) answer {
	noBody := !wantBody && st.pc.GetResponseBodyMode() != fullDuplex && st.pc.GetResponseBodyMode() != filterextproc.ProcessingMode_NONE && !st.noPath()
	if noBody {
		st.sentOverride = noStoreMode
	}
	if st.req.route.shadow {
		return untouched{noBody: noBody}
	}
	var expires time.Time
	if stored && st.req.route.ExpiresHeader != "" {
		expires = st.s.clock.Now().Add(st.req.adm.ttl)
	}
	return mark{expires: expires, noBody: noBody}
}

// overrideRefused notes that Envoy sent a phase a mode_override had turned off: every request
// then goes through every phase, buffered.
func (st *stream) overrideRefused() {
	st.sentOverride = nil // once per stream
	st.s.misconfigured(MisconfigModeOverrideRefused, func() {
		st.call.event(st.s.log.Warn()).Msg("Envoy ignored this processor's mode_override: set allow_mode_override: true, list exactly the processor's two modes in allowed_override_modes (or none), and turn send_body_without_waiting_for_header_response off; until then every request's bodies go through the processor")
	})
}

func (st *stream) responseBody(chunk []byte, eos bool) {
	if st.state != stateCapture {
		if st.sentOverride == noStoreMode {
			st.overrideRefused()
		}
		st.send(st.pass(kindResponseBody, chunk, eos), nil)
		return
	}
	if st.req.adm.grpc {
		st.grpcResponseBody(chunk, eos)
		return
	}
	resp, last := &st.call.resp, eos
	switch st.pc.GetResponseBodyMode() {
	case filterextproc.ProcessingMode_BUFFERED:
		// The one message holds the whole body, even when trailers follow.
		last = true
	case filterextproc.ProcessingMode_BUFFERED_PARTIAL:
		// A partial buffer that does not end the body means the rest passed unseen.
		if !eos {
			resp.BodyOmitted = true
		}
		last = true
	}
	switch {
	case resp.BodyOmitted:
	case len(resp.Body)+len(chunk) > st.req.route.MaxResponseBytes:
		resp.BodyOmitted, resp.Body = true, nil
	case resp.Body == nil:
		resp.Body = chunk
	default:
		resp.Body = append(resp.Body, chunk...)
	}
	a := st.pass(kindResponseBody, chunk, eos)
	if !last {
		st.send(a, nil)
		return
	}
	// Durability: the record is written before Envoy may pass the response's end on.
	st.call.complete()
	st.move(evSettle, a)
}

// unknownOutcome handles a lease whose request may or may not have run upstream, as the route's
// unknown_outcome says; status is Envoy's, or 0 when no response was seen.
func (st *stream) unknownOutcome(status int) {
	r, c := st.req.route, st.call
	r.unknown[r.UnknownOutcome].Inc()
	switch r.UnknownOutcome {
	case policy.UnknownOutcomeRelease:
		c.release(ReleaseUnknownOutcome)
	case policy.UnknownOutcomeRecord:
		c.resp = cache.Response{Status: status, OutcomeUnknown: true}
		if c.complete() {
			c.event(st.s.log.Info()).Int("status", status).Msg("outcome unknown; recorded so that duplicates get 409 outcome-unknown")
		}
	default:
		c.leave()
		c.event(st.s.log.Info()).Dur("lock_ttl", r.LockTTL).Int("status", status).Msg("outcome unknown; lease kept until it expires")
	}
}

// finish runs when the stream ends, however it ends. A lease still held means the response was
// not seen whole: with storable response headers seen, the request ran and its record is
// completed without a body; with none, its outcome is unknown. A request not yet settled is
// settled now; then its outcome is counted, its span ended and its line logged.
func (st *stream) finish() {
	c := st.call
	if c.fate == leaseInStore {
		// The stream's goroutine is unwinding a panic from inside the store: no further store
		// call may be made (Server.StreamInterceptor lets the panic end the process).
		c.s.storeBroken.Store(true)
		return
	}
	if c.fate == leaseHeld {
		switch {
		case st.state == stateCapture && st.req.adm.grpc:
			// No grpc-status came: the call's outcome is unknown.
			st.grpcTrailersMissing()
			st.unknownOutcome(c.resp.Status)
		case st.state == stateCapture:
			c.resp.BodyOmitted = true
			c.complete()
		case st.end == bodyHeld:
			// Envoy still held the request when the stream ended (the client left during a
			// BUFFERED upload claimed at its headers): it never reached the upstream.
			c.release(ReleaseNotSent)
		default:
			st.unknownOutcome(0)
		}
		if st.state == stateRunning || st.state == stateCapture {
			// A stream an illegal move settled already keeps its outcome; the lease is
			// handled all the same, and no second illegal move is counted.
			st.move(evSettle, nil)
		}
	}
	if st.req.route == nil {
		return
	}
	switch {
	case st.outcome != "":
	case st.state == stateUnprotected:
		st.move(evSettle, nil)
	default:
		st.move(evAnswer, nil) // the client left before the request's end: nobody waits for an answer
	}
	if st.req.span != nil {
		st.endSpan()
	}
	st.req.route.outcomes[st.outcome].Inc()
	if st.req.adm.covered {
		st.logRequest()
	}
}

// logRequest writes the one line a covered request logs: its identity, outcome, status and how
// long it took.
func (st *stream) logRequest() {
	ev := st.s.log.Info()
	if st.outcome == StoreError {
		ev = st.s.log.Warn()
	}
	if ev == nil {
		return
	}
	c := st.call
	ev = c.event(ev).Str("outcome", string(st.outcome)).Bytes("method", st.req.info.method)
	if c.resp.Status != 0 {
		ev = ev.Int("status", c.resp.Status)
	}
	recorded := c.fate == leaseRecorded
	if st.outcome == Executed && (!recorded || c.resp.OutcomeUnknown) {
		// A record of an unknown outcome keeps no response: none was seen.
		ev = ev.Bool("response_seen", false)
	} else if recorded && c.resp.BodyOmitted {
		ev = ev.Bool("body_kept", false)
	}
	if reason := c.released(); reason != "" {
		ev = ev.Str("release_reason", reason)
	}
	ev.Float64("duration_ms", float64(time.Since(st.req.start).Microseconds())/1000).Msg("request")
}

// originOf reads where a response came from out of the response attributes Envoy sent with it.
// Envoy sends the attempt count, a CEL integer, as a JSON number (ExtProcLoggingInfo and the
// CEL conversion in matching_utils.cc); a decimal string is accepted too.
func originOf(attrs map[string]*structpb.Struct) origin {
	fields := attrs[extProcAttributes].GetFields()
	details, detailsKnown := fields[attrCodeDetails].GetKind().(*structpb.Value_StringValue)
	o := origin{detailsKnown: detailsKnown, envoyMade: detailsKnown && details.StringValue != "via_upstream"}
	switch k := fields[attrAttemptCount].GetKind().(type) {
	case *structpb.Value_NumberValue:
		o.attempts, o.attemptsKnown = int64(k.NumberValue), true
	case *structpb.Value_StringValue:
		n, err := strconv.ParseInt(k.StringValue, 10, 64)
		o.attempts, o.attemptsKnown = n, err == nil
	}
	return o
}

// contentLength is the request's content-length, or -1 when it has none or it is not a number.
func contentLength(h headers) int64 {
	n, err := strconv.ParseInt(string(h.get("content-length")), 10, 64)
	if err != nil {
		return -1
	}
	return n
}
