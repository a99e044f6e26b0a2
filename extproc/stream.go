package extproc

import (
	"bytes"
	"context"
	"errors"
	"strconv"
	"sync"
	"time"

	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/rs/zerolog"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

// phase is where a stream is in the lock-step exchange.
type phase uint8

const (
	// phaseStart: nothing seen yet.
	phaseStart phase = iota
	// phasePass: the request is not handled; every later message gets a plain CONTINUE.
	phasePass
	// phaseAwaitBody: covered, to be claimed at request_body.
	phaseAwaitBody
	// phaseRunning: the lease is held and the request went upstream.
	phaseRunning
	// phaseCapture: the response will be stored; its body is being collected.
	phaseCapture
	// phaseUnprotected: covered, but it went upstream without a lease (the store failed under
	// fail_mode: open, or its body could not be claimed whole): its response gets the replay
	// header and nothing is stored.
	phaseUnprotected
	// phaseDone: the outcome is settled; later messages get a plain CONTINUE.
	phaseDone
)

// extProcAttributes is the key of Envoy's attributes map (reference §2.2).
const extProcAttributes = "envoy.filters.http.ext_proc"

// stream is the state of one HTTP request. Its methods run on the stream's goroutine, except the
// renewal, which shares only the lease and is stopped before the lease changes.
type stream struct {
	s     *Server
	ctx   context.Context
	start time.Time

	phase     phase
	outcome   Outcome
	covered   bool
	requestID string

	route    *policy.Route
	rs       *routeState // the route's metric series and fixed answers
	params   []string
	headers  headers
	method   []byte
	path     []byte
	bodyHash bool
	key      string
	ttl      time.Duration

	storeKey string
	keyHash  string
	lease    cache.Lease
	renewal  *renewal

	// The body modes Envoy announced in the stream's first message; known is false when it
	// announced none (Envoy before 1.32), and the shipped BUFFERED modes are assumed.
	requestBodyMode  filterextproc.ProcessingMode_BodySendMode
	responseBodyMode filterextproc.ProcessingMode_BodySendMode
	knownBodyModes   bool
	status           int
	respHeaders      []cache.Header
	body             []byte
	omitted          bool
	completed        bool
}

func newStream(s *Server, ctx context.Context) *stream {
	return &stream{s: s, ctx: ctx, start: time.Now(), outcome: Passthrough}
}

// event adds the request's identity to a log event: its request id, route and the short hash of
// its stored key, never the key itself. It is safe on a disabled (nil) event.
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

// handle answers one message. It never panics on a message out of order: it answers CONTINUE of
// the matching kind, or nil (end the stream) for a message of no known kind.
func (st *stream) handle(req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
	if pc := req.GetProtocolConfig(); pc != nil && !st.knownBodyModes {
		st.requestBodyMode, st.responseBodyMode = pc.GetRequestBodyMode(), pc.GetResponseBodyMode()
		st.knownBodyModes = true
	}
	switch r := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return st.requestHeaders(r.RequestHeaders)
	case *extprocv3.ProcessingRequest_RequestBody:
		return st.requestBody(r.RequestBody)
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return st.responseHeaders(r.ResponseHeaders, req.GetAttributes())
	case *extprocv3.ProcessingRequest_ResponseBody:
		return st.responseBody(r.ResponseBody)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return continueRequestTrailers
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		// Trailers end the response body of a STREAMED response.
		if st.phase == phaseCapture {
			st.complete()
		}
		return continueResponseTrailers
	}
	return nil
}

