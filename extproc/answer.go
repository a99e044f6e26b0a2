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
	"google.golang.org/protobuf/types/known/structpb"
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

// reply is one answer the stream decided on. Every answer the server sends is a reply rendered
// by stream.render, the one place where a decision becomes Envoy's message.
type reply struct {
	kind msgKind
	// mode is a mode_override for a header answer, or nil.
	mode *filterextproc.ProcessingMode
	// mark sets the replay header to false on a response header answer.
	mark bool
	// stream answers a body message of a FULL_DUPLEX_STREAMED direction, whose answers must
	// carry the body back (reference §17.2): chunk, ending the body when eos is set.
	stream bool
	chunk  []byte
	eos    bool
	// expires, when set on a response header answer, is the expiry of the record the response
	// will be (expires_header, SPEC §11).
	expires time.Time
	// problem or replay, when set, makes the answer an ImmediateResponse; a replay carries rec's
	// times and, when the client asked to wait, the wait applied.
	problem *problem
	replay  *cache.Record
	waited  string
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
	headerCT                = "content-type"
	headerRetryAfter        = "retry-after"
	headerPrefer            = "prefer"
	headerPreferenceApplied = "preference-applied"
)

// render turns r into Envoy's message, with the request's dynamic metadata when there is news
// for Envoy's access log (SPEC §9; see stream.newMetadata). Answers that never vary are built
// once and shared: gRPC only reads a message it sends.
func (st *stream) render(r reply) *extprocv3.ProcessingResponse {
	rs := st.rs
	if r.kind == kindRequestHeaders && st.outcome == Passthrough && r.problem == nil && st.newMetadata() {
		// An uncovered request's metadata is its route's alone: its answers are built once.
		if r.mode != nil {
			return rs.passThrough
		}
		return rs.passContinue
	}
	var resp *extprocv3.ProcessingResponse
	switch {
	case r.problem != nil:
		resp = rs.problems[r.problem]
	case r.replay != nil:
		resp = replayResponse(r.replay, st.route, r.waited)
	case r.stream:
		resp = streamedBody(r.kind, r.chunk, r.eos)
	case r.kind == kindResponseHeaders && r.mark && !r.expires.IsZero():
		resp = markResponseHeaders(st.route, r.mode, r.expires)
	case r.kind == kindResponseHeaders && r.mark && r.mode != nil:
		resp = rs.notStored
	case r.kind == kindResponseHeaders && r.mark:
		resp = rs.stored
	case r.kind == kindRequestHeaders && r.mode != nil:
		resp = passThroughRequestHeaders
	case r.kind == kindResponseHeaders && r.mode != nil:
		resp = noStoreResponseHeaders
	default:
		resp = continues[r.kind]
	}
	if !st.newMetadata() {
		return resp
	}
	md := st.metadata()
	if resp.DynamicMetadata == nil && (r.replay != nil || r.stream || !r.expires.IsZero()) {
		// Built for this answer alone: it can carry the metadata itself.
		resp.DynamicMetadata = md
		return resp
	}
	return &extprocv3.ProcessingResponse{Response: resp.Response, ModeOverride: resp.ModeOverride, DynamicMetadata: md}
}

// streamedBody answers a body message of a FULL_DUPLEX_STREAMED direction with chunk as the body
// Envoy sends on (reference §17.2: a plain BodyResponse is refused in that mode).
func streamedBody(k msgKind, chunk []byte, eos bool) *extprocv3.ProcessingResponse {
	br := &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
		Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{Body: chunk, EndOfStream: eos}},
	}}}
	if k == kindRequestBody {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: br}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: br}}
}

// metadataFields builds the dynamic metadata of SPEC §9 under namespace. The values that do not
// vary per request are built once and shared (a message is only read once built).
func metadataFields(namespace string, route *structpb.Value, o Outcome, keyHash, releaseReason string) *structpb.Struct {
	f := make(map[string]*structpb.Value, 5)
	f["outcome"] = outcomeValues[o]
	f["route"] = route
	f["replayed"] = replayedValues[o == Replayed]
	if keyHash != "" {
		f["key_hash"] = structpb.NewStringValue(keyHash)
	}
	if releaseReason != "" {
		f["release_reason"] = releaseValues[releaseReason]
	}
	return &structpb.Struct{Fields: map[string]*structpb.Value{
		namespace: structpb.NewStructValue(&structpb.Struct{Fields: f}),
	}}
}

var (
	outcomeValues  = map[Outcome]*structpb.Value{}
	releaseValues  = map[string]*structpb.Value{}
	replayedValues = map[bool]*structpb.Value{false: structpb.NewBoolValue(false), true: structpb.NewBoolValue(true)}
)

func init() {
	for _, o := range Outcomes {
		outcomeValues[o] = structpb.NewStringValue(string(o))
	}
	for _, r := range releaseReasons {
		releaseValues[r] = structpb.NewStringValue(r)
	}
}

// setHeader is a header mutation that overwrites name; Envoy reads raw_value only (reference
// §2.7), so value stays empty.
func setHeader(name string, value []byte) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: name, RawValue: value}}
}

// problemResponse answers a covered request of route r with p: the built-in problem+json, or
// the route's own template for p's code (SPEC §11). Templates were checked at start-up.
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
// (SPEC §11), and Preference-Applied when the duplicate waited.
//
// Envoy builds the local reply from the status alone, applies these mutations, and only then adds
// content-type: text/plain where none is set and the body is not empty, or removes content-type
// and content-length where the body is empty (reference §17.1, Utility::sendLocalReply). So a
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
				// ext_proc honours only the deprecated append flag (reference §2.7).
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
