package extproc_test

import (
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-extproc/idempotency-extproc/extproc"
)

// gRPC unary calls through the stream, message by message as Envoy sends them: claimed once
// the message has arrived in FULL_DUPLEX_STREAMED (the request headers' answer held until then),
// completed at the trailers' grpc-status, replayed as a streamed immediate response.

// grpcFrame is one gRPC message: flags 0, a 4-byte length, the payload.
func grpcFrame(payload string) []byte {
	n := len(payload)
	return append([]byte{0, byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}, payload...)
}

// grpcCall is one unary call as Envoy's ext_proc filter sends it in request body mode mode.
type grpcCall struct {
	key  string
	body []byte
	mode filterextproc.ProcessingMode_BodySendMode
}

func (c grpcCall) headers() *extprocv3.ProcessingRequest {
	m := requestHeaders(post("/payments.v1.Payments/Charge", c.key, string(c.body), "content-type", "application/grpc", "te", "trailers"))
	m.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: c.mode, ResponseBodyMode: filterextproc.ProcessingMode_BUFFERED}
	return m
}

// recv reads the next answer.
func recv(t *testing.T, st *stream) *extprocv3.ProcessingResponse {
	t.Helper()
	resp, err := st.s.Recv()
	require.NoError(t, err)
	return resp
}

// sendOnly sends m without waiting for an answer.
func sendOnly(t *testing.T, st *stream, m *extprocv3.ProcessingRequest) {
	t.Helper()
	require.NoError(t, st.s.Send(m))
}

// begin sends a call's request and returns the first answer that settles it: the request
// headers' CONTINUE (it runs), or an immediate or streamed immediate response. In
// FULL_DUPLEX_STREAMED the message goes right after the headers, unanswered, as Envoy streams it.
func (c grpcCall) begin(t *testing.T, st *stream) *extprocv3.ProcessingResponse {
	t.Helper()
	if c.mode == filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED {
		sendOnly(t, st, c.headers())
		sendOnly(t, st, requestBody(c.body))
		return recv(t, st)
	}
	return st.send(c.headers())
}

// finish sends the rest of a call that runs, and its upstream's answer: headers, the message
// (BUFFERED response mode: it comes at the trailers, end_of_stream false) and the trailers.
func (c grpcCall) finish(t *testing.T, st *stream, first *extprocv3.ProcessingResponse, reply []byte, status string) {
	t.Helper()
	require.NotNil(t, first.GetRequestHeaders(), "the call runs: its headers are let through")
	if c.mode == filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED {
		sr := recv(t, st).GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		require.Equal(t, c.body, sr.GetBody(), "the message is streamed back whole")
		require.True(t, sr.GetEndOfStream())
	} else {
		require.NotNil(t, st.send(requestBody(c.body)).GetRequestBody())
	}
	rh := responseHeaders(upstream{status: 200, headers: []string{"content-type", "application/grpc"}})
	rh.GetResponseHeaders().EndOfStream = false // the trailers follow
	require.NotNil(t, st.send(rh).GetResponseHeaders())
	if len(reply) > 0 {
		require.NotNil(t, st.send(responseBody(reply, false)).GetResponseBody())
	}
	trailers := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{
		Trailers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: "grpc-status", RawValue: []byte(status)}, {Key: "grpc-message", RawValue: []byte("")}}},
	}}}
	require.NotNil(t, st.send(trailers).GetResponseTrailers())
}

func grpcStatusOf(t *testing.T, resp *extprocv3.ProcessingResponse) codes.Code {
	t.Helper()
	ir := resp.GetImmediateResponse()
	require.NotNil(t, ir, "an immediate response, got %v", resp)
	return codes.Code(ir.GetGrpcStatus().GetStatus())
}

