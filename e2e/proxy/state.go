package proxy

import (
	"errors"
	"time"

	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// Body modes, short.
const (
	modeNone     = filterextproc.ProcessingMode_NONE
	modeStreamed = filterextproc.ProcessingMode_STREAMED
	modeBuffered = filterextproc.ProcessingMode_BUFFERED
	modePartial  = filterextproc.ProcessingMode_BUFFERED_PARTIAL
	modeDuplex   = filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
)

// callbackState is ProcessorState::CallbackState: what the direction waits for.
type callbackState int

const (
	cbIdle callbackState = iota
	cbHeaders
	cbBufferedBody
	cbStreamedBody
	cbPartialBody
	cbTrailers
)

// errSpurious is an answer that does not fit the direction's state (absl::FailedPreconditionError
// in ProcessorState): Filter::onReceiveMessage counts it as spurious. Its message becomes the
// local reply's details.
var errSpurious = errors.New("spurious message")

// spuriousError is an errSpurious with Envoy's own message.
type spuriousError struct{ msg string }

func (e *spuriousError) Error() string        { return e.msg }
func (e *spuriousError) Is(target error) bool { return target == errSpurious }

// direction is 0 for the request (decoding), 1 for the response (encoding).
type direction int

const (
	dirRequest direction = iota
	dirResponse
)

// sink is where a direction's filter chain continues: the router for the request, the
// downstream codec for the response.
type sink interface {
	headers(h headerList, eos bool)
	data(b []byte, eos bool)
	trailers(t headerList)
	// tooLarge is the filter manager's requestDataTooLarge / responseDataTooLarge for a buffer
	// that is not streaming: a 413, or a 500 (or reset) on the response path.
	tooLarge()
}

// queuedChunk is one entry of ProcessorState's ChunkQueue.
type queuedChunk struct {
	data []byte
	eos  bool
}

// dirState is ProcessorState (DecodingProcessorState / EncodingProcessorState) together with the
// parts of the filter manager's per-filter iteration state it relies on: whether iteration is
// paused, the buffered data and the held trailers. Everything runs on the exchange's goroutine.
type dirState struct {
	x   *exchange
	dir direction
	out sink
	lim int

	sendHeaders, sendTrailers bool
	bodyMode                  filterextproc.ProcessingMode_BodySendMode

	cb     callbackState
	paused bool // the filter returned a Stop status and has not continued
	// hdrs is the header map; held points at it while the processor may still mutate it
	// (ProcessorState::headers_), nil once finalized.
	hdrs             headerList
	held             bool
	headersContinued bool
	hasNoBody        bool
	complete         bool // completeBodyAvailable: end of stream seen (data or trailers)
	bodyReceived     bool
	trailers         headerList // the trailers, once they arrived
	trailersHeld     bool       // the trailers wait for the filter to continue
	trailersToServer bool
	trailersAvail    bool

	// buffered is the filter manager's buffered data for this filter (StopIterationAndBuffer /
	// StopIterationAndWatermark); hasBuffered says whether the buffer exists, even empty.
	buffered    []byte
	hasBuffered bool
	// streamingBuffer marks the buffer as watermarked (StopIterationAndWatermark): over the
	// limit it stops the reading instead of failing the stream.
	streamingBuffer bool

	queue       []queuedChunk
	queued      int
	watermark   bool // ProcessorState::requestWatermark raised
	partialDone bool
	replaced    bool // CONTINUE_AND_REPLACE replaced the body

	// The message timer (ProcessorState::message_timer_).
	timerOn       bool
	deadline      time.Time
	timerReplaced bool // new_timeout_received_

	attrsSent bool
	ended     bool // the direction's end of stream went on
}

// setMode is setProcessingModeInternal: headers are sent unless SKIP, trailers only with SEND.
func (s *dirState) setMode(m *filterextproc.ProcessingMode) {
	if s.dir == dirRequest {
		s.sendHeaders = m.GetRequestHeaderMode() != filterextproc.ProcessingMode_SKIP
		s.sendTrailers = m.GetRequestTrailerMode() == filterextproc.ProcessingMode_SEND
		s.bodyMode = m.GetRequestBodyMode()
		return
	}
	s.sendHeaders = m.GetResponseHeaderMode() != filterextproc.ProcessingMode_SKIP
	s.sendTrailers = m.GetResponseTrailerMode() == filterextproc.ProcessingMode_SEND
	s.bodyMode = m.GetResponseBodyMode()
}

// noExternalProcess is ProcessorState::noExternalProcess.
func (s *dirState) noExternalProcess() bool {
	return !s.sendHeaders && !s.sendTrailers && s.bodyMode == modeNone
}

// shouldRemoveContentLength is ProcessorState::shouldRemoveContentLength: STREAMED,
// BUFFERED_PARTIAL, FULL_DUPLEX_STREAMED, and BUFFERED with the headers not sent.
func (s *dirState) shouldRemoveContentLength() bool {
	switch s.bodyMode {
	case modeStreamed, modePartial, modeDuplex:
		return true
	case modeBuffered:
		return !s.sendHeaders
	}
	return false
}

// queueOverHigh and queueBelowLow are ProcessorState::queueOverHighLimit / queueBelowLowLimit.
func (s *dirState) queueOverHigh() bool { return s.queued > s.lim }
func (s *dirState) queueBelowLow() bool { return s.queued < s.lim/2 }

// readBlocked reports whether the direction's watermarks stop the reading of more body data.
func (s *dirState) readBlocked() bool {
	if s.watermark {
		return true
	}
	return s.hasBuffered && s.streamingBuffer && len(s.buffered) > s.lim
}

// --- The filter's callbacks (Filter::onHeaders / onData / onTrailers) ---

// onHeaders is Filter::onHeaders: the headers message, sent with the timer armed; the filter
// pauses. It returns false when the stream could not be opened and the headers must go on.
func (s *dirState) onHeaders(eos bool) (stop bool) {
	switch s.x.openStream(s) {
	case openError:
		return true
	case openIgnore:
		return false
	}
	s.held = true
	s.hasNoBody = eos
	req := s.x.headerRequest(s, eos, false)
	s.startCall(cbHeaders)
	s.x.sendRequest(req)
	s.paused = true
	return true
}

// startCall is ProcessorState::onStartProcessorCall: the timer is armed for every mode but
// FULL_DUPLEX_STREAMED.
func (s *dirState) startCall(cb callbackState) {
	s.cb = cb
	if s.bodyMode != modeDuplex {
		s.timerOn = true
		s.deadline = time.Now().Add(s.x.p.messageTimeout)
	}
	s.timerReplaced = false
}

// finishCall is ProcessorState::onFinishProcessorCall: the timer stops.
func (s *dirState) finishCall(next callbackState) {
	s.timerOn = false
	s.timerReplaced = false
	s.cb = next
}

// onData is Filter::onData for one data callback.
func (s *dirState) onData(data []byte, eos bool) {
	x := s.x
	s.bodyReceived = true
	if x.observability() {
		x.observeData(s, data, eos)
		s.pass(data, eos)
		return
	}
	if eos {
		s.complete = true
	}
	if s.replaced {
		// CONTINUE_AND_REPLACE: the original body is dropped.
		s.pass(nil, eos)
		return
	}
	if x.processingComplete {
		s.pass(data, eos)
		return
	}
	if s.cb == cbHeaders {
		if (s.bodyMode == modeStreamed && x.filter.GetSendBodyWithoutWaitingForHeaderResponse()) || s.bodyMode == modeDuplex {
			s.streamData(data, eos)
			return
		}
		// Header processing still in progress: hold the data. BUFFERED uses
		// StopIterationAndBuffer (over the limit: 413, or 500 on responses); the other modes
		// StopIterationAndWatermark (over the limit the reading stops).
		s.paused = true
		_ = s.bufferData(data, s.bodyMode != modeBuffered)
		return
	}
	switch s.bodyMode {
	case modeBuffered:
		if eos {
			if st := x.openStream(s); st != openOK {
				if st == openIgnore {
					s.pass(data, eos)
				}
				return
			}
			if !s.bufferData(data, false) {
				return
			}
			req := x.bodyRequest(s, s.buffered, true)
			s.startCall(cbBufferedBody)
			x.sendRequest(req)
			s.paused = true
			return
		}
		s.paused = true
		_ = s.bufferData(data, false)
	case modeStreamed, modeDuplex:
		s.streamData(data, eos)
	case modePartial:
		switch {
		case s.partialDone:
			s.held = false
			s.pass(data, eos)
		case s.cb == cbPartialBody:
			s.enqueue(data, eos)
			s.stopNoBuffer(eos)
		default:
			s.enqueue(data, eos)
			if eos || s.queueOverHigh() {
				if st := x.openStream(s); st != openOK {
					return
				}
				s.sendPartial(eos)
			}
		}
	default:
		s.pass(data, eos)
	}
}

// streamData is Filter::handleDataStreamedModeBase: the chunk goes to the processor at once;
// STREAMED keeps it queued until its answer, FULL_DUPLEX_STREAMED drops it (the processor sends
// the body back).
func (s *dirState) streamData(data []byte, eos bool) {
	x := s.x
	switch x.openStream(s) {
	case openError:
		return
	case openIgnore:
		s.pass(data, eos)
		return
	}
	req := x.bodyRequest(s, data, eos)
	if s.bodyMode != modeDuplex {
		s.enqueue(data, eos)
	}
	if s.cb == cbHeaders {
		s.startCall(cbHeaders)
	} else {
		s.startCall(cbStreamedBody)
	}
	x.sendRequest(req)
	if eos || s.cb == cbHeaders {
		s.stopNoBuffer(eos)
	}
}

// stopNoBuffer is the filter returning StopIterationNoBuffer: iteration pauses, and at the end of
// the stream (without trailers) the filter manager keeps an empty buffer so that continuing
// delivers the end of stream (ActiveStreamFilterBase::commonHandleAfterDataCallback).
func (s *dirState) stopNoBuffer(eos bool) {
	s.paused = true
	if eos && s.trailers == nil && !s.hasBuffered {
		s.hasBuffered = true
	}
}

// sendPartial is Filter::sendStreamChunk / ProcessorState::sendBufferedPartialData: everything
// queued goes as one message, end_of_stream true only when it holds the end of the body.
func (s *dirState) sendPartial(eos bool) {
	all := s.consolidate()
	req := s.x.bodyRequest(s, all.data, eos && all.eos)
	s.startCall(cbPartialBody)
	s.x.sendRequest(req)
	s.stopNoBuffer(eos)
}

// onTrailers is Filter::onTrailers.
func (s *dirState) onTrailers(t headerList) {
	x := s.x
	if x.processingComplete {
		s.trailers = t
		s.passTrailers()
		return
	}
	if s.sendTrailers && x.observability() {
		if x.openStream(s) == openOK {
			x.sendRequest(x.trailersRequest(s, t, true))
		}
		s.trailers = t
		s.passTrailers()
		return
	}
	delivered := s.complete
	s.complete = true
	s.trailersAvail = true
	s.trailers = t
	if s.cb != cbIdle && s.bodyMode != modeDuplex {
		// A previous callback is still executing: hold the trailers.
		s.paused = true
		s.trailersHeld = true
		return
	}
	if !delivered && ((s.hasBuffered && s.bodyMode == modeBuffered) || (len(s.queue) > 0 && s.bodyMode == modePartial)) {
		switch x.openStream(s) {
		case openError:
			return
		case openIgnore:
			s.passTrailers()
			return
		}
		// The trailers say the body is complete: send what is buffered, end_of_stream false.
		if s.bodyMode == modeBuffered {
			req := x.bodyRequest(s, s.buffered, false)
			s.startCall(cbBufferedBody)
			x.sendRequest(req)
		} else {
			all := s.consolidate()
			req := x.bodyRequest(s, all.data, false)
			s.startCall(cbPartialBody)
			x.sendRequest(req)
		}
		s.paused = true
		s.trailersHeld = true
		return
	}
	if !s.sendTrailers {
		s.passTrailers()
		return
	}
	switch x.openStream(s) {
	case openError:
		return
	case openIgnore:
		s.passTrailers()
		return
	}
	s.trailersHeld = true
	s.sendTrailersMsg()
	s.paused = true
}

// sendTrailersMsg is Filter::sendTrailers: once per direction; the callback state becomes
// TrailersCallback unless another call is pending (FULL_DUPLEX_STREAMED).
func (s *dirState) sendTrailersMsg() {
	if s.trailersToServer {
		return
	}
	s.trailersToServer = true
	req := s.x.trailersRequest(s, s.trailers, false)
	cb := s.cb
	if cb == cbIdle {
		cb = cbTrailers
	}
	s.startCall(cb)
	s.x.sendRequest(req)
}

// --- The filter manager's side ---

// bufferData appends to the filter manager's buffer (commonHandleBufferData). Over the limit, a
// watermarked buffer stops the reading (readBlocked); a plain one is too large, and bufferData
// returns false.
func (s *dirState) bufferData(data []byte, streaming bool) bool {
	s.buffered = append(s.buffered, data...)
	s.hasBuffered = true
	s.streamingBuffer = streaming
	if !streaming && len(s.buffered) > s.lim {
		s.out.tooLarge()
		return false
	}
	return true
}

// pass lets data through the filter: onward at once while iteration continues, into the buffer
// (then continued) while it is paused (commonHandleAfterDataCallback with Continue).
func (s *dirState) pass(data []byte, eos bool) {
	if s.paused {
		s.buffered = append(s.buffered, data...)
		s.hasBuffered = true
		s.continueIfNecessary()
		return
	}
	s.forwardData(data, eos)
}

// passTrailers lets the trailers through, after what the filter still holds.
func (s *dirState) passTrailers() {
	s.trailersHeld = true
	if s.paused {
		s.continueIfNecessary()
		return
	}
	s.continueProcessing()
}

func (s *dirState) forwardHeaders(eos bool) {
	if s.headersContinued {
		return
	}
	s.headersContinued = true
	if eos {
		s.ended = true
	}
	s.out.headers(s.hdrs, eos)
}

// forwardData is injectDataToFilterChain: the headers go first if they are still held.
func (s *dirState) forwardData(data []byte, eos bool) {
	if s.ended {
		return
	}
	// Once trailers exist the data does not end the stream for the next filters: the trailers
	// do (FilterManager::decodeData / encodeData: end_stream && !trailers).
	if eos && s.trailers != nil {
		eos = false
	}
	s.forwardHeaders(false)
	if eos {
		s.ended = true
	}
	s.out.data(data, eos)
}

// continueIfNecessary is ProcessorState::continueIfNecessary.
func (s *dirState) continueIfNecessary() {
	if !s.paused {
		return
	}
	s.paused = false
	s.continueProcessing()
}

// continueProcessing is ActiveStreamFilterBase::commonContinue: the headers (ending the stream
// when nothing follows), the buffered data, then the trailers.
func (s *dirState) continueProcessing() {
	if s.x.localComplete && s.dir == dirRequest {
		return
	}
	trailersPresent := s.trailers != nil
	if !s.headersContinued {
		s.forwardHeaders(s.complete && !s.hasBuffered && !trailersPresent)
	}
	if s.hasBuffered {
		data := s.buffered
		s.buffered, s.hasBuffered = nil, false
		s.forwardData(data, s.complete && !trailersPresent)
	}
	if s.trailersHeld && trailersPresent && !s.ended {
		s.trailersHeld = false
		s.ended = true
		s.out.trailers(s.trailers)
	}
}

// --- The chunk queue ---

// enqueue is ProcessorState::enqueueStreamingChunk: over the high limit the watermark rises.
func (s *dirState) enqueue(data []byte, eos bool) {
	s.queue = append(s.queue, queuedChunk{data: data, eos: eos})
	s.queued += len(data)
	if s.queueOverHigh() {
		s.watermark = true
	}
}

func (s *dirState) dequeue() (queuedChunk, bool) {
	if len(s.queue) == 0 {
		return queuedChunk{}, false
	}
	c := s.queue[0]
	s.queue = s.queue[1:]
	s.queued -= len(c.data)
	return c, true
}

// consolidate is ChunkQueue::consolidate: one chunk holding everything, with the last chunk's
// end of stream.
func (s *dirState) consolidate() queuedChunk {
	if len(s.queue) == 0 {
		return queuedChunk{}
	}
	var all []byte
	for _, c := range s.queue {
		all = append(all, c.data...)
	}
	c := queuedChunk{data: all, eos: s.queue[len(s.queue)-1].eos}
	s.queue = []queuedChunk{c}
	return c
}

func (s *dirState) clearQueue() {
	s.queue, s.queued = nil, 0
}

func (s *dirState) clearWatermark() { s.watermark = false }

// sendBufferedDataInStreamedMode moves what the filter manager buffered during the header call
// into the queue and sends it as one chunk.
func (s *dirState) sendBufferedDataInStreamedMode(eos bool) {
	if s.hasBuffered && len(s.buffered) > 0 {
		data := s.buffered
		s.buffered, s.hasBuffered = nil, false
		req := s.x.bodyRequest(s, data, eos)
		s.enqueue(data, eos)
		s.startCall(cbStreamedBody)
		s.x.sendRequest(req)
	}
	if s.queueBelowLow() {
		s.clearWatermark()
	}
}

// --- Answers ---

// handleHeadersResponse is ProcessorState::handleHeadersResponse.
func (s *dirState) handleHeadersResponse(r *extprocv3.HeadersResponse) error {
	if s.cb != cbHeaders {
		return errSpurious
	}
	c := r.GetResponse()
	if c.GetHeaderMutation() != nil && s.held {
		if err := s.mutateHeaders(c); err != nil {
			return err
		}
	}
	s.finishCall(s.callbackAfterHeaders(c))
	if c.GetStatus() == extprocv3.CommonResponse_CONTINUE_AND_REPLACE {
		if c.GetBodyMutation() != nil {
			s.hdrs.del("content-length")
			s.replaced = true
			s.buffered = mutatedBody(c.GetBodyMutation(), s.buffered)
			s.hasBuffered = true
		}
		s.clearQueue()
		s.bodyMode = modeNone
		s.sendTrailers = false
		s.clearWatermark()
		return s.finalize()
	}
	return s.headersContinue()
}

// callbackAfterHeaders is ProcessorState::getCallbackStateAfterHeaderResp.
func (s *dirState) callbackAfterHeaders(c *extprocv3.CommonResponse) callbackState {
	if c.GetStatus() == extprocv3.CommonResponse_CONTINUE_AND_REPLACE {
		return cbIdle
	}
	if s.bodyMode == modeStreamed && s.x.filter.GetSendBodyWithoutWaitingForHeaderResponse() && len(s.queue) > 0 {
		return cbStreamedBody
	}
	if s.bodyMode == modeDuplex {
		if s.bodyReceived {
			return cbStreamedBody
		}
		if s.trailersAvail {
			return cbTrailers
		}
	}
	return cbIdle
}

// headersContinue is ProcessorState::handleHeadersResponseWithContinue.
func (s *dirState) headersContinue() error {
	if s.hasNoBody {
		return s.finalizeContinue()
	}
	if s.complete && s.bodyMode != modeNone {
		// handleCompleteBodyAvailable: the body arrived whole during the header call and goes as
		// one message, end_of_stream unless trailers follow, whatever the mode.
		if s.cb == cbIdle {
			if s.hasBuffered {
				req := s.x.bodyRequest(s, s.buffered, !s.trailersAvail)
				s.startCall(cbBufferedBody)
				s.x.sendRequest(req)
				s.clearWatermark()
			}
			// Without buffered data (trailers and no data, both during the header call)
			// ProcessorState::handleCompleteBodyAvailable (processor_state.cc) sends nothing
			// and does not continue: the stream stays paused until a timeout of the connection
			// manager or the client ends it. The proxy does the same, unless told to behave as
			// the older handleHeadersResponse, which sent the trailers or continued.
			if s.x.p.cfg.Envoy.CompleteBodyWithoutDataContinues {
				return s.finalizeContinue()
			}
			return nil
		}
		s.sendBufferedDataInStreamedMode(!s.trailersAvail)
		return nil
	}
	switch s.bodyMode {
	case modeBuffered:
		// handleBufferedMode: the headers stay held until the body's answer.
		s.clearWatermark()
	case modeStreamed:
		s.sendBufferedDataInStreamedMode(false)
		s.held = false
		s.continueIfNecessary()
	case modeDuplex:
		s.held = false
		s.continueIfNecessary()
	case modePartial:
		if s.hasBuffered && len(s.buffered) > 0 {
			data := s.buffered
			s.buffered, s.hasBuffered = nil, false
			s.enqueue(data, false)
		}
		if s.queueOverHigh() {
			s.sendPartial(false)
			return nil
		}
		s.clearWatermark()
	default:
		return s.finalizeContinue()
	}
	return nil
}

// finalizeContinue is ProcessorState::finalizeContinueResponse.
func (s *dirState) finalizeContinue() error {
	if s.sendTrailers && s.trailersAvail {
		s.sendTrailersMsg()
		s.clearWatermark()
		return nil
	}
	return s.finalize()
}

// finalize is ProcessorState::finalizeResponse.
func (s *dirState) finalize() error {
	s.held = false
	s.continueIfNecessary()
	s.clearWatermark()
	return nil
}

// mutateHeaders is ProcessorState::processHeaderMutation.
func (s *dirState) mutateHeaders(c *extprocv3.CommonResponse) error {
	rejected, err := applyMutation(&s.hdrs, c.GetHeaderMutation(), s.x.p.rules, mutationOptions{
		replacing:       c.GetStatus() == extprocv3.CommonResponse_CONTINUE_AND_REPLACE,
		noContentLength: s.shouldRemoveContentLength(),
	})
	s.x.p.stats.rejectedMutations.Add(int64(rejected))
	return err
}

// handleBodyResponse is ProcessorState::handleBodyResponse.
func (s *dirState) handleBodyResponse(r *extprocv3.BodyResponse) error {
	c := r.GetResponse()
	cont := false
	switch s.cb {
	case cbBufferedBody:
		if c.GetHeaderMutation() != nil && s.held {
			if err := s.mutateHeaders(c); err != nil {
				return err
			}
		}
		if bm := c.GetBodyMutation(); bm != nil {
			// With content-length kept (BUFFERED, headers SEND) a replaced body must match it.
			if v, ok := s.hdrs.get("content-length"); ok && s.held {
				if n, err := parseUint(v); err == nil && n != uint64(len(bm.GetBody())) {
					return &mutationError{msg: "mismatch between content length and the length of the mutated body"}
				}
			}
			s.buffered = mutatedBody(bm, s.buffered)
		}
		s.clearWatermark()
		s.finishCall(cbIdle)
		cont = true
	case cbStreamedBody:
		bm := c.GetBodyMutation()
		if sr := bm.GetStreamedResponse(); sr != nil {
			if s.bodyMode != modeDuplex {
				return &spuriousError{msg: "spurious message: streamed_response is received while body_mode_ is not FULL_DUPLEX_STREAMED"}
			}
			// handleDuplexStreamedBodyResponse.
			if len(sr.GetBody()) > 0 {
				s.held = false
				s.forwardData(sr.GetBody(), sr.GetEndOfStream())
			}
			if sr.GetEndOfStream() {
				s.finishCall(cbIdle)
			} else {
				s.finishCall(cbStreamedBody)
			}
			cont = sr.GetEndOfStream()
		} else {
			if s.bodyMode == modeDuplex {
				return &spuriousError{msg: "spurious message: Normal body mutation response is received while body_mode_ is FULL_DUPLEX_STREAMED"}
			}
			// handleStreamedBodyResponse.
			chunk, _ := s.dequeue()
			data := chunk.data
			if bm != nil {
				data = mutatedBody(bm, data)
			}
			cont = chunk.eos
			if len(data) > 0 {
				s.held = false
				s.forwardData(data, chunk.eos)
			}
			if s.queueBelowLow() {
				s.clearWatermark()
			}
			if len(s.queue) == 0 {
				s.finishCall(cbIdle)
			} else {
				s.finishCall(s.cb)
			}
		}
	case cbPartialBody:
		chunk, _ := s.dequeue()
		if c.GetHeaderMutation() != nil && s.held {
			if err := s.mutateHeaders(c); err != nil {
				return err
			}
		}
		data := chunk.data
		if bm := c.GetBodyMutation(); bm != nil {
			data = mutatedBody(bm, data)
		}
		if len(data) > 0 {
			s.held = false
			s.forwardData(data, chunk.eos)
		}
		cont = true
		s.clearWatermark()
		s.finishCall(cbIdle)
		s.partialDone = true
		if len(s.queue) > 0 {
			rest := s.consolidate()
			s.clearQueue()
			s.forwardData(rest.data, rest.eos)
		}
	default:
		return errSpurious
	}
	s.held = false
	if s.sendTrailers && s.trailersAvail && len(s.queue) == 0 {
		s.sendTrailersMsg()
		return nil
	}
	if cont || (s.trailersAvail && len(s.queue) == 0) {
		s.continueIfNecessary()
	}
	return nil
}

// handleTrailersResponse is ProcessorState::handleTrailersResponse: accepted while the trailers
// call is pending, or any time in FULL_DUPLEX_STREAMED.
func (s *dirState) handleTrailersResponse(m *extprocv3.HeaderMutation) error {
	if s.cb != cbTrailers && s.bodyMode != modeDuplex {
		return errSpurious
	}
	if m != nil && s.trailers != nil {
		rejected, err := applyMutation(&s.trailers, m, s.x.p.rules, mutationOptions{})
		s.x.p.stats.rejectedMutations.Add(int64(rejected))
		if err != nil {
			return err
		}
	}
	s.finishCall(cbIdle)
	s.continueIfNecessary()
	return nil
}

// clearAsyncState is ProcessorState::clearAsyncState: the processor is gone; what the queue holds
// goes on unprocessed and the filter continues.
func (s *dirState) clearAsyncState() {
	s.finishCall(cbIdle)
	if len(s.queue) > 0 {
		all := s.consolidate()
		s.clearQueue()
		s.held = false
		s.forwardData(all.data, all.eos)
	}
	s.clearWatermark()
	s.streamingBuffer = true
	s.held = false
	s.continueIfNecessary()
}

// isLastBodyResponse is the function of that name in ext_proc.cc, evaluated before the answer is
// handled: only STREAMED (the queue's front ends the body) and FULL_DUPLEX_STREAMED (the
// streamed_response ends it) can tell.
func (s *dirState) isLastBodyResponse(r *extprocv3.BodyResponse) bool {
	switch s.bodyMode {
	case modeStreamed:
		return len(s.queue) > 0 && s.queue[0].eos
	case modeDuplex:
		return r.GetResponse().GetBodyMutation().GetStreamedResponse().GetEndOfStream()
	}
	return false
}

// mutatedBody is MutationUtils::applyBodyMutations for body and clear_body; streamed_response is
// not a mutation of the buffered body.
func mutatedBody(bm *extprocv3.BodyMutation, old []byte) []byte {
	switch m := bm.GetMutation().(type) {
	case *extprocv3.BodyMutation_Body:
		return m.Body
	case *extprocv3.BodyMutation_ClearBody:
		if m.ClearBody {
			return []byte{}
		}
	}
	return old
}
