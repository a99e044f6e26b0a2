package e2e_test

import (
	"context"
	"errors"
	"io"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// firstMessageTimeout is how long the binary lets a stream stay open without its first message
// (extproc.DefaultFirstMessageTimeout, which it does not let a flag change).
const firstMessageTimeout = 10 * time.Second

// dialProcessor opens a gRPC connection to the processor's ext_proc port.
func dialProcessor(t *testing.T, p *processor) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+p.grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// processorMetric reads one series from the processor's /metrics.
func processorMetric(t *testing.T, p *processor, series string) float64 {
	t.Helper()
	code, body := p.admin("/metrics")
	require.Equal(t, 200, code)
	return metric(body, series)
}

// getHeaders is the first message of a GET no route covers: the processor answers it and keeps
// the stream open for the response's.
func getHeaders() *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
			{Key: ":method", RawValue: []byte("GET")},
			{Key: ":path", RawValue: []byte("/v1/things")},
			{Key: ":authority", RawValue: []byte("example.com")},
		}},
		EndOfStream: true,
	}}}
}

// Streams that never send a message (3,000 of them, over four connections) are each ended with
// DEADLINE_EXCEEDED once the first-message timeout has passed, and before twice that; each is
// counted, the goroutines they held are gone once their connections close, and requests through
// Envoy still run. The test logs what an idle stream costs the process (docs/operating.md).
func TestIdleStreamsAreEnded(t *testing.T) {
	const streams, conns = 3000, 4
	s := newStack(t, stackOptions{})
	p := s.procs[0]
	require.Equal(t, 200, s.do(call{key: "before-idle"}).status)
	baseGoroutines := processorMetric(t, p, "go_goroutines")
	baseRSS := processorMetric(t, p, "process_resident_memory_bytes")

	type ended struct {
		code  codes.Code
		after time.Duration // since the client opened the stream
	}
	results := make([]ended, streams)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var clients []extprocv3.ExternalProcessorClient
	var connections []*grpc.ClientConn
	for range conns {
		c := dialProcessor(t, p)
		connections = append(connections, c)
		clients = append(clients, extprocv3.NewExternalProcessorClient(c))
	}
	first := time.Now()
	var wg sync.WaitGroup
	for i := range streams {
		opened := time.Now()
		stream, err := clients[i%conns].Process(ctx)
		require.NoError(t, err)
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := stream.Recv()
			results[i] = ended{status.Code(err), time.Since(opened)}
		}()
	}
	within(t, first, firstMessageTimeout*9/10, "every stream open on the processor", func() bool {
		return processorMetric(t, p, "idempotency_streams") == streams
	})
	held := processorMetric(t, p, "process_resident_memory_bytes") - baseRSS
	goroutines := processorMetric(t, p, "go_goroutines") - baseGoroutines
	t.Logf("%d idle streams: +%.0f goroutines, +%.1f MiB resident (%.1f KiB a stream)", streams, goroutines, held/(1<<20), held/streams/1024)

	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(2*firstMessageTimeout - time.Since(first)):
		t.Fatalf("idle streams still open %v after the first was opened", 2*firstMessageTimeout)
	}
	for i, r := range results {
		require.Equal(t, codes.DeadlineExceeded, r.code, "stream %d", i)
		require.GreaterOrEqual(t, r.after, firstMessageTimeout, "stream %d ended before its first message was due", i)
	}
	// grpc-go writes a stream's status as its Recv fails, before the handler returns and counts
	// it: the counts may trail the clients by a moment.
	within(t, time.Now(), 10*time.Second, "every stream counted and none open", func() bool {
		return processorMetric(t, p, `idempotency_streams_refused_total{reason="first_message_timeout"}`) == streams &&
			processorMetric(t, p, "idempotency_streams") == 0
	})
	require.Zero(t, processorMetric(t, p, `idempotency_streams_refused_total{reason="limit"}`))

	for _, c := range connections {
		require.NoError(t, c.Close())
	}
	// Each connection's reader, writer and keepalive goroutines end with it; a few of the
	// runtime's and the HTTP server's may come and go.
	within(t, time.Now(), 10*time.Second, "goroutines back to their level", func() bool {
		return processorMetric(t, p, "go_goroutines") <= baseGoroutines+10
	})
	for range 2 {
		require.Equal(t, 200, s.do(call{key: "after-idle"}).status)
	}
	require.Equal(t, 1, s.up.Count("after-idle"), "the retry is replayed, not run again")
}

// With --max-streams 4 and four streams open, the fifth is refused at once with
// RESOURCE_EXHAUSTED and counted, while gRPC health on the same port still answers; once one of
// the four ends, a new stream is served.
func TestStreamLimit(t *testing.T) {
	const limit = 4
	p := startProcessor(t, nil, "--max-streams", "4")
	conn := dialProcessor(t, p)
	client := extprocv3.NewExternalProcessorClient(conn)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	// open starts a stream and has its first message answered: it is then held, with no
	// deadline, until it is closed. A stream the server has already ended fails Send with
	// io.EOF, and Recv then returns its status (grpc-go's ClientStream.SendMsg): a refusal may
	// come before or after the first message is sent.
	open := func() (extprocv3.ExternalProcessor_ProcessClient, error) {
		stream, err := client.Process(ctx)
		require.NoError(t, err)
		if err := stream.Send(getHeaders()); err != nil && !errors.Is(err, io.EOF) {
			return stream, err
		}
		_, err = stream.Recv()
		return stream, err
	}
	var held []extprocv3.ExternalProcessor_ProcessClient
	for range limit {
		stream, err := open()
		require.NoError(t, err)
		held = append(held, stream)
	}
	require.Equal(t, float64(limit), processorMetric(t, p, "idempotency_streams"))
	require.Equal(t, float64(limit), processorMetric(t, p, "idempotency_streams_limit"))

	_, err := open()
	require.Equal(t, codes.ResourceExhausted, status.Code(err), "the stream beyond the limit: %v", err)
	require.Equal(t, 1.0, processorMetric(t, p, `idempotency_streams_refused_total{reason="limit"}`))

	health := healthpb.NewHealthClient(conn)
	within(t, time.Now(), 10*time.Second, "gRPC health SERVING beside the full limit", func() bool {
		resp, err := health.Check(ctx, &healthpb.HealthCheckRequest{Service: extprocv3.ExternalProcessor_ServiceDesc.ServiceName})
		require.NoError(t, err, "gRPC health is not limited")
		return resp.GetStatus() == healthpb.HealthCheckResponse_SERVING
	})

	// One of the four ends (Envoy half-closes once the request is done): its place is free.
	require.NoError(t, held[0].CloseSend())
	_, err = held[0].Recv()
	require.ErrorIs(t, err, io.EOF, "a stream Envoy ends is not an error")
	stream, err := open()
	require.NoError(t, err, "a stream after one ended is served")
	held[0] = stream
	require.Equal(t, float64(limit), processorMetric(t, p, "idempotency_streams"))
	require.Equal(t, 1.0, processorMetric(t, p, `idempotency_streams_refused_total{reason="limit"}`))
	require.Zero(t, processorMetric(t, p, `idempotency_streams_refused_total{reason="first_message_timeout"}`), "streams that sent their first message are never ended for want of one")
}
