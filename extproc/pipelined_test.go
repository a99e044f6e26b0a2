package extproc_test

import (
	"errors"
	"io"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
)

// A pipelined stream sends the messages a test scripts without waiting for answers, and reads
// the answers as they come: for tests that hold the server to its answers message by message.
// What Envoy sends when is e2e/proxy's to model (viaenvoy_test.go runs requests through it).
type pipelined struct {
	*stream
	answers chan *extprocv3.ProcessingResponse
	timeout time.Duration
}

func (h *harness) openPipelined(timeout time.Duration) *pipelined {
	s := h.open()
	ps := &pipelined{stream: s, answers: make(chan *extprocv3.ProcessingResponse, 1024), timeout: timeout}
	go func() {
		defer close(ps.answers)
		for {
			resp, err := s.s.Recv()
			if err != nil {
				return
			}
			ps.answers <- resp
		}
	}()
	return ps
}

// put sends m. A stream the server already ended refuses it with io.EOF, which is not an error
// here: the answers already received tell what happened.
func (s *pipelined) put(m *extprocv3.ProcessingRequest) {
	s.t.Helper()
	if err := s.s.Send(m); !errors.Is(err, io.EOF) {
		require.NoError(s.t, err)
	}
}

// next returns the next answer, or nil when none came within the timeout or the stream ended.
func (s *pipelined) next() *extprocv3.ProcessingResponse {
	select {
	case resp := <-s.answers:
		return resp
	case <-time.After(s.timeout):
		return nil
	}
}

// withBodyModes sets the body modes of m's protocol_config.
func withBodyModes(m *extprocv3.ProcessingRequest, req, resp bodyMode) *extprocv3.ProcessingRequest {
	m.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: req, ResponseBodyMode: resp}
	return m
}

func bodyMsg(b []byte, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: b, EndOfStream: eos}}}
}

var requestTrailersMsg = &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{
	Trailers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: "x-checksum", RawValue: []byte("1")}}},
}}}

// immediateAnswer reads an ImmediateResponse as the processor wrote it: its status, its
// set_headers as name, raw_value pairs in order, and its body. ok is false for any other answer.
// How Envoy turns it into a local reply is e2e/proxy's to model.
func immediateAnswer(resp *extprocv3.ProcessingResponse) (res result, ok bool) {
	ir := resp.GetImmediateResponse()
	if ir == nil {
		return result{}, false
	}
	return result{status: int(ir.GetStatus().GetCode()), headers: setHeaders(ir.GetHeaders()), body: ir.GetBody()}, true
}

// setHeaders lists a header mutation's set_headers as name, raw_value pairs, in order.
func setHeaders(m *extprocv3.HeaderMutation) []string {
	var hs []string
	for _, o := range m.GetSetHeaders() {
		hs = append(hs, o.GetHeader().GetKey(), string(o.GetHeader().GetRawValue()))
	}
	return hs
}
