package proxy_test

import (
	"bytes"
	"io"
	"net/http"
	"sync"
	"testing"
	"time"

	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
	"github.com/idempotency-extproc/idempotency-extproc/e2e/upstream"
)

const bodyDUPLEX = filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED

// duplexFilter is FULL_DUPLEX_STREAMED both ways, with trailer mode SEND as Envoy requires, and
// a message timeout far below the processor's delays: FULL_DUPLEX_STREAMED has no timer.
func duplexFilter() *filterextproc.ExternalProcessor {
	f := bufferedFilter()
	f.ProcessingMode = &filterextproc.ProcessingMode{
		RequestHeaderMode: modeSEND, RequestBodyMode: bodyDUPLEX, RequestTrailerMode: modeSEND,
		ResponseHeaderMode: modeSEND, ResponseBodyMode: bodyDUPLEX, ResponseTrailerMode: modeSEND,
	}
	f.MessageTimeout = durationpb.New(50 * time.Millisecond)
	return f
}

func streamed(req *extprocv3.ProcessingRequest, body []byte, eos bool) *extprocv3.ProcessingResponse {
	return answer(req, &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
		StreamedResponse: &extprocv3.StreamedBodyResponse{Body: body, EndOfStream: eos},
	}}})
}

// collector is a FULL_DUPLEX_STREAMED processor that buffers the whole request (headers
// unanswered), then answers the headers and streams the body back upper-cased in 1000-byte
// chunks, keeping the headers-body-trailers order; it echoes the response chunk by chunk.
type collector struct {
	mu      sync.Mutex
	delay   time.Duration
	headers *extprocv3.ProcessingRequest
	body    []byte
}

func (c *collector) handle(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	flush := func(trailers *extprocv3.ProcessingRequest) error {
		time.Sleep(c.delay)
		if err := st.Send(cont(c.headers)); err != nil {
			return err
		}
		up := bytes.ToUpper(c.body)
		for len(up) > 0 {
			n := min(1000, len(up))
			if err := st.Send(streamed(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{}}, up[:n], n == len(up))); err != nil {
				return err
			}
			up = up[n:]
		}
		if trailers != nil {
			return st.Send(cont(trailers))
		}
		return nil
	}
	switch kind(req) {
	case "request_headers":
		c.headers = req
		if req.GetRequestHeaders().GetEndOfStream() {
			return flush(nil)
		}
	case "request_body":
		c.body = append(c.body, req.GetRequestBody().GetBody()...)
		if req.GetRequestBody().GetEndOfStream() {
			return flush(nil)
		}
	case "request_trailers":
		return flush(req)
	case "response_body":
		b := req.GetResponseBody()
		return st.Send(streamed(req, b.GetBody(), b.GetEndOfStream()))
	default:
		return st.Send(cont(req))
	}
	return nil
}

// FULL_DUPLEX_STREAMED: chunks go as they arrive, even while the headers wait for their answer
// (Filter::onData); the processor may hold everything and send the body back as
// streamed_response chunks (ProcessorState::handleDuplexStreamedBodyResponse); no message timer
// runs (ProcessorState::onStartProcessorCall).
func TestFullDuplexCollectAndStreamBack(t *testing.T) {
	c := &collector{delay: 300 * time.Millisecond}
	e := newEnv(t, duplexFilter(), c.handle, func(cfg *proxy.Config) {
		cfg.Shapes = shape(proxy.BodyShape{Chunks: []int{700}})
	})
	body := bytes.Repeat([]byte("d"), 2500)
	resp, got := e.do(t, http.MethodPost, "/upload", body, "X-Test-Body-Bytes", "3000")
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.True(t, bytes.Equal(upstream.Body(3000), got), "the response echoed chunk by chunk")
	require.Equal(t, sha(bytes.ToUpper(body)), e.up.Requests()[0].BodySHA256)
	require.Equal(t, int64(-1), resp.ContentLength, "FULL_DUPLEX_STREAMED removes content-length")
	log := e.proc.next(t)
	bs := bodies(log.msgs)
	require.Len(t, bs, 4, "700+700+700+400")
	require.True(t, bs[3].GetEndOfStream())
	require.Equal(t, bodyDUPLEX, log.msgs[0].GetProtocolConfig().GetRequestBodyMode())
	require.Zero(t, e.proxy.Stats().MessageTimeouts)
}

