package extproc

import (
	"encoding/binary"
	"net/http"
	"strconv"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// gRPC unary calls. A call is gRPC when its content-type says so (isGRPC), or when its route says
// grpc: true and it has no :path (grpc-go's own ext_proc client sends the call's metadata only, no
// content-type); a plain HTTP request on a grpc: true route stays HTTP.
// What differs from HTTP is decided here, as functions of plain values: the answers are gRPC
// statuses, the outcome is grpc-status in the trailers (or in the headers of a trailers-only
// response), a replay goes out as a streamed immediate response where Envoy can carry one, and
// the request body must be one message.

// headerGRPCStatus is where a gRPC response carries its status: in the trailers, or in the
// headers of a trailers-only response.
const headerGRPCStatus = "grpc-status"

// headerOriginalGRPCStatus carries a completed call's status on the answer to a duplicate that
// cannot be replayed.
const headerOriginalGRPCStatus = "x-idempotency-original-grpc-status"

// grpcFrameHeader is the length prefix of each gRPC message: a flags byte and a 4-byte
// big-endian length.
const grpcFrameHeader = 5

// grpcMessages counts the length-prefixed messages of a gRPC request body; whole is false when
// the body ends inside a message (a truncated or malformed body).
func grpcMessages(body []byte) (n int, whole bool) {
	for len(body) > 0 {
		if len(body) < grpcFrameHeader {
			return n + 1, false
		}
		size := uint64(binary.BigEndian.Uint32(body[1:grpcFrameHeader]))
		if uint64(len(body)-grpcFrameHeader) < size {
			return n + 1, false
		}
		body = body[grpcFrameHeader+int(size):]
		n++
	}
	return n, true
}

// grpcStatusOf reads grpc-status from h; ok is false when h has none or it is not a number.
func grpcStatusOf(h headers) (code int, ok bool) {
	v := h.get(headerGRPCStatus)
	if v == nil {
		return 0, false
	}
	n, err := strconv.Atoi(string(v))
	if err != nil || n < 0 {
		return 0, false
	}
	return n, true
}

// storedGRPCStatus returns the grpc-status of a stored response: its trailers', or its headers'
// for a trailers-only response; "" when it has none.
func storedGRPCStatus(r *cache.Response) string {
	for _, hs := range [][]cache.Header{r.Trailers, r.Headers} {
		for _, h := range hs {
			if h.Name == headerGRPCStatus {
				return string(h.Value)
			}
		}
	}
	return ""
}

// grpcCodeOf is the gRPC status a problem answers a gRPC call with. The problem's code goes in
// grpc-message, so that answers sharing a status stay apart.
func grpcCodeOf(p *problem) codes.Code {
	switch p.outcome {
	case InProgress:
		return codes.Aborted
	case Mismatch, OutcomeUnknown:
		// Neither will change by retrying under the same key.
		return codes.FailedPrecondition
	case NotReplayable:
		return codes.AlreadyExists
	case MissingKey, Invalid, ScopeClaimAmbiguous:
		return codes.InvalidArgument
	case TooLarge:
		return codes.ResourceExhausted
	case StoreError, DurabilityUnmet:
		return codes.Unavailable
	case ScopeMissing:
		return codes.Unauthenticated
	}
	return codes.Internal // Misconfigured, and any problem added later
}

// grpcProblemResponse answers a gRPC call of route r with p: an ImmediateResponse with
// grpc_status, which Envoy sends as a trailers-only response with the body, p's code, percent-
// encoded into grpc-message (Utility::prepareLocalReply in source/common/http/utility.cc). No
// content-type is set: Envoy writes application/grpc itself. The route's problem templates,
// written for HTTP bodies, do not apply. grpc_status is never 0: grpc-go's ext_proc client
// panics on it.
func grpcProblemResponse(p *problem, r *policy.Route, set ...*corev3.HeaderValueOption) *extprocv3.ProcessingResponse {
	if r.ReplayHeaderFresh {
		set = append(set, setHeader(r.ReplayHeader, valueFalse))
	}
	if p.retryAfter {
		set = append(set, setHeader(headerRetryAfter, valueOne))
	}
	resp := immediate(p.status, set, []byte(p.code), "idempotency_"+p.code)
	resp.GetImmediateResponse().GrpcStatus = &extprocv3.GrpcStatus{Status: uint32(grpcCodeOf(p))}
	return resp
}

// grpcReplayRefused answers a duplicate of a completed gRPC call that cannot be replayed here:
// ALREADY_EXISTS response-not-replayable, with the first call's status in
// x-idempotency-original-grpc-status (and, for grpc-go's ext_proc client, which keeps only the
// status and details of an ImmediateResponse, in details).
func grpcReplayRefused(rec *cache.Record, r *policy.Route) *extprocv3.ProcessingResponse {
	original := storedGRPCStatus(&rec.Response)
	var set []*corev3.HeaderValueOption
	if original != "" {
		set = append(set, setHeader(headerOriginalGRPCStatus, []byte(original)))
	}
	resp := grpcProblemResponse(problemNotReplayable, r, set...)
	if original != "" {
		resp.GetImmediateResponse().Details += "_original_grpc_status_" + original
	}
	return resp
}

// canStreamReplay reports whether Envoy can carry a stored gRPC response whole to the client: a
// streamed immediate response (Envoy 1.37 and later) is accepted only as the answer to the
// request headers (owed), and one with a body only in request body mode NONE or
// FULL_DUPLEX_STREAMED (DecodingProcessorState::startLocalResponse in
// source/extensions/filters/http/ext_proc/processor_state.cc). An ordinary ImmediateResponse
// to a gRPC request becomes a trailers-only reply with the body in grpc-message
// (Utility::sendLocalReply in source/common/http/utility.cc), which could not carry the message.
func canStreamReplay(requestMode filterextproc.ProcessingMode_BodySendMode, headersOwed bool) bool {
	return headersOwed && (requestMode == filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED || requestMode == filterextproc.ProcessingMode_NONE)
}

// grpcClaimsAtBody reports whether a gRPC call is claimed once its message has arrived, so that
// the fingerprint covers the message and a replay can still answer the request headers: only in
// FULL_DUPLEX_STREAMED, where Envoy keeps waiting for the request headers' answer while it
// streams the body (Filter::handleDataStreamedModeBase in ext_proc.cc). In every other mode the
// call is claimed at its headers, its fingerprint without the body.
func grpcClaimsAtBody(requestMode filterextproc.ProcessingMode_BodySendMode) bool {
	return requestMode == filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
}

// streamedReplay is a stored gRPC response replayed as a streamed immediate response: the
// headers (with :status, the replay header, the record's expiry and first-sent time, and
// Preference-Applied when the duplicate waited), the message in chunks of at most
// maxStreamedChunk, and the trailers, each its own message, the last ending the response. A
// trailers-only response is its headers alone.
func streamedReplay(rec *cache.Record, route *policy.Route, waited string) []*extprocv3.ProcessingResponse {
	r := &rec.Response
	hs := make([]*corev3.HeaderValue, 0, len(r.Headers)+5)
	hs = append(hs, &corev3.HeaderValue{Key: ":status", RawValue: []byte(strconv.Itoa(r.Status))})
	for _, h := range r.Headers {
		hs = append(hs, &corev3.HeaderValue{Key: h.Name, RawValue: h.Value})
	}
	hs = append(hs, &corev3.HeaderValue{Key: route.ReplayHeader, RawValue: valueTrue})
	if route.ExpiresHeader != "" && !rec.ExpiresAt.IsZero() {
		hs = append(hs, &corev3.HeaderValue{Key: route.ExpiresHeader, RawValue: httpDate(rec.ExpiresAt)})
	}
	if route.FirstSentHeader != "" && !rec.CreatedAt.IsZero() {
		hs = append(hs, &corev3.HeaderValue{Key: route.FirstSentHeader, RawValue: httpDate(rec.CreatedAt)})
	}
	if waited != "" {
		hs = append(hs, &corev3.HeaderValue{Key: headerPreferenceApplied, RawValue: []byte(waited)})
	}
	body, trailers := r.Body, len(r.Trailers) > 0
	onlyHeaders := len(body) == 0 && !trailers
	out := []*extprocv3.ProcessingResponse{localPart(&extprocv3.StreamedImmediateResponse{
		Response: &extprocv3.StreamedImmediateResponse_HeadersResponse{HeadersResponse: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: hs}, EndOfStream: onlyHeaders,
		}},
	})}
	for len(body) > 0 {
		n := min(len(body), maxStreamedChunk)
		out = append(out, localPart(&extprocv3.StreamedImmediateResponse{
			Response: &extprocv3.StreamedImmediateResponse_BodyResponse{BodyResponse: &extprocv3.StreamedBodyResponse{
				Body: body[:n], EndOfStream: n == len(body) && !trailers,
			}},
		}))
		body = body[n:]
	}
	if trailers {
		ts := make([]*corev3.HeaderValue, len(r.Trailers))
		for i, h := range r.Trailers {
			ts[i] = &corev3.HeaderValue{Key: h.Name, RawValue: h.Value}
		}
		out = append(out, localPart(&extprocv3.StreamedImmediateResponse{
			Response: &extprocv3.StreamedImmediateResponse_TrailersResponse{TrailersResponse: &corev3.HeaderMap{Headers: ts}},
		}))
	}
	return out
}

