package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// The streamed body modes (docs/guarantees.md#request-body-modes): a request body of
// streamChunks chunks of streamChunk bytes, sent as Envoy sends them in STREAMED and
// FULL_DUPLEX_STREAMED mode, and in FULL_DUPLEX_STREAMED a response body cut the same way. The HTTP request and response have no
// trailers (a plain JSON POST and its answer), so no trailers message is sent in either mode.
const (
	streamChunks = 4
	streamChunk  = 256
)

// streamBody is the streamed workloads' request body: 1 KiB, four times the buffered one.
var streamBody = bytes.Repeat(requestBody, streamChunks*streamChunk/len(requestBody))

// chunks cuts b into messages of at most streamChunk bytes.
func chunks(b []byte) [][]byte {
	var out [][]byte
	for len(b) > streamChunk {
		out = append(out, b[:streamChunk])
		b = b[streamChunk:]
	}
	return append(out, b)
}

// requestStreaming plays one first execution's exchange as Envoy does in a streamed request body
// mode (Filter::onData and ProcessorState in source/extensions/filters/http/ext_proc/), as
// e2e/proxy models it:
//
//   - STREAMED request, BUFFERED response: the request headers, and once they are answered the
//     body's chunks, pipelined (each sent without waiting for the previous one's answer), then an
//     answer per chunk, each a request_body (the processor withholds them until the last chunk
//     and claims there; the null processor answers each as it comes); then the response headers
//     and the response body in one message, lock-step. mode_override is honoured, as in request.
//   - FULL_DUPLEX_STREAMED both ways: the request headers and every chunk at once, without
//     waiting; then the headers' answer (the processor withholds it until the claim) and the
//     body streamed back as streamed_response messages until one ends the stream, which is what
//     Envoy forwards upstream (checked to be the body sent). The response headers and every
//     response chunk go at once in turn; their answers are the headers' and the chunks streamed
//     back until end_of_stream, checked to be the response. mode_override is ignored, as Envoy
//     ignores it in this mode.
//
// Any ImmediateResponse fails the request: a first execution runs.
func requestStreaming(ctx context.Context, client extprocv3.ExternalProcessorClient, duplex bool, n int64) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s, err := client.Process(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = s.CloseSend() }()
	recv := func(want string) (*extprocv3.ProcessingResponse, error) {
		resp, err := s.Recv()
		if err != nil {
			return nil, err
		}
		if ir := resp.GetImmediateResponse(); ir != nil {
			return nil, fmt.Errorf("a first execution answered %d (%s) where %s was due: %s", ir.GetStatus().GetCode(), ir.GetDetails(), want, ir.GetBody())
		}
		return resp, nil
	}
	reqMode, respMode := filterextproc.ProcessingMode_STREAMED, filterextproc.ProcessingMode_BUFFERED
	if duplex {
		reqMode, respMode = filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED, filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
	}
	if err := s.Send(&extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: requestHeaderValues("POST", "/v1/payments", "first-"+strconv.FormatInt(n, 10), n)},
		}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: reqMode, ResponseBodyMode: respMode},
	}); err != nil {
		return err
	}
	var mode *filterextproc.ProcessingMode
	if !duplex {
		// STREAMED: the body goes once the headers are answered (Filter::onData holds it while
		// they are not).
		resp, err := recv("request_headers")
		if err != nil {
			return err
		}
		if resp.GetRequestHeaders() == nil {
			return fmt.Errorf("request_headers answered with %T", resp.GetResponse())
		}
		mode = resp.GetModeOverride()
	}
	if mode == nil || mode.GetRequestBodyMode() != filterextproc.ProcessingMode_NONE {
		parts := chunks(streamBody)
		for i, p := range parts {
			if err := s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
				RequestBody: &extprocv3.HttpBody{Body: p, EndOfStream: i == len(parts)-1},
			}}); err != nil {
				return err
			}
		}
		if duplex {
			resp, err := recv("request_headers")
			if err != nil {
				return err
			}
			if resp.GetRequestHeaders() == nil {
				return fmt.Errorf("request_headers answered with %T", resp.GetResponse())
			}
			if err := streamedBack(recv, "request_body", streamBody); err != nil {
				return err
			}
		} else {
			for range parts {
				resp, err := recv("request_body")
				if err != nil {
					return err
				}
				if resp.GetRequestBody() == nil {
					return fmt.Errorf("a request chunk answered with %T", resp.GetResponse())
				}
			}
		}
	}
	if mode != nil && mode.GetResponseHeaderMode() == filterextproc.ProcessingMode_SKIP {
		return nil
	}
	if err := s.Send(&extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
				{Key: ":status", RawValue: []byte("201")},
				{Key: "content-type", RawValue: []byte("application/json")},
				{Key: "x-envoy-upstream-service-time", RawValue: []byte("3")},
			}},
		}},
		Attributes: viaUpstream,
	}); err != nil {
		return err
	}
	if duplex {
		parts := chunks(responseBody)
		for i, p := range parts {
			if err := s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
				ResponseBody: &extprocv3.HttpBody{Body: p, EndOfStream: i == len(parts)-1},
			}}); err != nil {
				return err
			}
		}
	}
	resp, err := recv("response_headers")
	if err != nil {
		return err
	}
	if resp.GetResponseHeaders() == nil {
		return fmt.Errorf("response_headers answered with %T", resp.GetResponse())
	}
	if duplex {
		return streamedBack(recv, "response_body", responseBody)
	}
	if mo := resp.GetModeOverride(); mo != nil && mo.GetResponseBodyMode() == filterextproc.ProcessingMode_NONE {
		return nil
	}
	if err := s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: responseBody, EndOfStream: true},
	}}); err != nil {
		return err
	}
	resp, err = recv("response_body")
	if err != nil {
		return err
	}
	if resp.GetResponseBody() == nil {
		return fmt.Errorf("response_body answered with %T", resp.GetResponse())
	}
	return nil
}

// streamedBack reads a FULL_DUPLEX_STREAMED direction's body as the processor streams it back,
// until a chunk ends it, and checks that it is want: what Envoy forwards is what was sent.
func streamedBack(recv func(string) (*extprocv3.ProcessingResponse, error), kind string, want []byte) error {
	var got []byte
	for {
		resp, err := recv(kind)
		if err != nil {
			return err
		}
		var body *extprocv3.BodyResponse
		if kind == "request_body" {
			body = resp.GetRequestBody()
		} else {
			body = resp.GetResponseBody()
		}
		sr := body.GetResponse().GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			// Envoy rejects it as spurious and fails the request
			// (ProcessorState::handleBodyInStreamedState).
			return fmt.Errorf("a FULL_DUPLEX_STREAMED %s answered without a streamed_response: %T", kind, resp.GetResponse())
		}
		got = append(got, sr.GetBody()...)
		if sr.GetEndOfStream() {
			break
		}
	}
	if !bytes.Equal(got, want) {
		return errors.New("the " + kind + " streamed back is not the one sent")
	}
	return nil
}