// With trailers the body chunks all have end_of_stream false and the trailers message tells the
// processor the body is complete; it answers them after the body.
func TestFullDuplexTrailers(t *testing.T) {
	c := &collector{}
	up := startTrailerUpstream(t)
	e := newEnv(t, duplexFilter(), c.handle, func(cfg *proxy.Config) {
		cfg.Upstream = up.srv.URL
		cfg.UpstreamTrailers, cfg.DownstreamTrailers = true, true
	})
	req := trailerRequest(t, e.proxy.URL()+"/t", bytes.Repeat([]byte("z"), 1500), "X-Sum", "1")
	resp, err := e.client.Do(req)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusOK, resp.StatusCode)
	msgs := e.proc.next(t).msgs
	require.Contains(t, kinds(msgs), "request_trailers")
	for _, b := range bodies(msgs) {
		require.False(t, b.GetEndOfStream())
	}
	up.mu.Lock()
	defer up.mu.Unlock()
	require.Equal(t, bytes.Repeat([]byte("Z"), 1500), up.bodies[0])
	require.Equal(t, "1", up.trailers[0].Get("X-Sum"))
}

// A plain BodyResponse (no streamed_response) in FULL_DUPLEX_STREAMED is spurious
// (ProcessorState::handleBodyInStreamedState): status_on_error before response headers went
// downstream, a reset after.
func TestFullDuplexPlainBodyResponseIsSpurious(t *testing.T) {
	plain := func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		return st.Send(cont(req))
	}
	t.Run("request", func(t *testing.T) {
		e := newEnv(t, duplexFilter(), plain)
		resp, _ := e.do(t, http.MethodPost, "/x", []byte("body"))
		require.Equal(t, http.StatusInternalServerError, resp.StatusCode)
		require.Equal(t, "spurious_message:_Normal_body_mutation_response_is_received_while_body_mode__is_FULL_DUPLEX_STREAMED", e.record(t).CodeDetails)
		require.Equal(t, int64(1), e.proxy.Stats().Spurious)
		e.proc.next(t)
	})
	t.Run("response", func(t *testing.T) {
		c := &collector{}
		h := func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
			if kind(req) == "response_body" {
				return st.Send(cont(req))
			}
			return c.handle(st, req)
		}
		// The body comes after the header answer, so the headers are downstream already.
		e := newEnv(t, duplexFilter(), h, func(c *proxy.Config) {
			c.Shapes = func(*http.Request) proxy.Shapes {
				return proxy.Shapes{Response: proxy.BodyShape{DuringHeaders: proxy.Held}}
			}
		})
		req, err := http.NewRequest(http.MethodPost, e.proxy.URL()+"/x", bytes.NewReader([]byte("b")))
		require.NoError(t, err)
		req.Header.Set("X-Test-Body-Bytes", "100")
		resp, err := e.client.Do(req)
		require.NoError(t, err)
		defer func() { _ = resp.Body.Close() }()
		require.Equal(t, http.StatusOK, resp.StatusCode, "the headers went downstream before the body")
		_, err = readAll(resp)
		require.Error(t, err, "then the stream is reset")
		e.proc.next(t)
		require.Equal(t, int64(1), e.proxy.Stats().Resets)
	})
	t.Run("response complete during the header call", func(t *testing.T) {
		c := &collector{}
		h := func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
			if kind(req) == "response_body" {
				return st.Send(cont(req))
			}
			return c.handle(st, req)
		}
		// The headers stay held until the first streamed_response (handleCompleteBodyAvailable
		// with the callback state StreamedBodyCallback): the spurious answer is a 500.
		e := newEnv(t, duplexFilter(), h, func(c *proxy.Config) {
			c.Shapes = func(*http.Request) proxy.Shapes {
				return proxy.Shapes{Response: proxy.BodyShape{DuringHeaders: proxy.Whole}}
			}
		})
		resp, _ := e.do(t, http.MethodPost, "/x", []byte("b"), "X-Test-Body-Bytes", "100")
		require.Equal(t, http.StatusInternalServerError, resp.StatusCode)
		e.proc.next(t)
	})
}

// mode_override is ignored when a filter-level body mode is FULL_DUPLEX_STREAMED
// (Filter::onReceiveMessage).
func TestFullDuplexIgnoresModeOverride(t *testing.T) {
	c := &collector{}
	h := func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		if kind(req) == "response_headers" {
			resp := cont(req)
			resp.ModeOverride = fullMode(bodyNONE, modeSEND, bodyNONE)
			return st.Send(resp)
		}
		return c.handle(st, req)
	}
	f := duplexFilter()
	f.AllowModeOverride = true
	f.AllowedOverrideModes = nil
	e := newEnv(t, f, h)
	resp, got := e.do(t, http.MethodPost, "/x", []byte("b"), "X-Test-Body-Bytes", "100")
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.True(t, bytes.Equal(upstream.Body(100), got))
	require.Contains(t, kinds(e.proc.next(t).msgs), "response_body")
	require.Equal(t, int64(1), e.proxy.Stats().ModeOverridesIgnored)
}

