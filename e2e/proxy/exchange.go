package proxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
)

// filterName keys ProcessingRequest.attributes (FilterName in ext_proc.cc, used by
// Filter::addAttributes).
const filterName = "envoy.filters.http.ext_proc"

// openState is Filter::StreamOpenState.
type openState int

const (
	openOK     openState = iota
	openError            // the stream failed and a local reply went out: stop
	openIgnore           // processing is over: go on without the processor
)

// exchange is one HTTP request: the connection manager's stream with its filters (jwt_authn,
// ext_proc, router). Everything but the goroutines that read bodies and the side stream runs on
// the goroutine of ServeHTTP, so the state needs no locks.
type exchange struct {
	p      *Proxy
	filter *filterextproc.ExternalProcessor
	w      http.ResponseWriter
	rc     *http.ResponseController
	r      *http.Request
	ctx    context.Context // the request's: done when the client goes away or on Close
	cancel context.CancelFunc
	wg     sync.WaitGroup // the exchange's goroutines
	start  time.Time
	shape  Shapes

	route     *route // nil when no route matched
	reqID     string
	method    string
	grpc      bool
	head      bool
	trace     traceContext
	metadata  map[string]*structpb.Struct // the stream's dynamic metadata
	forwardNS []string
	receiveNS []string
	initialMD []*corev3.HeaderValue
	fma       bool // failure_mode_allow, per-route merged

	dec, enc *dirState
	side     *sideStream
	// processingComplete is Filter::processing_complete_: no more messages for this request.
	processingComplete bool
	protocolSent       bool
	// localComplete is set once a local reply started: the request direction is over.
	localComplete bool
	// localStreaming is set once a streamed immediate response's headers went downstream
	// (ProcessorState::localResponseStarted); localEnded once it ended.
	localStreaming bool
	localEnded     bool
	sentImmediate  bool
	h2             bool // the downstream stream is HTTP/2
	resetH2        bool // reset the HTTP/2 stream when ServeHTTP returns
	lastReply      localReply

	reqBody  *bodyReader
	up       *upstreamCall
	attempts int
	routeTO  time.Duration
	routeDL  time.Time // the route timeout, zero when not running
	// inFlight are the hedged attempts still running beside up; perTryDL is up's per-try timer
	// on a route that hedges, zero when not running (hedge.go).
	inFlight []*upstreamCall
	perTryDL time.Time
	res      *response // the response headers, once the router produced them
	respBody *bodyReader

	stash       *recvResult // a header answer held back by a Whole shape
	wroteHeader bool
	finished    bool
	drained     bool
	rec         Record
}

func (x *exchange) observability() bool { return x.filter.GetObservabilityMode() }

// run handles the request until its response is written, reset or abandoned.
func (x *exchange) run() {
	x.rc = http.NewResponseController(x.w)
	// Envoy reads the request body while it writes the response.
	_ = x.rc.EnableFullDuplex()
	x.begin()
	for !x.finished {
		x.step()
	}
	x.finish()
}

// step waits for the next event and handles it.
func (x *exchange) step() {
	if x.stash != nil && x.stashReady() {
		rr := *x.stash
		x.stash = nil
		x.onRecv(rr)
		return
	}
	var reqCh, respCh <-chan bodyEvent
	if x.reqBody != nil && x.wantRequestData() {
		reqCh = x.reqBody.ch
	}
	if x.respBody != nil && x.wantResponseData() {
		respCh = x.respBody.ch
	}
	var ansCh <-chan recvResult
	if x.side.active() && x.stash == nil {
		ansCh = x.side.recv
	}
	var upCh <-chan upstreamResult
	if x.up != nil && x.res == nil && !x.localComplete {
		upCh = x.up.result
	}
	var timerC <-chan time.Time
	if d, ok := x.nextDeadline(); ok {
		t := time.NewTimer(time.Until(d))
		defer t.Stop()
		timerC = t.C
	}
	select {
	case ev := <-reqCh:
		x.onRequestBody(ev)
	case ev := <-respCh:
		x.onResponseBody(ev)
	case rr := <-ansCh:
		if x.shouldStash(rr) {
			x.stash = &rr
			return
		}
		x.onRecv(rr)
	case res := <-upCh:
		x.onUpstream(res)
	case <-timerC:
		x.onTimers()
	case <-x.ctx.Done():
		x.abandon("downstream_remote_disconnect", "DC")
	}
}