func TestGRPCUnaryFullDuplex(t *testing.T) {
	fds := filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
	h := newHarness(t, harnessOptions{policy: "routes: [{name: charge, match: {path_prefix: /payments.v1.Payments/}, grpc: true}]"})
	charge := grpcCall{key: "k1", body: grpcFrame("amount=10"), mode: fds}
	reply := grpcFrame("tx_1")

	// The first call: its headers' answer is held until the message came, then it runs.
	st := h.open()
	first := charge.begin(t, st)

	// A concurrent duplicate: ABORTED request-in-progress.
	dup := h.open()
	inFlight := charge.begin(t, dup)
	require.Equal(t, codes.Aborted, grpcStatusOf(t, inFlight))
	require.Equal(t, "request-in-progress", string(inFlight.GetImmediateResponse().GetBody()))

	charge.finish(t, st, first, reply, "0")
	st.end()
	h.waitIdle(t)

	// The retry: the stored headers, message and trailers, as a streamed immediate response.
	retry := h.open()
	var parts []*extprocv3.StreamedImmediateResponse
	parts = append(parts, charge.begin(t, retry).GetStreamedImmediateResponse())
	require.NotNil(t, parts[0].GetHeadersResponse(), "a streamed immediate response answers the request headers")
	parts = append(parts, recv(t, retry).GetStreamedImmediateResponse(), recv(t, retry).GetStreamedImmediateResponse())
	hs := map[string]string{}
	for _, hv := range parts[0].GetHeadersResponse().GetHeaders().GetHeaders() {
		hs[hv.GetKey()] = string(hv.GetRawValue())
	}
	require.Equal(t, "200", hs[":status"])
	require.Equal(t, "application/grpc", hs["content-type"])
	require.Equal(t, "true", hs["x-idempotency-replayed"])
	require.Equal(t, reply, parts[1].GetBodyResponse().GetBody())
	require.False(t, parts[1].GetBodyResponse().GetEndOfStream())
	require.Equal(t, "grpc-status", parts[2].GetTrailersResponse().GetHeaders()[0].GetKey())
	require.Equal(t, "0", string(parts[2].GetTrailersResponse().GetHeaders()[0].GetRawValue()))
	retry.end()

	// Another message under the same key: FAILED_PRECONDITION idempotency-key-reused.
	other := charge
	other.body = grpcFrame("amount=99")
	require.Equal(t, codes.FailedPrecondition, grpcStatusOf(t, other.begin(t, h.open())))

	// Two messages: INVALID_ARGUMENT grpc-not-unary, and nothing claimed.
	stream := grpcCall{key: "k2", body: append(grpcFrame("a"), grpcFrame("b")...), mode: fds}
	refused := stream.begin(t, h.open())
	require.Equal(t, codes.InvalidArgument, grpcStatusOf(t, refused))
	require.Equal(t, "grpc-not-unary", string(refused.GetImmediateResponse().GetBody()))
	h.requireStoreEmpty(t, "k2")

	// A call that failed UNAVAILABLE is not stored: it runs again.
	flaky := grpcCall{key: "k3", body: grpcFrame("amount=1"), mode: fds}
	for range 2 {
		st := h.open()
		flaky.finish(t, st, flaky.begin(t, st), nil, "14")
		st.end()
		h.waitIdle(t)
	}
	h.requireStoreEmpty(t, "k3")
	require.Equal(t, 3.0, h.counter("idempotency_requests_total", "route", "charge", "outcome", "executed"), "the first charge, and the failing one twice")
	require.Equal(t, 1.0, h.counter("idempotency_requests_total", "route", "charge", "outcome", "replayed"))
}

// In request body mode BUFFERED Envoy cannot carry a stored message back (a streamed immediate
// response with a body needs NONE or FULL_DUPLEX_STREAMED): the call is claimed at its headers,
// and a duplicate of a completed call gets ALREADY_EXISTS with the first call's status.
func TestGRPCUnaryBufferedIsRefusedWithTheOriginalStatus(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: "routes: [{name: charge, match: {path_prefix: /payments.v1.Payments/}, grpc: true, store_grpc_statuses: [OK, NOT_FOUND]}]"})
	call := grpcCall{key: "k1", body: grpcFrame("amount=10"), mode: filterextproc.ProcessingMode_BUFFERED}
	st := h.open()
	call.finish(t, st, call.begin(t, st), grpcFrame(""), "5")
	st.end()
	h.waitIdle(t)

	resp := call.begin(t, h.open())
	require.Equal(t, codes.AlreadyExists, grpcStatusOf(t, resp))
	ir := resp.GetImmediateResponse()
	require.Equal(t, "response-not-replayable", string(ir.GetBody()))
	got := map[string]string{}
	for _, o := range ir.GetHeaders().GetSetHeaders() {
		got[o.GetHeader().GetKey()] = string(o.GetHeader().GetRawValue())
	}
	require.Equal(t, "5", got["x-idempotency-original-grpc-status"])
	md := resp.GetDynamicMetadata().GetFields()["idempotency"].GetStructValue().GetFields()["outcome"]
	require.Equal(t, structpb.NewStringValue("not_replayable").GetStringValue(), md.GetStringValue())
}

