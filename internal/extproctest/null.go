// Package extproctest holds ext_proc test doubles shared by tests and benchmarks.
package extproctest

import (
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// NullProcessor answers every message with the least a processor must send, and changes
// nothing: the floor that any ext_proc server pays, against which the processor is measured.
// That is CONTINUE to every phase, trailers included; but in a FULL_DUPLEX_STREAMED direction
// Envoy rejects a plain body answer (Filter::onReceiveMessage in source/extensions/filters/http/ext_proc/ext_proc.cc treats it as spurious), so each body chunk goes back as it came,
// a streamed_response with its end_of_stream, which is what a processor that lets the body
// through unchanged must do. The modes come in the first message's protocol_config.
type NullProcessor struct {
	extprocv3.UnimplementedExternalProcessorServer
}

// Process implements [extprocv3.ExternalProcessorServer.Process].
func (NullProcessor) Process(s extprocv3.ExternalProcessor_ProcessServer) error {
	var reqDuplex, respDuplex bool
	for {
		req, err := s.Recv()
		if err != nil {
			return nil
		}
		if pc := req.GetProtocolConfig(); pc != nil {
			reqDuplex = pc.GetRequestBodyMode() == filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
			respDuplex = pc.GetResponseBodyMode() == filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
		}
		resp := &extprocv3.ProcessingResponse{}
		switch m := req.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			resp.Response = &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{}}
		case *extprocv3.ProcessingRequest_RequestBody:
			resp.Response = &extprocv3.ProcessingResponse_RequestBody{RequestBody: bodyAnswer(reqDuplex, m.RequestBody)}
		case *extprocv3.ProcessingRequest_RequestTrailers:
			resp.Response = &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			resp.Response = &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}
		case *extprocv3.ProcessingRequest_ResponseBody:
			resp.Response = &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: bodyAnswer(respDuplex, m.ResponseBody)}
		case *extprocv3.ProcessingRequest_ResponseTrailers:
			resp.Response = &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}
		default:
			return nil
		}
		if err := s.Send(resp); err != nil {
			return nil
		}
	}
}

// bodyAnswer continues a body message: unchanged, or in FULL_DUPLEX_STREAMED streamed back.
func bodyAnswer(duplex bool, b *extprocv3.HttpBody) *extprocv3.BodyResponse {
	if !duplex {
		return &extprocv3.BodyResponse{}
	}
	return &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
		Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{
			Body: b.GetBody(), EndOfStream: b.GetEndOfStream(),
		}},
	}}}
}
