package extproc

import (
	"encoding/json"
	"net/http"
)

// Outcome is what happened to one request. The same value is the response's meaning, the
// idempotency_requests_total label, the log field and the dynamic metadata's outcome.
type Outcome string

// The outcomes (docs/outcomes.md has the table).
const (
	// Passthrough: not covered (or no key under missing_key: optional);
	// nothing was stored.
	Passthrough Outcome = "passthrough"
	// Executed: the request ran upstream under a lease.
	Executed Outcome = "executed"
	// Replayed: a completed response was sent again.
	Replayed Outcome = "replayed"
	// InProgress: a duplicate arrived while the first was still running (409).
	InProgress Outcome = "in_progress"
	// Mismatch: the key was used before with a different fingerprint (422).
	Mismatch Outcome = "mismatch"
	// MissingKey: a key is required and there was none (400).
	MissingKey Outcome = "missing_key"
	// Invalid: the key or the TTL header is malformed, a body key differs from the header key,
	// or a route that reads the body's members got a body that is not JSON (400).
	Invalid Outcome = "invalid"
	// NotReplayable: the first request completed but its response cannot be replayed: it was not
	// kept whole, or the stored record cannot be read (409).
	NotReplayable Outcome = "not_replayable"
	// OutcomeUnknown: the first request's outcome is unknown and was recorded as such
	// (unknown_outcome: record), so a duplicate is refused rather than run again (409).
	OutcomeUnknown Outcome = "outcome_unknown"
	// TooLarge: the request body is larger than the processor may hold, or Envoy sent only part
	// of it (413); it never reached the upstream.
	TooLarge Outcome = "too_large"
	// Misconfigured: Envoy's configuration keeps the processor from protecting the request
	// (500), such as a request body that never reaches it or a policy route that does not exist.
	Misconfigured Outcome = "misconfigured"
	// ScopeMissing: the route requires a scope and the request had none of its values (401).
	ScopeMissing Outcome = "scope_missing"
	// ScopeClaimAmbiguous: a JWT claim the route scopes by is a number that Envoy's metadata
	// cannot carry exactly (400): several callers' values could arrive as one.
	ScopeClaimAmbiguous Outcome = "scope_claim_ambiguous"
	// StoreError: the store failed; the request got 503 (fail closed), passed through (fail
	// open), or ran but its completion could not be recorded.
	StoreError Outcome = "store_error"
	// DurabilityUnmet: the route's durability.replicas is above the replicas the store has, so
	// no claim of it could be confirmed; the request got 503 (fail closed) or passed through
	// (fail open) without a store call.
	DurabilityUnmet Outcome = "durability_unmet"
)

// Outcomes lists every outcome, for pre-creating metric series.
var Outcomes = []Outcome{
	Passthrough, Executed, Replayed, InProgress, Mismatch, MissingKey, Invalid, NotReplayable,
	OutcomeUnknown, TooLarge, Misconfigured, ScopeMissing, ScopeClaimAmbiguous, StoreError, DurabilityUnmet,
}

// problem is an error the server answers itself, as RFC 9457 application/problem+json.
type problem struct {
	outcome    Outcome
	status     int
	code       string
	detail     string
	retryAfter bool
	body       []byte
}

func newProblem(o Outcome, status int, code, detail string, retryAfter bool) *problem {
	body, err := json.Marshal(struct {
		Type   string `json:"type"`
		Title  string `json:"title"`
		Status int    `json:"status"`
		Detail string `json:"detail"`
		Code   string `json:"code"`
	}{"about:blank", reasonPhrase(status), status, detail, code})
	if err != nil {
		panic(err) // a constant struct of strings always marshals
	}
	body = append(body, '\n') // as every body the service writes ends, for a terminal's sake
	return &problem{outcome: o, status: status, code: code, detail: detail, retryAfter: retryAfter, body: body}
}

