package proxy

import (
	"crypto/rand"
	"encoding/hex"
	"strings"
)

// traceContext is the request's span under the OpenTelemetry tracer: the connection manager
// starts it as a child of an incoming W3C traceparent (or a new trace), the router propagates
// it upstream, and the ext_proc stream gets a child of it. Envoy's
// Grpc::AsyncStreamImpl constructor spawns that child from the stream options' parent span
// (ext_proc.cc Filter::openStream passes decoder_callbacks_->activeSpan()), and
// AsyncStreamImpl::initialize injects it into the stream's initial metadata; the
// OpenTelemetry tracer's injectContext writes traceparent (and tracestate). Without tracing the
// active span is a NullSpan and nothing is injected.
type traceContext struct {
	on      bool
	traceID string // 32 hex digits
	spanID  string // the request's span, 16 hex digits
	flags   string // "01" sampled, "00" not
	state   string // tracestate, passed on
}

func newTrace(t *Tracing, h headerList) traceContext {
	if t == nil {
		return traceContext{}
	}
	tc := traceContext{on: true, spanID: randomHex(8), flags: "01"}
	if t.Unsampled {
		tc.flags = "00"
	}
	if tp, ok := h.get("traceparent"); ok {
		if id, flags, ok := parseTraceparent(tp); ok {
			tc.traceID, tc.flags = id, flags
			tc.state, _ = h.get("tracestate")
		}
	}
	if tc.traceID == "" {
		tc.traceID = randomHex(16)
	}
	return tc
}

// parseTraceparent reads version-00 traceparent values: 00-<trace-id>-<parent-id>-<flags>, lower
// hex, ids not all zero.
func parseTraceparent(v string) (traceID, flags string, ok bool) {
	p := strings.Split(strings.TrimSpace(v), "-")
	if len(p) != 4 || p[0] != "00" || len(p[1]) != 32 || len(p[2]) != 16 || len(p[3]) != 2 {
		return "", "", false
	}
	for _, s := range p[1:] {
		if _, err := hex.DecodeString(s); err != nil || strings.ToLower(s) != s {
			return "", "", false
		}
	}
	if strings.Trim(p[1], "0") == "" || strings.Trim(p[2], "0") == "" {
		return "", "", false
	}
	return p[1], p[3], true
}

// parent is the traceparent of the request's span ("" without tracing).
func (t traceContext) parent() string {
	if !t.on {
		return ""
	}
	return "00-" + t.traceID + "-" + t.spanID + "-" + t.flags
}

// child is the traceparent of a new child span of the request's span ("" without tracing).
func (t traceContext) child() string {
	if !t.on {
		return ""
	}
	return "00-" + t.traceID + "-" + randomHex(8) + "-" + t.flags
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
