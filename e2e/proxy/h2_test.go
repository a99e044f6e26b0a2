package proxy_test

import (
	"bytes"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
)

// rawH2Upstream is an HTTP/2 server written on the frame layer, so that it sees trailers nobody
// declared (Go's net/http server keeps only declared ones). It answers every stream with
// :status 200, content-length 2, the body "ok" and a trailer x-up-trailer: t (HTTP/2 allows
// trailers after a body of announced length), and records each request's headers
// and trailers.
type rawH2Upstream struct {
	url      string
	mu       sync.Mutex
	trailers []map[string]string // per finished stream, in order
}

func startRawH2Upstream(t *testing.T) *rawH2Upstream {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	u := &rawH2Upstream{url: "http://" + ln.Addr().String()}
	var wg sync.WaitGroup
	var conns sync.Map
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Store(c, true)
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() { _ = c.Close() }()
				u.serve(c)
			}()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		conns.Range(func(k, _ any) bool { _ = k.(net.Conn).Close(); return true })
		wg.Wait()
	})
	return u
}

func (u *rawH2Upstream) serve(c net.Conn) {
	preface := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(c, preface); err != nil || string(preface) != http2.ClientPreface {
		return
	}
	fr := http2.NewFramer(c, c)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	if fr.WriteSettings() != nil {
		return
	}
	var hbuf bytes.Buffer
	enc := hpack.NewEncoder(&hbuf)
	headers := func(id uint32, end bool, kv ...string) error {
		hbuf.Reset()
		for i := 0; i+1 < len(kv); i += 2 {
			_ = enc.WriteField(hpack.HeaderField{Name: kv[i], Value: kv[i+1]})
		}
		return fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: hbuf.Bytes(), EndStream: end, EndHeaders: true})
	}
	seenHeaders := map[uint32]bool{}
	trailers := map[uint32]map[string]string{}
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return
		}
		id, ended := f.Header().StreamID, false
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() && fr.WriteSettingsAck() != nil {
				return
			}
		case *http2.PingFrame:
			if !f.IsAck() && fr.WritePing(true, f.Data) != nil {
				return
			}
		case *http2.MetaHeadersFrame:
			if seenHeaders[id] {
				tr := map[string]string{}
				for _, hf := range f.RegularFields() {
					tr[hf.Name] = hf.Value
				}
				trailers[id] = tr
			}
			seenHeaders[id] = true
			ended = f.StreamEnded()
		case *http2.DataFrame:
			if n := len(f.Data()); n > 0 {
				_ = fr.WriteWindowUpdate(0, uint32(n))
			}
			ended = f.StreamEnded()
		}
		if !ended {
			continue
		}
		u.mu.Lock()
		u.trailers = append(u.trailers, trailers[id])
		u.mu.Unlock()
		if headers(id, false, ":status", "200", "content-length", "2", "x-up-header", "h") != nil ||
			fr.WriteData(id, false, []byte("ok")) != nil ||
			headers(id, true, "x-up-trailer", "t") != nil {
			return
		}
	}
}