// nextDeadline is the earliest armed timer: the message timers and the route timeout.
func (x *exchange) nextDeadline() (time.Time, bool) {
	var d time.Time
	consider := func(t time.Time) {
		if d.IsZero() || t.Before(d) {
			d = t
		}
	}
	if x.side.active() && x.stash == nil {
		for _, s := range []*dirState{x.dec, x.enc} {
			if s.timerOn {
				consider(s.deadline)
			}
		}
	}
	if !x.routeDL.IsZero() {
		consider(x.routeDL)
	}
	if !x.perTryDL.IsZero() {
		consider(x.perTryDL)
	}
	return d, !d.IsZero()
}

func (x *exchange) onTimers() {
	now := time.Now()
	if x.side.active() && x.stash == nil {
		for _, s := range []*dirState{x.dec, x.enc} {
			if s.timerOn && !now.Before(s.deadline) {
				x.onMessageTimeout()
				return
			}
		}
	}
	if !x.routeDL.IsZero() && !now.Before(x.routeDL) {
		x.routeDL = time.Time{}
		x.onRouteTimeout()
		return
	}
	if !x.perTryDL.IsZero() && !now.Before(x.perTryDL) {
		x.perTryDL = time.Time{}
		x.onPerTryTimeout()
	}
}

// shouldStash holds back a header answer while a Whole shape still lets body data arrive.
func (x *exchange) shouldStash(rr recvResult) bool {
	if rr.err != nil || x.observability() {
		return false
	}
	switch rr.resp.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_RequestHeaders:
		return x.shape.Request.DuringHeaders == Whole && x.dec.cb == cbHeaders && !x.stashReady1(x.dec, x.reqBody)
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		return x.shape.Response.DuringHeaders == Whole && x.enc.cb == cbHeaders && !x.stashReady1(x.enc, x.respBody)
	}
	return false
}

func (x *exchange) stashReady() bool {
	if _, ok := x.stash.resp.GetResponse().(*extprocv3.ProcessingResponse_RequestHeaders); ok {
		return x.stashReady1(x.dec, x.reqBody)
	}
	return x.stashReady1(x.enc, x.respBody)
}

func (x *exchange) stashReady1(s *dirState, b *bodyReader) bool {
	return b == nil || b.done || s.complete || s.readBlocked() || x.localComplete || x.finished
}

// wantRequestData reports whether the proxy reads more of the request body now: not once a
// local reply went out, not above the watermarks, and as the request's Shape says.
func (x *exchange) wantRequestData() bool {
	if x.localComplete && !x.localDuplexBody() {
		return false
	}
	return x.wantData(x.dec, x.shape.Request)
}

func (x *exchange) wantResponseData() bool { return x.wantData(x.enc, x.shape.Response) }

func (x *exchange) wantData(s *dirState, sh BodyShape) bool {
	if s.readBlocked() {
		return false
	}
	if s.cb == cbHeaders && sh.DuringHeaders == Held && !x.processingComplete {
		return false
	}
	if sh.Pipeline > 0 && s.bodyMode == modeStreamed && len(s.queue) >= sh.Pipeline && !x.processingComplete {
		return false
	}
	return true
}

// --- The side stream ---