// A gRPC call whose trailers never reach the processor has no known outcome: under
// unknown_outcome release (the default) its key is freed when the stream ends, and the retry runs.
// Under response body mode NONE its message is never seen: it completes without it, and a retry
// gets ALREADY_EXISTS rather than an empty message.
func TestGRPCUnaryOutcomeWithoutTrailersOrMessage(t *testing.T) {
	fds := filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
	h := newHarness(t, harnessOptions{policy: "routes: [{name: charge, match: {path_prefix: /payments.v1.Payments/}, grpc: true}]"})

	call := grpcCall{key: "k1", body: grpcFrame("amount=10"), mode: fds}
	st := h.open()
	require.NotNil(t, call.begin(t, st).GetRequestHeaders())
	recv(t, st) // the message streamed back
	rh := responseHeaders(upstream{status: 200, headers: []string{"content-type", "application/grpc"}, body: grpcFrame("tx_1")})
	require.NotNil(t, st.send(rh).GetResponseHeaders())
	st.end()
	h.waitIdle(t)
	h.requireStoreEmpty(t, "k1")

	noBody := grpcCall{key: "k2", body: grpcFrame("amount=10"), mode: fds}
	headers := func() *extprocv3.ProcessingRequest {
		m := noBody.headers()
		m.ProtocolConfig.ResponseBodyMode = filterextproc.ProcessingMode_NONE
		return m
	}
	st = h.open()
	sendOnly(t, st, headers())
	sendOnly(t, st, requestBody(noBody.body))
	noBody.finish(t, st, recv(t, st), nil, "0")
	st.end()
	h.waitIdle(t)
	require.True(t, h.record(t, "k2").Response.BodyOmitted, "the message was never seen")

	retry := h.open()
	sendOnly(t, retry, headers())
	sendOnly(t, retry, requestBody(noBody.body))
	require.Equal(t, codes.AlreadyExists, grpcStatusOf(t, recv(t, retry)))
}

// proxylessCall is a unary call as grpc-go's own ext_proc client (gRFC A93) sends it, read from
// grpc-go 1.85's internal/xds/httpfilter/extproc/ext_proc.go: request headers that are the
// call's metadata only (no :path, :method or content-type; requestHeaders), the protocol_config
// of the first message, each message de-framed in its own body message and the half-close as a
// body with end_of_stream and end_of_stream_without_message (marshalAndCreateBodyReq,
// halfClose), response headers without :status (responseHeaders), and response trailers that are
// the call's trailer metadata (initiateResponseTrailerProcessing): grpc-go's transport keeps
// grpc-status out of that metadata (internal/transport/http2_client.go, operateHeaders), so
// grpc-go 1.85 sends none. run's status models a client that would forward it; "" is grpc-go
// 1.85.
type proxylessCall struct {
	key            string
	mode, respMode filterextproc.ProcessingMode_BodySendMode // GRPC or NONE
}

func (c proxylessCall) headers() *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
			{Key: "idempotency-key", RawValue: []byte(c.key)}, {Key: "user-agent", RawValue: []byte("grpc-go/1.85.0")},
		}}}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: c.mode, ResponseBodyMode: c.respMode},
	}
}

// run sends a whole call that runs, with the upstream's answer, and requires every body answer
// to carry the body back as grpc-go's client needs.
func (c proxylessCall) run(t *testing.T, st *stream, msg, reply []byte, status string) {
	t.Helper()
	require.NotNil(t, st.send(c.headers()).GetRequestHeaders(), "the call runs")
	if c.mode == filterextproc.ProcessingMode_GRPC {
		sr := st.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: msg}}}).
			GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		require.NotNil(t, sr, "grpc-go fails the call on a body answer without streamed_response")
		require.Equal(t, msg, sr.GetBody())
		require.False(t, sr.GetEndOfStream())
		sr = st.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{EndOfStream: true, EndOfStreamWithoutMessage: true}}}).
			GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		require.True(t, sr.GetEndOfStream() && sr.GetEndOfStreamWithoutMessage(), "the half-close is streamed back as one, not as an empty message")
	}
	rh := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: "x-up-header", RawValue: []byte("h")}}},
	}}}
	require.NotNil(t, st.send(rh).GetResponseHeaders())
	if c.respMode == filterextproc.ProcessingMode_GRPC {
		sr := st.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: reply}}}).
			GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		require.Equal(t, reply, sr.GetBody())
		require.False(t, sr.GetEndOfStream(), "grpc-go fails the call on end_of_stream in a response body answer")
	}
	trailers := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}}
	if status != "" {
		trailers.GetResponseTrailers().Trailers = &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: "grpc-status", RawValue: []byte(status)}}}
	}
	require.NotNil(t, st.send(trailers).GetResponseTrailers())
}