func localPart(p *extprocv3.StreamedImmediateResponse) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_StreamedImmediateResponse{StreamedImmediateResponse: p}}
}

// judgeGRPCResponse decides what the response headers of a gRPC call that ran under a lease of
// route r do to that lease. A response Envoy made, or one that is not a gRPC answer (a :status
// other than 200), is judged as HTTP; a trailers-only response by the grpc-status in its
// headers (code, known); any other waits for its trailers (settleCapture: its message is kept
// meanwhile).
func judgeGRPCResponse(r *policy.Route, resp response, code int, known bool) (s settlement, releaseReason string, omitted bool) {
	o := resp.origin
	switch {
	case o.envoyMade || resp.status != http.StatusOK:
		if o.envoyMade || !o.detailsKnown {
			if o.attemptsKnown && o.attempts == 0 {
				return settleRelease, ReleaseEnvoyResponse, false
			}
			return settleUnknown, "", false
		}
		return settleRelease, ReleaseStatus, false
	case resp.endOfStream:
		s, releaseReason = judgeGRPCStatus(r, o, code, known)
		return s, releaseReason, false
	}
	return settleCapture, "", false
}

// judgeGRPCStatus decides a gRPC call by its grpc-status (code, known): stored when the route
// stores it, else released; unknown when no status came, or when it may be Envoy's (the
// response came without response.code_details) and the request reached the upstream.
func judgeGRPCStatus(r *policy.Route, o origin, code int, known bool) (settlement, string) {
	switch {
	case !known:
		return settleUnknown, ""
	case r.StoreGRPCStatuses.Has(code):
		return settleRecord, ""
	case !o.detailsKnown && o.attemptsKnown && o.attempts == 0:
		return settleRelease, ReleaseEnvoyResponse
	case !o.detailsKnown:
		return settleUnknown, ""
	}
	return settleRelease, ReleaseStatus
}

