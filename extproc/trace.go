package extproc

import (
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/metadata"
)

// Tracing: one span per covered request, a child of the trace context Envoy sends in
// the stream's gRPC initial metadata (W3C traceparent), with one child span per store call. With
// no tracer nothing here runs: a stream's span is nil, and the callers check for it.

// The span attributes. The raw key never is one: key_hash is the hash the record is stored under.
const (
	attrTraceRoute         = attribute.Key("idempotency.route")
	attrTraceOutcome       = attribute.Key("idempotency.outcome")
	attrTraceKeyHash       = attribute.Key("idempotency.key_hash")
	attrTraceReleaseReason = attribute.Key("idempotency.release_reason")
	attrTraceMethod        = attribute.Key("http.request.method")
	attrTraceStatus        = attribute.Key("http.response.status_code")
)

// traceContext is the W3C Trace Context propagator Envoy's tracers write (traceparent,
// tracestate).
var traceContext = propagation.TraceContext{}

// metadataCarrier reads a propagator's fields from gRPC metadata.
type metadataCarrier metadata.MD

func (c metadataCarrier) Get(key string) string {
	if v := metadata.MD(c).Get(key); len(v) > 0 {
		return v[0]
	}
	return ""
}

func (c metadataCarrier) Set(key, value string) { metadata.MD(c).Set(key, value) }

func (c metadataCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// beginSpan starts the request's span, once it is known to be covered; its callers skip it
// without a tracer. Its context becomes the context of the request's store calls, whose spans are
// its children.
func (st *stream) beginSpan() {
	a, c := st.req, st.call
	if a.span != nil {
		return
	}
	ctx := c.ctx
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		ctx = traceContext.Extract(ctx, metadataCarrier(md))
	}
	c.ctx, a.span = st.s.tracer.Start(ctx, "idempotency.request",
		trace.WithSpanKind(trace.SpanKindServer),
		trace.WithAttributes(attrTraceRoute.String(a.route.Name), attrTraceMethod.String(string(a.info.method))))
}

// endSpan ends the request's span with its outcome; its caller skips it when there is none.
func (st *stream) endSpan() {
	sp, c := st.req.span, st.call
	attrs := []attribute.KeyValue{attrTraceOutcome.String(string(st.outcome))}
	if c.keyHash != "" {
		attrs = append(attrs, attrTraceKeyHash.String(c.keyHash))
	}
	if c.resp.Status != 0 {
		attrs = append(attrs, attrTraceStatus.Int(c.resp.Status))
	}
	if reason := c.released(); reason != "" {
		attrs = append(attrs, attrTraceReleaseReason.String(reason))
	}
	sp.SetAttributes(attrs...)
	if st.outcome == StoreError {
		sp.SetStatus(codes.Error, "store operation failed")
	}
	sp.End()
}

var _ propagation.TextMapCarrier = metadataCarrier(nil)
