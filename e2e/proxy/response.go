package proxy

import (
	"net/http"
	"strconv"
	"time"
)

// response is what the router (or a local reply) hands to the encoder filters.
type response struct {
	status  int
	headers headerList // starts with :status
	noBody  bool
	// local marks a local reply; localBody is its body, sent as one data callback after the
	// headers (Utility::encodeLocalReply).
	local     bool
	localBody []byte
	details   string
	flagStr   string
	flags     uint64
}

// encodeResponse is Filter::encodeHeaders (then, for a local reply, its one data callback).
func (x *exchange) encodeResponse(res *response) {
	x.res = res
	s := x.enc
	s.hdrs = res.headers
	eos := res.noBody || (res.local && len(res.localBody) == 0)
	if s.sendHeaders && x.observability() {
		if x.openStream(s) == openOK {
			x.sendRequest(x.headerRequest(s, eos, true))
		}
		s.forwardHeaders(eos)
	} else {
		if eos {
			s.complete = true
		}
		stop := false
		if !x.processingComplete && s.sendHeaders {
			stop = s.onHeaders(eos)
		}
		if !x.processingComplete && s.shouldRemoveContentLength() {
			s.hdrs.del("content-length")
		}
		// Nothing to process on the response path: the stream closes (1.37). Envoy 1.37.0 closes
		// it even while the request direction still waits for answers, which later releases fix
		// (envoyproxy/envoy#45617, #46836); the proxy closes only when the request direction is
		// done.
		if s.noExternalProcess() && !x.p.cfg.Envoy.NoStreamCloseOptimization && x.side != nil && !x.side.closed &&
			x.dec.cb == cbIdle && (x.dec.ended || x.localComplete) {
			x.p.stats.streamsClosedEarly.Add(1)
			x.closeStream()
		}
		if !stop && !x.finished {
			s.forwardHeaders(eos)
		}
	}
	if res.local && len(res.localBody) > 0 && !x.finished {
		s.onData(res.localBody, true)
	}
}

// onResponseBody feeds one read of the upstream response body to the encoder filters.
func (x *exchange) onResponseBody(ev bodyEvent) {
	if ev.final() {
		x.respBody.done = true
		if ev.err == nil {
			// Router::Filter::onUpstreamComplete: the route timeout ends.
			x.routeDL = time.Time{}
		}
	}
	switch {
	case ev.err != nil:
		// The headers reached the filter chain: Envoy resets the downstream stream
		// (Router::Filter::onUpstreamReset with downstream_response_started_).
		x.reset("upstream_reset_after_response_started{connection_termination}", "UR")
	case ev.trailers != nil:
		x.enc.onTrailers(ev.trailers)
	default:
		x.enc.onData(ev.data, ev.eos)
	}
}

// responseSink continues the response's filter chain into the downstream codec.
type responseSink struct{ x *exchange }

func (k responseSink) headers(h headerList, eos bool) {
	x := k.x
	x.writeHeaders(h, eos)
	if eos || x.head {
		x.flushEnd()
		x.finished = true
	}
}

func (k responseSink) data(b []byte, eos bool) {
	x := k.x
	if x.finished {
		return
	}
	if len(b) > 0 && !x.head {
		if _, err := x.w.Write(b); err != nil {
			x.abandon("downstream_remote_disconnect", "DC")
			return
		}
	}
	x.flush()
	if eos {
		x.finished = true
	}
}

func (k responseSink) trailers(t headerList) {
	x := k.x
	if x.finished {
		return
	}
	if x.downstreamTrailers() {
		for _, f := range t {
			x.w.Header().Add(http.TrailerPrefix+f.name, f.value)
		}
	}
	x.finished = true
}