// Through grpc-go's own ext_proc client the policy route is named by the filter's
// grpc_service.initial_metadata and says grpc: true. A call runs once per key; a duplicate of a
// call completed with a status the processor saw (grpc-go 1.85 forwards none:
// TestGRPCProxylessClientSendsNoStatus) gets ALREADY_EXISTS with the first status in details (that client keeps only
// grpc_status and details of an ImmediateResponse, and takes no streamed immediate response); one
// sent while the first runs gets ABORTED; a call that failed UNAVAILABLE runs again.
func TestGRPCProxylessClient(t *testing.T) {
	grpcMode, none := filterextproc.ProcessingMode_GRPC, filterextproc.ProcessingMode_NONE
	for _, modes := range [][2]filterextproc.ProcessingMode_BodySendMode{{grpcMode, grpcMode}, {none, none}, {none, grpcMode}} {
		mode, respMode := modes[0], modes[1]
		t.Run(mode.String()+"-"+respMode.String(), func(t *testing.T) {
			h := newHarness(t, harnessOptions{policy: "routes: [{name: charge, match: {path_prefix: /payments.v1.Payments/}, grpc: true}]"})
			call := proxylessCall{key: "k1", mode: mode, respMode: respMode}

			st := h.openNamed("charge")
			call.run(t, st, []byte("\x08\x0a"), []byte("\x0a\x04tx_1"), "0")
			st.end()
			h.waitIdle(t)
			require.Equal(t, 1.0, h.counter("idempotency_requests_total", "route", "charge", "outcome", "executed"))
			require.Zero(t, h.counter("idempotency_envoy_misconfig_total", "kind", "code_details_missing"), "that client sends no response attributes: not a misconfiguration")

			ir := h.openNamed("charge").send(call.headers()).GetImmediateResponse()
			require.NotNil(t, ir, "a duplicate of a completed call is answered at its headers")
			require.Equal(t, uint32(codes.AlreadyExists), ir.GetGrpcStatus().GetStatus())
			require.Contains(t, ir.GetDetails(), "original_grpc_status_0")

			running := proxylessCall{key: "k2", mode: mode, respMode: respMode}
			first := h.openNamed("charge")
			require.NotNil(t, first.send(running.headers()).GetRequestHeaders())
			ir = h.openNamed("charge").send(running.headers()).GetImmediateResponse()
			require.Equal(t, uint32(codes.Aborted), ir.GetGrpcStatus().GetStatus())
			first.end()

			flaky := proxylessCall{key: "k3", mode: mode, respMode: respMode}
			for range 2 {
				st := h.openNamed("charge")
				flaky.run(t, st, []byte("\x08\x01"), nil, "14")
				st.end()
				h.waitIdle(t)
			}
			require.Equal(t, 4.0, h.counter("idempotency_requests_total", "route", "charge", "outcome", "executed"), "k1 and k2 once, k3 twice")
		})
	}
}