func (st *stream) requestHeaders(m *extprocv3.HttpHeaders) *extprocv3.ProcessingResponse {
	if st.phase != phaseStart {
		return continueRequestHeaders
	}
	h := headers(m.GetHeaders().GetHeaders())
	st.headers = h
	st.method = h.get(":method")
	st.path = h.get(":path")
	st.requestID = string(h.get("x-request-id"))
	r, params := st.s.policy.Match(string(splitPath(st.path)))
	st.route, st.rs, st.params = r, st.s.routes[r], params

	if !r.Enabled || !r.Covers(string(st.method)) {
		return st.passThrough()
	}
	key, present, err := parseKey(h, r.KeyHeaders)
	switch {
	case err != nil:
		return st.reject(problemInvalidKey)
	case !present && r.MissingKey == policy.MissingKeyOptional:
		return st.passThrough()
	case !present && r.MissingKey == policy.MissingKeyRequired:
		return st.reject(problemMissingKey)
	case !present:
		st.bodyHash = true
	}
	st.covered = true
	st.key = key
	st.ttl = r.TTL
	if r.TTLHeader != "" {
		if v, ok := h.lookup(r.TTLHeader); ok {
			ttl, err := parseTTL(v, r.MaxTTL)
			if err != nil {
				return st.reject(problemInvalidTTL)
			}
			st.ttl = ttl
		}
	}
	if m.GetEndOfStream() {
		return st.claim(nil, true)
	}
	// Envoy sends the buffered body only after this answer (reference §3).
	st.phase = phaseAwaitBody
	return continueRequestHeaders
}

func (st *stream) requestBody(m *extprocv3.HttpBody) *extprocv3.ProcessingResponse {
	if st.phase != phaseAwaitBody {
		return continueRequestBody
	}
	// In BUFFERED mode the one body message holds the whole body, whatever end_of_stream says
	// (reference §2.4). In STREAMED and BUFFERED_PARTIAL modes only a first message that ends
	// the stream does; otherwise it is the body's first part, which could neither fingerprint
	// the request nor stand for its body-hash key.
	if mode := st.requestBodyMode; st.knownBodyModes && mode != filterextproc.ProcessingMode_BUFFERED &&
		(mode == filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED || !m.GetEndOfStream()) {
		st.unprotected("the request body did not come whole (request_body_mode " + mode.String() + "); set request_body_mode: BUFFERED")
		return continueRequestBody
	}
	return st.claim(m.GetBody(), false)
}

// unprotected lets a covered request go upstream without a lease, with a warning: its body
// could not be claimed. Its response gets the replay header, and nothing is stored.
func (st *stream) unprotected(why string) {
	st.event(st.s.log.Warn()).Msg(why + "; this request ran unprotected")
	st.phase, st.outcome, st.covered = phaseUnprotected, Passthrough, false
}

// passThrough leaves the request alone and asks Envoy to skip every later phase.
func (st *stream) passThrough() *extprocv3.ProcessingResponse {
	st.phase = phasePass
	st.outcome = Passthrough
	return passThroughRequestHeaders
}

// reject settles a covered request with a problem answered by the server.
func (st *stream) reject(p *problem) *extprocv3.ProcessingResponse {
	st.covered = true
	st.phase = phaseDone
	st.outcome = p.outcome
	return st.rs.problems[p]
}

// claim makes the one store round trip of a covered request and decides its fate: 422, 409,
// a replay, or running it under a fresh lease.
func (st *stream) claim(body []byte, atHeaders bool) *extprocv3.ProcessingResponse {
	r := st.route
	d := newDigest()
	if st.bodyHash {
		st.key = d.bodyHashKey(st.method, st.path, body)
	}
	st.storeKey, st.keyHash = d.storeKey(r, st.headers, st.params, st.key)
	fp := d.fingerprint(r, st.method, st.path, body, st.headers)

	lease, rec, err := st.s.acquire(st.ctx, st.storeKey, cache.Claim{Fingerprint: fp, LockTTL: r.LockTTL, TTL: st.ttl})
	if err != nil && st.ctx.Err() != nil {
		// Envoy ended the stream during the call (the client went away): not the store's
		// failure, and nobody waits for an answer. The request never went upstream.
		st.event(st.s.log.Debug()).Err(err).Msg("stream ended during the store call")
		st.phase = phaseDone
		return continueClaimed(atHeaders)
	}
	if err != nil {
		st.storeFailed("acquire", err)
		if st.s.policy.FailMode == policy.FailOpen {
			// Its response headers still come, for the replay header.
			st.phase = phaseUnprotected
			return continueClaimed(atHeaders)
		}
		return st.reject(problemStoreUnavailable)
	}
	if rec != nil {
		// The mismatch check comes before the in-flight and replay checks (SPEC §4).
		switch {
		case !bytes.Equal(fp, rec.Fingerprint) &&
			// A record without a fingerprint comes from a build before b740924, for a route
			// with none: such a route accepts it, as that build did, until it expires.
			(len(r.Fingerprint) > 0 || len(rec.Fingerprint) > 0):
			return st.reject(problemReused)
		case rec.State == cache.Pending:
			return st.reject(problemInProgress)
		case rec.Response.BodyOmitted:
			return st.reject(problemNotReplayable)
		}
		st.phase = phaseDone
		st.outcome = Replayed
		return replayResponse(&rec.Response, r.ReplayHeader)
	}
	st.lease = lease
	st.phase = phaseRunning
	st.outcome = Executed
	st.s.metrics.inflight.Inc()
	st.startRenewal()
	return continueClaimed(atHeaders)
}

