package proxy_test

import (
	"bytes"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
)

// rawUpstream answers every request with raw bytes written on the hijacked connection, then
// closes it.
func rawUpstream(t *testing.T, raw string) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		conn, buf, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		_, _ = buf.WriteString(raw)
		_ = buf.Flush()
		_ = conn.Close()
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// Early ends the processor can only learn from the stream's end (no ext_proc message reports
// them): the router's responses and resets, as Envoy makes them.
func TestRouterEarlyEnds(t *testing.T) {
	for _, tc := range []struct {
		name        string
		raw         string
		mode        filterextproc.ProcessingMode_BodySendMode
		wantStatus  int // 0: the client sees a reset
		chunks      []int
		wantDetails string
		wantFlags   string
		wantKinds   []string
	}{
		{name: "reset before headers", raw: "", wantStatus: 503, mode: bodyBUF,
			wantDetails: "upstream_reset_before_response_started{connection_termination}", wantFlags: "UC",
			wantKinds: []string{"request_headers", "request_body", "response_headers", "response_body"}},
		// The headers reached the filters, so the router resets the downstream stream
		// (Router::Filter::onUpstreamReset with downstream_response_started_) and the processor
		// never gets the body.
		{name: "reset mid-body, BUFFERED", raw: "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial", mode: bodyBUF,
			wantDetails: "upstream_reset_after_response_started{connection_termination}", wantFlags: "UR",
			wantKinds: []string{"request_headers", "request_body", "response_headers"}},
		{name: "reset mid-body, STREAMED", raw: "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial", mode: bodySTR,
			wantDetails: "upstream_reset_after_response_started{connection_termination}", wantFlags: "UR",
			wantKinds: []string{"request_headers", "request_body", "response_headers", "response_body"}},
		// A chunked body cut before its last chunk is a reset too, whatever the sizes of the
		// reads: the processor never gets a body it could take for the whole one.
		{name: "reset mid-chunked-body, BUFFERED, sized reads", raw: "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7\r\npartial\r\n",
			mode: bodyBUF, chunks: []int{4},
			wantDetails: "upstream_reset_after_response_started{connection_termination}", wantFlags: "UR",
			wantKinds: []string{"request_headers", "request_body", "response_headers"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := bufferedFilter()
			f.ProcessingMode.ResponseBodyMode = tc.mode
			url := rawUpstream(t, tc.raw)
			e := newEnv(t, f, nil, func(c *proxy.Config) {
				c.Upstream = url
				c.Shapes = func(*http.Request) proxy.Shapes {
					return proxy.Shapes{Response: proxy.BodyShape{DuringHeaders: proxy.Held, Chunks: tc.chunks}}
				}
			})
			req, err := http.NewRequest(http.MethodPost, e.proxy.URL()+"/x", bytes.NewReader([]byte("x")))
			require.NoError(t, err)
			resp, err := e.client.Do(req)
			if tc.wantStatus != 0 {
				require.NoError(t, err)
				_ = resp.Body.Close()
				require.Equal(t, tc.wantStatus, resp.StatusCode)
			} else if err == nil {
				_, err = io.ReadAll(resp.Body)
				_ = resp.Body.Close()
				require.Error(t, err, "reset")
			}
			rec := e.record(t)
			require.Equal(t, tc.wantDetails, rec.CodeDetails)
			require.Equal(t, tc.wantFlags, rec.ResponseFlags)
			log := e.proc.next(t)
			require.Equal(t, tc.wantKinds, kinds(log.msgs))
		})
	}
}

// The route timeout after the upstream's headers is a reset (UT), not a 504.
func TestRouteTimeoutAfterHeadersResets(t *testing.T) {
	f := bufferedFilter()
	f.ProcessingMode.ResponseBodyMode = bodySTR
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "100")
		w.WriteHeader(200)
		_, _ = w.Write([]byte("part"))
		http.NewResponseController(w).Flush()
		<-r.Context().Done()
	}))
	t.Cleanup(srv.Close)
	e := newEnv(t, f, nil, func(c *proxy.Config) { c.Upstream = srv.URL; c.RouteTimeout = 300 * time.Millisecond })
	resp, err := e.client.Post(e.proxy.URL()+"/x", "text/plain", strings.NewReader("x"))
	require.NoError(t, err)
	_, err = io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	require.Error(t, err)
	rec := e.record(t)
	require.Equal(t, "upstream_response_timeout", rec.CodeDetails)
	require.Equal(t, "UT", rec.ResponseFlags)
	e.proc.next(t)
}

// A client that goes away mid-body (STREAMED) ends the processor's stream without any
// response phase; the access log says DC.
func TestClientGoneMidBody(t *testing.T) {
	f := bufferedFilter()
	f.ProcessingMode.RequestBodyMode = bodySTR
	e := newEnv(t, f, nil, func(c *proxy.Config) {
		c.Shapes = shape(proxy.BodyShape{DuringHeaders: proxy.Held})
	})
	conn, err := net.Dial("tcp", e.proxy.URL()[len("http://"):])
	require.NoError(t, err)
	_, err = conn.Write([]byte("POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 1000\r\n\r\nfirst-part"))
	require.NoError(t, err)
	// Wait until the first chunk reached the processor, then leave.
	require.Eventually(t, func() bool { return e.proxy.Stats().MessagesSent >= 2 }, 5*time.Second, 5*time.Millisecond)
	require.NoError(t, conn.Close())
	log := e.proc.next(t)
	require.Equal(t, []string{"request_headers", "request_body"}, kinds(log.msgs))
	require.False(t, log.msgs[1].GetRequestBody().GetEndOfStream())
	require.Equal(t, "DC", e.record(t).ResponseFlags)
}