// tooLarge is ActiveStreamEncoderFilter::responseDataTooLarge
// (source/common/http/filter_manager.cc) for a buffer that is not streaming: 500
// response_payload_too_large straight to the codec, or a reset once headers went downstream. The
// processor never gets the body.
func (k responseSink) tooLarge() {
	k.x.sendLocalReply(localReply{code: http.StatusInternalServerError, body: "Internal Server Error",
		details: "response_payload_too_large"})
}

// writeDirect is DownstreamFilterManager::sendDirectLocalReply: the reply bypasses the filters.
func (x *exchange) writeDirect(prep preparedReply, lr localReply) {
	x.rec.CodeDetails, x.rec.ResponseFlags = lr.details, lr.flags
	if lr.drain {
		x.drainRequest()
	}
	x.writeHeaders(prep.headers, prep.headersOnly || len(prep.body) == 0)
	if !prep.headersOnly && len(prep.body) > 0 {
		_, _ = x.w.Write(prep.body)
	}
	x.flushEnd()
	x.finished = true
}

// writeHeaders sends the response headers downstream, with the connection manager's
// server_header_transformation (OVERWRITE: server: envoy). When the headers end the stream the
// HTTP/1 codec adds content-length: 0 unless the status forbids a body
// (Http1::StreamEncoderImpl::encodeHeadersBase): after the filters, so the processor never sees it.
// That content-length is the HTTP/1 codec's alone, as is closing the connection: an HTTP/2
// stream gets neither, and headers that end it carry no content-length unless they have one.
func (x *exchange) writeHeaders(h headerList, eos bool) {
	if x.wroteHeader {
		return
	}
	s, _ := h.get(":status")
	code, err := strconv.Atoi(s)
	if err != nil || code < 200 || code > 999 {
		code = http.StatusInternalServerError
	}
	dst := x.w.Header()
	h.writeTo(dst)
	if eos && !x.h2 && !h.has("content-length") && !x.head && code != http.StatusNoContent && code != http.StatusNotModified {
		dst.Set("Content-Length", "0")
	}
	if eos && x.h2 && !h.has("content-length") {
		// Go's HTTP/2 server adds content-length: 0 to a handler that ends at its headers; Envoy's
		// HTTP/2 codec adds none, and a trailers-only gRPC reply has none
		// (Utility::prepareLocalReply removes it). A nil value suppresses Go's.
		dst["Content-Length"] = nil
	}
	if _, ok := dst["Content-Type"]; !ok {
		dst["Content-Type"] = nil // no content sniffing: Envoy adds no content-type
	}
	dst.Set("Server", "envoy")
	if x.reqBody != nil && !x.reqBody.done && !x.h2 {
		// A response that starts before the request ended closes the HTTP/1 connection
		// (ConnectionManagerImpl::ActiveStream::encodeHeaders). What the codec already read
		// counts as read.
		x.takeReadyRequestData()
		if !x.reqBody.done {
			dst.Set("Connection", "close")
		}
	}
	x.w.WriteHeader(code)
	x.wroteHeader = true
	x.rec.Status = code
}

func (x *exchange) flush() { _ = x.rc.Flush() }

// flushEnd flushes what ends the response. On HTTP/2 nothing is flushed: ServeHTTP returning
// ends the stream, so headers that end it go out as one HEADERS frame with END_STREAM (a
// trailers-only gRPC response), as Envoy's HTTP/2 codec sends them, not as HEADERS then an
// empty DATA frame.
func (x *exchange) flushEnd() {
	if !x.h2 {
		x.flush()
	}
}

// downstreamTrailers reports whether trailers pass on the downstream stream: on HTTP/2 always,
// on HTTP/1 with the connection manager's enable_trailers (Http1Settings::enable_trailers_,
// read by the HTTP/1 codec only).
func (x *exchange) downstreamTrailers() bool { return x.h2 || x.p.cfg.DownstreamTrailers }

// upstreamTrailers is the same for the upstream cluster's codec.
func (x *exchange) upstreamTrailers() bool { return x.p.cfg.UpstreamHTTP2 || x.p.cfg.UpstreamTrailers }