// continueClaimed continues the message a claim answers: the request headers of a bodiless
// request, else its body.
func continueClaimed(atHeaders bool) *extprocv3.ProcessingResponse {
	if atHeaders {
		return continueRequestHeaders
	}
	return continueRequestBody
}

func (st *stream) responseHeaders(m *extprocv3.HttpHeaders, attrs map[string]*structpb.Struct) *extprocv3.ProcessingResponse {
	switch st.phase {
	case phaseRunning:
	case phaseAwaitBody:
		// The request went upstream without its body phase: Envoy's request_body_mode is not
		// BUFFERED, or the request had trailers and no body data (reference §2.4).
		st.unprotected("the request body never reached the processor (request_body_mode is not BUFFERED, or the request had trailers but no data)")
		st.phase = phaseDone
		return st.rs.notStored
	case phaseUnprotected:
		st.phase = phaseDone
		return st.rs.notStored
	default:
		return continueResponseHeaders
	}
	r := st.route
	h := headers(m.GetHeaders().GetHeaders())
	st.status = parseStatus(h.get(":status"))
	if details, ok := codeDetails(attrs); ok && details != "via_upstream" {
		// Envoy made this response (a timeout, a refused connection): it is not the outcome of
		// the request (SPEC §4).
		st.release(ReleaseEnvoyResponse)
		st.phase = phaseDone
		return st.rs.notStored
	}
	if !r.StoreStatuses.Has(st.status) {
		st.release(ReleaseStatus)
		st.phase = phaseDone
		return st.rs.notStored
	}
	st.respHeaders = replayableHeaders(h, r)
	if m.GetEndOfStream() {
		st.complete()
		return st.rs.stored
	}
	if st.knownBodyModes && st.responseBodyMode == filterextproc.ProcessingMode_NONE {
		// Envoy will not send the body: record the outcome now, without it, so that the request
		// still runs at most once (duplicates get 409 response-not-replayable).
		st.omitted = true
		st.complete()
		return st.rs.stored
	}
	st.phase = phaseCapture
	return st.rs.stored
}

func (st *stream) responseBody(m *extprocv3.HttpBody) *extprocv3.ProcessingResponse {
	if st.phase != phaseCapture {
		return continueResponseBody
	}
	chunk := m.GetBody()
	last := m.GetEndOfStream()
	if st.knownBodyModes {
		switch st.responseBodyMode {
		case filterextproc.ProcessingMode_BUFFERED:
			// The one message holds the whole body, even when trailers follow (reference §2.4).
			last = true
		case filterextproc.ProcessingMode_BUFFERED_PARTIAL:
			// A partial buffer that does not end the body means the rest passed unseen.
			if !last {
				st.omitted = true
			}
			last = true
		}
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
		// Durability: the record is written before Envoy may pass the response on (SPEC §4).
		st.complete()
	}
	return continueResponseBody
}

