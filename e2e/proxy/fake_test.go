package proxy_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
	"github.com/idempotency-extproc/idempotency-extproc/e2e/upstream"
)

// errClose makes the fake processor end the stream cleanly (return nil from Process).
var errClose = errors.New("close the stream cleanly")

// handler answers one ProcessingRequest: it may Send any number of responses, and returns
// errClose to end the stream cleanly or another error to end it with that status.
type handler func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error

// streamLog is what the fake processor saw on one stream.
type streamLog struct {
	msgs []*extprocv3.ProcessingRequest
	// end is the error that ended the stream: the Recv error (io.EOF or Canceled) when the
	// proxy ended it, or the handler's error.
	end error
	// byHandler reports whether the handler ended the stream.
	byHandler bool
	// ctxDone reports whether the stream context was done when the stream ended.
	ctxDone bool
	// md is the stream's initial metadata.
	md metadata.MD
	// ended is when the stream ended, as the server saw it.
	ended time.Time
}

// fakeProcessor is a minimal ext_proc server driven by a handler.
type fakeProcessor struct {
	extprocv3.UnimplementedExternalProcessorServer
	addr   string
	handle handler
	logs   chan streamLog
	health *health.Server // SERVING until a test says otherwise
}

// startProcessor serves a fake processor on loopback until the test ends; nil h answers CONTINUE
// to everything.
func startProcessor(t *testing.T, h handler) *fakeProcessor {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	return serveProcessor(t, ln, ln.Addr().String(), h)
}

// serveProcessor serves a fake processor on ln, which the proxy reaches at addr.
func serveProcessor(t *testing.T, ln net.Listener, addr string, h handler) *fakeProcessor {
	t.Helper()
	if h == nil {
		h = continueAll
	}
	f := &fakeProcessor{addr: addr, handle: h, logs: make(chan streamLog, 1000), health: health.NewServer()}
	srv := grpc.NewServer(grpc.MaxRecvMsgSize(64 << 20))
	extprocv3.RegisterExternalProcessorServer(srv, f)
	healthpb.RegisterHealthServer(srv, f.health)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(ln)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return f
}

func (f *fakeProcessor) Process(st extprocv3.ExternalProcessor_ProcessServer) error {
	var log streamLog
	log.md, _ = metadata.FromIncomingContext(st.Context())
	defer func() {
		log.ctxDone = st.Context().Err() != nil
		log.ended = time.Now()
		f.logs <- log
	}()
	for {
		req, err := st.Recv()
		if err != nil {
			log.end = err
			return nil
		}
		log.msgs = append(log.msgs, proto.Clone(req).(*extprocv3.ProcessingRequest))
		if err := f.handle(st, req); err != nil {
			log.end, log.byHandler = err, true
			if errors.Is(err, errClose) {
				return nil
			}
			return err
		}
	}
}

// next returns the log of the next stream to end, checking that it ended the way Envoy ends
// streams: io.EOF or Canceled on Recv (ExternalProcessorStreamImpl::close in
// source/extensions/filters/http/ext_proc/client_impl.cc half-closes, then resets), unless the
// handler ended it.
func (f *fakeProcessor) next(t *testing.T) streamLog {
	t.Helper()
	select {
	case log := <-f.logs:
		if !log.byHandler {
			require.True(t, errors.Is(log.end, io.EOF) || status.Code(log.end) == codes.Canceled,
				"stream must end with EOF or Canceled, got %v", log.end)
		}
		return log
	case <-time.After(5 * time.Second):
		t.Fatal("no stream ended within 5s")
		return streamLog{}
	}
}

// none checks that no further stream ends within a short while.
func (f *fakeProcessor) none(t *testing.T) {
	t.Helper()
	select {
	case log := <-f.logs:
		t.Fatalf("unexpected stream with %v", kinds(log.msgs))
	case <-time.After(50 * time.Millisecond):
	}
}

// continueAll answers every message with CONTINUE of the matching kind.
func continueAll(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
	return st.Send(cont(req))
}

// cont is the CONTINUE answer to req.
func cont(req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
	return answer(req, &extprocv3.CommonResponse{})
}

// answer is the answer of the matching kind to req with common c.
func answer(req *extprocv3.ProcessingRequest, c *extprocv3.CommonResponse) *extprocv3.ProcessingResponse {
	switch req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: c}}}
	case *extprocv3.ProcessingRequest_RequestBody:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: c}}}
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{Response: c}}}
	case *extprocv3.ProcessingRequest_ResponseBody:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{Response: c}}}
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{HeaderMutation: c.GetHeaderMutation()}}}
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{HeaderMutation: c.GetHeaderMutation()}}}
	}
	return &extprocv3.ProcessingResponse{}
}

// immediate is an ImmediateResponse answer.
func immediate(code typev3.StatusCode, body string, m *extprocv3.HeaderMutation, details string) *extprocv3.ProcessingResponse {
	ir := &extprocv3.ImmediateResponse{Headers: m, Body: []byte(body), Details: details}
	if code != 0 {
		ir.Status = &typev3.HttpStatus{Code: code}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: ir}}
}

// setRaw is a set_headers entry with raw_value; appendIt sets the deprecated append to true.
func setRaw(key, value string, appendIt bool) *corev3.HeaderValueOption {
	o := &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: key, RawValue: []byte(value)}}
	if appendIt {
		//lint:ignore SA1019 ext_proc honours only the deprecated append (MutationUtils::applyHeaderMutations).
		o.Append = wrapperspb.Bool(true)
	}
	return o
}

// on returns a handler that runs fn for messages of kind k and CONTINUEs the others.
func on(k string, fn handler) handler {
	return func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		if kind(req) == k {
			return fn(st, req)
		}
		return continueAll(st, req)
	}
}