// openStream is Filter::openStream.
func (x *exchange) openStream(s *dirState) openState {
	if x.processingComplete {
		return openIgnore
	}
	if x.side != nil && x.side.stream != nil {
		return openOK
	}
	i := x.p.pick(-1)
	ctx, cancel := context.WithCancel(x.p.ctx)
	x.side = &sideStream{p: x.p, index: i, addr: x.p.cfg.Processors[i], ctx: ctx, cancel: cancel}
	var deadline time.Time
	if s.bodyMode != modeDuplex && !x.observability() {
		// The message timer that the first message arms covers the wait for a transport.
		deadline = time.Now().Add(x.p.messageTimeout)
	}
	err := x.side.open(x.streamMetadata(), deadline, x.observability())
	x.rec.Processor = x.side.addr
	if err == nil {
		return openOK
	}
	x.side.close()
	if errors.Is(err, errOpenDeadline) {
		x.onMessageTimeout()
	} else {
		x.onGrpcError(err)
	}
	if x.sentImmediate {
		return openError
	}
	return openIgnore
}

// streamMetadata is the stream's initial metadata: grpc_service.initial_metadata with the
// route's grpc_initial_metadata merged by key (Filter::mergePerRouteConfig), then the trace
// context (AsyncStreamImpl::initialize: injectContext on a child of the request's span).
func (x *exchange) streamMetadata() []*corev3.HeaderValue {
	md := slices.Clone(x.initialMD)
	if tp := x.trace.child(); tp != "" {
		md = append(md, &corev3.HeaderValue{Key: "traceparent", Value: tp})
		if x.trace.state != "" {
			md = append(md, &corev3.HeaderValue{Key: "tracestate", Value: x.trace.state})
		}
	}
	return md
}

// sendRequest adds protocol_config to the first message (Filter::encodeProtocolConfig) and sends.
func (x *exchange) sendRequest(req *extprocv3.ProcessingRequest) {
	if !x.protocolSent && !x.observability() {
		x.protocolSent = true
		req.ProtocolConfig = &extprocv3.ProtocolConfiguration{
			RequestBodyMode:                         x.dec.bodyMode,
			ResponseBodyMode:                        x.enc.bodyMode,
			SendBodyWithoutWaitingForHeaderResponse: x.filter.GetSendBodyWithoutWaitingForHeaderResponse(),
		}
	}
	if x.observability() {
		req.ObservabilityMode = true
	}
	x.side.send(req)
}

// closeStream is Filter::closeStreamMaybeGraceful without graceful close: processing is over.
func (x *exchange) closeStream() {
	x.processingComplete = true
	if x.side != nil && !x.side.closed {
		x.side.close()
	}
}

// onRecv handles what the receiving goroutine delivered.
func (x *exchange) onRecv(rr recvResult) {
	if rr.err != nil {
		x.side.ended = true
		if x.side.closed {
			return
		}
		if errors.Is(rr.err, io.EOF) {
			x.onGrpcClose()
			return
		}
		x.onGrpcError(rr.err)
		return
	}
	x.p.stats.messagesReceived.Add(1)
	x.onReceiveMessage(rr.resp)
}