// reasonPhrase is status's reason phrase in RFC 9110, which a problem's title carries; net/http
// still says "Unprocessable Entity" for 422 and "Request Entity Too Large" for 413, the names of
// RFC 4918 and RFC 7231.
func reasonPhrase(status int) string {
	switch status {
	case http.StatusUnprocessableEntity:
		return "Unprocessable Content"
	case http.StatusRequestEntityTooLarge:
		return "Content Too Large"
	}
	return http.StatusText(status)
}

// The problems the server answers, each with its stable code.
var (
	problemMissingKey = newProblem(MissingKey, http.StatusBadRequest, "missing-idempotency-key",
		"This endpoint requires an Idempotency-Key header.", false)
	problemInvalidKey = newProblem(Invalid, http.StatusBadRequest, "invalid-idempotency-key",
		"The idempotency key must be 1 to 255 visible ASCII characters, and the same in every key header.", false)
	problemInvalidTTL = newProblem(Invalid, http.StatusBadRequest, "invalid-ttl",
		"The TTL header must be a positive whole number of seconds.", false)
	problemInProgress = newProblem(InProgress, http.StatusConflict, "request-in-progress",
		"A request with this idempotency key is still being processed; retry later.", true)
	problemReused = newProblem(Mismatch, http.StatusUnprocessableEntity, "idempotency-key-reused",
		"This idempotency key was already used for a different request.", false)
	problemNotReplayable = newProblem(NotReplayable, http.StatusConflict, "response-not-replayable",
		"The request with this idempotency key completed, but its response was not kept whole and cannot be replayed.", false)
	problemOutcomeUnknown = newProblem(OutcomeUnknown, http.StatusConflict, "outcome-unknown",
		"The request with this idempotency key may or may not have run, and its outcome is unknown; it will not be run again under this key.", false)
	problemTooLarge = newProblem(TooLarge, http.StatusRequestEntityTooLarge, "request-too-large",
		"The request body is larger than this endpoint accepts for idempotent requests.", false)
	problemBodyNotAvailable = newProblem(Misconfigured, http.StatusInternalServerError, "body-not-available",
		"The request body cannot be checked for idempotency on this route.", false)
	problemStoreUnavailable = newProblem(StoreError, http.StatusServiceUnavailable, "store-unavailable",
		"The idempotency store is unavailable; retry later.", true)
	problemDurabilityUnmet = newProblem(DurabilityUnmet, http.StatusServiceUnavailable, "durability-unmet",
		"The idempotency store has fewer replicas than this endpoint requires to record the request durably; retry later.", true)
	problemUnknownRoute = newProblem(Misconfigured, http.StatusInternalServerError, "unknown-idempotency-route",
		"The gateway names an idempotency policy that does not exist.", false)
	problemRouteMismatch = newProblem(Misconfigured, http.StatusInternalServerError, "unknown-idempotency-route",
		"The gateway names an idempotency policy whose path parameters this request does not have.", false)
	problemScopeMissing = newProblem(ScopeMissing, http.StatusUnauthorized, "scope-missing",
		"This endpoint requires an authenticated caller for idempotent requests.", false)
	problemScopeAmbiguous = newProblem(Misconfigured, http.StatusInternalServerError, "scope-ambiguous",
		"The caller's identity cannot be told apart for idempotency on this route.", false)
	problemGRPCNotUnary = newProblem(Invalid, http.StatusBadRequest, "grpc-not-unary",
		"The gRPC call sent more than one message; only unary calls are protected on this method.", false)
	// 400, not 401: the token is valid, and a new one would carry the same claim, so a client
	// that refreshes its token on 401 would only send the same request again.
	problemScopeClaimAmbiguous = newProblem(ScopeClaimAmbiguous, http.StatusBadRequest, "scope-claim-ambiguous",
		"A claim of the caller's token that scopes idempotency keys on this endpoint is a number that reaches it only approximately (not a whole number below 2^53), so callers could not be told apart; the request was not run.", false)
	problemKeyConflict = newProblem(Invalid, http.StatusBadRequest, "idempotency-key-conflict",
		"The request carries one idempotency key in a header and a different one in its body.", false)
	problemInvalidJSON = newProblem(Invalid, http.StatusBadRequest, "invalid-json-body",
		"This endpoint reads members of the request body, which is not valid JSON or nests deeper than 64 levels.", false)
)