// failure_mode_allow (here per route; Envoy refuses it on the filter with FULL_DUPLEX_STREAMED)
// stops applying once body data went to the processor (Filter::failureModeAllow).
func TestFullDuplexFailureModeAllow(t *testing.T) {
	failAt := func(k string) handler {
		return on(k, statusErr(codes.Internal, "boom"))
	}
	route := []proxy.Route{{Name: "r", ExtProc: &filterextproc.ExtProcPerRoute{Override: &filterextproc.ExtProcPerRoute_Overrides{
		Overrides: &filterextproc.ExtProcOverrides{FailureModeAllow: wrapperspb.Bool(true)},
	}}}}
	e := newEnv(t, duplexFilter(), failAt("request_headers"), func(c *proxy.Config) { c.Routes = route })
	resp, _ := e.do(t, http.MethodGet, "/x", nil)
	require.Equal(t, http.StatusOK, resp.StatusCode, "no body yet: fail open")
	e.proc.next(t)

	e = newEnv(t, duplexFilter(), failAt("request_body"), func(c *proxy.Config) { c.Routes = route })
	resp, _ = e.do(t, http.MethodPost, "/x", []byte("body"))
	require.Equal(t, http.StatusInternalServerError, resp.StatusCode, "body sent: failure_mode_allow no longer applies")
	require.Equal(t, "ext_proc_error_gRPC_error_13{boom}", e.record(t).CodeDetails)
	e.proc.next(t)
}

// observability_mode: send and go. Every message carries observability_mode, none waits for an
// answer or arms a timer, answers are ignored, only STREAMED bodies are sent, protocol_config is
// not, and the stream is closed deferred_close_timeout after the request
// (Filter::sendHeadersInObservabilityMode, sendDataInObservabilityMode, onDestroy).
func TestObservabilityMode(t *testing.T) {
	f := bufferedFilter()
	f.ObservabilityMode = true
	f.ProcessingMode.RequestBodyMode = bodySTR  // sent
	f.ProcessingMode.ResponseBodyMode = bodyBUF // not sent
	f.MessageTimeout = durationpb.New(10 * time.Millisecond)
	f.DeferredCloseTimeout = durationpb.New(time.Second)
	ignored := func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		return st.Send(immediate(409, "ignored", nil, ""))
	}
	e := newEnv(t, f, ignored, func(c *proxy.Config) {
		c.Shapes = shape(proxy.BodyShape{Chunks: []int{100}})
	})
	resp, got := e.do(t, http.MethodPost, "/x", bytes.Repeat([]byte("o"), 250), "X-Test-Body-Bytes", "10")
	done := time.Now()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, upstream.Body(10), got)
	log := e.proc.next(t)
	require.Equal(t, []string{"request_headers", "request_body", "request_body", "request_body", "response_headers"}, kinds(log.msgs))
	for _, m := range log.msgs {
		require.True(t, m.GetObservabilityMode())
		require.Nil(t, m.GetProtocolConfig())
	}
	// 1 s after the request: at least half of that after the client has the response, however
	// late a loaded machine hands it over.
	require.GreaterOrEqual(t, log.ended.Sub(done), 500*time.Millisecond, "closed after deferred_close_timeout")
	require.Zero(t, e.proxy.Stats().MessageTimeouts)
	require.Zero(t, e.proxy.Stats().ImmediateResponses)
}

func readAll(resp *http.Response) ([]byte, error) {
	var b bytes.Buffer
	_, err := b.ReadFrom(resp.Body)
	return b.Bytes(), err
}

// trailerRequest is a chunked POST that sends data, then the trailer name: value.
func trailerRequest(t *testing.T, url string, data []byte, name, value string) *http.Request {
	t.Helper()
	pr, pw := io.Pipe()
	req, err := http.NewRequest(http.MethodPost, url, pr)
	require.NoError(t, err)
	req.Trailer = http.Header{name: nil}
	go func() {
		_, _ = pw.Write(data)
		req.Trailer.Set(name, value)
		_ = pw.Close()
	}()
	return req
}