// onReceiveMessage is Filter::onReceiveMessage.
func (x *exchange) onReceiveMessage(resp *extprocv3.ProcessingResponse) {
	if x.observability() || x.processingComplete {
		return
	}
	if d := resp.GetOverrideMessageTimeout(); d != nil {
		x.onNewTimeout(d.AsDuration())
		return
	}
	x.modeOverride(resp)

	var err error
	lastBody := false
	switch r := resp.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_RequestHeaders:
		x.setDynamicMetadata(resp)
		err = x.dec.handleHeadersResponse(r.RequestHeaders)
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		x.setDynamicMetadata(resp)
		err = x.enc.handleHeadersResponse(r.ResponseHeaders)
	case *extprocv3.ProcessingResponse_RequestBody:
		if x.localStreaming {
			// The decoding state waits for no answer once a local response started.
			err = errSpurious
			break
		}
		lastBody = x.dec.isLastBodyResponse(r.RequestBody)
		x.setDynamicMetadata(resp)
		err = x.dec.handleBodyResponse(r.RequestBody)
	case *extprocv3.ProcessingResponse_ResponseBody:
		lastBody = x.enc.isLastBodyResponse(r.ResponseBody)
		x.setDynamicMetadata(resp)
		err = x.enc.handleBodyResponse(r.ResponseBody)
	case *extprocv3.ProcessingResponse_RequestTrailers:
		if x.localStreaming {
			err = errSpurious
			break
		}
		x.setDynamicMetadata(resp)
		err = x.dec.handleTrailersResponse(r.RequestTrailers.GetHeaderMutation())
	case *extprocv3.ProcessingResponse_ResponseTrailers:
		x.setDynamicMetadata(resp)
		err = x.enc.handleTrailersResponse(r.ResponseTrailers.GetHeaderMutation())
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		if x.filter.GetDisableImmediateResponse() {
			err = &spuriousError{msg: "unhandled immediate response due to config disabled it"}
			break
		}
		x.setDynamicMetadata(resp)
		x.p.stats.immediateResponses.Add(1)
		x.dec.finishCall(cbIdle)
		x.enc.finishCall(cbIdle)
		x.closeStream()
		x.sendImmediateResponse(r.ImmediateResponse)
		return
	case *extprocv3.ProcessingResponse_StreamedImmediateResponse:
		if x.p.cfg.Envoy.NoStreamedImmediateResponse {
			// An unknown field to Envoy before 1.37: the oneof is unset, the default branch.
			err = &spuriousError{msg: "unhandled message"}
			break
		}
		x.setDynamicMetadata(resp)
		err = x.handleStreamingImmediateResponse(r.StreamedImmediateResponse)
	default:
		// Unknown kinds: spurious.
		err = &spuriousError{msg: "unhandled message"}
	}
	switch {
	case err == nil:
	case errors.Is(err, errSpurious):
		x.p.stats.spurious.Add(1)
		// ext_proc_fail_close_spurious_resp (default true): fail with status_on_error unless
		// failure_mode_allow; once a local response started, always (Filter::onReceiveMessage:
		// decoding_state_.localResponseStarted()).
		if x.failureModeAllow() && !x.localStreaming {
			x.p.stats.failureModeAllowed.Add(1)
			x.closeStream()
			x.clearAsyncState()
		} else {
			x.handleErrorResponse(err)
		}
	default:
		x.handleErrorResponse(err)
	}
	x.closeIfLastResponse(resp, lastBody)
}

// modeOverride applies a mode_override as Filter::onReceiveMessage does: with
// allow_mode_override, without send_body_without_waiting_for_header_response, when neither
// filter-level body mode is FULL_DUPLEX_STREAMED, and only while a header message is being
// answered. The override is merged with the filter-level processing_mode (never with a
// per-route one, nor with an earlier override), and with allowed_override_modes it must equal
// an entry on the five fields other than request_header_mode (effectiveModeOverride and the
// allowed_override_modes check in Filter::onReceiveMessage).
func (x *exchange) modeOverride(resp *extprocv3.ProcessingResponse) {
	o := resp.GetModeOverride()
	if o == nil {
		return
	}
	f := x.filter
	base := f.GetProcessingMode()
	if !f.GetAllowModeOverride() || f.GetSendBodyWithoutWaitingForHeaderResponse() ||
		base.GetRequestBodyMode() == modeDuplex || base.GetResponseBodyMode() == modeDuplex ||
		(x.dec.cb != cbHeaders && x.enc.cb != cbHeaders) {
		x.p.stats.modeOverridesIgnored.Add(1)
		return
	}
	m := effectiveModeOverride(o, base)
	if allowed := f.GetAllowedOverrideModes(); len(allowed) > 0 && !slices.ContainsFunc(allowed, func(a *filterextproc.ProcessingMode) bool {
		return a.GetRequestBodyMode() == m.GetRequestBodyMode() &&
			a.GetRequestTrailerMode() == m.GetRequestTrailerMode() &&
			a.GetResponseHeaderMode() == m.GetResponseHeaderMode() &&
			a.GetResponseBodyMode() == m.GetResponseBodyMode() &&
			a.GetResponseTrailerMode() == m.GetResponseTrailerMode()
	}) {
		x.p.stats.modeOverridesIgnored.Add(1)
		return
	}
	x.dec.setMode(m)
	x.enc.setMode(m)
	x.p.stats.modeOverrides.Add(1)
}