// grpc-go 1.85's ext_proc client forwards no grpc-status: a call's trailers are its trailer
// metadata, and a trailers-only response (a failure before any message) comes as response
// headers that end the response, without it too (proxylessCall). The outcome of either is
// unknown: released by default, so a retry runs again, or kept under unknown_outcome: record, so
// a retry gets FAILED_PRECONDITION outcome-unknown. No misconfiguration is counted: that client
// sends no response attributes, whatever its xDS configuration.
func TestGRPCProxylessClientSendsNoStatus(t *testing.T) {
	grpcMode, none := filterextproc.ProcessingMode_GRPC, filterextproc.ProcessingMode_NONE
	for _, unknown := range []string{"release", "record"} {
		t.Run(unknown, func(t *testing.T) {
			h := newHarness(t, harnessOptions{policy: "routes: [{name: charge, match: {path_prefix: /payments.v1.Payments/}, grpc: true, unknown_outcome: " + unknown + "}]"})
			ok := proxylessCall{key: "k1", mode: grpcMode, respMode: grpcMode}
			st := h.openNamed("charge")
			ok.run(t, st, []byte("\x08\x0a"), []byte("\x0a\x04tx_1"), "")
			st.end()

			failed := proxylessCall{key: "k2", mode: none, respMode: none}
			st = h.openNamed("charge")
			require.NotNil(t, st.send(failed.headers()).GetRequestHeaders(), "the call runs")
			trailersOnly := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{EndOfStream: true}}}
			require.NotNil(t, st.send(trailersOnly).GetResponseHeaders())
			st.end()
			h.waitIdle(t)

			for _, call := range []proxylessCall{ok, failed} {
				retry := h.openNamed("charge").send(call.headers())
				if unknown == "release" {
					require.NotNil(t, retry.GetRequestHeaders(), "%s: the retry runs again", call.key)
					continue
				}
				ir := retry.GetImmediateResponse()
				require.NotNil(t, ir, "%s: the retry is refused", call.key)
				require.Equal(t, uint32(codes.FailedPrecondition), ir.GetGrpcStatus().GetStatus())
				require.Equal(t, "idempotency_outcome-unknown", ir.GetDetails())
			}
			for _, kind := range []string{extproc.MisconfigAttemptCountMissing, extproc.MisconfigCodeDetailsMissing} {
				require.Zero(t, h.counter("idempotency_envoy_misconfig_total", "kind", kind), kind)
			}
		})
	}
}

// A plain HTTP request on a grpc: true route stays HTTP: its retry is replayed from the record its
// :status settled, another payload under its key is 422, and nothing goes out as a grpc-status.
func TestGRPCRouteKeepsHTTPRequestsHTTP(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: "routes: [{name: charge, match: {path_prefix: /payments.v1.Payments/}, grpc: true}]"})
	ok := upstream{status: 200, headers: []string{"content-type", "application/json"}, body: []byte(`{"id":"tx_1"}`)}
	charge := func(body string) request {
		return post("/payments.v1.Payments/Charge", "k1", body, "content-type", "application/json")
	}
	first := h.do(charge(`{"amount":1}`), ok)
	require.True(t, first.executed)
	require.Equal(t, []string{"false"}, first.header("x-idempotency-replayed"))

	retry := h.do(charge(`{"amount":1}`), ok)
	require.False(t, retry.executed, "the retry must not run again")
	require.Equal(t, 200, retry.status)
	require.Equal(t, []string{"true"}, retry.header("x-idempotency-replayed"))
	require.JSONEq(t, `{"id":"tx_1"}`, string(retry.body))

	other := h.do(charge(`{"amount":999}`), ok)
	require.False(t, other.executed)
	require.Equal(t, 422, other.status)
	require.Empty(t, other.header("grpc-status"))
	h.waitIdle(t)
	require.Equal(t, 1.0, h.counter("idempotency_requests_total", "route", "charge", "outcome", "replayed"))
	require.Equal(t, 1.0, h.counter("idempotency_requests_total", "route", "charge", "outcome", "mismatch"))
}

// grpc-go's own ext_proc client reads no mode_override: the processor sends it none, for an
// uncovered call or for a response it will not store, and the phases that client then sends are
// no misconfiguration of Envoy's.
func TestGRPCProxylessSendsNoModeOverride(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: "routes: [{name: charge, match: {path_prefix: /payments.v1.Payments/}, grpc: true, missing_key: optional}]"})
	grpcMode := filterextproc.ProcessingMode_GRPC
	respHeaders := func(hs ...string) *extprocv3.ProcessingRequest {
		var hv []*corev3.HeaderValue
		for i := 0; i < len(hs); i += 2 {
			hv = append(hv, &corev3.HeaderValue{Key: hs[i], RawValue: []byte(hs[i+1])})
		}
		return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: hv}}}}
	}

	// Uncovered: no key on a missing_key: optional route.
	uncovered := proxylessCall{mode: grpcMode, respMode: grpcMode}.headers()
	uncovered.GetRequestHeaders().Headers.Headers = uncovered.GetRequestHeaders().Headers.Headers[1:]
	st := h.openNamed("charge")
	a := st.send(uncovered)
	require.NotNil(t, a.GetRequestHeaders())
	require.Nil(t, a.GetModeOverride())
	require.NotNil(t, st.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte("m")}}}).GetRequestBody())
	require.NotNil(t, st.send(respHeaders("x-up-header", "h")).GetResponseHeaders())
	st.end()

	// Covered, with a trailers-only UNAVAILABLE: released, not stored.
	call := proxylessCall{key: "k1", mode: filterextproc.ProcessingMode_NONE, respMode: grpcMode}
	st = h.openNamed("charge")
	require.NotNil(t, st.send(call.headers()).GetRequestHeaders())
	a = st.send(respHeaders("grpc-status", "14"))
	require.NotNil(t, a.GetResponseHeaders())
	require.Nil(t, a.GetModeOverride())
	st.end()

	h.waitIdle(t)
	require.Zero(t, h.counter("idempotency_envoy_misconfig_total", "kind", "mode_override_refused"))
}

