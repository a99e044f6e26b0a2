package proxy

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// maxDrain bounds how much of an unwanted request body the proxy reads after a 413, so that the
// client can read the reply instead of a connection reset.
const maxDrain = 8 << 20

// Response flags as the response.flags attribute encodes them (StreamInfo::legacyResponseFlags,
// a bit vector), and as %RESPONSE_FLAGS% prints them.
const (
	flagUpstreamRequestTimeout        = 0x4   // UT
	flagUpstreamRemoteReset           = 0x10  // UR
	flagUpstreamConnectionFailure     = 0x20  // UF
	flagUpstreamConnectionTermination = 0x40  // UC
	flagNoRouteFound                  = 0x100 // NR
)

// errRouteTimeout is the cause of the upstream context when the route timeout fires.
var errRouteTimeout = errors.New("proxy: route timeout")

// begin builds the request headers the connection manager hands to the filters, resolves the
// route and its per-filter configuration, then runs the decoder filters on the headers.
func (x *exchange) begin() {
	r := x.r
	x.h2 = r.ProtoMajor == 2
	h := x.requestHeaders()
	x.grpc = isGrpc(h)
	x.head = x.method == http.MethodHead
	path, _ := h.get(":path")
	for _, rt := range x.p.routes {
		if rt.matches(path, x.grpc) {
			x.route = rt
			break
		}
	}
	if x.route != nil {
		x.rec.Route = x.route.Name
		x.routeTO = x.p.routeTimeout
		if t := x.route.Timeout; t > 0 {
			x.routeTO = t
		} else if t < 0 {
			x.routeTO = 0
		}
	}
	x.trace = newTrace(x.p.cfg.Tracing, h)
	x.metadata = map[string]*structpb.Struct{}
	x.dec = &dirState{x: x, dir: dirRequest, out: requestSink{x}, lim: int(x.p.requestLimit), hdrs: h}
	x.enc = &dirState{x: x, dir: dirResponse, out: responseSink{x}, lim: int(x.p.responseLimit)}
	x.mergePerRouteConfig()

	hasBody := r.Body != nil && r.Body != http.NoBody && r.ContentLength != 0
	if hasBody {
		var trailers func() headerList
		if x.downstreamTrailers() {
			trailers = func() headerList { return trailerList(r.Trailer) }
		}
		x.reqBody = x.startBodyReader(r.Body, bodyLength(r.ProtoMajor, r.ContentLength), trailers, x.shape.Request.Chunks)
	}
	// jwt_authn runs before ext_proc (http_filters order).
	if x.p.jwt != nil && !x.p.jwt.decodeHeaders(x) {
		return
	}
	x.decodeHeaders(!hasBody)
}

// requestHeaders builds the header map the HCM hands to the filters: pseudo-headers, the request
// headers with lower-cased names, x-request-id and x-forwarded-proto
// (ConnectionManagerUtility::mutateRequestHeaders in source/common/http/conn_manager_utility.cc).
// Hop-by-hop headers and Expect: 100-continue are consumed by the codec and HCM.
func (x *exchange) requestHeaders() headerList {
	r := x.r
	x.method = r.Method
	path := r.RequestURI
	if !strings.HasPrefix(path, "/") {
		path = r.URL.RequestURI()
	}
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	h := headerList{
		{name: ":method", value: r.Method},
		{name: ":path", value: path},
		{name: ":authority", value: r.Host},
		{name: ":scheme", value: scheme},
	}
	skip := []string{"host"}
	if strings.EqualFold(r.Header.Get("Expect"), "100-continue") {
		skip = append(skip, "expect")
	}
	h.fromHTTP(r.Header, skip...)
	// An empty x-request-id gets a new one too (1.34's generateRequestId change).
	if id, ok := h.get("x-request-id"); ok && id != "" {
		x.reqID = id
	} else {
		x.reqID = newRequestID()
		h.set("x-request-id", x.reqID)
	}
	if !h.has("x-forwarded-proto") {
		h.add("x-forwarded-proto", scheme)
	}
	x.rec.RequestID, x.rec.Method, x.rec.Path = x.reqID, r.Method, path
	return h
}