// effectiveModeOverride is the function of that name in ext_proc.cc: header and trailer modes
// left DEFAULT keep the existing ones; body modes are taken literally.
func effectiveModeOverride(o, existing *filterextproc.ProcessingMode) *filterextproc.ProcessingMode {
	m := &filterextproc.ProcessingMode{
		RequestHeaderMode:   existing.GetRequestHeaderMode(),
		ResponseHeaderMode:  existing.GetResponseHeaderMode(),
		RequestTrailerMode:  existing.GetRequestTrailerMode(),
		ResponseTrailerMode: existing.GetResponseTrailerMode(),
		RequestBodyMode:     o.GetRequestBodyMode(),
		ResponseBodyMode:    o.GetResponseBodyMode(),
	}
	if o.GetRequestHeaderMode() != filterextproc.ProcessingMode_DEFAULT {
		m.RequestHeaderMode = o.GetRequestHeaderMode()
	}
	if o.GetResponseHeaderMode() != filterextproc.ProcessingMode_DEFAULT {
		m.ResponseHeaderMode = o.GetResponseHeaderMode()
	}
	if o.GetRequestTrailerMode() != filterextproc.ProcessingMode_DEFAULT {
		m.RequestTrailerMode = o.GetRequestTrailerMode()
	}
	if o.GetResponseTrailerMode() != filterextproc.ProcessingMode_DEFAULT {
		m.ResponseTrailerMode = o.GetResponseTrailerMode()
	}
	return m
}

// closeIfLastResponse is Filter::closeGrpcStreamIfLastRespReceived (Envoy 1.37+): the stream is
// closed once nothing more can be sent on it. BUFFERED and BUFFERED_PARTIAL body answers never
// close it (a TODO in Envoy).
func (x *exchange) closeIfLastResponse(resp *extprocv3.ProcessingResponse, lastBody bool) {
	if x.p.cfg.Envoy.NoStreamCloseOptimization || x.side == nil || x.side.closed || x.processingComplete {
		return
	}
	dec, enc := x.dec, x.enc
	last := false
	switch resp.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_RequestHeaders:
		last = (dec.hasNoBody || (dec.bodyMode == modeNone && !dec.sendTrailers)) && enc.noExternalProcess()
	case *extprocv3.ProcessingResponse_RequestBody:
		last = lastBody && enc.noExternalProcess()
	case *extprocv3.ProcessingResponse_RequestTrailers:
		last = enc.noExternalProcess()
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		last = enc.hasNoBody || (enc.bodyMode == modeNone && !enc.sendTrailers)
	case *extprocv3.ProcessingResponse_ResponseBody:
		last = lastBody
	case *extprocv3.ProcessingResponse_ResponseTrailers:
		last = true
	}
	// The response's last answer does not close a stream whose request direction still waits
	// for answers: Envoy 1.37.0 does, a bug later releases fix (envoyproxy/envoy#45617, #46836).
	switch resp.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_ResponseHeaders, *extprocv3.ProcessingResponse_ResponseBody,
		*extprocv3.ProcessingResponse_ResponseTrailers:
		if !dec.ended && !x.localComplete && !dec.noExternalProcess() {
			last = false
		}
	}
	if last {
		x.p.stats.streamsClosedEarly.Add(1)
		x.closeStream()
	}
}

// onNewTimeout is Filter::onNewTimeout: override_message_timeout within [1ms,
// max_message_timeout] restarts the running timer, once per call.
func (x *exchange) onNewTimeout(d time.Duration) {
	if x.p.maxMsgTimeout <= 0 || d < time.Millisecond || d > x.p.maxMsgTimeout {
		x.p.stats.timeoutOverridesIgnored.Add(1)
		return
	}
	restarted := false
	for _, s := range []*dirState{x.dec, x.enc} {
		if s.timerOn && !s.timerReplaced {
			s.deadline = time.Now().Add(d)
			s.timerReplaced = true
			restarted = true
		}
	}
	if !restarted {
		x.p.stats.timeoutOverridesIgnored.Add(1)
		return
	}
	x.p.stats.timeoutOverrides.Add(1)
}

