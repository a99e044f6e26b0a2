package extproc_test

import (
	"bytes"
	"errors"
	"io"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
)

// This file plays Envoy's side of one stream in every body mode, as Envoy's ext_proc filter does
// (Filter in source/extensions/filters/http/ext_proc/ext_proc.cc, ProcessorState in
// processor_state.cc): the message kinds and their order, pipelined STREAMED chunks held until
// answered, a body complete during the header call sent as one message, BUFFERED_PARTIAL
// buffers, FULL_DUPLEX_STREAMED bodies that must come back as streamed_response, honoured
// mode_override (except in FULL_DUPLEX_STREAMED), ImmediateResponse at any point, Envoy-made
// responses with their attributes, and early ends. What reaches the upstream is what Envoy would
// forward: a request runs only once its whole body went through.

type bodyMode = filterextproc.ProcessingMode_BodySendMode

const (
	modeNone     = filterextproc.ProcessingMode_NONE
	modeStreamed = filterextproc.ProcessingMode_STREAMED
	modeBuffered = filterextproc.ProcessingMode_BUFFERED
	modePartial  = filterextproc.ProcessingMode_BUFFERED_PARTIAL
	modeDuplex   = filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
)

// ending is where an exchange ends early, if it does.
type ending uint8

const (
	endNormally ending = iota
	// endBeforeResponse: the stream ends after the request phases, before any response headers
	// (client gone, upstream reset or timeout on an Envoy that sends no local reply to the
	// processor); ranUpstream says whether the upstream had run it.
	endBeforeResponse
	// endMidBody: the stream ends after the response headers were answered, before the body's
	// end (upstream reset mid-body, client gone, a body over the buffer limit).
	endMidBody
	// endEnvoyMade: Envoy makes the response (Envoy-made status and details, attempt count).
	endEnvoyMade
)

// shape is how Envoy delivers one request and its response.
type shape struct {
	reqMode, respMode bodyMode
	// chunks are the sizes of the request body's messages in the streamed modes (the last takes
	// the rest); whole sends the body as one message, as Envoy does when it arrived complete
	// during the header call.
	chunks []int
	whole  bool
	// trailers: the request and the response have trailers, sent to the processor when
	// trailerSend (request_trailer_mode and response_trailer_mode SEND).
	trailers, trailerSend bool
	// bufferLimit is Envoy's buffer limit: BUFFERED_PARTIAL's buffer, the most a STREAMED
	// request may hold unanswered, the most a BUFFERED response may be (0: 1 MiB).
	bufferLimit int
	// respChunks are the response body's messages in the streamed modes.
	respChunks []int
	end        ending
	// ranUpstream: with endBeforeResponse or endEnvoyMade, the upstream ran the request.
	ranUpstream bool
	// envoyStatus, attempts and noAttempts describe an Envoy-made response.
	envoyStatus int
	attempts    int
	noAttempts  bool
	// messageTimeout is how long Envoy waits for an answer (0: 5 s, far above any answer here).
	messageTimeout time.Duration
	// bodyBeforeAnswer is send_body_without_waiting_for_header_response (STREAMED).
	bodyBeforeAnswer bool
}

// simResult is what the client gets, and what the upstream saw.
type simResult struct {
	result
	// ran: the upstream ran the request (it received it whole).
	ran bool
	// stalled: Envoy's message timer fired waiting for an answer (504).
	stalled bool
	// ambiguous: the processor could not know whether the upstream ran.
	ambiguous bool
}

// simStream is a stream whose answers are read as they come, so that messages can be pipelined.
type simStream struct {
	*stream
	answers chan *extprocv3.ProcessingResponse
	timeout time.Duration
}

func (h *harness) openSim(timeout time.Duration) *simStream {
	s := h.open()
	ss := &simStream{stream: s, answers: make(chan *extprocv3.ProcessingResponse, 1024), timeout: timeout}
	go func() {
		defer close(ss.answers)
		for {
			resp, err := s.s.Recv()
			if err != nil {
				return
			}
			ss.answers <- resp
		}
	}()
	return ss
}

// put sends m. A stream the processor already ended (it answered with an ImmediateResponse
// while Envoy was pipelining body chunks) refuses it with io.EOF: Envoy's message is lost the
// same way, and the answers already received decide the exchange.
func (s *simStream) put(m *extprocv3.ProcessingRequest) {
	s.t.Helper()
	if err := s.s.Send(m); !errors.Is(err, io.EOF) {
		require.NoError(s.t, err)
	}
}