// Under BUFFERED and BUFFERED_PARTIAL a gRPC call is claimed at its headers, and Envoy holds them
// until the body's answer: a body of more than one message is refused INVALID_ARGUMENT
// grpc-not-unary before anything reaches the upstream, and its key is released, so a unary call
// under it then runs.
func TestGRPCNotUnaryRefusedWhereEnvoyHoldsTheHeaders(t *testing.T) {
	for _, mode := range []filterextproc.ProcessingMode_BodySendMode{filterextproc.ProcessingMode_BUFFERED, filterextproc.ProcessingMode_BUFFERED_PARTIAL} {
		t.Run(mode.String(), func(t *testing.T) {
			h := newHarness(t, harnessOptions{policy: "routes: [{name: charge, match: {path_prefix: /payments.v1.Payments/}, grpc: true}]"})
			stream := grpcCall{key: "k1", body: append(grpcFrame("a"), grpcFrame("b")...), mode: mode}
			st := h.open()
			require.NotNil(t, stream.begin(t, st).GetRequestHeaders(), "claimed at its headers")
			resp := st.send(requestBody(stream.body))
			require.Equal(t, codes.InvalidArgument, grpcStatusOf(t, resp))
			require.Equal(t, "idempotency_grpc-not-unary", resp.GetImmediateResponse().GetDetails())
			st.end()
			h.waitIdle(t)
			require.Equal(t, 1.0, h.counter("idempotency_requests_total", "route", "charge", "outcome", "invalid"))
			require.Equal(t, 1.0, h.counter("idempotency_releases_total", "route", "charge", "reason", "not_sent"))

			unary := grpcCall{key: "k1", body: grpcFrame("a"), mode: mode}
			st = h.open()
			unary.finish(t, st, unary.begin(t, st), grpcFrame("ok"), "0")
			st.end()
			h.waitIdle(t)
			require.Equal(t, 1.0, h.counter("idempotency_requests_total", "route", "charge", "outcome", "executed"))
		})
	}
}

// The response headers of a gRPC call being captured carry no record expiry: whether the call is
// stored is known only at its trailers. An HTTP response being captured carries it.
func TestGRPCCaptureHeadersCarryNoExpiry(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: "routes: [{name: charge, match: {path_prefix: /payments.v1.Payments/}, grpc: true}]"})
	setHeaders := func(resp *extprocv3.ProcessingResponse) map[string]string {
		got := map[string]string{}
		for _, o := range resp.GetResponseHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
			got[o.GetHeader().GetKey()] = string(o.GetHeader().GetRawValue())
		}
		return got
	}
	call := grpcCall{key: "k1", body: grpcFrame("a"), mode: filterextproc.ProcessingMode_BUFFERED}
	st := h.open()
	require.NotNil(t, call.begin(t, st).GetRequestHeaders())
	require.NotNil(t, st.send(requestBody(call.body)).GetRequestBody())
	rh := responseHeaders(upstream{status: 200, headers: []string{"content-type", "application/grpc"}})
	rh.GetResponseHeaders().EndOfStream = false
	got := setHeaders(st.send(rh))
	require.Equal(t, "false", got["x-idempotency-replayed"], "the answer is the capture's mark")
	require.NotContains(t, got, "x-idempotency-expires")
	st.end()

	st = h.open()
	require.NotNil(t, st.send(requestHeaders(post("/payments.v1.Payments/Charge", "k2", `{"a":1}`, "content-type", "application/json"))).GetRequestHeaders())
	require.NotNil(t, st.send(requestBody([]byte(`{"a":1}`))).GetRequestBody())
	rh = responseHeaders(upstream{status: 200, headers: []string{"content-type", "application/json"}})
	rh.GetResponseHeaders().EndOfStream = false
	require.Contains(t, setHeaders(st.send(rh)), "x-idempotency-expires")
	st.end()
}