// failureModeAllow is Filter::failureModeAllow: not once a FULL_DUPLEX_STREAMED direction has
// received body data.
func (x *exchange) failureModeAllow() bool {
	if (x.dec.bodyMode == modeDuplex && x.dec.bodyReceived) || (x.enc.bodyMode == modeDuplex && x.enc.bodyReceived) {
		return false
	}
	return x.fma
}

// clearAsyncState is Filter::clearAsyncState.
func (x *exchange) clearAsyncState() {
	x.dec.clearAsyncState()
	x.enc.clearAsyncState()
}

// onGrpcClose is Filter::onGrpcCloseWithStatus for a clean close: the request goes on without
// the processor.
func (x *exchange) onGrpcClose() {
	if x.processingComplete {
		return
	}
	x.closeStream()
	x.clearAsyncState()
}

// onGrpcError is Filter::onGrpcError.
func (x *exchange) onGrpcError(err error) {
	x.p.stats.streamErrors.Add(1)
	if x.processingComplete {
		return
	}
	if x.failureModeAllow() {
		x.p.stats.failureModeAllowed.Add(1)
		x.onGrpcClose()
		x.processingComplete = true
		return
	}
	x.dec.finishCall(cbIdle)
	x.enc.finishCall(cbIdle)
	x.closeStream()
	st := status.Convert(err)
	x.sendImmediateResponse(&extprocv3.ImmediateResponse{
		Details: fmt.Sprintf("ext_proc_error_gRPC_error_%d{%s}", st.Code(), st.Message()),
	}, x.p.statusOnError)
}

// onMessageTimeout is Filter::onMessageTimeout: 504 (not status_on_error), or processing skipped
// under failure_mode_allow.
func (x *exchange) onMessageTimeout() {
	x.p.stats.messageTimeouts.Add(1)
	if x.failureModeAllow() {
		x.closeStream()
		x.p.stats.failureModeAllowed.Add(1)
		x.clearAsyncState()
		return
	}
	x.closeStream()
	x.dec.finishCall(cbIdle)
	x.enc.finishCall(cbIdle)
	x.sendImmediateResponse(&extprocv3.ImmediateResponse{Details: "ext_proc_error_per-message_timeout_exceeded"}, http.StatusGatewayTimeout)
}

// handleErrorResponse is Filter::handleErrorResponse: status_on_error with the error as details,
// whatever failure_mode_allow says.
func (x *exchange) handleErrorResponse(err error) {
	x.dec.finishCall(cbIdle)
	x.enc.finishCall(cbIdle)
	x.closeStream()
	x.sendImmediateResponse(&extprocv3.ImmediateResponse{Details: err.Error()}, x.p.statusOnError)
}

// sendImmediateResponse is Filter::sendImmediateResponse. code, when non-zero, is the status of an
// error reply; otherwise the ImmediateResponse's (missing or below 200: 200). Its header
// mutations go through the filter's mutation_rules; a failing one is logged and the reply still
// goes out.
func (x *exchange) sendImmediateResponse(ir *extprocv3.ImmediateResponse, code ...int) {
	c := 200
	if len(code) > 0 {
		c = code[0]
	} else if ir.GetStatus() != nil && ir.GetStatus().GetCode() >= 200 {
		c = int(ir.GetStatus().GetCode())
	}
	if c > 999 {
		c = http.StatusInternalServerError // net/http cannot send it
	}
	x.sentImmediate = true
	lr := localReply{code: c, body: string(ir.GetBody()), details: sanitizeDetails(ir.GetDetails()), immediate: true}
	if gs := ir.GetGrpcStatus(); gs != nil {
		v := gs.GetStatus()
		lr.grpcStatus = &v
	}
	if m := ir.GetHeaders(); m != nil {
		lr.modify = func(h *headerList) {
			rejected, err := applyMutation(h, m, x.p.rules, mutationOptions{})
			x.p.stats.rejectedMutations.Add(int64(rejected))
			if err != nil {
				x.p.stats.immediateMutationErrors.Add(1)
			}
		}
	}
	x.sendLocalReply(lr)
}