// next returns the next answer, or nil when none came within the message timeout or the stream
// ended.
func (s *simStream) next() *extprocv3.ProcessingResponse {
	select {
	case resp := <-s.answers:
		return resp
	case <-time.After(s.timeout):
		return nil
	}
}

func withModes(m *extprocv3.ProcessingRequest, sh shape) *extprocv3.ProcessingRequest {
	m.ProtocolConfig = &extprocv3.ProtocolConfiguration{
		RequestBodyMode: sh.reqMode, ResponseBodyMode: sh.respMode,
		SendBodyWithoutWaitingForHeaderResponse: sh.bodyBeforeAnswer,
	}
	return m
}

func bodyMsg(b []byte, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: b, EndOfStream: eos}}}
}

var requestTrailersMsg = &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{
	Trailers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: "x-checksum", RawValue: []byte("1")}}},
}}}

var responseTrailersMsg = &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{
	Trailers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: "grpc-status", RawValue: []byte("0")}}},
}}}

// split cuts b into messages of the given sizes, the last taking the rest.
func split(b []byte, sizes []int) [][]byte {
	var out [][]byte
	for _, n := range sizes {
		if n >= len(b) {
			break
		}
		out = append(out, b[:n])
		b = b[n:]
	}
	return append(out, b)
}