var problems = []*problem{
	problemMissingKey, problemInvalidKey, problemInvalidTTL, problemInProgress, problemReused,
	problemNotReplayable, problemOutcomeUnknown, problemTooLarge, problemBodyNotAvailable,
	problemStoreUnavailable, problemDurabilityUnmet, problemUnknownRoute, problemRouteMismatch, problemScopeMissing,
	problemScopeAmbiguous, problemScopeClaimAmbiguous, problemGRPCNotUnary, problemKeyConflict, problemInvalidJSON,
}

// Release reasons, the reason label of idempotency_releases_total.
const (
	// ReleaseStatus: the response's status is not in store_statuses.
	ReleaseStatus = "status"
	// ReleaseEnvoyResponse: Envoy made the response before the request reached the upstream
	// (upstream.request_attempt_count is 0).
	ReleaseEnvoyResponse = "envoy_response"
	// ReleaseUnknownOutcome: the outcome is unknown (the stream ended before any response
	// headers, or Envoy made the response after the request was sent upstream) and
	// unknown_outcome is release: a retry runs again.
	ReleaseUnknownOutcome = "unknown_outcome"
	// ReleaseNotSent: the stream ended while Envoy still held the request (a BUFFERED upload
	// claimed at its headers, the client gone before the body's end): it never reached the
	// upstream.
	ReleaseNotSent = "not_sent"
)

// notCoveredBatch is the reason label of idempotency_not_covered_total for a JSON-RPC batch.
const notCoveredBatch = "json-rpc-batch"

var releaseReasons = []string{ReleaseStatus, ReleaseEnvoyResponse, ReleaseUnknownOutcome, ReleaseNotSent}

// Misconfiguration kinds, the kind label of idempotency_envoy_misconfig_total.
const (
	// MisconfigModeOverrideRefused: Envoy sent a phase that a mode_override had turned off.
	MisconfigModeOverrideRefused = "mode_override_refused"
	// MisconfigAttemptCountMissing: an Envoy-made response came without
	// upstream.request_attempt_count.
	MisconfigAttemptCountMissing = "attempt_count_missing"
	// MisconfigBodyNotAvailable: request_body_mode NONE on a route whose requests need their body.
	MisconfigBodyNotAvailable = "body_not_available"
	// MisconfigObservabilityMode: the filter runs in observability_mode and ignores every answer.
	MisconfigObservabilityMode = "observability_mode"
	// MisconfigUnknownRoute: x-idempotency-route names a route the policy does not define, or one
	// whose path parameters the request's path does not have.
	MisconfigUnknownRoute = "unknown_route"
	// MisconfigScopeAmbiguous: jwt_claim scope with several jwt_authn payloads and no
	// jwt_payload_key.
	MisconfigScopeAmbiguous = "scope_ambiguous"
	// MisconfigCodeDetailsMissing: a response came without response.code_details, so the
	// processor cannot tell Envoy's responses from the upstream's.
	MisconfigCodeDetailsMissing = "code_details_missing"
	// MisconfigUnclaimedRequest: the upstream answered a covered request whose end the processor
	// never saw (request trailers under request_trailer_mode SKIP, or an upstream that answers
	// before the request body ends): it ran without a lease.
	MisconfigUnclaimedRequest = "unclaimed_request"
)

var misconfigKinds = []string{
	MisconfigModeOverrideRefused, MisconfigAttemptCountMissing, MisconfigBodyNotAvailable,
	MisconfigObservabilityMode, MisconfigUnknownRoute, MisconfigScopeAmbiguous,
	MisconfigCodeDetailsMissing, MisconfigUnclaimedRequest,
}
