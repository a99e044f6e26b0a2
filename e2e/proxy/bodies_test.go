package proxy_test

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
)

func shape(req proxy.BodyShape) func(*http.Request) proxy.Shapes {
	return func(*http.Request) proxy.Shapes { return proxy.Shapes{Request: req} }
}

// bodies returns the request_body messages of a stream.
func bodies(msgs []*extprocv3.ProcessingRequest) []*extprocv3.HttpBody {
	var out []*extprocv3.HttpBody
	for _, m := range msgs {
		if b := m.GetRequestBody(); b != nil {
			out = append(out, b)
		}
	}
	return out
}

// STREAMED chunks are pipelined: Envoy sends each chunk as it arrives, without waiting for the
// previous answer, and holds the data until each answer (Filter::handleDataStreamedModeBase).
// A processor that withholds its answers until the last chunk therefore sees every chunk first.
func TestStreamedPipelined(t *testing.T) {
	f := bufferedFilter()
	f.ProcessingMode.RequestBodyMode = bodySTR
	var pending []*extprocv3.ProcessingRequest
	var seenBeforeAnswer atomic.Int64
	withhold := on("request_body", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		pending = append(pending, req)
		if !req.GetRequestBody().GetEndOfStream() {
			return nil
		}
		seenBeforeAnswer.Store(int64(len(pending)))
		for _, p := range pending {
			b := bytes.ToUpper(p.GetRequestBody().GetBody())
			if err := st.Send(answer(p, &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: b}}})); err != nil {
				return err
			}
		}
		return nil
	})
	e := newEnv(t, f, withhold, func(c *proxy.Config) {
		c.Shapes = shape(proxy.BodyShape{DuringHeaders: proxy.Held, Chunks: []int{1000}})
	})
	body := bytes.Repeat([]byte("abcde"), 1000) // 5000 bytes: five chunks
	resp, got := e.do(t, http.MethodPost, "/upload", body)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Contains(t, string(got), sha(bytes.ToUpper(body)), "answers applied in order")
	require.Equal(t, int64(5), seenBeforeAnswer.Load(), "all five chunks went out before any answer")
	bs := bodies(e.proc.next(t).msgs)
	require.Len(t, bs, 5)
	for i, b := range bs {
		require.Len(t, b.GetBody(), 1000)
		require.Equal(t, i == 4, b.GetEndOfStream())
	}
	// content-length goes for STREAMED (shouldRemoveContentLength).
	require.Empty(t, e.up.Requests()[0].Header.Get("Content-Length"))
}

// The Pipeline shape bounds the unanswered chunks: with 1 the stream is lock-step.
func TestStreamedLockStep(t *testing.T) {
	f := bufferedFilter()
	f.ProcessingMode.RequestBodyMode = bodySTR
	var outstanding, most atomic.Int64
	h := func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		if kind(req) == "request_body" {
			if n := outstanding.Add(1); n > most.Load() {
				most.Store(n)
			}
			time.Sleep(5 * time.Millisecond)
			outstanding.Add(-1)
		}
		return continueAll(st, req)
	}
	e := newEnv(t, f, h, func(c *proxy.Config) {
		c.Shapes = shape(proxy.BodyShape{DuringHeaders: proxy.Held, Chunks: []int{100}, Pipeline: 1})
	})
	resp, _ := e.do(t, http.MethodPost, "/upload", bytes.Repeat([]byte("x"), 1000))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Len(t, bodies(e.proc.next(t).msgs), 10)
	require.Equal(t, int64(1), most.Load())
}

// A STREAMED body longer than the buffer limit, with its answers withheld, stops being read once
// the queue exceeds the limit (the watermark), and the message timer of the last send expires:
// 504 (ProcessorState::enqueueStreamingChunk raises the watermark; Filter::onMessageTimeout).
// STREAMED lets the headers go on after their answer, so the
// upstream request has started, but no byte of the body reached it.
func TestStreamedStallsAboveTheBufferLimit(t *testing.T) {
	f := bufferedFilter()
	f.ProcessingMode.RequestBodyMode = bodySTR
	f.MessageTimeout = durationpb.New(500 * time.Millisecond)
	never := on("request_body", func(extprocv3.ExternalProcessor_ProcessServer, *extprocv3.ProcessingRequest) error { return nil })
	e := newEnv(t, f, never, func(c *proxy.Config) {
		c.ListenerBufferLimit = 4096
		c.Shapes = shape(proxy.BodyShape{DuringHeaders: proxy.Held, Chunks: []int{1024}})
	})
	resp, _ := e.do(t, http.MethodPost, "/upload", bytes.Repeat([]byte("x"), 64<<10))
	require.Equal(t, http.StatusGatewayTimeout, resp.StatusCode)
	require.Equal(t, "ext_proc_error_per-message_timeout_exceeded", e.record(t).CodeDetails)
	bs := bodies(e.proc.next(t).msgs)
	require.Len(t, bs, 5, "the fifth chunk takes the queue over 4096 bytes")
	require.False(t, bs[len(bs)-1].GetEndOfStream())
	reqs := e.up.Requests()
	require.Len(t, reqs, 1, "the upstream saw the headers")
	require.Empty(t, reqs[0].BodySHA256, "and never the end of the body")
}