// run plays one whole request through the server as Envoy would, in the body modes and shape sh,
// and returns what the client gets. The upstream answers with u when it runs.
func (h *harness) run(r request, sh shape, u upstream) simResult {
	h.t.Helper()
	t := h.t
	timeout := sh.messageTimeout
	if timeout == 0 {
		timeout = 5 * time.Second
	}
	limit := sh.bufferLimit
	if limit == 0 {
		limit = 1 << 20
	}
	s := h.openSim(timeout)
	defer s.end()
	var res simResult
	finalAnswer := func(resp *extprocv3.ProcessingResponse) (simResult, bool) {
		if ir, ok := immediateResult(resp); ok {
			res.result = ir
			return res, true
		}
		return res, false
	}
	stall := func() simResult {
		// Envoy's message timer fired: 504, and the stream ends (Filter::onMessageTimeout).
		res.stalled = true
		res.status = 504
		return res
	}

	hasBody := len(r.body) > 0 || sh.trailers
	reqMode, respMode := sh.reqMode, sh.respMode
	duplexReq := reqMode == modeDuplex
	// Envoy waits for the header answer before the body, except in FULL_DUPLEX_STREAMED and
	// with send_body_without_waiting_for_header_response in STREAMED (Filter::onData).
	waitHeaders := !duplexReq && !(reqMode == modeStreamed && sh.bodyBeforeAnswer)
	first := requestHeaders(r)
	first.GetRequestHeaders().EndOfStream = !hasBody
	s.put(withModes(first, sh))
	headersAnswered := false
	respHeaderSkip := false
	answerHeaders := func(resp *extprocv3.ProcessingResponse) (simResult, bool) {
		if res, done := finalAnswer(resp); done {
			return res, true
		}
		require.NotNil(t, resp.GetRequestHeaders(), "request_headers must be answered with request_headers, got %v", kind(resp))
		headersAnswered = true
		if mo := resp.GetModeOverride(); mo != nil && !duplexReq && respMode != modeDuplex && !sh.bodyBeforeAnswer {
			// Honoured (Filter::onReceiveMessage): body modes taken literally
			// (effectiveModeOverride).
			reqMode, respMode = mo.GetRequestBodyMode(), mo.GetResponseBodyMode()
			respHeaderSkip = mo.GetResponseHeaderMode() == filterextproc.ProcessingMode_SKIP
		}
		return res, false
	}
	if waitHeaders {
		resp := s.next()
		if resp == nil {
			return stall()
		}
		if res, done := answerHeaders(resp); done {
			return res
		}
	}

	// The request body, by mode. upstreamBody is what the upstream receives.
	var upstreamBody []byte
	switch {
	case !hasBody:
	case reqMode == modeNone:
		upstreamBody = r.body
	case reqMode == modeBuffered, reqMode == modePartial:
		part, eos := r.body, !sh.trailers
		if reqMode == modePartial && len(r.body) > limit {
			part, eos = r.body[:limit], false
		}
		if len(r.body) > 0 || !sh.trailers {
			s.put(bodyMsg(part, eos))
			resp := s.next()
			if resp == nil {
				return stall()
			}
			if res, done := finalAnswer(resp); done {
				return res
			}
			require.NotNil(t, resp.GetRequestBody(), "request_body must be answered with request_body, got %v", kind(resp))
		}
		if sh.trailers && sh.trailerSend && (reqMode != modePartial || len(r.body) <= limit) {
			s.put(requestTrailersMsg)
			resp := s.next()
			if resp == nil {
				return stall()
			}
			if res, done := finalAnswer(resp); done {
				return res
			}
			require.NotNil(t, resp.GetRequestTrailers(), "request_trailers must be answered with request_trailers, got %v", kind(resp))
		}
		upstreamBody = r.body
	case reqMode == modeStreamed:
		// Pipelined: the next chunk goes without waiting for the last answer, and the data is
		// held until answered; past the buffer limit Envoy stops reading and waits
		// (ProcessorState::enqueueStreamingChunk raises the watermark). Each answer lets its
		// chunk go upstream.
		parts := split(r.body, sh.chunks)
		if sh.whole {
			// Complete during the header call: one message
			// (ProcessorState::handleCompleteBodyAvailable).
			parts = [][]byte{r.body}
		}
		if len(r.body) == 0 {
			parts = nil
		}
		held, answered := []int{}, 0
		await := func() (*simResult, bool) {
			resp := s.next()
			if resp == nil {
				res := stall()
				return &res, true
			}
			if !headersAnswered {
				if res, done := answerHeaders(resp); done {
					return &res, true
				}
				return nil, false
			}
			if res, done := finalAnswer(resp); done {
				return &res, true
			}
			require.NotNil(t, resp.GetRequestBody(), "a request chunk must be answered with request_body, got %v", kind(resp))
			upstreamBody = append(upstreamBody, r.body[answered:answered+held[0]]...)
			answered += held[0]
			held = held[1:]
			return nil, false
		}
		sum := func() int {
			n := 0
			for _, v := range held {
				n += v
			}
			return n
		}
		for i, p := range parts {
			for sum() > 0 && sum()+len(p) > limit {
				if res, done := await(); done {
					return *res
				}
			}
			s.put(bodyMsg(p, i == len(parts)-1 && !sh.trailers))
			held = append(held, len(p))
		}
		// Trailers wait while any chunk's answer is outstanding (Filter::onTrailers in
		// ext_proc.cc: callbackState() != Idle holds them) and go once the queue is empty
		// (ProcessorState::finalizeBodyResponse). A processor that withholds chunk answers
		// until the body's end therefore stalls a request whose body ends with trailers.
		for len(held) > 0 || !headersAnswered {
			if res, done := await(); done {
				return *res
			}
		}
		if sh.trailers && sh.trailerSend {
			s.put(requestTrailersMsg)
			resp := s.next()
			if resp == nil {
				return stall()
			}
			if res, done := finalAnswer(resp); done {
				return res
			}
			require.NotNil(t, resp.GetRequestTrailers(), "request_trailers must be answered with request_trailers, got %v", kind(resp))
		}
	case reqMode == modeDuplex:
		// Everything goes at once; the answers come as the processor decides, in order: the
		// headers, the body as streamed_response chunks, the trailers
		// (ProcessorState::handleBodyInStreamedState).
		parts := split(r.body, sh.chunks)
		if sh.whole || len(r.body) == 0 {
			parts = [][]byte{r.body}
		}
		if len(r.body) > 0 || !sh.trailers {
			for i, p := range parts {
				s.put(bodyMsg(p, i == len(parts)-1 && !sh.trailers))
			}
		}
		if sh.trailers {
			s.put(requestTrailersMsg) // trailer mode must be SEND in this mode
		}
		resp := s.next()
		if resp == nil {
			return stall()
		}
		if res, done := answerHeaders(resp); done {
			return res
		}
		ended := false
		for !ended && (len(r.body) > 0 || !sh.trailers) {
			resp := s.next()
			if resp == nil {
				return stall()
			}
			if res, done := finalAnswer(resp); done {
				return res
			}
			sr := resp.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
			require.NotNil(t, sr, "a FULL_DUPLEX_STREAMED request chunk needs a streamed_response, got %v", kind(resp))
			require.LessOrEqual(t, len(sr.GetBody()), 64<<10, "chunks of at most 64 KiB")
			upstreamBody = append(upstreamBody, sr.GetBody()...)
			ended = sr.GetEndOfStream()
			if sh.trailers && len(upstreamBody) == len(r.body) {
				break
			}
		}
		if sh.trailers {
			resp := s.next()
			if resp == nil {
				return stall()
			}
			if res, done := finalAnswer(resp); done {
				return res
			}
			require.NotNil(t, resp.GetRequestTrailers(), "request_trailers must be answered with request_trailers, got %v", kind(resp))
		}
	}
	if !headersAnswered {
		resp := s.next()
		if resp == nil {
			return stall()
		}
		if res, done := answerHeaders(resp); done {
			return res
		}
	}
	if reqMode != modeNone && !bytes.Equal(upstreamBody, r.body) {
		t.Fatalf("the upstream would get %d bytes of a %d-byte body", len(upstreamBody), len(r.body))
	}

	// The request reached the upstream whole.
	switch sh.end {
	case endBeforeResponse:
		res.ran, res.ambiguous = sh.ranUpstream, true
		if res.ran {
			h.count(r)
		}
		return res
	case endEnvoyMade:
		res.ran = sh.attempts > 0 && sh.ranUpstream
		res.ambiguous = sh.attempts > 0 || sh.noAttempts
		if res.ran {
			h.count(r)
		}
		u = upstream{status: sh.envoyStatus, body: []byte("upstream request timeout"), details: "upstream_response_timeout",
			attempts: sh.attempts, noAttempts: sh.noAttempts, headers: []string{"content-type", "text/plain"}}
		if sh.attempts == 0 {
			u.details = "no_healthy_upstream"
		}
	case endNormally, endMidBody:
		res.ran = true
		h.count(r)
	}
	res.status, res.headers, res.body = u.status, append([]string{}, u.headers...), u.body
	if respHeaderSkip {
		return res
	}
	rh := responseHeaders(u)
	duplexResp := respMode == modeDuplex
	if sh.trailers && len(u.body) == 0 && sh.end != endEnvoyMade {
		rh.GetResponseHeaders().EndOfStream = false
	}
	s.put(rh)
	resp := s.next()
	if resp == nil {
		return stall()
	}
	require.NotNil(t, resp.GetResponseHeaders(), "response_headers must be answered with response_headers, got %v", kind(resp))
	res.headers = applyMutation(res.headers, resp.GetResponseHeaders().GetResponse().GetHeaderMutation())
	res.final = resp
	if mo := resp.GetModeOverride(); mo != nil && !duplexResp {
		respMode = mo.GetResponseBodyMode()
	}
	if sh.end == endMidBody {
		return res
	}
	trailers := sh.trailers && sh.end != endEnvoyMade
	if len(u.body) == 0 && !trailers || respMode == modeNone {
		return res
	}
	var parts [][]byte
	switch respMode {
	case modeBuffered:
		if len(u.body) > limit {
			// Over the buffer limit: Envoy's own 500, and the processor never gets the body
			// (ActiveStreamEncoderFilter::responseDataTooLarge in
			// source/common/http/filter_manager.cc).
			res.status, res.body = 500, []byte("Internal Server Error")
			return res
		}
		if len(u.body) > 0 {
			parts = [][]byte{u.body}
		}
	case modePartial:
		parts = [][]byte{u.body[:min(limit, len(u.body))]}
	default:
		if len(u.body) > 0 {
			parts = split(u.body, sh.respChunks)
		}
	}
	for i, p := range parts {
		eos := i == len(parts)-1 && !trailers && (respMode != modePartial || len(u.body) <= limit)
		s.put(responseBody(p, eos))
	}
	for range parts {
		resp := s.next()
		if resp == nil {
			return stall()
		}
		require.NotNil(t, resp.GetResponseBody(), "response_body must be answered with response_body, got %v", kind(resp))
		if duplexResp {
			require.NotNil(t, resp.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse(),
				"a FULL_DUPLEX_STREAMED response chunk needs a streamed_response")
		}
		res.final = resp
	}
	if trailers && (sh.trailerSend || duplexResp) && (respMode != modePartial || len(u.body) <= limit) {
		s.put(responseTrailersMsg)
		resp := s.next()
		if resp == nil {
			return stall()
		}
		require.NotNil(t, resp.GetResponseTrailers(), "response_trailers must be answered with response_trailers, got %v", kind(resp))
	}
	return res
}

// count records one upstream execution of r.
func (h *harness) count(r request) {
	h.mu.Lock()
	h.executed[keyOf(r)]++
	h.mu.Unlock()
}
