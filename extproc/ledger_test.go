package extproc_test

import (
	"fmt"
	"sync"

	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
)

// The answer ledger holds every stream of the harness to what Envoy's ext_proc filter accepts:
// an answer only for a message Envoy sent and has not had answered, of that message's kind and
// in the order the messages came, and never two for one message. Envoy before 1.39 mishandles
// "packed unexpected ProcessingResponses" (CVE-2026-47207, fixed in the 1.39.0 changelog); later
// Envoys fail the request as spurious (Filter::onReceiveMessage in ext_proc.cc). An
// ImmediateResponse answers whatever is outstanding and ends the exchange. In a
// FULL_DUPLEX_STREAMED direction the body goes back as streamed_response chunks of the
// processor's own size, so the body's answers are counted in bytes: never more bytes back than
// came, and none before they came. A streamed immediate response starts only as the answer to
// the request headers Envoy still waits for (DecodingProcessorState::startLocalResponse in
// processor_state.cc), and its body and trailers follow only after its headers; its last part
// ends the exchange.

// ledger collects the violations of every stream of one harness.
type ledger struct {
	mu         sync.Mutex
	violations []string
}

func (l *ledger) violate(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.violations = append(l.violations, fmt.Sprintf(format, args...))
}

func (l *ledger) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.violations...)
}

// interceptor wraps each stream the server handles.
func (l *ledger) interceptor(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	return handler(srv, &ledgerStream{ServerStream: ss, l: l})
}

// asked is one message Envoy sent whose answer is outstanding. For a FULL_DUPLEX_STREAMED body
// chunk, bytes is how many of its bytes have not come back yet.
type asked struct {
	kind   string
	duplex bool
	bytes  int
}

type ledgerStream struct {
	grpc.ServerStream
	l           *ledger
	mu          sync.Mutex
	outstanding []asked
	reqDuplex   bool
	respDuplex  bool
	modesKnown  bool
	ended       bool // an ImmediateResponse went
	local       bool // a streamed immediate response started
}

func (s *ledgerStream) RecvMsg(m any) error {
	if err := s.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	req := m.(*extprocv3.ProcessingRequest)
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.modesKnown {
		s.modesKnown = true
		pc := req.GetProtocolConfig()
		s.reqDuplex = pc.GetRequestBodyMode() == filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
		s.respDuplex = pc.GetResponseBodyMode() == filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
	}
	if req.GetObservabilityMode() {
		return nil // Envoy takes no answer in observability mode
	}
	a := asked{kind: requestKind(req)}
	switch b := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestBody:
		a.duplex, a.bytes = s.reqDuplex, len(b.RequestBody.GetBody())
	case *extprocv3.ProcessingRequest_ResponseBody:
		a.duplex, a.bytes = s.respDuplex, len(b.ResponseBody.GetBody())
	}
	s.outstanding = append(s.outstanding, a)
	return nil
}

func (s *ledgerStream) SendMsg(m any) error {
	resp := m.(*extprocv3.ProcessingResponse)
	s.mu.Lock()
	s.check(resp)
	s.mu.Unlock()
	return s.ServerStream.SendMsg(m)
}

// check holds one answer to the outstanding messages. s.mu is held.
func (s *ledgerStream) check(resp *extprocv3.ProcessingResponse) {
	k := kind(resp)
	switch {
	case s.ended:
		s.l.violate("%s sent after an ImmediateResponse ended the exchange", k)
		return
	case k == "immediate_response":
		s.ended, s.outstanding = true, nil
		return
	case k == "streamed_immediate_response":
		s.checkLocal(resp.GetStreamedImmediateResponse())
		return
	case len(s.outstanding) == 0:
		s.l.violate("%s sent, but Envoy has no message waiting for an answer", k)
		return
	}
	head := &s.outstanding[0]
	if head.kind != k {
		s.l.violate("%s sent, but the oldest message waiting for an answer is %s", k, head.kind)
		return
	}
	if !head.duplex {
		s.outstanding = s.outstanding[1:]
		return
	}
	// A FULL_DUPLEX_STREAMED body chunk: its bytes come back in chunks of the processor's size,
	// possibly spanning several of Envoy's.
	sr := resp.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
	if k == "response_body" {
		sr = resp.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
	}
	n := len(sr.GetBody())
	for {
		take := min(n, head.bytes)
		head.bytes -= take
		n -= take
		if head.bytes > 0 {
			break
		}
		s.outstanding = s.outstanding[1:]
		if len(s.outstanding) == 0 || !s.outstanding[0].duplex || s.outstanding[0].kind != k || (n == 0 && s.outstanding[0].bytes > 0) {
			break
		}
		head = &s.outstanding[0]
	}
	if n > 0 {
		s.l.violate("%s streams back %d more bytes than Envoy sent", k, n)
	}
}

// requestKind names a message as kind names its answer.
func requestKind(req *extprocv3.ProcessingRequest) string {
	switch req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return "request_headers"
	case *extprocv3.ProcessingRequest_RequestBody:
		return "request_body"
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return "request_trailers"
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return "response_headers"
	case *extprocv3.ProcessingRequest_ResponseBody:
		return "response_body"
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return "response_trailers"
	}
	return "unknown"
}

// checkLocal holds one part of a streamed immediate response. s.mu is held.
func (s *ledgerStream) checkLocal(r *extprocv3.StreamedImmediateResponse) {
	switch part := r.GetResponse().(type) {
	case *extprocv3.StreamedImmediateResponse_HeadersResponse:
		if s.local || len(s.outstanding) == 0 || s.outstanding[0].kind != "request_headers" {
			s.l.violate("a streamed immediate response started, but Envoy is not waiting for the request headers' answer")
		}
		s.local, s.outstanding = true, nil
		s.ended = part.HeadersResponse.GetEndOfStream()
	case *extprocv3.StreamedImmediateResponse_BodyResponse:
		if !s.local {
			s.l.violate("a streamed immediate response's body before its headers")
		}
		s.ended = part.BodyResponse.GetEndOfStream()
	case *extprocv3.StreamedImmediateResponse_TrailersResponse:
		if !s.local {
			s.l.violate("a streamed immediate response's trailers before its headers")
		}
		s.ended = true
	default:
		s.l.violate("a streamed immediate response with no part")
	}
}
