package main

import (
	"context"
	"encoding/hex"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracev1 "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

// receiver is an in-process OTLP trace collector.
type receiver struct {
	collectortrace.UnimplementedTraceServiceServer
	mu    sync.Mutex
	spans []*tracev1.Span
}

func (r *receiver) Export(_ context.Context, req *collectortrace.ExportTraceServiceRequest) (*collectortrace.ExportTraceServiceResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			r.spans = append(r.spans, ss.GetSpans()...)
		}
	}
	return &collectortrace.ExportTraceServiceResponse{}, nil
}

func (r *receiver) all() []*tracev1.Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*tracev1.Span(nil), r.spans...)
}

func startReceiver(t *testing.T) (*receiver, string) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	r := &receiver{}
	gs := grpc.NewServer()
	collectortrace.RegisterTraceServiceServer(gs, r)
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)
	return r, lis.Addr().String()
}

func attrs(s *tracev1.Span) map[string]string {
	m := map[string]string{}
	for _, kv := range s.GetAttributes() {
		v := kv.GetValue()
		switch {
		case v.GetStringValue() != "":
			m[kv.GetKey()] = v.GetStringValue()
		default:
			m[kv.GetKey()] = v.String()
		}
	}
	return m
}

// With the SDK's environment set, each covered request is one span, a child of the trace context
// Envoy sent in the stream's initial metadata, with its route, outcome and key_hash, and one child
// span per store call; no attribute holds the raw key.
func TestTracingExportsOneSpanPerCoveredRequest(t *testing.T) {
	rcv, addr := startReceiver(t)
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://"+addr)
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
	t.Setenv("OTEL_SERVICE_NAME", "idem-test")
	t.Setenv("OTEL_TRACES_SAMPLER", "parentbased_always_on")
	mr := miniredis.RunT(t)
	logs := newLogLines()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	done := make(chan error, 1)
	args := []string{"--store", "redis", "--redis-url", "redis://" + mr.Addr() + "/0", "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"}
	go func() { done <- runWith(ctx, args, os.Getenv, logs, runOptions{}) }()
	ready := logs.wait(t, "ready", 10*time.Second)

	const rawKey = "raw-key-4f1c-never-exported"
	traceID, parentID := "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	sctx := metadata.AppendToOutgoingContext(t.Context(), "traceparent", "00-"+traceID+"-"+parentID+"-01")
	s, err := extprocv3.NewExternalProcessorClient(dial(t, ready["grpc_addr"].(string))).Process(sctx)
	require.NoError(t, err)
	require.NoError(t, s.Send(bodilessPost(rawKey)))
	_, err = s.Recv()
	require.NoError(t, err)
	require.NoError(t, s.Send(created()))
	_, err = s.Recv()
	require.NoError(t, err)
	_ = s.CloseSend()
	// An uncovered request makes no span.
	u, err := extprocv3.NewExternalProcessorClient(dial(t, ready["grpc_addr"].(string))).Process(sctx)
	require.NoError(t, err)
	get := bodilessPost("")
	get.GetRequestHeaders().Headers.Headers = get.GetRequestHeaders().Headers.Headers[:2]
	get.GetRequestHeaders().Headers.Headers[0].RawValue = []byte("GET")
	require.NoError(t, u.Send(get))
	_, err = u.Recv()
	require.NoError(t, err)
	_ = u.CloseSend()
	cancel()
	require.NoError(t, <-done) // shutdown flushes the buffered spans

	spans := rcv.all()
	var request *tracev1.Span
	byName := map[string]*tracev1.Span{}
	for _, sp := range spans {
		byName[sp.GetName()] = sp
		for k, v := range attrs(sp) {
			require.NotContains(t, v, rawKey, "attribute %s of %s", k, sp.GetName())
		}
	}
	request = byName["idempotency.request"]
	require.NotNil(t, request, "spans: %v", spans)
	require.Len(t, spans, 3, "the covered request and its two store calls, nothing for the uncovered one")
	require.Equal(t, traceID, hex.EncodeToString(request.GetTraceId()))
	require.Equal(t, parentID, hex.EncodeToString(request.GetParentSpanId()), "a child of Envoy's span")
	a := attrs(request)
	require.Equal(t, "default", a["idempotency.route"])
	require.Equal(t, "executed", a["idempotency.outcome"])
	require.Len(t, a["idempotency.key_hash"], 64)
	for _, op := range []string{"acquire", "complete"} {
		sp := byName["idempotency.store."+op]
		require.NotNil(t, sp, op)
		require.Equal(t, request.GetSpanId(), sp.GetParentSpanId(), "%s is a child of the request's span", op)
	}
	require.False(t, strings.Contains(logs.String(), rawKey))
}

// Without the SDK's environment no tracer runs.
func TestTracingOffWithoutAnEndpoint(t *testing.T) {
	tracer, shutdown, err := openTracing(t.Context(), env(nil))
	require.NoError(t, err)
	require.Nil(t, tracer)
	require.NoError(t, shutdown(t.Context()))
	_, _, err = openTracing(t.Context(), env(map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}))
	require.ErrorContains(t, err, `OTEL_EXPORTER_OTLP_PROTOCOL is "http/json"`)
	tracer, _, err = openTracing(t.Context(), env(map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SDK_DISABLED": "true"}))
	require.NoError(t, err)
	require.Nil(t, tracer)
}