// isGrpc is Grpc::Common::isGrpcRequestHeaders, through hasGrpcContentType
// (source/common/grpc/common.cc): content-type exactly application/grpc, or application/grpc+…
// (application/grpc-web and application/grpc;… are not gRPC).
func isGrpc(h headerList) bool {
	ct, _ := h.get("content-type")
	return ct == "application/grpc" || strings.HasPrefix(ct, "application/grpc+")
}

// mergePerRouteConfig is Filter::mergePerRouteConfig: the virtual host's then the route's
// ExtProcPerRoute, merged as FilterConfigPerRoute(less_specific, more_specific) does. disabled
// sets every callback to SKIP; processing_mode replaces the filter-level mode (body modes
// included, which protocol_config then reports); grpc_initial_metadata is merged by key into
// grpc_service.initial_metadata; metadata_options namespaces and failure_mode_allow replace the
// filter's.
func (x *exchange) mergePerRouteConfig() {
	f := x.filter
	mode := f.GetProcessingMode()
	x.fma = f.GetFailureModeAllow()
	x.forwardNS = f.GetMetadataOptions().GetForwardingNamespaces().GetUntyped()
	x.receiveNS = f.GetMetadataOptions().GetReceivingNamespaces().GetUntyped()
	x.initialMD = f.GetGrpcService().GetInitialMetadata()

	var chain []*filterextproc.ExtProcPerRoute
	if v := x.p.cfg.VirtualHostExtProc; v != nil {
		chain = append(chain, v)
	}
	if x.route != nil && x.route.ExtProc != nil {
		chain = append(chain, x.route.ExtProc)
	}
	var (
		disabled bool
		rmode    *filterextproc.ProcessingMode
		md       = x.initialMD
		fwd, rcv *[]string
		fma      *bool
	)
	for _, c := range chain {
		o := c.GetOverrides()
		disabled = c.GetDisabled()
		if disabled {
			rmode = nil
		} else if o.GetProcessingMode() != nil {
			rmode = o.GetProcessingMode()
		}
		for _, hv := range o.GetGrpcInitialMetadata() {
			md = mergeHeaderValue(md, hv)
		}
		if mo := o.GetMetadataOptions(); mo != nil {
			if mo.GetForwardingNamespaces() != nil {
				v := mo.GetForwardingNamespaces().GetUntyped()
				fwd = &v
			}
			if mo.GetReceivingNamespaces() != nil {
				v := mo.GetReceivingNamespaces().GetUntyped()
				rcv = &v
			}
		}
		if b := o.GetFailureModeAllow(); b != nil {
			v := b.GetValue()
			fma = &v
		}
	}
	if disabled {
		mode = &filterextproc.ProcessingMode{
			RequestHeaderMode:  filterextproc.ProcessingMode_SKIP,
			ResponseHeaderMode: filterextproc.ProcessingMode_SKIP,
		}
	} else if rmode != nil {
		mode = rmode
	}
	x.dec.setMode(mode)
	x.enc.setMode(mode)
	if !disabled {
		x.initialMD = md
		if fwd != nil {
			x.forwardNS = *fwd
		}
		if rcv != nil {
			x.receiveNS = *rcv
		}
		if fma != nil {
			x.fma = *fma
		}
	}
}

// decodeHeaders is Filter::decodeHeaders.
func (x *exchange) decodeHeaders(eos bool) {
	s := x.dec
	if s.sendHeaders && x.observability() {
		// sendHeadersInObservabilityMode: send and go.
		if x.openStream(s) == openOK {
			x.sendRequest(x.headerRequest(s, eos, true))
		}
		s.forwardHeaders(eos)
		return
	}
	if eos {
		s.complete = true
	}
	stop := false
	if s.sendHeaders {
		stop = s.onHeaders(eos)
	}
	if !x.processingComplete && s.shouldRemoveContentLength() {
		s.hdrs.del("content-length")
	}
	if !stop && !x.localComplete {
		s.forwardHeaders(eos)
	}
}

