package extproc

import (
	"fmt"
	"net/http"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// msgKind is the kind of a ProcessingRequest, and of the answer it needs.
type msgKind uint8

const (
	kindRequestHeaders msgKind = iota
	kindRequestBody
	kindRequestTrailers
	kindResponseHeaders
	kindResponseBody
	kindResponseTrailers
)

// answer is one message the processor sends Envoy. The answers are a closed set of small types,
// each turned into Envoy's message by render, the one place where that happens.
type answer interface {
	// answers returns the kind of message the answer is for; anyMessage for an
	// ImmediateResponse, which Envoy takes in answer to any message and which ends the exchange.
	answers() msgKind
}

// anyMessage is what an ImmediateResponse answers.
const anyMessage msgKind = 255

// proceed lets the phase of a message of its kind go on unchanged: CONTINUE.
type proceed msgKind

// passOn answers the request headers of a request the processor leaves alone: CONTINUE, with the
// mode_override that turns every later phase off.
type passOn struct{}

// echo answers a body message of a FULL_DUPLEX_STREAMED direction, whose answers must carry the
// body back (a plain BodyResponse is refused in that mode): chunk, ending the body when eos is
// set.
type echo struct {
	k     msgKind
	chunk []byte
	eos   bool
	// noMessage: the body ends without a message (grpc-go's half-close, body mode GRPC).
	noMessage bool
}

// mark answers the response headers of a covered request: the replay header set to false
// (unless the route writes it on replays only), the record's expiry when it will be stored
// (expires not zero), and, with noBody, the mode_override that turns the body phase off.
type mark struct {
	expires time.Time
	noBody  bool
}

// untouched answers the response headers of a shadow-mode request: CONTINUE, with the body
// phase turned off when noBody is set.
type untouched struct{ noBody bool }

// refuse answers a covered request with a problem: an ImmediateResponse.
type refuse struct{ p *problem }

// replay answers a duplicate with the stored response: an ImmediateResponse. waited is the
// Preference-Applied value of a duplicate that waited for it.
type replay struct {
	rec    *cache.Record
	waited string
	// refused: a gRPC call's replay Envoy cannot carry (sendGRPC), answered ALREADY_EXISTS
	// response-not-replayable with the original status instead.
	refused bool
}

func (a proceed) answers() msgKind { return msgKind(a) }
func (passOn) answers() msgKind    { return kindRequestHeaders }
func (a echo) answers() msgKind    { return a.k }
func (mark) answers() msgKind      { return kindResponseHeaders }
func (untouched) answers() msgKind { return kindResponseHeaders }
func (refuse) answers() msgKind    { return anyMessage }
func (replay) answers() msgKind    { return anyMessage }

// render turns a, an answer of a request on route r, into Envoy's message; own reports whether
// the message was built for this answer alone. An answer that never varies is built once and
// shared, and a shared message is never changed (withMetadata copies it).
func render(r *route, a answer) (resp *extprocv3.ProcessingResponse, own bool) {
	switch a := a.(type) {
	case proceed:
		resp = continues[a]
	case passOn:
		resp = passThroughRequestHeaders
	case echo:
		resp, own = streamedBody(a.k, a.chunk, a.eos), true
		if a.noMessage {
			br := resp.GetRequestBody()
			if br == nil {
				br = resp.GetResponseBody()
			}
			br.GetResponse().GetBodyMutation().GetStreamedResponse().EndOfStreamWithoutMessage = true
		}
	case mark:
		switch {
		case !a.expires.IsZero():
			resp = r.freshHeaders(a.expires, a.noBody)
		case a.noBody:
			resp = r.notStored
		default:
			resp = r.stored
		}
	case untouched:
		resp = continues[kindResponseHeaders]
		if a.noBody {
			resp = noStoreResponseHeaders
		}
	case refuse:
		resp = r.problems[a.p]
	case replay:
		resp, own = replayResponse(a.rec, r.Route, a.waited), true
	}
	return resp, own
}

// The two mode_override values the processor sends (envoy/envoy.yaml's allowed_override_modes
// lists exactly these), every field spelled out: Envoy compares an override merged with the
// filter-level mode to each allowed entry raw, field by field (Filter::onReceiveMessage and
// effectiveModeOverride in source/extensions/filters/http/ext_proc/ext_proc.cc).
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
	headerCT                = "content-type"
	headerRetryAfter        = "retry-after"
	headerPrefer            = "prefer"
	headerPreferenceApplied = "preference-applied"
)

