package extproc

import (
	"encoding/json"
	"net/http"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
)

// Outcome is what happened to one request. The same value is the response's meaning, the
// idempotency_requests_total label and the log field.
type Outcome string

// The outcomes of SPEC §7.
const (
	// Passthrough: not covered (or no key under missing_key: optional); nothing was stored.
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
	// Invalid: the key or the TTL header is malformed (400).
	Invalid Outcome = "invalid"
	// NotReplayable: the first request completed but its response was too large to keep (409).
	NotReplayable Outcome = "not_replayable"
	// StoreError: the store failed; the request got 503 (fail closed), passed through (fail
	// open), or ran but its completion could not be recorded.
	StoreError Outcome = "store_error"
)

// Outcomes lists every outcome, for pre-creating metric series.
var Outcomes = []Outcome{Passthrough, Executed, Replayed, InProgress, Mismatch, MissingKey, Invalid, NotReplayable, StoreError}

// problem is an error the server answers itself, as RFC 9457 application/problem+json.
type problem struct {
	outcome    Outcome
	status     int
	code       string
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
	return &problem{outcome: o, status: status, code: code, retryAfter: retryAfter, body: body}
}

// reasonPhrase is status's reason phrase in RFC 9110, which SPEC §4 asks for in a problem's
// title; net/http still says "Unprocessable Entity" for 422, RFC 4918's name.
func reasonPhrase(status int) string {
	if status == http.StatusUnprocessableEntity {
		return "Unprocessable Content"
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
		"The request with this idempotency key completed, but its response was too large to keep and cannot be replayed.", false)
	problemStoreUnavailable = newProblem(StoreError, http.StatusServiceUnavailable, "store-unavailable",
		"The idempotency store is unavailable; retry later.", true)
)

var problems = []*problem{
	problemMissingKey, problemInvalidKey, problemInvalidTTL, problemInProgress, problemReused,
	problemNotReplayable, problemStoreUnavailable,
}

// The two mode_override values of SPEC §5, every field spelled out so that Envoy's
// allowed_override_modes comparison matches them (reference §4.3).
var (
	// passThroughMode turns off every phase after request_headers.
	passThroughMode = &filterextproc.ProcessingMode{
		RequestHeaderMode:   filterextproc.ProcessingMode_SEND,
		RequestBodyMode:     filterextproc.ProcessingMode_NONE,
		RequestTrailerMode:  filterextproc.ProcessingMode_SKIP,
		ResponseHeaderMode:  filterextproc.ProcessingMode_SKIP,
		ResponseBodyMode:    filterextproc.ProcessingMode_NONE,
		ResponseTrailerMode: filterextproc.ProcessingMode_SKIP,
	}
	// noStoreMode, sent at response_headers of a response that will not be stored, turns off the
	// response body phase.
	noStoreMode = &filterextproc.ProcessingMode{
		RequestHeaderMode:   filterextproc.ProcessingMode_SEND,
		RequestBodyMode:     filterextproc.ProcessingMode_NONE,
		RequestTrailerMode:  filterextproc.ProcessingMode_SKIP,
		ResponseHeaderMode:  filterextproc.ProcessingMode_SEND,
		ResponseBodyMode:    filterextproc.ProcessingMode_NONE,
		ResponseTrailerMode: filterextproc.ProcessingMode_SKIP,
	}
)

// PassThroughMode returns a copy of the mode_override sent for requests that are not covered.
func PassThroughMode() *filterextproc.ProcessingMode {
	return proto.Clone(passThroughMode).(*filterextproc.ProcessingMode)
}

// NoStoreMode returns a copy of the mode_override sent at response_headers of a response that is
// not stored.
func NoStoreMode() *filterextproc.ProcessingMode {
	return proto.Clone(noStoreMode).(*filterextproc.ProcessingMode)
}