// onRequestBody feeds one read of the request body to the decoder filters.
func (x *exchange) onRequestBody(ev bodyEvent) {
	if ev.final() {
		x.reqBody.done = true
	}
	switch {
	case ev.err != nil:
		// The client went away mid-body: Envoy resets the stream; the processor's stream ends.
		x.abandon("downstream_remote_disconnect", "DC")
	case ev.trailers != nil:
		x.dec.onTrailers(ev.trailers)
	default:
		x.dec.onData(ev.data, ev.eos)
	}
}

// drainRequest reads what is left of the request body (bounded), so that the client reads the
// reply rather than a connection reset; net/http cannot read it once the response started.
func (x *exchange) drainRequest() {
	if x.reqBody == nil || x.drained {
		return
	}
	x.drained = true
	n := 0
	for !x.reqBody.done && n < maxDrain {
		select {
		case ev := <-x.reqBody.ch:
			n += len(ev.data)
			if ev.final() {
				x.reqBody.done = true
			}
		case <-x.ctx.Done():
			return
		}
	}
}

// takeReadyRequestData consumes, without waiting, the reads of the request body that already
// happened. Once a local reply went out they are dropped (FilterManager::decodeData returns at
// local_complete_); otherwise they go through the filters.
func (x *exchange) takeReadyRequestData() {
	for !x.reqBody.done {
		select {
		case ev := <-x.reqBody.ch:
			if x.localComplete {
				if ev.final() {
					x.reqBody.done = true
				}
				continue
			}
			x.onRequestBody(ev)
		default:
			return
		}
	}
}

// --- Body reading ---

// bodyEvent is one data callback (or the trailers, or a read error) of a body.
type bodyEvent struct {
	data     []byte
	eos      bool
	trailers headerList
	err      error
}

func (e bodyEvent) final() bool { return e.eos || e.trailers != nil || e.err != nil }

// bodyReader reads a body on its own goroutine, one event per read, as the codec feeds data
// callbacks. The exchange receives from ch only when it wants more data, which is how the
// watermarks stop the reading. done is set by the exchange once the final event arrived.
type bodyReader struct {
	ch   chan bodyEvent
	src  io.ReadCloser
	done bool
}

// startBodyReader reads src (length -1 when unknown) in reads of the given sizes (the last one
// repeats; none: reads of up to DefaultReadSize as data arrives). With a known length the read
// that completes it ends the stream; otherwise, as HTTP/1 chunked encoding does, an empty last
// read ends it, or the trailers do when trailers returns some.
func (x *exchange) startBodyReader(src io.ReadCloser, length int64, trailers func() headerList, sizes []int) *bodyReader {
	b := &bodyReader{ch: make(chan bodyEvent), src: src}
	x.wg.Add(1)
	go func() {
		defer x.wg.Done()
		send := func(ev bodyEvent) bool {
			select {
			case b.ch <- ev:
				return !ev.final()
			case <-x.ctx.Done():
				return false
			}
		}
		var read int64
		for i := 0; ; i++ {
			size := DefaultReadSize
			if len(sizes) > 0 {
				size = sizes[min(i, len(sizes)-1)]
			}
			buf := make([]byte, max(size, 1))
			var n int
			var err error
			if len(sizes) > 0 {
				n, err = readFull(src, buf)
			} else {
				n, err = src.Read(buf)
			}
			read += int64(n)
			eof := errors.Is(err, io.EOF)
			if err != nil && !eof {
				send(bodyEvent{err: err})
				return
			}
			if length >= 0 {
				if read >= length {
					send(bodyEvent{data: buf[:n], eos: true})
					return
				}
				if eof {
					send(bodyEvent{err: io.ErrUnexpectedEOF})
					return
				}
				if n > 0 && !send(bodyEvent{data: buf[:n]}) {
					return
				}
				continue
			}
			if n > 0 && !send(bodyEvent{data: buf[:n]}) {
				return
			}
			if eof {
				if trailers != nil {
					if t := trailers(); len(t) > 0 {
						send(bodyEvent{trailers: t})
						return
					}
				}
				send(bodyEvent{data: []byte{}, eos: true})
				return
			}
		}
	}()
	return b
}