// streamedBody answers a body message of a FULL_DUPLEX_STREAMED direction with chunk as the body
// Envoy sends on: in that mode a plain BodyResponse is refused as spurious
// (ProcessorState::handleBodyInStreamedState in
// source/extensions/filters/http/ext_proc/processor_state.cc).
func streamedBody(k msgKind, chunk []byte, eos bool) *extprocv3.ProcessingResponse {
	br := &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
		Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{Body: chunk, EndOfStream: eos}},
	}}}
	if k == kindRequestBody {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: br}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: br}}
}

// setHeader is a header mutation that overwrites name; Envoy reads raw_value only, so value
// stays empty (MutationUtils::applyHeaderMutations in
// source/extensions/filters/http/ext_proc/mutation_utils.cc).
func setHeader(name string, value []byte) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: name, RawValue: value}}
}

// problemResponse answers a covered request of route r with p: the built-in problem+json, or
// the route's own template for p's code. Templates were checked at start-up.
func problemResponse(p *problem, r *policy.Route) (*extprocv3.ProcessingResponse, error) {
	status, ct, body := p.status, problemType, p.body
	if t := r.Problems[p.code]; t != nil {
		if t.Status != 0 {
			status = t.Status
		}
		if t.Body != nil {
			b, err := t.Render(policy.ProblemData{Code: p.code, Title: reasonPhrase(status), Detail: p.detail, Status: status})
			if err != nil {
				return nil, fmt.Errorf("extproc: route %s: problem %s: %w", r.Name, p.code, err)
			}
			body, ct = b, []byte(t.ContentType)
		}
	}
	set := make([]*corev3.HeaderValueOption, 0, 3)
	set = append(set, setHeader(headerCT, ct))
	if r.ReplayHeaderFresh {
		set = append(set, setHeader(r.ReplayHeader, valueFalse))
	}
	if p.retryAfter {
		set = append(set, setHeader(headerRetryAfter, valueOne))
	}
	return immediate(status, set, body, "idempotency_"+p.code), nil
}

// replayResponse answers a duplicate with the stored response: its status, every header in order
// (the second and later values of a repeated header with append, so that they add rather than
// overwrite) and its body, plus the replay header, the record's expiry and first-sent time
// and Preference-Applied when the duplicate waited.
//
// Envoy builds the local reply from the status alone, applies these mutations, and only then adds
// content-type: text/plain where none is set and the body is not empty, or removes content-type
// and content-length where the body is empty (Utility::prepareLocalReply, called by
// Utility::sendLocalReply, in source/common/http/utility.cc). So a
// stored content-type is kept, a stored response without one replays as text/plain, and an
// empty-bodied one loses its content-type: nothing the processor sends can change that.
func replayResponse(rec *cache.Record, route *policy.Route, waited string) *extprocv3.ProcessingResponse {
	r := &rec.Response
	var extra [3]corev3.HeaderValue
	x := extra[:0]
	if route.ExpiresHeader != "" && !rec.ExpiresAt.IsZero() {
		x = append(x, corev3.HeaderValue{Key: route.ExpiresHeader, RawValue: httpDate(rec.ExpiresAt)})
	}
	if route.FirstSentHeader != "" && !rec.CreatedAt.IsZero() {
		x = append(x, corev3.HeaderValue{Key: route.FirstSentHeader, RawValue: httpDate(rec.CreatedAt)})
	}
	if waited != "" {
		x = append(x, corev3.HeaderValue{Key: headerPreferenceApplied, RawValue: []byte(waited)})
	}
	n := len(r.Headers) + 1 + len(x)
	// One allocation each for the options, the values and the pointers, whatever the count.
	opts := make([]corev3.HeaderValueOption, n)
	values := make([]corev3.HeaderValue, n)
	set := make([]*corev3.HeaderValueOption, n)
	for i, h := range r.Headers {
		values[i].Key, values[i].RawValue = h.Name, h.Value
		for _, prev := range r.Headers[:i] {
			if prev.Name == h.Name {
				// ext_proc honours only the deprecated append flag
				// (MutationUtils::applyHeaderMutations in
				// source/extensions/filters/http/ext_proc/mutation_utils.cc).
				//lint:ignore SA1019 append_action is not implemented for ext_proc mutations
				opts[i].Append = appendHeader
				break
			}
		}
	}
	i := len(r.Headers)
	values[i].Key, values[i].RawValue = route.ReplayHeader, valueTrue
	copy(values[i+1:], x)
	for i := range opts {
		opts[i].Header = &values[i]
		set[i] = &opts[i]
	}
	return immediate(r.Status, set, r.Body, "idempotency_replayed")
}