// complete records the response and gives up the lease.
func (st *stream) complete() {
	st.phase = phaseDone
	st.renewal.stop()
	resp := cache.Response{Status: st.status, Headers: st.respHeaders, Body: st.body, BodyOmitted: st.omitted}
	// The client may already be gone; the record must still be written.
	err := st.s.complete(context.WithoutCancel(st.ctx), st.lease, resp)
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
	err := st.s.release(context.WithoutCancel(st.ctx), st.lease)
	st.dropLease()
	if err != nil {
		st.storeFailed("release", err)
		return
	}
	st.rs.releases[reason].Inc()
	st.event(st.s.log.Debug()).Str("reason", reason).Msg("lease released")
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

// finish runs when the stream ends, however it ends: a lease still held means the response was
// not seen whole, so the outcome is unknown.
func (st *stream) finish() {
	if st.lease.Held() {
		st.renewal.stop()
		if st.route.UnknownOutcome == policy.UnknownOutcomeRelease {
			st.release(ReleaseUnknownOutcome)
		} else {
			st.event(st.s.log.Info()).Dur("lock_ttl", st.route.LockTTL).Msg("stream ended before the response; lease kept until it expires")
			st.dropLease()
		}
	}
	if st.route == nil {
		return
	}
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
	}
	ev.Float64("duration_ms", float64(time.Since(st.start).Microseconds())/1000).Msg("request")
}

// renewal extends a lease every lock_ttl/3 while the stream lives.
type renewal struct {
	mu      sync.Mutex
	stopped bool
	timer   clock.Timer
	cancel  context.CancelFunc // ends the renewal in flight, if any
}

func (st *stream) startRenewal() {
	r := &renewal{}
	lease, lockTTL := st.lease, st.route.LockTTL
	interval := lockTTL / 3
	var tick func()
	tick = func() {
		// The context exists only while a renewal runs: most requests end before their first.
		ctx, cancel := context.WithCancel(st.ctx)
		defer cancel()
		r.mu.Lock()
		if r.stopped {
			r.mu.Unlock()
			return
		}
		r.cancel = cancel
		r.mu.Unlock()
		// Outside the lock, so that stop never waits for a store call: a renewal that lands
		// after the completion or release is refused by the store (the record is no longer
		// pending), and one cut short by stop changes nothing.
		err := st.s.renew(ctx, lease, lockTTL)
		switch {
		case ctx.Err() != nil:
			return
		case errors.Is(err, cache.ErrLeaseLost):
			st.event(st.s.log.Warn()).Msg("lease lost while the request was running; its completion will not be recorded")
			return
		case err != nil:
			st.event(st.s.log.Warn()).Str("op", "renew").Err(err).Msg("store operation failed")
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		r.cancel = nil
		if !r.stopped {
			r.timer = st.s.clock.AfterFunc(interval, tick)
		}
	}
	r.mu.Lock()
	r.timer = st.s.clock.AfterFunc(interval, tick)
	r.mu.Unlock()
	st.renewal = r
}

// stop prevents further renewals and cuts short one in flight, without waiting for it: the
// stream's next store call is its only one in the phase (SPEC §4). It is safe on a nil renewal.
func (r *renewal) stop() {
	if r == nil {
		return
	}
	r.mu.Lock()
	r.stopped = true
	if r.timer != nil {
		r.timer.Stop()
	}
	cancel := r.cancel
	r.mu.Unlock()
	if cancel != nil {
		cancel()
	}
}

func parseStatus(v []byte) int {
	n, err := strconv.Atoi(string(v))
	if err != nil {
		return 0
	}
	return n
}

// codeDetails returns Envoy's response.code_details attribute, if Envoy sent it.
func codeDetails(attrs map[string]*structpb.Struct) (string, bool) {
	v, ok := attrs[extProcAttributes].GetFields()["response.code_details"]
	if !ok {
		return "", false
	}
	s, ok := v.GetKind().(*structpb.Value_StringValue)
	if !ok {
		return "", false
	}
	return s.StringValue, true
}
