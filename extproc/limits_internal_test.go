package extproc

import (
	"context"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/tap"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
)

// What the first-message deadline costs a stream: the tap's context and timer as a stream opens,
// and stopping the timer at its first message. No goroutine is started.
func BenchmarkFirstMessageTimer(b *testing.B) {
	s := benchServer(b)
	handle, info := s.TapHandle(), &tap.Info{FullMethodName: processMethod}
	b.ReportAllocs()
	for b.Loop() {
		ctx, err := handle(context.Background(), info)
		if err != nil {
			b.Fatal(err)
		}
		if err := ctx.Value(firstMessageKey{}).(*firstMessageContext).arrived(); err != nil {
			b.Fatal(err)
		}
	}
}

// What a new stream costs with the route its metadata names read, when it names none (the
// common case): from the tap's context, where TapHandle read it, and from the stream's context,
// as a server without the tap reads it. The metadata is what grpc-go's transport gives a stream
// of Envoy's ext_proc client (its gRPC headers, not the HTTP request's).
func BenchmarkNamedRoute(b *testing.B) {
	s := benchServer(b)
	md := metadata.Pairs(":authority", "idempotency-extproc", "content-type", "application/grpc",
		"user-agent", "envoy/1.36.0", "x-envoy-internal", "true", "x-forwarded-for", "10.0.0.1",
		"x-request-id", "6f1c2b1e-9a4d-4c1e-8b1a-100000000001", "x-envoy-expected-rq-timeout-ms", "200")
	parent, cancel := context.WithCancel(context.Background())
	defer cancel()
	handle := s.TapHandle()
	ctx, err := handle(metadata.NewIncomingContext(parent, md), &tap.Info{FullMethodName: processMethod, Header: md})
	if err != nil {
		b.Fatal(err)
	}
	first := ctx.Value(firstMessageKey{}).(*firstMessageContext)
	defer first.arrived()
	// grpc-go's server stream wraps the tap's context once more.
	ctx = grpc.NewContextWithServerTransportStream(ctx, nil)
	for _, tc := range []struct {
		name   string
		tapped *firstMessageContext
	}{{"context", nil}, {"tap", first}} {
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if newStream(s, ctx, tc.tapped).req.named != "" {
					b.Fatal("no route is named")
				}
			}
		})
	}
}

// benchServer is a Server on a memory store of its own, closed when b ends.
func benchServer(b *testing.B) *Server {
	store, err := cache.NewMemory(cache.MemoryOptions{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = store.Close() })
	s, err := NewServer(Options{Store: store})
	if err != nil {
		b.Fatal(err)
	}
	return s
}