// The message timer is re-armed at every send and stopped at every answer
// (ProcessorState::onStartProcessorCall / onFinishProcessorCall): pipelined chunks whose answers
// come slowly, one after the other, do not time out as long as each send is answered in time.
func TestStreamedTimerPerSend(t *testing.T) {
	f := bufferedFilter()
	f.ProcessingMode.RequestBodyMode = bodySTR
	f.MessageTimeout = durationpb.New(time.Second)
	slow := on("request_body", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		time.Sleep(400 * time.Millisecond)
		return st.Send(cont(req))
	})
	e := newEnv(t, f, slow, func(c *proxy.Config) {
		c.Shapes = shape(proxy.BodyShape{DuringHeaders: proxy.Held, Chunks: []int{100}})
	})
	resp, _ := e.do(t, http.MethodPost, "/upload", bytes.Repeat([]byte("x"), 400))
	require.Equal(t, http.StatusOK, resp.StatusCode, "1.6 s of answers, none later than 1 s after the last send")
	require.Len(t, bodies(e.proc.next(t).msgs), 4)
}

// In every body mode, a body that arrived whole while request_headers was answered goes as one
// message with end_of_stream (ProcessorState::handleCompleteBodyAvailable), and the headers stay
// held until its answer: nothing reaches the upstream before.
func TestWholeDuringHeadersEveryMode(t *testing.T) {
	for _, mode := range []filterextproc.ProcessingMode_BodySendMode{bodySTR, bodyBUF, bodyPART} {
		t.Run(mode.String(), func(t *testing.T) {
			f := bufferedFilter()
			f.ProcessingMode.RequestBodyMode = mode
			var upstreamAtBody atomic.Int64
			var e *env
			h := on("request_body", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
				upstreamAtBody.Store(int64(e.up.Total()) + 1)
				return st.Send(cont(req))
			})
			e = newEnv(t, f, h, func(c *proxy.Config) {
				c.Shapes = shape(proxy.BodyShape{DuringHeaders: proxy.Whole, Chunks: []int{300}})
			})
			body := bytes.Repeat([]byte("q"), 1000)
			resp, got := e.do(t, http.MethodPost, "/pay", body)
			require.Equal(t, http.StatusOK, resp.StatusCode)
			require.Contains(t, string(got), sha(body))
			bs := bodies(e.proc.next(t).msgs)
			require.Len(t, bs, 1)
			require.Equal(t, body, bs[0].GetBody())
			require.True(t, bs[0].GetEndOfStream())
			require.Equal(t, int64(1), upstreamAtBody.Load(), "the upstream had not been reached at request_body")
		})
	}
}

// With Race, the same STREAMED request comes as one message or as several depending on timing;
// with Held the body always streams after the header answer.
func TestStreamedHeldStreams(t *testing.T) {
	f := bufferedFilter()
	f.ProcessingMode.RequestBodyMode = bodySTR
	e := newEnv(t, f, nil, func(c *proxy.Config) {
		c.Shapes = shape(proxy.BodyShape{DuringHeaders: proxy.Held, Chunks: []int{300}})
	})
	resp, _ := e.do(t, http.MethodPost, "/pay", bytes.Repeat([]byte("q"), 1000))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	bs := bodies(e.proc.next(t).msgs)
	require.Len(t, bs, 4)
	require.True(t, bs[3].GetEndOfStream())
}

// BUFFERED holds the body during the header call with StopIterationAndBuffer: an upload larger
// than the listener buffer gets 413 even when the header answer is a pass-through
// mode_override, if the body outruns it (Filter::onData;
// ActiveStreamDecoderFilter::requestDataTooLarge in source/common/http/filter_manager.cc).
func TestBufferedUploadOutrunsThePassThroughAnswer(t *testing.T) {
	f := bufferedFilter()
	passThrough := on("request_headers", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		resp := cont(req)
		resp.ModeOverride = fullMode(bodyNONE, modeSKIP, bodyNONE)
		return st.Send(resp)
	})
	for _, tc := range []struct {
		during proxy.DuringHeaders
		want   int
	}{{proxy.Whole, http.StatusRequestEntityTooLarge}, {proxy.Held, http.StatusOK}} {
		e := newEnv(t, f, passThrough, func(c *proxy.Config) {
			c.ListenerBufferLimit = 4096
			c.Shapes = shape(proxy.BodyShape{DuringHeaders: tc.during})
			c.Envoy = proxy.Envoy136()
		})
		resp, _ := e.do(t, http.MethodPost, "/upload", bytes.Repeat([]byte("u"), 64<<10))
		require.Equal(t, tc.want, resp.StatusCode)
		require.Equal(t, []string{"request_headers"}, kinds(e.proc.next(t).msgs))
	}
}