// sendLocalReply is DownstreamFilterManager::sendLocalReply: before any response headers the
// reply goes through the encoder filters (ext_proc included, unless processing is over or the
// version skips local replies); with response headers not yet downstream it goes straight to the
// codec; after that the stream is reset.
func (x *exchange) sendLocalReply(lr localReply) {
	if x.finished {
		return
	}
	if !lr.immediate {
		x.p.stats.localReplies.Add(1)
	}
	x.localComplete = true
	x.lastReply = lr
	x.routeDL = time.Time{}
	if x.up != nil {
		// Router::Filter::onLocalReply resets the upstream requests.
		x.up.cancel()
		x.cancelOtherAttempts()
	}
	prep := prepareLocalReply(lr, x.p.localReply, x.replyContext(lr))
	if x.wroteHeader {
		x.reset(lr.details, lr.flags)
		return
	}
	if x.res != nil {
		x.writeDirect(prep, lr)
		return
	}
	code, _ := parseUint(mustGet(prep.headers, ":status"))
	res := &response{
		status: int(code), headers: prep.headers, local: true, localBody: prep.body,
		details: lr.details, flagStr: lr.flags, flags: lr.flagBits,
	}
	x.rec.CodeDetails, x.rec.ResponseFlags = lr.details, lr.flags
	if lr.drain {
		x.drainRequest()
	}
	if x.p.cfg.Envoy.SkipExtProcOnLocalReply {
		x.res = res
		x.writeDirect(prep, lr)
		return
	}
	x.encodeResponse(res)
}

// replyContext is what the local reply rewrite may read.
func (x *exchange) replyContext(lr localReply) replyContext {
	return replyContext{
		reqHeaders: x.dec.hdrs, metadata: x.metadata, details: lr.details, flags: lr.flags,
		protocol: x.r.Proto, grpc: x.grpc, head: x.head,
	}
}

// --- Ending ---

// reset ends the request by resetting the downstream stream, as Envoy does once response
// headers went downstream.
func (x *exchange) reset(details, flags string) {
	x.p.stats.resets.Add(1)
	x.rec.CodeDetails, x.rec.ResponseFlags = details, flags
	x.abandonConn()
}

// abandon ends a request whose client went away.
func (x *exchange) abandon(details, flags string) {
	x.rec.CodeDetails, x.rec.ResponseFlags = details, flags
	x.abandonConn()
}

func (x *exchange) abandonConn() {
	x.finished = true
	if x.h2 {
		x.resetH2 = true
		return
	}
	if conn, _, err := x.rc.Hijack(); err == nil {
		_ = conn.Close()
	}
}

// finish is Filter::onDestroy and the access log: the side stream closes (deferred in
// observability mode), the upstream request and the body readers stop.
func (x *exchange) finish() {
	if x.side != nil && !x.side.closed {
		if x.observability() {
			d := DefaultDeferredCloseTimeout
			if t := x.filter.GetDeferredCloseTimeout(); t != nil {
				d = t.AsDuration()
			}
			x.side.deferredClose(d)
		} else {
			x.side.close()
		}
	}
	if x.up != nil {
		x.up.cancel()
	}
	if x.reqBody != nil && !x.reqBody.done {
		// Unblock a read of a body the client is still sending.
		_ = x.rc.SetReadDeadline(time.Now())
	}
	x.cancel()
	x.wg.Wait()
	if x.respBody != nil {
		_ = x.respBody.src.Close()
	}
	x.rec.Duration = time.Since(x.start)
	if x.rec.ResponseFlags == "" {
		x.rec.ResponseFlags = "-"
	}
	x.rec.Attempts = x.attempts
	x.rec.TraceParent = x.trace.parent()
	if len(x.metadata) > 0 {
		x.rec.DynamicMetadata = cloneMetadata(x.metadata)
	}
	if fn := x.p.cfg.AccessLog; fn != nil {
		fn(x.rec)
	}
}

func mustGet(h headerList, name string) string {
	v, _ := h.get(name)
	return v
}