// readFull reads into buf until it is full or src stops. Unlike io.ReadFull it returns src's
// error as is: io.EOF only for a clean end, so that a body cut short (a chunked body without its
// last chunk reads io.ErrUnexpectedEOF) stays an error and is not taken for the body's end.
func readFull(src io.Reader, buf []byte) (int, error) {
	n := 0
	for n < len(buf) {
		m, err := src.Read(buf[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// bodyLength is the length a body reader may count on to end the stream. On HTTP/2 the stream
// ends with END_STREAM, not with content-length: trailers may follow a body of announced length,
// so the reader reads to the end.
func bodyLength(protoMajor int, contentLength int64) int64 {
	if protoMajor == 2 {
		return -1
	}
	return contentLength
}

// trailerList converts the trailers net/http filled in once the body was read to its end; those
// announced but never sent have no value.
func trailerList(t http.Header) headerList {
	var h headerList
	for name, values := range t {
		if len(values) == 0 {
			delete(t, name)
		}
	}
	h.fromHTTP(t)
	return h
}

// --- The router ---

// requestSink continues the request's filter chain into the router.
type requestSink struct{ x *exchange }

func (k requestSink) headers(h headerList, eos bool) { k.x.routerHeaders(h, eos) }

func (k requestSink) data(b []byte, eos bool) {
	x := k.x
	if x.up == nil {
		return
	}
	x.up.body.write(b)
	if eos {
		x.up.body.end(nil)
		x.startRouteTimer()
	}
}

func (k requestSink) trailers(t headerList) {
	x := k.x
	if x.up == nil {
		return
	}
	var tr http.Header
	if x.upstreamTrailers() {
		tr = http.Header{}
		t.writeTo(tr)
	}
	x.up.body.end(tr)
	x.startRouteTimer()
}

// tooLarge is ActiveStreamDecoderFilter::requestDataTooLarge for a buffer that is not streaming:
// 413 with request_payload_too_large.
func (k requestSink) tooLarge() {
	k.x.sendLocalReply(localReply{code: http.StatusRequestEntityTooLarge, body: "Payload Too Large",
		details: "request_payload_too_large", drain: true})
}

// upstreamCall is the router's upstream request.
type upstreamCall struct {
	// req is the request as first sent, which a retry sends again; whole and trailers are the
	// body and trailers a retry sent (the first attempt streams body instead).
	req      *http.Request
	whole    []byte
	trailers http.Header
	ctx      context.Context
	stop     context.CancelCauseFunc
	body     *upstreamBody
	result   chan upstreamResult
	start    time.Time
}

// cancel resets the upstream request; the body is closed too, since the transport may be
// blocked reading it.
func (uc *upstreamCall) cancel(cause ...error) {
	err := context.Canceled
	if len(cause) > 0 {
		err = cause[0]
	}
	uc.stop(err)
	if uc.body != nil {
		_ = uc.body.Close()
	}
}

type upstreamResult struct {
	resp *http.Response
	err  error
	from *upstreamCall // the attempt that produced it
}

// routerHeaders is Router::Filter::decodeHeaders: a request no route matches gets 404
// route_not_found (NR); otherwise the attempt count becomes 1 (set before the connection pool is
// asked for a connection, so a connection failure counts as an attempt) and the request goes
// upstream with the (mutated) headers, Host from :authority, and
// x-envoy-expected-rq-timeout-ms.
func (x *exchange) routerHeaders(h headerList, eos bool) {
	if x.localComplete {
		return
	}
	if x.route == nil {
		x.sendLocalReply(localReply{code: http.StatusNotFound, details: "route_not_found", flags: "NR", flagBits: flagNoRouteFound})
		return
	}
	x.attempts = 1
	path, _ := h.get(":path")
	u, err := url.ParseRequestURI(path)
	if err != nil {
		x.sendLocalReply(localReply{code: http.StatusBadRequest, body: "Bad Request", details: "invalid_path"})
		return
	}
	u.Scheme, u.Host = x.p.upstream.Scheme, x.p.upstream.Host
	ctx, cancel := context.WithCancelCause(x.ctx)
	uc := &upstreamCall{ctx: ctx, stop: cancel, result: make(chan upstreamResult, x.attemptSlots()), start: time.Now()}
	method, _ := h.get(":method")
	req, err := http.NewRequestWithContext(ctx, method, u.String(), nil)
	if err != nil {
		cancel(err)
		x.sendLocalReply(localReply{code: http.StatusBadRequest, body: "Bad Request", details: "invalid_path"})
		return
	}
	req.Host, _ = h.get(":authority")
	h.writeTo(req.Header, "content-length")
	if x.routeTO > 0 {
		req.Header.Set("X-Envoy-Expected-Rq-Timeout-Ms", strconv.FormatInt(x.routeTO.Milliseconds(), 10))
	}
	if tp := x.trace.parent(); tp != "" {
		req.Header.Set("Traceparent", tp)
	}
	if _, ok := req.Header["User-Agent"]; !ok {
		req.Header["User-Agent"] = []string{""} // no Go default user agent
	}
	switch {
	case eos:
		req.Body, req.ContentLength = http.NoBody, 0
	default:
		uc.body = newUpstreamBody()
		req.Body, req.ContentLength = uc.body, -1
		if v, ok := h.get("content-length"); ok {
			if n, err := strconv.ParseInt(v, 10, 64); err == nil {
				req.ContentLength = n
			}
		}
		if req.ContentLength < 0 && x.upstreamTrailers() {
			req.Trailer = http.Header{}
			uc.body.reqTrailer = req.Trailer
		}
	}
	uc.req = req
	x.up = uc
	x.roundTrip(uc, req)
	if eos {
		x.startRouteTimer()
	}
}

func (x *exchange) roundTrip(uc *upstreamCall, req *http.Request) {
	x.wg.Add(1)
	go func() {
		defer x.wg.Done()
		resp, err := x.p.transport.RoundTrip(req)
		uc.result <- upstreamResult{resp: resp, err: err, from: uc}
	}()
}

// retry is the router's retry on the upstream's headers (router.cc Filter::onUpstreamHeaders,
// which asks RetryStateImpl::shouldRetryHeaders; its conditions are
// RetryStateImpl::wouldRetryFromHeaders in source/common/router/retry_state_impl.cc): when the
// route's retry_policy retries status and attempts are left, the response is dropped and the
// request is sent upstream again, after ext_proc, which sees nothing of it but the attempt
// count. The router buffers the request body for retries and sends it again with the request's
// trailers (Router::Filter::doRetry in source/common/router/router.cc); the proxy retries only
// once the whole body reached it. It reports whether it retried.
func (x *exchange) retry(status int, h http.Header) bool {
	if x.route == nil || x.route.Retry == nil || x.up == nil || x.up.req == nil {
		return false
	}
	rp := x.route.Retry
	retries := uint32(1) // RetryPolicy.num_retries' default
	if n := rp.GetNumRetries(); n != nil {
		retries = n.GetValue()
	}
	if uint32(x.attempts) > retries || !wouldRetryStatus(rp, status) && !wouldRetryGRPC(rp, h) {
		return false
	}
	body, trailers := x.up.whole, x.up.trailers
	if b := x.up.body; b != nil {
		whole, done := b.sentBody()
		if !done {
			return false
		}
		body, trailers = whole, b.sentTrailers()
	}
	x.attempts++
	ctx, cancel := context.WithCancelCause(x.ctx)
	uc := &upstreamCall{ctx: ctx, stop: cancel, result: make(chan upstreamResult, 1), start: time.Now()}
	req := x.up.req.Clone(ctx)
	req.Body, req.ContentLength = http.NoBody, 0
	if len(body) > 0 {
		req.Body, req.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
	}
	if len(trailers) > 0 {
		// Unknown length: chunked, so that the trailers follow the body.
		req.Body, req.ContentLength = io.NopCloser(bytes.NewReader(body)), -1
		req.Trailer = trailers.Clone()
	}
	uc.req, uc.whole, uc.trailers = req, body, trailers
	x.up = uc
	x.roundTrip(uc, req)
	x.startPerTry()
	return true
}

// wouldRetryStatus reports whether rp's retry_on retries a response of status
// (RetryStateImpl::wouldRetryFromHeaders).
func wouldRetryStatus(rp *routev3.RetryPolicy, status int) bool {
	for _, c := range strings.Split(rp.GetRetryOn(), ",") {
		switch strings.TrimSpace(c) {
		case "5xx":
			if status >= 500 {
				return true
			}
		case "gateway-error":
			if status == 502 || status == 503 || status == 504 {
				return true
			}
		case "retriable-4xx":
			if status == 409 {
				return true
			}
		case "retriable-status-codes":
			if slices.Contains(rp.GetRetriableStatusCodes(), uint32(status)) {
				return true
			}
		}
	}
	return false
}

// grpcRetryOn are the retry_on conditions on a gRPC status, by the grpc-status they retry
// (RetryPolicy::RETRY_ON_GRPC_* in source/common/router/retry_state_impl.cc).
var grpcRetryOn = map[string]string{
	"cancelled": "1", "deadline-exceeded": "4", "resource-exhausted": "8", "internal": "13", "unavailable": "14",
}

// wouldRetryGRPC reports whether rp's retry_on retries a response whose headers carry h's
// grpc-status: RetryStateImpl::wouldRetryFromHeaders reads it from the response headers only
// (Grpc::Common::getGrpcStatus in source/common/grpc/common.cc), so only a trailers-only gRPC
// response is retried, as an upstream sends for a call that fails before its message.
func wouldRetryGRPC(rp *routev3.RetryPolicy, h http.Header) bool {
	status := h.Get("grpc-status")
	if status == "" {
		return false
	}
	for _, c := range strings.Split(rp.GetRetryOn(), ",") {
		if code, ok := grpcRetryOn[strings.TrimSpace(c)]; ok && code == status {
			return true
		}
	}
	return false
}

// startRouteTimer starts the route timeout once the whole request reached the router
// (Router::Filter::onRequestComplete), and the attempt's per-try timer on a route that hedges.
func (x *exchange) startRouteTimer() {
	x.startPerTry()
	if x.routeTO > 0 && !x.localComplete && (x.respBody == nil || !x.respBody.done) {
		x.routeDL = time.Now().Add(x.routeTO)
	}
}

// onRouteTimeout is Router::Filter::onResponseTimeout: 504 before the upstream's headers, a
// reset once they reached the filter chain.
func (x *exchange) onRouteTimeout() {
	if x.up != nil {
		x.up.cancel(errRouteTimeout)
		x.cancelOtherAttempts()
	}
	if x.res == nil {
		x.sendLocalReply(localReply{code: http.StatusGatewayTimeout, body: "upstream request timeout",
			details: "upstream_response_timeout", flags: "UT", flagBits: flagUpstreamRequestTimeout})
		return
	}
	x.reset("upstream_response_timeout", "UT")
}

// onUpstream handles the outcome of the upstream round trip.
func (x *exchange) onUpstream(res upstreamResult) {
	if !x.pickAttempt(res) {
		return
	}
	if res.err != nil {
		if res.resp != nil {
			_ = res.resp.Body.Close()
		}
		x.routerFailure(res.err)
		return
	}
	resp := res.resp
	if x.retry(resp.StatusCode, resp.Header) {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		_ = resp.Body.Close()
		return
	}
	h := headerList{{name: ":status", value: strconv.Itoa(resp.StatusCode)}}
	h.fromHTTP(resp.Header)
	// The router adds x-envoy-upstream-service-time before the filters see the headers
	// (Router::Filter::onUpstreamHeaders in source/common/router/router.cc).
	h.add("x-envoy-upstream-service-time", strconv.FormatInt(time.Since(x.up.start).Milliseconds(), 10))
	r := &response{status: resp.StatusCode, headers: h, details: "via_upstream", flagStr: "-"}
	noBody := x.head || resp.StatusCode == http.StatusNoContent || resp.StatusCode == http.StatusNotModified ||
		resp.ContentLength == 0 || resp.Body == http.NoBody
	if noBody {
		_ = resp.Body.Close()
		x.routeDL = time.Time{}
	} else {
		var trailers func() headerList
		if x.upstreamTrailers() {
			trailers = func() headerList { return trailerList(resp.Trailer) }
		}
		x.respBody = x.startBodyReader(resp.Body, bodyLength(resp.ProtoMajor, resp.ContentLength), trailers, x.shape.Response.Chunks)
	}
	r.noBody = noBody
	x.rec.CodeDetails, x.rec.ResponseFlags = "via_upstream", "-"
	x.encodeResponse(r)
}

// routerFailure maps a failed round trip to the router's local reply, as
// router.cc Filter::onUpstreamReset builds it: the reset reason, and the transport's failure
// reason after it when there is one, in the body and, spaces made underscores, in the details.
// For a refused connection on Linux that reason is "delayed connect error: Connection refused":
// source/common/network/connection_impl.cc ConnectionImpl::onWriteReady sets it from the
// socket's SO_ERROR, as Envoy's 503 bodies in the field read ("... transport failure reason:
// delayed connect error: Connection refused").
func (x *exchange) routerFailure(err error) {
	switch {
	case errors.Is(context.Cause(x.up.ctx), errRouteTimeout):
		// onRouteTimeout already replied.
	case x.ctx.Err() != nil:
		x.abandon("downstream_remote_disconnect", "DC")
	case isConnectFailure(err):
		body, details := "upstream connect error or disconnect/reset before headers. reset reason: remote connection failure",
			"upstream_reset_before_response_started{remote_connection_failure}"
		if errors.Is(err, syscall.ECONNREFUSED) {
			body += ", transport failure reason: delayed connect error: Connection refused"
			details = "upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}"
		}
		x.sendLocalReply(localReply{code: http.StatusServiceUnavailable, body: body, details: details,
			flags: "UF", flagBits: flagUpstreamConnectionFailure})
	default:
		x.sendLocalReply(localReply{code: http.StatusServiceUnavailable,
			body:    "upstream connect error or disconnect/reset before headers. reset reason: connection termination",
			details: "upstream_reset_before_response_started{connection_termination}", flags: "UC", flagBits: flagUpstreamConnectionTermination})
	}
}

func isConnectFailure(err error) bool {
	var op *net.OpError
	return errors.Is(err, syscall.ECONNREFUSED) || (errors.As(err, &op) && op.Op == "dial")
}

// upstreamBody is the request body the router streams upstream: the exchange writes to it
// without blocking, the transport reads it. Request trailers are copied into the request's
// Trailer map by the transport's own goroutine, on the read that returns io.EOF.
type upstreamBody struct {
	mu         sync.Mutex
	cond       *sync.Cond
	chunks     [][]byte
	sent       []byte // every byte written, for the router's retries
	eof        bool
	closed     bool
	trailers   http.Header
	reqTrailer http.Header
}

func newUpstreamBody() *upstreamBody {
	b := &upstreamBody{}
	b.cond = sync.NewCond(&b.mu)
	return b
}

func (b *upstreamBody) write(p []byte) {
	if len(p) == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.eof || b.closed {
		return
	}
	b.chunks = append(b.chunks, p)
	b.sent = append(b.sent, p...)
	b.cond.Broadcast()
}

// sentBody returns every byte written, and whether the body ended.
func (b *upstreamBody) sentBody() ([]byte, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.sent), b.eof
}

// sentTrailers returns the trailers the body ended with (nil when none went upstream).
func (b *upstreamBody) sentTrailers() http.Header {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.trailers.Clone()
}

func (b *upstreamBody) end(trailers http.Header) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.eof = true
	b.trailers = trailers
	b.cond.Broadcast()
}

func (b *upstreamBody) Read(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for len(b.chunks) == 0 && !b.eof && !b.closed {
		b.cond.Wait()
	}
	if b.closed {
		return 0, io.ErrClosedPipe
	}
	if len(b.chunks) > 0 {
		n := copy(p, b.chunks[0])
		if n == len(b.chunks[0]) {
			b.chunks = b.chunks[1:]
		} else {
			b.chunks[0] = b.chunks[0][n:]
		}
		return n, nil
	}
	if b.reqTrailer != nil {
		for k, v := range b.trailers {
			b.reqTrailer[k] = v
		}
	}
	return 0, io.EOF
}

func (b *upstreamBody) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed = true
	b.cond.Broadcast()
	return nil
}

// newRequestID returns a random UUID v4, like the HCM's x-request-id.
func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

func parseUint(s string) (uint64, error) { return strconv.ParseUint(s, 10, 64) }
