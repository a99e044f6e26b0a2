package extproc_test

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

// limitsHarness is a server with the first-message tap and gRPC health, as the binary serves it,
// on a fake clock.
type limitsHarness struct {
	t        *testing.T
	server   *extproc.Server
	registry *prometheus.Registry
	clock    *clock.Fake
	client   extprocv3.ExternalProcessorClient
	health   healthpb.HealthClient
	ctx      context.Context
}

const testFirstMessageTimeout = 10 * time.Second

func newLimitsHarness(t *testing.T, maxStreams int) *limitsHarness {
	t.Helper()
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	store, err := cache.NewMemory(cache.MemoryOptions{Clock: clk})
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	metrics, err := extproc.NewMetrics(reg)
	require.NoError(t, err)
	srv, err := extproc.NewServer(extproc.Options{Store: store, Metrics: metrics, Clock: clk, MaxStreams: maxStreams, FirstMessageTimeout: testFirstMessageTimeout})
	require.NoError(t, err)
	lis := bufconn.Listen(1 << 20)
	gs := grpc.NewServer(grpc.InTapHandle(srv.TapHandle()), grpc.ChainStreamInterceptor(srv.StreamInterceptor()))
	extprocv3.RegisterExternalProcessorServer(gs, srv)
	healthpb.RegisterHealthServer(gs, health.NewServer())
	go func() { _ = gs.Serve(lis) }()
	conn, err := grpc.NewClient("passthrough:///bufconn",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() {
		cancel()
		_ = conn.Close()
		gs.Stop()
		wctx, stop := context.WithTimeout(context.Background(), 5*time.Second)
		defer stop()
		require.NoError(t, srv.Shutdown(wctx))
		_ = store.Close()
	})
	return &limitsHarness{t: t, server: srv, registry: reg, clock: clk, ctx: ctx,
		client: extprocv3.NewExternalProcessorClient(conn), health: healthpb.NewHealthClient(conn)}
}

func (h *limitsHarness) metric(name string, labels ...string) float64 {
	h.t.Helper()
	return metricValue(h.t, h.registry, name, labels...)
}

// waitStreams waits until n streams wait for their first message: the server has taken them.
func (h *limitsHarness) waitStreams(n int) {
	h.t.Helper()
	require.Eventually(h.t, func() bool { return extproc.FirstMessagesAwaited(h.server) == n }, 5*time.Second, time.Millisecond,
		"%d streams waiting for their first message", n)
}

// served opens a stream whose first message (a GET's headers) is answered.
func (h *limitsHarness) served() (extprocv3.ExternalProcessor_ProcessClient, error) {
	stream, err := h.client.Process(h.ctx)
	require.NoError(h.t, err)
	if err := stream.Send(requestHeaders(request{method: "GET", path: "/v1/things"})); err != nil {
		if errors.Is(err, io.EOF) {
			// The server ended the stream before the message went out: its status comes
			// from Recv.
			_, err = stream.Recv()
		}
		return stream, err
	}
	_, err = stream.Recv()
	return stream, err
}

// A stream gets DEADLINE_EXCEEDED, counted, when its first message has not come when the
// first-message timeout is up, and not a moment before; a stream that sent one in time is never
// ended for it, however long it then stays open.
func TestFirstMessageTimeout(t *testing.T) {
	for _, tc := range []struct {
		name  string
		first bool // whether the stream sends its first message
	}{
		{"silent stream", false},
		{"first message in time", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newLimitsHarness(t, 0)
			stream, err := h.client.Process(h.ctx)
			require.NoError(t, err)
			h.waitStreams(1)
			require.Equal(t, 1, h.clock.Pending(), "one first-message timer")
			ended := make(chan error, 1)
			if tc.first {
				require.NoError(t, stream.Send(requestHeaders(request{method: "GET", path: "/v1/things"})))
				_, err := stream.Recv()
				require.NoError(t, err)
				require.Zero(t, extproc.FirstMessagesAwaited(h.server), "the first message takes the stream off the watch")
			} else {
				go func() {
					_, err := stream.Recv()
					ended <- err
				}()
			}

			h.clock.Advance(testFirstMessageTimeout - time.Millisecond)
			if !tc.first {
				// The timer has not fired: it is still on the clock (the refusal itself is
				// counted on the server's goroutine, so the counter alone could not tell).
				require.Equal(t, 1, h.clock.Pending(), "the timer fired before its time")
			}
			require.Zero(t, h.metric("idempotency_streams_refused_total", "reason", "first_message_timeout"))
			require.Equal(t, 1.0, h.metric("idempotency_streams"))
			h.clock.Advance(time.Millisecond)

			if tc.first {
				// The shared timer fired, found no stream due, and is not armed again.
				require.Zero(t, h.clock.Pending(), "no first-message timer once no stream waits")
				h.clock.Advance(time.Hour)
				require.NoError(t, stream.CloseSend())
				_, err := stream.Recv()
				require.ErrorIs(t, err, io.EOF, "the stream ends as Envoy ends it")
				require.NoError(t, h.server.Wait(h.ctx))
				require.Zero(t, h.metric("idempotency_streams_refused_total", "reason", "first_message_timeout"))
				return
			}
			select {
			case err := <-ended:
				require.Equal(t, codes.DeadlineExceeded, status.Code(err), "%v", err)
			case <-time.After(5 * time.Second):
				t.Fatal("the silent stream is still open after its first message was due")
			}
			require.NoError(t, h.server.Wait(h.ctx))
			require.Equal(t, 1.0, h.metric("idempotency_streams_refused_total", "reason", "first_message_timeout"))
			require.Zero(t, h.metric("idempotency_streams"))
		})
	}
}