// httpDate formats t as an RFC 9110 HTTP-date.
func httpDate(t time.Time) []byte {
	return t.UTC().AppendFormat(make([]byte, 0, len(http.TimeFormat)), http.TimeFormat)
}

func immediate(status int, set []*corev3.HeaderValueOption, body []byte, details string) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_ImmediateResponse{
			ImmediateResponse: &extprocv3.ImmediateResponse{
				Status:  &typev3.HttpStatus{Code: typev3.StatusCode(status)},
				Headers: &extprocv3.HeaderMutation{SetHeaders: set},
				Body:    body,
				Details: details,
			},
		},
	}
}

// The answers that never vary.
var (
	passThroughRequestHeaders = &extprocv3.ProcessingResponse{
		Response:     &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{}},
		ModeOverride: passThroughMode,
	}
	// continues are the plain CONTINUE answers, by message kind.
	continues = [...]*extprocv3.ProcessingResponse{
		kindRequestHeaders: {Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{}}},
		kindRequestBody:    {Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{}}},
		kindRequestTrailers: {Response: &extprocv3.ProcessingResponse_RequestTrailers{
			RequestTrailers: &extprocv3.TrailersResponse{},
		}},
		kindResponseHeaders: {Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}},
		kindResponseBody:    {Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{}}},
		kindResponseTrailers: {Response: &extprocv3.ProcessingResponse_ResponseTrailers{
			ResponseTrailers: &extprocv3.TrailersResponse{},
		}},
	}
)

// markResponseHeaders continues the response of a covered request of route r: the replay header
// set to false (unless the route writes it on replays only), the record's expiry when it will be
// stored (expires is not zero), and a mode_override when mode is not nil.
func markResponseHeaders(r *policy.Route, mode *filterextproc.ProcessingMode, expires time.Time) *extprocv3.ProcessingResponse {
	var set []*corev3.HeaderValueOption
	if r.ReplayHeaderFresh {
		set = append(set, setHeader(r.ReplayHeader, valueFalse))
	}
	if !expires.IsZero() && r.ExpiresHeader != "" {
		set = append(set, setHeader(r.ExpiresHeader, httpDate(expires)))
	}
	resp := &extprocv3.ProcessingResponse{
		Response:     &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}},
		ModeOverride: mode,
	}
	if len(set) > 0 {
		resp.GetResponseHeaders().Response = &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: set}}
	}
	return resp
}

// noStoreResponseHeaders continues an unmarked response (shadow mode) and turns its body phase
// off.
var noStoreResponseHeaders = &extprocv3.ProcessingResponse{
	Response:     &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}},
	ModeOverride: noStoreMode,
}