// grpcAdmit fits a gRPC call's admission to the request body mode (grpcClaimsAtBody). Claimed at
// its headers, a call's fingerprint leaves the body out, and a key that would be the body's hash
// (missing_key: body-hash) cannot be had: 500 body-not-available.
func grpcAdmit(a admission, requestMode filterextproc.ProcessingMode_BodySendMode) admission {
	if !a.grpc || a.problem != nil || grpcClaimsAtBody(requestMode) {
		return a
	}
	if a.key == "" { // the body's hash
		return admission{covered: true, grpc: true, problem: problemBodyNotAvailable}
	}
	a.needsBody = false
	return a
}

// The stream's gRPC steps: what it does differently for a call whose admission says grpc.

// grpcReplayable reports whether Envoy can carry rec back to this call as a streamed immediate
// response: the call is Envoy's (not the proxyless client's), its message was kept, and the
// request headers' answer is still owed in a body mode that allows one. Asked before the verdict
// moves the stream.
func (st *stream) grpcReplayable(rec *cache.Record) bool {
	headersOwed := st.state == stateStart || st.withholdsHeaders()
	return !st.proxyless() && !rec.Response.BodyOmitted && canStreamReplay(st.pc.GetRequestBodyMode(), headersOwed)
}

// sendGRPC sends a, an answer to a gRPC call, when it differs from the HTTP one, and reports
// whether it did: a problem as a gRPC status, a replay as a streamed immediate response where
// Envoy can carry one, else ALREADY_EXISTS response-not-replayable with the original status
// (the outcome is then not_replayable). The first message carries md, the dynamic metadata of
// the outcome settled with it.
func (st *stream) sendGRPC(a answer, md []byte) bool {
	var msgs []*extprocv3.ProcessingResponse
	switch a := a.(type) {
	case refuse:
		msgs = []*extprocv3.ProcessingResponse{st.req.route.grpcProblems[a.p]}
	case replay:
		if a.refused {
			msgs = []*extprocv3.ProcessingResponse{grpcReplayRefused(a.rec, st.req.route.Route)}
		} else {
			msgs = streamedReplay(a.rec, st.req.route.Route, a.waited)
		}
	default:
		return false
	}
	if md != nil {
		msgs[0] = withMetadata(msgs[0], false, md)
	}
	st.out = append(st.out, msgs...)
	return true
}