// h2cClient speaks HTTP/2 with prior knowledge.
func h2cClient(t *testing.T) *http.Client {
	tr := &http.Transport{DisableCompression: true, Protocols: new(http.Protocols)}
	tr.Protocols.SetUnencryptedHTTP2(true)
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

// On HTTP/2 trailers pass both ways without enable_trailers (an HTTP/1 option): the request's
// reach the processor (request_trailer_mode SEND) and the upstream, with the answer's mutation
// applied; the response's reach the processor and the client. An HTTP/1.1 client on the same
// listener still gets HTTP/1.1 and, without enable_trailers, no trailers.
func TestHTTP2TrailersBothWays(t *testing.T) {
	up := startRawH2Upstream(t)
	addTrailer := func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		switch kind(req) {
		case "request_trailers", "response_trailers":
			return st.Send(answer(req, &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{
				SetHeaders: []*corev3.HeaderValueOption{setRaw("x-proc-trailer", kind(req), false)},
			}}))
		}
		return continueAll(st, req)
	}
	mode := &filterextproc.ProcessingMode{
		RequestHeaderMode: modeSEND, RequestBodyMode: bodySTR, RequestTrailerMode: modeSEND,
		ResponseHeaderMode: modeSEND, ResponseBodyMode: bodySTR, ResponseTrailerMode: modeSEND,
	}
	proc := startProcessor(t, addTrailer)
	p := proxy.Start(t, proxy.Config{
		Filter:          &filterextproc.ExternalProcessor{ProcessingMode: mode},
		Processors:      []string{proc.addr},
		Upstream:        up.url,
		DownstreamHTTP2: true,
		UpstreamHTTP2:   true,
	})

	req, err := http.NewRequest(http.MethodPost, p.URL()+"/t", io.NopCloser(strings.NewReader("body")))
	require.NoError(t, err)
	req.ContentLength = -1
	req.Trailer = http.Header{"X-Req-Trailer": {"r"}}
	resp, err := h2cClient(t).Do(req)
	require.NoError(t, err)
	got, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	_ = resp.Body.Close()
	require.Equal(t, "HTTP/2.0", resp.Proto)
	require.Equal(t, "ok", string(got))
	require.Equal(t, "h", resp.Header.Get("X-Up-Header"))
	require.Equal(t, "t", resp.Trailer.Get("X-Up-Trailer"))
	require.Equal(t, "response_trailers", resp.Trailer.Get("X-Proc-Trailer"))

	up.mu.Lock()
	require.Equal(t, []map[string]string{{"x-req-trailer": "r", "x-proc-trailer": "request_trailers"}}, up.trailers,
		"the request's trailers and the processor's reach the upstream, undeclared")
	up.mu.Unlock()

	msgs := proc.next(t).msgs
	var ks []string
	for _, m := range msgs {
		if k := kind(m); len(ks) == 0 || ks[len(ks)-1] != k {
			ks = append(ks, k)
		}
	}
	require.Equal(t, []string{"request_headers", "request_body", "request_trailers", "response_headers", "response_body", "response_trailers"}, ks)

	// HTTP/1.1 on the same listener: unchanged, trailers dropped without enable_trailers.
	h1req, err := http.NewRequest(http.MethodPost, p.URL()+"/t", bytes.NewReader([]byte("b1")))
	require.NoError(t, err)
	h1, err := newClient(t).Do(h1req)
	require.NoError(t, err)
	got, err = io.ReadAll(h1.Body)
	require.NoError(t, err)
	_ = h1.Body.Close()
	require.Equal(t, "HTTP/1.1", h1.Proto)
	require.Equal(t, "ok", string(got))
	require.Empty(t, h1.Trailer.Get("X-Up-Trailer"))
	proc.next(t)
}

// A trailers-only gRPC local reply is one HEADERS frame with END_STREAM and no content-length:
// Utility::prepareLocalReply (source/common/http/utility.cc) removes content-length when it turns
// the reply into trailers-only, and Envoy's HTTP/2 codec adds none. Read on the frame layer, for
// Go's HTTP/2 server adds content-length: 0 to a handler that ends at its headers.
func TestHTTP2TrailersOnlyReplyOnTheWire(t *testing.T) {
	ir := immediate(409, "in flight", nil, "replied")
	e := newGrpcEnv(t, grpcMode(bodyNONE, bodyNONE, modeSKIP), on("request_headers", sendOnce(ir)))
	c, err := net.Dial("tcp", strings.TrimPrefix(e.proxy.URL(), "http://"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	require.NoError(t, c.SetDeadline(time.Now().Add(10*time.Second)))
	_, err = io.WriteString(c, http2.ClientPreface)
	require.NoError(t, err)
	fr := http2.NewFramer(c, c)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	require.NoError(t, fr.WriteSettings())
	var block bytes.Buffer
	enc := hpack.NewEncoder(&block)
	for _, f := range [][2]string{{":method", "POST"}, {":scheme", "http"}, {":path", unaryPath}, {":authority", "proxy"}, {"content-type", "application/grpc"}, {"te", "trailers"}} {
		require.NoError(t, enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]}))
	}
	require.NoError(t, fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block.Bytes(), EndStream: true, EndHeaders: true}))
	var frames []http2.Frame
	for {
		f, err := fr.ReadFrame()
		require.NoError(t, err)
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				require.NoError(t, fr.WriteSettingsAck())
			}
			continue
		case *http2.WindowUpdateFrame, *http2.PingFrame:
			continue
		}
		require.EqualValues(t, 1, f.Header().StreamID, "a frame of another stream: %v", f)
		frames = append(frames, f)
		if f.Header().Flags.Has(http2.FlagHeadersEndStream) || f.Header().Type == http2.FrameRSTStream {
			break
		}
	}
	require.Len(t, frames, 1, "a trailers-only reply is one frame: %v", frames)
	h, ok := frames[0].(*http2.MetaHeadersFrame)
	require.True(t, ok, "not HEADERS: %v", frames[0])
	require.True(t, h.StreamEnded())
	require.Equal(t, "200", h.PseudoValue("status"))
	var names []string
	for _, f := range h.RegularFields() {
		names = append(names, f.Name)
	}
	require.Contains(t, names, "grpc-status")
	require.NotContains(t, names, "content-length", "prepareLocalReply removes content-length from a trailers-only reply")
}