// Streams opened at different times share the first-message timer, and each silent one is ended
// when its own deadline passes, not a moment before, whatever the others do; one that sent its
// first message meanwhile stays open.
func TestFirstMessageTimeoutEachStream(t *testing.T) {
	h := newLimitsHarness(t, 0)
	silent := func() <-chan error {
		stream, err := h.client.Process(h.ctx)
		require.NoError(t, err)
		ended := make(chan error, 1)
		go func() {
			_, err := stream.Recv()
			ended <- err
		}()
		return ended
	}
	requireEnded := func(ended <-chan error, what string) {
		t.Helper()
		select {
		case err := <-ended:
			require.Equal(t, codes.DeadlineExceeded, status.Code(err), "%s: %v", what, err)
		case <-time.After(5 * time.Second):
			t.Fatalf("%s is still open after its first message was due", what)
		}
	}
	first := silent()
	h.waitStreams(1)
	h.clock.Advance(testFirstMessageTimeout / 2)
	second := silent()
	h.waitStreams(2)
	talking, err := h.served()
	require.NoError(t, err)
	require.Equal(t, 1, h.clock.Pending(), "the streams share one timer")

	h.clock.Advance(testFirstMessageTimeout / 2)
	requireEnded(first, "the first silent stream")
	require.Equal(t, 1, extproc.FirstMessagesAwaited(h.server))
	require.Equal(t, 1, h.clock.Pending(), "the timer is armed again for the second stream")
	h.clock.Advance(testFirstMessageTimeout/2 - time.Millisecond)
	require.Equal(t, 1, extproc.FirstMessagesAwaited(h.server), "the second stream still waits")
	select {
	case err := <-second:
		t.Fatalf("the second silent stream ended before its time: %v", err)
	default:
	}
	h.clock.Advance(time.Millisecond)
	requireEnded(second, "the second silent stream")
	require.Zero(t, h.clock.Pending())

	require.NoError(t, talking.CloseSend())
	_, err = talking.Recv()
	require.ErrorIs(t, err, io.EOF, "the stream that sent its first message is not ended for it")
	require.NoError(t, h.server.Wait(h.ctx))
	require.Equal(t, 2.0, h.metric("idempotency_streams_refused_total", "reason", "first_message_timeout"))
}

// With MaxStreams open, the next stream is refused at once with RESOURCE_EXHAUSTED, counted, and
// its first-message timer stopped; gRPC health is neither limited nor timed; once a stream ends,
// a new one is served.
func TestMaxStreams(t *testing.T) {
	const limit = 3
	h := newLimitsHarness(t, limit)
	require.Equal(t, float64(limit), h.metric("idempotency_streams_limit"))
	var held []extprocv3.ExternalProcessor_ProcessClient
	for range limit {
		stream, err := h.served()
		require.NoError(t, err)
		held = append(held, stream)
	}
	require.Equal(t, float64(limit), h.metric("idempotency_streams"))

	_, err := h.served()
	require.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
	require.Equal(t, 1.0, h.metric("idempotency_streams_refused_total", "reason", "limit"))
	require.Zero(t, extproc.FirstMessagesAwaited(h.server), "the refused stream is off the first-message watch")

	resp, err := h.health.Check(h.ctx, &healthpb.HealthCheckRequest{})
	require.NoError(t, err, "gRPC health is not limited")
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, resp.GetStatus())
	watch, err := h.health.Watch(h.ctx, &healthpb.HealthCheckRequest{})
	require.NoError(t, err)
	_, err = watch.Recv()
	require.NoError(t, err)
	require.Zero(t, extproc.FirstMessagesAwaited(h.server), "gRPC health streams have no first-message deadline")

	require.NoError(t, held[0].CloseSend())
	_, err = held[0].Recv()
	require.ErrorIs(t, err, io.EOF)
	_, err = h.served()
	require.NoError(t, err, "a stream after one ended is served")
	require.Equal(t, 1.0, h.metric("idempotency_streams_refused_total", "reason", "limit"))
	require.Equal(t, float64(limit), h.metric("idempotency_streams"))
}

// NewServer refuses a negative limit or timeout.
func TestStreamLimitsMustNotBeNegative(t *testing.T) {
	store, err := cache.NewMemory(cache.MemoryOptions{})
	require.NoError(t, err)
	defer store.Close()
	for _, o := range []extproc.Options{{Store: store, MaxStreams: -1}, {Store: store, FirstMessageTimeout: -time.Second}} {
		_, err := extproc.NewServer(o)
		require.Error(t, err)
	}
}