var (
	valueTrue    = []byte("true")
	valueFalse   = []byte("false")
	valueOne     = []byte("1")
	problemType  = []byte("application/problem+json")
	appendHeader = wrapperspb.Bool(true)
)

const (
	headerCT         = "content-type"
	headerRetryAfter = "retry-after"
)

// setHeader is a header mutation that overwrites name; Envoy reads raw_value only (reference
// §2.7), so value stays empty.
func setHeader(name string, value []byte) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: name, RawValue: value}}
}

// problemResponse answers a covered request with p.
func problemResponse(p *problem, replayHeader string) *extprocv3.ProcessingResponse {
	set := make([]*corev3.HeaderValueOption, 0, 3)
	set = append(set, setHeader(headerCT, problemType), setHeader(replayHeader, valueFalse))
	if p.retryAfter {
		set = append(set, setHeader(headerRetryAfter, valueOne))
	}
	return immediate(p.status, set, nil, p.body, "idempotency_"+p.code)
}

// replayResponse answers a duplicate with the stored response: its status, every header in order
// (the second and later values of a repeated header with append, so that they add rather than
// overwrite) and its body, plus the replay header.
func replayResponse(r *cache.Response, replayHeader string) *extprocv3.ProcessingResponse {
	n := len(r.Headers) + 1
	// One allocation each for the options, the values and the pointers, whatever the count.
	opts := make([]corev3.HeaderValueOption, n)
	values := make([]corev3.HeaderValue, n)
	set := make([]*corev3.HeaderValueOption, n)
	hasCT := false
	for i, h := range r.Headers {
		values[i].Key, values[i].RawValue = h.Name, h.Value
		opts[i].Header = &values[i]
		for _, prev := range r.Headers[:i] {
			if prev.Name == h.Name {
				// ext_proc honours only the deprecated append flag (reference §2.7).
				//lint:ignore SA1019 append_action is not implemented for ext_proc mutations
				opts[i].Append = appendHeader
				break
			}
		}
		hasCT = hasCT || h.Name == headerCT
		set[i] = &opts[i]
	}
	values[n-1].Key, values[n-1].RawValue = replayHeader, valueTrue
	opts[n-1].Header = &values[n-1]
	set[n-1] = &opts[n-1]
	var remove []string
	if !hasCT && len(r.Body) > 0 {
		// Envoy gives a local reply with a body "content-type: text/plain" (reference §2.6); the
		// original had none.
		remove = removeContentType
	}
	return immediate(r.Status, set, remove, r.Body, "idempotency_replayed")
}

var removeContentType = []string{headerCT}

func immediate(status int, set []*corev3.HeaderValueOption, remove []string, body []byte, details string) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_ImmediateResponse{
			ImmediateResponse: &extprocv3.ImmediateResponse{
				Status:  &typev3.HttpStatus{Code: typev3.StatusCode(status)},
				Headers: &extprocv3.HeaderMutation{SetHeaders: set, RemoveHeaders: remove},
				Body:    body,
				Details: details,
			},
		},
	}
}

// The answers that never vary are built once and shared: gRPC only reads a message it sends.
var (
	continueRequestHeaders = &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{}},
	}
	passThroughRequestHeaders = &extprocv3.ProcessingResponse{
		Response:     &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{}},
		ModeOverride: passThroughMode,
	}
	continueRequestBody = &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{}},
	}
	continueResponseHeaders = &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}},
	}
	continueResponseBody = &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{}},
	}
	continueRequestTrailers = &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}},
	}
	continueResponseTrailers = &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}},
	}
)

// markResponseHeaders continues the response with the replay header set to false, and with a
// mode_override when mode is not nil.
func markResponseHeaders(replayHeader string, mode *filterextproc.ProcessingMode) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{
			Response: &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{
				SetHeaders: []*corev3.HeaderValueOption{setHeader(replayHeader, valueFalse)},
			}},
		}},
		ModeOverride: mode,
	}
}