// sendOnce returns a handler that sends resp.
func sendOnce(resp *extprocv3.ProcessingResponse) handler {
	return func(st extprocv3.ExternalProcessor_ProcessServer, _ *extprocv3.ProcessingRequest) error {
		return st.Send(resp)
	}
}

func kind(req *extprocv3.ProcessingRequest) string {
	switch req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return "request_headers"
	case *extprocv3.ProcessingRequest_RequestBody:
		return "request_body"
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return "response_headers"
	case *extprocv3.ProcessingRequest_ResponseBody:
		return "response_body"
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return "request_trailers"
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return "response_trailers"
	}
	return "other"
}

func kinds(msgs []*extprocv3.ProcessingRequest) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = kind(m)
	}
	return out
}

// values returns the raw values of name in m, in order, checking that value is never used.
func values(t *testing.T, m *corev3.HeaderMap, name string) []string {
	t.Helper()
	var out []string
	for _, h := range m.GetHeaders() {
		require.Empty(t, h.GetValue(), "header %q must travel in raw_value only", h.GetKey())
		require.Equal(t, strings.ToLower(h.GetKey()), h.GetKey(), "header names are lower case")
		if h.GetKey() == name {
			out = append(out, string(h.GetRawValue()))
		}
	}
	return out
}

// fullMode spells out every field of a processing mode: Filter::onReceiveMessage compares a
// mode_override with each allowed_override_modes entry raw, field by field.
func fullMode(reqBody filterextproc.ProcessingMode_BodySendMode, respHeader filterextproc.ProcessingMode_HeaderSendMode, respBody filterextproc.ProcessingMode_BodySendMode) *filterextproc.ProcessingMode {
	return &filterextproc.ProcessingMode{
		RequestHeaderMode:   filterextproc.ProcessingMode_SEND,
		RequestBodyMode:     reqBody,
		RequestTrailerMode:  filterextproc.ProcessingMode_SKIP,
		ResponseHeaderMode:  respHeader,
		ResponseBodyMode:    respBody,
		ResponseTrailerMode: filterextproc.ProcessingMode_SKIP,
	}
}

// bufferedFilter is a filter configuration like the one envoy/envoy.yaml ships (BUFFERED both
// ways, every mode field spelled out, allow_mode_override), with a generous timeout.
func bufferedFilter() *filterextproc.ExternalProcessor {
	return &filterextproc.ExternalProcessor{
		ProcessingMode:     fullMode(filterextproc.ProcessingMode_BUFFERED, filterextproc.ProcessingMode_SEND, filterextproc.ProcessingMode_BUFFERED),
		MessageTimeout:     durationpb.New(5 * time.Second),
		AllowModeOverride:  true,
		RequestAttributes:  []string{"request.id", "request.path", "request.method"},
		ResponseAttributes: []string{"response.code", "response.code_details", "response.flags"},
	}
}

// env is one proxy between a test client, fake processors and a counting upstream.
type env struct {
	proc   *fakeProcessor
	up     *upstream.Upstream
	proxy  *proxy.Proxy
	client *http.Client
	recs   chan proxy.Record
}

// newEnv starts an upstream, a fake processor running h and a proxy with filter; opts adjust
// the proxy configuration.
func newEnv(t *testing.T, filter *filterextproc.ExternalProcessor, h handler, opts ...func(*proxy.Config)) *env {
	t.Helper()
	e := &env{proc: startProcessor(t, h), up: upstream.Start(t), recs: make(chan proxy.Record, 1000)}
	cfg := proxy.Config{
		Filter:     filter,
		Processors: []string{e.proc.addr},
		Upstream:   e.up.URL(),
		AccessLog:  func(r proxy.Record) { e.recs <- r },
	}
	for _, o := range opts {
		o(&cfg)
	}
	e.proxy = proxy.Start(t, cfg)
	e.client = newClient(t)
	return e
}

func newClient(t *testing.T) *http.Client {
	tr := &http.Transport{DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 30 * time.Second}
}

// do sends a request through the proxy and returns the response with its body read.
func (e *env) do(t *testing.T, method, path string, body []byte, hdr ...string) (*http.Response, []byte) {
	t.Helper()
	return e.doCtx(t, context.Background(), method, path, body, hdr...)
}

func (e *env) doCtx(t *testing.T, ctx context.Context, method, path string, body []byte, hdr ...string) (*http.Response, []byte) {
	t.Helper()
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, e.proxy.URL()+path, rd)
	require.NoError(t, err)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Add(hdr[i], hdr[i+1])
	}
	resp, err := e.client.Do(req)
	require.NoError(t, err)
	defer func() { _ = resp.Body.Close() }()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp, b
}

// record returns the access-log record of the next finished request.
func (e *env) record(t *testing.T) proxy.Record {
	t.Helper()
	select {
	case r := <-e.recs:
		return r
	case <-time.After(5 * time.Second):
		t.Fatal("no access log record within 5s")
		return proxy.Record{}
	}
}

// statusErr is a handler that ends the stream with a gRPC error.
func statusErr(code codes.Code, msg string) handler {
	return func(extprocv3.ExternalProcessor_ProcessServer, *extprocv3.ProcessingRequest) error {
		return status.Error(code, msg)
	}
}

// valueOnly is a set_headers entry that uses value, which Envoy ignores
// (MutationUtils::applyHeaderMutations).
func valueOnly(key, value string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: key, Value: value}}
}

// bothSet is a set_headers entry with value and raw_value, which Envoy rejects
// (MutationUtils::applyHeaderMutations).
func bothSet(key, value string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: key, Value: value, RawValue: []byte(value)}}
}
