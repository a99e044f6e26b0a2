package proxy

import (
	"strconv"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// The streamed immediate response (ProcessingResponse.streamed_immediate_response, Envoy 1.37 and
// later) follows Filter::handleStreamingImmediateResponse in
// source/extensions/filters/http/ext_proc/ext_proc.cc. The ProcessorState side
// (DecodingProcessorState::startLocalResponse, processLocalBodyResponse,
// processLocalTrailersResponse in processor_state.cc) is modelled from the unit tests that pin
// it, test/extensions/filters/http/ext_proc/filter_local_reply_streaming_test.cc: their error
// strings and the calls they expect.

// localBodyModeError is the details of a streamed local response that announces a body in a
// request body mode other than NONE and FULL_DUPLEX_STREAMED (the unit tests
// LocalBodyResponseInBufferedMode, ...InBufferedPartialMode, ...InStreamingMode).
const localBodyModeError = "streaming_local_response_body_is_only_supported_in_NONE_or_FULL_DUPLEX_STREAMED_modes"

// localStatusError is the proxy's own details for a streamed local response whose headers carry
// no valid :status: the check Envoy makes there was not read, so the reply is the proxy's guess.
const localStatusError = "ext_proc_streamed_local_response_without_valid_status"

// handleStreamingImmediateResponse is Filter::handleStreamingImmediateResponse: headers start the
// local response (the encoder's processing is turned off first, whatever follows), body chunks
// and trailers continue it, and processing finishes with the part that ends it. A message with no
// part is an error, not a spurious message ("Invalid local response headers continue").
func (x *exchange) handleStreamingImmediateResponse(r *extprocv3.StreamedImmediateResponse) error {
	switch part := r.GetResponse().(type) {
	case *extprocv3.StreamedImmediateResponse_HeadersResponse:
		// EncodingProcessorState::setLocalResponseStreaming: the local response is not sent to
		// the processor.
		x.enc.sendHeaders, x.enc.sendTrailers, x.enc.bodyMode = false, false, modeNone
		return x.startLocalResponse(part.HeadersResponse)
	case *extprocv3.StreamedImmediateResponse_BodyResponse:
		return x.processLocalBodyResponse(part.BodyResponse)
	case *extprocv3.StreamedImmediateResponse_TrailersResponse:
		return x.processLocalTrailersResponse(part.TrailersResponse)
	}
	return detailsError("Invalid local response headers continue")
}

// detailsError is an error whose text is Envoy's own, used as the local reply's details.
type detailsError string

func (e detailsError) Error() string { return string(e) }

// startLocalResponse is DecodingProcessorState::startLocalResponse. It is accepted only while the
// request headers' answer is awaited (the unit test
// InitiateLocalSteramingResponseWithoutRequestHeaders: otherwise spurious). Under
// FULL_DUPLEX_STREAMED that answer may be held while body chunks go to the processor, since
// Filter::handleDataStreamedModeBase keeps the headers callback state while it sends them (the
// proxy's streamData does the same); Envoy's tests of that case are disabled. A response that
// announces a body needs request body mode NONE or FULL_DUPLEX_STREAMED. The headers go
// downstream through encodeHeaders with the filter's mutation_rules (the :status always stays:
// HttpStatusHeaderIsPreservedEvenWhenPreudoHeadersDisabled); the upstream is never called.
func (x *exchange) startLocalResponse(r *extprocv3.HttpHeaders) error {
	s := x.dec
	if s.cb != cbHeaders || x.localStreaming {
		return errSpurious
	}
	eos := r.GetEndOfStream()
	if !eos && s.bodyMode != modeNone && s.bodyMode != modeDuplex {
		return &spuriousError{msg: localBodyModeError}
	}
	h, err := x.localHeaders(r.GetHeaders())
	if err != nil {
		return err
	}
	x.p.stats.streamedImmediate.Add(1)
	s.finishCall(cbIdle)
	s.held = false
	x.localStreaming, x.localComplete = true, true
	x.routeDL = time.Time{}
	if x.up != nil {
		x.up.cancel()
	}
	// ext_proc_local_response: the response code details startLocalResponse passes to
	// encodeHeaders.
	x.res = &response{status: mustStatus(h), headers: h, local: true, details: "ext_proc_local_response", flagStr: "-"}
	x.rec.CodeDetails, x.rec.ResponseFlags = "ext_proc_local_response", "-"
	if eos {
		x.finishLocalResponse()
	}
	// DecoderFilterCallbacks::encodeHeaders: the encoder filters after ext_proc in encoding
	// order (none here) and the codec.
	x.enc.out.headers(h, eos)
	return nil
}

// localHeaders builds the local response's header map: :status from the processor's headers,
// then the other entries as header mutations under the filter's mutation_rules.
func (x *exchange) localHeaders(m *corev3.HeaderMap) (headerList, error) {
	status := ""
	set := &extprocv3.HeaderMutation{}
	for _, hv := range m.GetHeaders() {
		v := hv.GetValue()
		if len(hv.GetRawValue()) > 0 {
			v = string(hv.GetRawValue())
		}
		if hv.GetKey() == ":status" {
			status = v
			continue
		}
		set.SetHeaders = append(set.SetHeaders, &corev3.HeaderValueOption{
			Header:       &corev3.HeaderValue{Key: hv.GetKey(), RawValue: []byte(v)},
			AppendAction: corev3.HeaderValueOption_APPEND_IF_EXISTS_OR_ADD,
		})
	}
	if c, err := strconv.Atoi(status); err != nil || c < 200 || c > 999 {
		return nil, detailsError(localStatusError)
	}
	h := headerList{{name: ":status", value: status}}
	rejected, err := applyMutation(&h, set, x.p.rules, mutationOptions{})
	x.p.stats.rejectedMutations.Add(int64(rejected))
	if err != nil {
		return nil, err
	}
	return h, nil
}

// processLocalBodyResponse is DecodingProcessorState::processLocalBodyResponse: one chunk straight
// to the client (encodeData), the last one ending the response. Before the headers it is
// spurious (LocalBodyWithoutHeadersResponse).
func (x *exchange) processLocalBodyResponse(r *extprocv3.StreamedBodyResponse) error {
	if !x.localStreaming {
		return &spuriousError{msg: "local_response_body_received_before_headers"}
	}
	if x.localEnded {
		return errSpurious
	}
	eos := r.GetEndOfStream()
	if eos {
		x.finishLocalResponse()
	}
	x.enc.out.data(r.GetBody(), eos)
	return nil
}

// processLocalTrailersResponse is DecodingProcessorState::processLocalTrailersResponse: the
// trailers straight to the client (encodeTrailers), ending the response. Before the headers it
// is spurious (LocalTrailersWithoutHeadersResponse).
func (x *exchange) processLocalTrailersResponse(m *corev3.HeaderMap) error {
	if !x.localStreaming {
		return &spuriousError{msg: "local_response_trailers_received_before_headers"}
	}
	if x.localEnded {
		return errSpurious
	}
	var t headerList
	for _, hv := range m.GetHeaders() {
		v := hv.GetValue()
		if len(hv.GetRawValue()) > 0 {
			v = string(hv.GetRawValue())
		}
		t.add(hv.GetKey(), v)
	}
	x.finishLocalResponse()
	x.enc.out.trailers(t)
	return nil
}

// finishLocalResponse is Filter::finishProcessing once the local response ended: the timers stop
// and the side stream closes.
func (x *exchange) finishLocalResponse() {
	x.localEnded = true
	x.dec.finishCall(cbIdle)
	x.enc.finishCall(cbIdle)
	x.closeStream()
}

// localDuplexBody reports whether the request body still goes to the processor after a local
// response started: FULL_DUPLEX_STREAMED until the processing ends (the unit test
// RequestWithBodyDuplexAndLocalResponseWithBody sends it, and the processor answers with the
// response's body; answers of the request's own kinds are spurious then). In the other modes
// the rest of the request is dropped (RequestWithBodySkipAndLocalResponseWithBody).
func (x *exchange) localDuplexBody() bool {
	return x.localStreaming && x.dec.bodyMode == modeDuplex && !x.processingComplete
}

func mustStatus(h headerList) int {
	c, _ := strconv.Atoi(mustGet(h, ":status"))
	return c
}