// grpcVerdict is a claim's verdict for a gRPC call: a completed call whose message was not kept
// is answered as a replay that cannot be carried (sendGRPC), with its status.
func (st *stream) grpcVerdict(v verdict, rec *cache.Record) verdict {
	if v.act == actRefuse && v.problem == problemNotReplayable && st.req.adm.grpc && rec != nil && !rec.Response.OutcomeUnknown {
		return verdict{act: actReplay}
	}
	return v
}

// notUnary refuses a gRPC call whose request body holds more than one message, before it is
// claimed: INVALID_ARGUMENT grpc-not-unary.
func (st *stream) notUnary(body []byte) bool {
	if n, _ := grpcMessages(body); n <= 1 {
		return false
	}
	st.reject(problemGRPCNotUnary)
	return true
}

// notUnaryHeld refuses a gRPC call claimed at its headers whose body holds more than one
// message, where Envoy holds the headers until the body's answer (BUFFERED, BUFFERED_PARTIAL):
// nothing of it reached the upstream, so the key is released (not_sent) and the call refused
// INVALID_ARGUMENT grpc-not-unary. Under STREAMED the headers went upstream at their answer, and
// the call runs (docs/outcomes.md). In shadow mode the call goes on.
func (st *stream) notUnaryHeld(body []byte) bool {
	if st.state != stateRunning || !st.req.adm.grpc || st.req.route.shadow || !requestBodyRows[st.pc.GetRequestBodyMode()].holdsHeaders {
		return false
	}
	if n, _ := grpcMessages(body); n <= 1 {
		return false
	}
	st.call.release(ReleaseNotSent)
	st.move(evSettle, refuse{problemGRPCNotUnary})
	return true
}

// judgeGRPC judges the response headers of a gRPC call, keeping their origin for the trailers.
// A message Envoy will not send (response body mode NONE) is left out of the record.
func (st *stream) judgeGRPC(resp response, h headers) (settlement, string, bool) {
	st.call.origin = resp.origin
	code, known := grpcStatusOf(h)
	s, reason, omitted := judgeGRPCResponse(st.req.route.Route, resp, code, known)
	if s == settleCapture && !resp.bodySent {
		st.call.resp.BodyOmitted = true
	}
	return s, reason, omitted
}

// grpcResponseBody keeps the message of a gRPC response being captured; its outcome waits for
// the trailers. A body that ends the response (no trailers, so no grpc-status) leaves it unknown.
func (st *stream) grpcResponseBody(chunk []byte, eos bool) {
	resp := &st.call.resp
	switch {
	case resp.BodyOmitted:
	case !st.req.route.StoreBody || len(resp.Body)+len(chunk) > st.req.route.MaxResponseBytes:
		resp.BodyOmitted, resp.Body = true, nil
	default:
		resp.Body = append(resp.Body, chunk...)
	}
	a := st.pass(kindResponseBody, chunk, eos)
	if !eos {
		st.send(a, nil)
		return
	}
	st.grpcTrailersMissing()
	st.unknownOutcome(resp.Status)
	st.move(evSettle, a)
}

// grpcTrailers settles a captured gRPC response by the grpc-status of its trailers: recorded with
// them, released, or unknown. The record is written before the trailers' answer lets the
// response's end go on.
func (st *stream) grpcTrailers(m *extprocv3.HttpTrailers) {
	t := headers(m.GetTrailers().GetHeaders())
	code, known := grpcStatusOf(t)
	switch s, reason := judgeGRPCStatus(st.req.route.Route, st.call.origin, code, known); s {
	case settleRecord:
		st.call.resp.Trailers = replayableHeaders(t, st.req.route.Route)
		st.call.complete()
	case settleRelease:
		st.call.release(reason)
	default:
		st.unknownOutcome(st.call.resp.Status)
	}
}

// noPath reports whether the request came without a :path, as through grpc-go's ext_proc client
// (Envoy always sends one), covered or not. That client reads no mode_override (nothing in
// grpc-go 1.85's internal/xds/httpfilter/extproc/ext_proc.go reads one): the processor sends it
// none, as a phase it then sends is no sign of a misconfigured Envoy.
func (st *stream) noPath() bool {
	return st.req.info.path == nil
}

// proxyless reports whether the call came through grpc-go's own ext_proc client (gRFC A93),
// which sends no :path (Envoy always does): it takes no streamed immediate response.
func (st *stream) proxyless() bool {
	return st.req.adm.grpc && st.noPath()
}
