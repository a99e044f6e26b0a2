package proxy_test

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
	"github.com/idempotency-extproc/idempotency-extproc/e2e/upstream"
)

var shapeModes = []filterextproc.ProcessingMode_BodySendMode{bodyNONE, bodySTR, bodyBUF, bodyPART, bodyDUPLEX}

// shapeProcessor answers every mode as a pass-through processor would: CONTINUE, echoing
// FULL_DUPLEX_STREAMED chunks as streamed_response, and (x-withhold: 1) withholding STREAMED
// request answers until the chunk that ends the body.
type shapeProcessor struct {
	mu      sync.Mutex
	pending map[extprocv3.ExternalProcessor_ProcessServer][]*extprocv3.ProcessingRequest
	withold map[extprocv3.ExternalProcessor_ProcessServer]bool
}

func (p *shapeProcessor) handle(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if rh := req.GetRequestHeaders(); rh != nil {
		for _, h := range rh.GetHeaders().GetHeaders() {
			if h.GetKey() == "x-withhold" {
				p.withold[st] = true
			}
		}
	}
	duplex := func(b *extprocv3.HttpBody) error { return st.Send(streamed(req, b.GetBody(), b.GetEndOfStream())) }
	switch {
	case req.GetRequestBody() != nil && p.isDuplex(st, 0):
		return duplex(req.GetRequestBody())
	case req.GetResponseBody() != nil && p.isDuplex(st, 1):
		return duplex(req.GetResponseBody())
	case req.GetRequestBody() != nil && p.withold[st]:
		p.pending[st] = append(p.pending[st], req)
		if !req.GetRequestBody().GetEndOfStream() {
			return nil
		}
		for _, q := range p.pending[st] {
			if err := st.Send(cont(q)); err != nil {
				return err
			}
		}
		delete(p.pending, st)
		return nil
	}
	return st.Send(cont(req))
}

// modes remembers each stream's protocol_config (the route's modes).
var shapeStreamModes sync.Map // ProcessServer -> [2]BodySendMode

func (p *shapeProcessor) isDuplex(st extprocv3.ExternalProcessor_ProcessServer, dir int) bool {
	m, ok := shapeStreamModes.Load(st)
	return ok && m.([2]filterextproc.ProcessingMode_BodySendMode)[dir] == bodyDUPLEX
}

// TestRandomShapes runs seeded random combinations of body modes (per route, both directions),
// body sizes, read sizes, header-call timing and pipelining depth through a pass-through
// processor, and checks the invariants Envoy's filter keeps: every byte reaches the upstream and
// the client unchanged, each direction's body messages add up to the body with end_of_stream on
// the last one only, a body complete during the header call goes as one message, nothing comes
// after the end of a direction, and no timer fires. The seed is fixed; PROXY_SHAPE_SEED=<n>
// runs another one (the Race shapes still depend on timing).
func TestRandomShapes(t *testing.T) {
	seed := uint64(20261201)
	if s := os.Getenv("PROXY_SHAPE_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		require.NoError(t, err)
		seed = v
	}
	t.Logf("PROXY_SHAPE_SEED=%d", seed)
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))

	var routes []proxy.Route
	for _, rq := range shapeModes {
		for _, rs := range shapeModes {
			m := fullMode(rq, modeSEND, rs)
			m.RequestTrailerMode, m.ResponseTrailerMode = modeSEND, modeSEND
			routes = append(routes, proxy.Route{Name: rq.String() + "/" + rs.String(), Prefix: "/" + rq.String() + "/" + rs.String() + "/",
				ExtProc: overrides(&filterextproc.ExtProcOverrides{ProcessingMode: m})})
		}
	}
	sp := &shapeProcessor{pending: map[extprocv3.ExternalProcessor_ProcessServer][]*extprocv3.ProcessingRequest{},
		withold: map[extprocv3.ExternalProcessor_ProcessServer]bool{}}
	h := func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		if pc := req.GetProtocolConfig(); pc != nil {
			shapeStreamModes.Store(st, [2]filterextproc.ProcessingMode_BodySendMode{pc.GetRequestBodyMode(), pc.GetResponseBodyMode()})
		}
		return sp.handle(st, req)
	}
	f := bufferedFilter()
	f.MessageTimeout = durationpb.New(10 * time.Second)
	var mu sync.Mutex
	var current proxy.Shapes
	e := newEnv(t, f, h, func(c *proxy.Config) {
		c.Routes = routes
		c.ListenerBufferLimit, c.UpstreamBufferLimit = 64<<10, 64<<10
		c.Shapes = func(*http.Request) proxy.Shapes {
			mu.Lock()
			defer mu.Unlock()
			return current
		}
	})
	pick := func(n int) int { return rng.IntN(n) }
	randShape := func() proxy.BodyShape {
		s := proxy.BodyShape{DuringHeaders: proxy.DuringHeaders(pick(3)), Pipeline: pick(3)}
		for range pick(3) {
			s.Chunks = append(s.Chunks, 1+pick(3000))
		}
		return s
	}
	for i := range 60 {
		rq, rs := shapeModes[pick(len(shapeModes))], shapeModes[pick(len(shapeModes))]
		reqSize, respSize := pick(6000), pick(6000)
		withhold := rq == bodySTR && pick(2) == 0
		mu.Lock()
		current = proxy.Shapes{Request: randShape(), Response: randShape()}
		if withhold {
			current.Request.Pipeline = 0 // a withholding processor needs every chunk sent
		}
		sh := current
		mu.Unlock()
		name := fmt.Sprintf("#%d %s/%s req=%d resp=%d withhold=%v shapes=%+v", i, rq, rs, reqSize, respSize, withhold, sh)
		body := upstream.Body(reqSize)
		hdr := []string{"X-Test-Body-Bytes", strconv.Itoa(respSize)}
		if withhold {
			hdr = append(hdr, "X-Withhold", "1")
		}
		if pick(2) == 0 {
			hdr = append(hdr, "X-Test-Chunked", "true", "X-Test-Chunk-Size", strconv.Itoa(1+pick(2000)))
		}
		var reqBody []byte
		if reqSize > 0 {
			reqBody = body
		}
		resp, got := e.do(t, http.MethodPost, "/"+rq.String()+"/"+rs.String()+"/x", reqBody, hdr...)
		require.Equal(t, http.StatusOK, resp.StatusCode, name)
		require.True(t, bytes.Equal(upstream.Body(respSize), got), "%s: response body", name)
		reqs := e.up.Requests()
		require.Equal(t, sha(body), reqs[len(reqs)-1].BodySHA256, "%s: request body", name)
		log := e.proc.next(t)
		e.record(t)
		checkDirection(t, name, log.msgs, 0, rq, body, sh.Request)
		checkDirection(t, name, log.msgs, 1, rs, upstream.Body(respSize), sh.Response)
		shapeStreamModes.Range(func(k, _ any) bool { shapeStreamModes.Delete(k); return true })
	}
	require.Zero(t, e.proxy.Stats().MessageTimeouts)
	require.Zero(t, e.proxy.Stats().Spurious)
}

