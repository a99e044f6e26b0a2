package extproc

import (
	"errors"
	"net/http"
	"slices"
	"time"

	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// The idempotency decision, apart from Envoy: what a request's headers admit, what a taken key's
// record answers, and what a response does to the lease. These are functions of plain values;
// the stream (stream.go) reads them out of Envoy's messages and carries their verdicts out. They
// are table-tested without gRPC (decide_test.go).

// requestInfo is what the request headers tell the decision.
type requestInfo struct {
	headers      headers
	method, path []byte
	// jwtAuthn is the jwt_authn namespace of metadata_context; nil when Envoy forwarded none.
	jwtAuthn *structpb.Struct
	// peer is connection.uri_san_peer_certificate; "" when there is none.
	peer string
	// params are the route's path parameters, aligned with its path_param scope entries.
	params []string
	// body is what a route that reads its body's members keeps of the request (jsonstream.go):
	// the route's selector while match.json decides it, then the body's json scope values and
	// JSON-RPC id. nil on other routes; its scope is nil until the body is read.
	body *jsonState
}

// admission is what a request's headers decide.
type admission struct {
	// problem, when set, answers a covered request at once (400, 401, 500).
	problem *problem
	// What a claim needs. key is "" (a key is 1 to MaxKeyLength characters) when it is not in
	// the headers: the body's hash, known at the body's end (missing_key: body-hash), unless a
	// route with key_json finds it in the body first (keyFromBody).
	key string
	ttl time.Duration
	// jwt is the payload jwt_authn verified that the route's jwt_claim scope reads; nil when
	// there is none. The rest of the scope values are the request's (requestInfo).
	jwt *structpb.Struct
	// covered: the request is the processor's. A request that is not passes through untouched.
	covered bool
	// needsBody: the claim waits for the whole body (it is fingerprinted, or is the key).
	needsBody bool
	// grpc: the request is a gRPC call (its content-type, or its route's grpc: true): its
	// answers are gRPC statuses and its outcome is its grpc-status (grpc.go). A gRPC call without
	// :path came through grpc-go's own ext_proc client (stream.proxyless).
	grpc bool
}

// admit decides what a request on route r is: not covered, answered at once, or to be claimed.
// What depends on the route alone (whether its scope reads claims, whether its fingerprint
// reads the body) was compiled into r at load.
func admit(r *route, req requestInfo) admission {
	method := req.method
	if len(method) == 0 && r.GRPC {
		// grpc-go's ext_proc client sends the call's metadata only: a gRPC call is a POST.
		method = []byte(http.MethodPost)
	}
	if !r.Enabled || !slices.Contains(r.Methods, string(method)) {
		return admission{}
	}
	// A request is gRPC when its content-type says so, or when its route says grpc: true and it
	// has no :path (grpc-go's ext_proc client, which sends no content-type either). A plain HTTP
	// request on a grpc: true route stays HTTP: its outcome is its :status, its answers HTTP.
	hasPath := req.path != nil
	a := admission{covered: true, ttl: r.TTL, grpc: isGRPC(req.headers) || (r.GRPC && !hasPath)}
	refuse := func(p *problem) admission {
		return admission{covered: true, problem: p, grpc: a.grpc}
	}
	key, present, err := parseKey(req.headers, r.KeyHeaders)
	switch {
	case err != nil:
		return refuse(problemInvalidKey)
	case !present && len(r.KeyJSON) > 0:
		// The key may be in the body: settled at its end (keyFromBody).
	case !present && r.MissingKey == policy.MissingKeyOptional:
		return admission{}
	case !present && r.MissingKey == policy.MissingKeyRequired:
		return refuse(problemMissingKey)
	}
	a.key = key
	if r.TTLHeader != "" {
		if v := req.headers.get(r.TTLHeader); v != nil {
			if a.ttl, err = parseTTL(v, r.MaxTTL); err != nil {
				return refuse(problemInvalidTTL)
			}
		}
	}
	if r.claims {
		payload, ok := jwtPayload(req.jwtAuthn, r.JWTPayloadKey)
		if !ok {
			return refuse(problemScopeAmbiguous)
		}
		a.jwt = payload
		if !claimsExact(r.Route, payload) {
			return refuse(problemScopeClaimAmbiguous)
		}
	}
	if r.RequireScope && scopeEmpty(r.Route, req, a.jwt) {
		return refuse(problemScopeMissing)
	}
	a.needsBody = a.key == "" || r.bodyFingerprint || r.json != nil
	return a
}

// judgeRecord answers a claim that found key's record rec: 422 when the record is another
// request's (another payload, or another route), 409 while the first is in flight (wait tells
// whether a duplicate may wait for it instead), 409 when its outcome is unknown or its response
// was not kept, else the replay (problem nil). The mismatch check comes first.
func judgeRecord(r *policy.Route, fp []byte, rec *cache.Record) (p *problem, wait bool) {
	switch {
	case !fingerprintMatches(r, fp, rec.Fingerprint) || !sameRoute(r, rec.Route):
		return problemReused, false
	case rec.State == cache.Pending:
		return problemInProgress, true
	case rec.Response.OutcomeUnknown:
		return problemOutcomeUnknown, false
	case rec.Response.BodyOmitted:
		return problemNotReplayable, false
	}
	return nil, false
}

// sameRoute reports whether a record was claimed under route r. A key reused on another route
// that shares r's key_prefix is another endpoint's, whatever the routes' fingerprints say (a
// route whose fingerprint omits the path would otherwise replay the other route's response). A
// record that names no route (written before records carried it) is taken as r's, as before.
func sameRoute(r *policy.Route, stored string) bool {
	return stored == "" || stored == r.Name[:min(len(r.Name), cache.MaxRouteBytes)]
}

// fingerprintMatches reports whether a record's fingerprint is this request's. A record without
// a fingerprint comes from a build before fingerprints were stored, for a route with none: such a
// route accepts it, as that build did, until it expires.
func fingerprintMatches(r *policy.Route, fp, stored []byte) bool {
	return string(fp) == string(stored) || (len(r.Fingerprint) == 0 && len(stored) == 0)
}

// origin is what a response's attributes say about who made it.
type origin struct {
	// detailsKnown: response.code_details came; envoyMade: it is not via_upstream.
	detailsKnown, envoyMade bool
	// attempts is upstream.request_attempt_count when attemptsKnown (0: never sent upstream).
	attempts      int64
	attemptsKnown bool
}

// settlement is what a response does to the lease of the request it answers.
type settlement uint8

const (
	// settleRelease frees the key, with a release reason: a retry runs again.
	settleRelease settlement = iota
	// settleUnknown follows the route's unknown_outcome: the request may or may not have run.
	settleUnknown
	// settleRecord records the response now, from its headers: its body is empty (the headers
	// end the stream) or not kept (omitted).
	settleRecord
	// settleCapture captures the body that follows, and records the response at its end.
	settleCapture
)

// response is what the decision needs of a response: its status and origin, whether its headers
// end it, and whether Envoy will send its body (the response body mode is not NONE).
type response struct {
	status      int
	origin      origin
	endOfStream bool
	bodySent    bool
}

// judgeResponse decides what the response to a request that ran under a lease of route r does to
// that lease, and for a release why, and whether the body is left out of the record.
func judgeResponse(r *policy.Route, resp response) (s settlement, releaseReason string, omitted bool) {
	o := resp.origin
	switch {
	case o.envoyMade || (!o.detailsKnown && !r.StoreStatuses.Has(resp.status)):
		// Envoy made this response (a timeout, a refused connection, an overflow), or may have:
		// it is not the outcome of the request. Only when the request never reached the upstream
		// is it known that nothing ran.
		if o.attemptsKnown && o.attempts == 0 {
			return settleRelease, ReleaseEnvoyResponse, false
		}
		return settleUnknown, "", false
	case !r.StoreStatuses.Has(resp.status):
		return settleRelease, ReleaseStatus, false
	case resp.endOfStream:
		return settleRecord, "", false
	case !resp.bodySent || !r.StoreBody:
		// No body will come (response body mode NONE), or none is to be kept (store_body:
		// false): record the outcome now, without it, so that the request still runs at most
		// once (duplicates get 409 response-not-replayable).
		return settleRecord, "", true
	}
	return settleCapture, "", false
}

// claimResult is what one claim found, as plain values.
type claimResult struct {
	// err is the store's failure (cache.ErrCorrupt: the record is there but cannot be read), or
	// errDurabilityUnmet when no claim was made; gone: the stream ended during the call.
	err  error
	gone bool
	// rec is the record that holds the key: the store's, or this replica's own hold on it
	// (hold.record). nil, with no err: the lease is the request's.
	rec *cache.Record
	// mayWait: a duplicate of a request in flight may wait for its replay (the route's
	// in_flight_wait, or the client's Prefer: wait, is not spent).
	mayWait bool
}

// action is what the stream does with a claimed request.
type action uint8

const (
	actRun         action = iota // the key was free: the request goes upstream under its lease
	actReplay                    // the stored response answers it
	actRefuse                    // the verdict's problem answers it
	actWait                      // the first request is in flight: claim again after a wait
	actUnprotected               // fail_mode: open: it goes upstream without a lease
	actShadow                    // shadow mode: it goes on untouched; would is what enforcement would have answered
	actNone                      // the stream ended: nobody waits for an answer
)

// verdict is what a claim's result means for the request.
type verdict struct {
	act     action
	problem *problem // actRefuse
	would   Outcome  // actShadow
}

// judgeClaim decides what a claim's result means for a request of route r with fingerprint fp:
// run it, replay the record, refuse it (409 in progress, 422 reused, 409 outcome-unknown or
// not-replayable, 503 store-unavailable or durability-unmet), wait for the first request, or let
// it go on without a lease (fail_mode: open, failOpen) or untouched (shadow mode). A record that
// cannot be read answers 409 whatever the fail mode: the request ran once already.
func judgeClaim(r *policy.Route, fp []byte, shadow, failOpen bool, c claimResult) verdict {
	refuse := func(p *problem) verdict {
		if shadow {
			return verdict{act: actShadow, would: p.outcome}
		}
		return verdict{act: actRefuse, problem: p}
	}
	switch {
	case c.gone:
		return verdict{act: actNone}
	case errors.Is(c.err, cache.ErrCorrupt):
		return refuse(problemNotReplayable)
	case c.err != nil:
		p := problemStoreUnavailable
		if errors.Is(c.err, errDurabilityUnmet) {
			p = problemDurabilityUnmet
		}
		if failOpen && !shadow {
			return verdict{act: actUnprotected}
		}
		return refuse(p)
	case c.rec == nil:
		return verdict{act: actRun}
	}
	p, inFlight := judgeRecord(r, fp, c.rec)
	switch {
	case inFlight && c.mayWait && !shadow:
		return verdict{act: actWait}
	case p != nil:
		return refuse(p)
	case shadow:
		return verdict{act: actShadow, would: Replayed}
	}
	return verdict{act: actReplay}
}

// settle returns the outcome of a request, from the move that settles it: e, from the state
// from; answered is the outcome of the ImmediateResponse sent with it ("" for none), and failed
// the first failure of its store calls (errDurabilityUnmet when its claim was not made).
func settle(e event, from state, answered Outcome, failed error) Outcome {
	switch {
	case (e == evAnswer || e == evSettle) && answered != "":
		// evSettle carries an answer only for a gRPC call refused after its claim
		// (notUnaryHeld).
		return answered
	case e != evSettle:
		// Passed on (not covered, or shadow mode), or given up with nobody waiting.
		return Passthrough
	case errors.Is(failed, errDurabilityUnmet):
		return DurabilityUnmet
	case failed != nil:
		return StoreError
	case from == stateRunning || from == stateCapture:
		return Executed
	}
	// It went upstream without a lease: its body never reached the processor.
	return Passthrough
}