// BUFFERED_PARTIAL on the request: one message with what was queued when the queue first
// exceeded the limit, end_of_stream false; its answer applies to that part; the rest passes
// unseen (Filter::handleDataBufferedPartialMode, ProcessorState::handleBodyResponse).
func TestBufferedPartialRequest(t *testing.T) {
	f := bufferedFilter()
	f.ProcessingMode.RequestBodyMode = bodyPART
	upper := on("request_body", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		b := bytes.ToUpper(req.GetRequestBody().GetBody())
		return st.Send(answer(req, &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: b}}}))
	})
	e := newEnv(t, f, upper, func(c *proxy.Config) {
		c.ListenerBufferLimit = 1024
		c.Shapes = shape(proxy.BodyShape{DuringHeaders: proxy.Held, Chunks: []int{512}})
	})
	body := bytes.Repeat([]byte("p"), 4096)
	resp, got := e.do(t, http.MethodPost, "/upload", body)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	want := append(bytes.ToUpper(body[:1536]), body[1536:]...)
	require.Contains(t, string(got), sha(want))
	bs := bodies(e.proc.next(t).msgs)
	require.Len(t, bs, 1)
	require.Len(t, bs[0].GetBody(), 1536)
	require.False(t, bs[0].GetEndOfStream())
}

// trailerUpstream records each request's body and trailers.
type trailerUpstream struct {
	srv      *httptest.Server
	mu       sync.Mutex
	bodies   [][]byte
	trailers []http.Header
}

func startTrailerUpstream(t *testing.T) *trailerUpstream {
	u := &trailerUpstream{}
	u.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		u.mu.Lock()
		u.bodies = append(u.bodies, b)
		u.trailers = append(u.trailers, r.Trailer.Clone())
		u.mu.Unlock()
		_, _ = w.Write([]byte("ok"))
	}))
	t.Cleanup(u.srv.Close)
	return u
}

// Request trailers (HTTP/1 chunked, with enable_trailers on both codecs): the body's last message
// has end_of_stream false and, with request_trailer_mode SEND, a request_trailers message follows
// whose mutations apply; with SKIP nothing says the body ended (Filter::onTrailers).
func TestRequestTrailers(t *testing.T) {
	for _, tc := range []struct {
		bodyMode filterextproc.ProcessingMode_BodySendMode
		trailers filterextproc.ProcessingMode_HeaderSendMode
		during   proxy.DuringHeaders
	}{
		{bodyBUF, modeSEND, proxy.Held},
		{bodyBUF, modeSKIP, proxy.Held},
		{bodySTR, modeSEND, proxy.Held},
		{bodySTR, modeSEND, proxy.Whole},
		{bodyPART, modeSEND, proxy.Held},
		{bodyNONE, modeSEND, proxy.Held},
	} {
		t.Run(tc.bodyMode.String()+"/"+tc.trailers.String()+"/"+map[proxy.DuringHeaders]string{proxy.Held: "held", proxy.Whole: "whole"}[tc.during], func(t *testing.T) {
			f := bufferedFilter()
			f.ProcessingMode.RequestBodyMode = tc.bodyMode
			f.ProcessingMode.RequestTrailerMode = tc.trailers
			h := func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
				if kind(req) == "request_trailers" {
					return st.Send(answer(req, &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{
						SetHeaders: []*corev3.HeaderValueOption{setRaw("x-checksum", "mutated", false)},
					}}))
				}
				return continueAll(st, req)
			}
			up := startTrailerUpstream(t)
			e := newEnv(t, f, h, func(c *proxy.Config) {
				c.Upstream = up.srv.URL
				c.UpstreamTrailers, c.DownstreamTrailers = true, true
				c.Shapes = shape(proxy.BodyShape{DuringHeaders: tc.during, Chunks: []int{100}})
			})
			pr, pw := io.Pipe()
			req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, e.proxy.URL()+"/t", pr)
			require.NoError(t, err)
			req.Trailer = http.Header{"X-Checksum": nil}
			go func() {
				_, _ = pw.Write(bytes.Repeat([]byte("t"), 250))
				req.Trailer.Set("X-Checksum", "abc")
				_ = pw.Close()
			}()
			resp, err := e.client.Do(req)
			require.NoError(t, err)
			_, _ = io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			require.Equal(t, http.StatusOK, resp.StatusCode)

			msgs := e.proc.next(t).msgs
			var sent []byte
			for _, b := range bodies(msgs) {
				require.False(t, b.GetEndOfStream(), "the trailers end the body, not a chunk")
				sent = append(sent, b.GetBody()...)
			}
			if tc.bodyMode != bodyNONE {
				require.Equal(t, bytes.Repeat([]byte("t"), 250), sent)
			}
			ks := strings.Join(kinds(msgs), ",")
			up.mu.Lock()
			defer up.mu.Unlock()
			require.Equal(t, bytes.Repeat([]byte("t"), 250), up.bodies[0])
			if tc.trailers == modeSEND {
				require.Contains(t, ks, "request_trailers")
				require.Equal(t, "mutated", up.trailers[0].Get("X-Checksum"))
			} else {
				require.NotContains(t, ks, "request_trailers")
				require.Equal(t, "abc", up.trailers[0].Get("X-Checksum"))
			}
		})
	}
}