func checkDirection(t *testing.T, name string, msgs []*extprocv3.ProcessingRequest, dir int, mode filterextproc.ProcessingMode_BodySendMode, body []byte, sh proxy.BodyShape) {
	t.Helper()
	var got []byte
	var chunks []*extprocv3.HttpBody
	headersSeen, ended := false, false
	for _, m := range msgs {
		var hh *extprocv3.HttpHeaders
		var b *extprocv3.HttpBody
		if dir == 0 {
			hh, b = m.GetRequestHeaders(), m.GetRequestBody()
		} else {
			hh, b = m.GetResponseHeaders(), m.GetResponseBody()
		}
		switch {
		case hh != nil:
			headersSeen = true
			ended = hh.GetEndOfStream()
		case b != nil:
			require.True(t, headersSeen, "%s: body before headers", name)
			require.False(t, ended, "%s: a message after the end of direction %d", name, dir)
			chunks = append(chunks, b)
			got = append(got, b.GetBody()...)
			ended = b.GetEndOfStream()
		}
	}
	dirName := []string{"request", "response"}[dir]
	switch mode {
	case bodyNONE:
		require.Empty(t, chunks, "%s: NONE sends no %s body", name, dirName)
		return
	case bodyPART:
		require.LessOrEqual(t, len(chunks), 1, "%s: BUFFERED_PARTIAL sends one message", name)
		require.True(t, bytes.HasPrefix(body, got), "%s: BUFFERED_PARTIAL sends a prefix", name)
		return
	}
	if len(body) == 0 {
		// A bodyless message ends the direction at its headers, or an empty last chunk does.
		require.LessOrEqual(t, len(got), 0, name)
		return
	}
	require.True(t, bytes.Equal(body, got), "%s: the %s body messages add up to the body (%d vs %d bytes)", name, dirName, len(got), len(body))
	for i, c := range chunks {
		require.Equal(t, i == len(chunks)-1, c.GetEndOfStream(), "%s: end_of_stream on the last %s chunk only", name, dirName)
	}
	if mode == bodyBUF {
		require.Len(t, chunks, 1, "%s: BUFFERED sends one message", name)
	}
	if sh.DuringHeaders == proxy.Whole && mode != bodyDUPLEX && len(body) <= 64<<10 {
		require.Len(t, chunks, 1, "%s: a body complete during the header call goes as one message", name)
	}
}
