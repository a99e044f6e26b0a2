package e2e_test

import (
	"context"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/envoyconf"
)

// echoService is a grpc-go TestService whose UnaryCall echoes the payload and sends a header and
// a trailer.
type echoService struct {
	testgrpc.UnimplementedTestServiceServer
	calls atomic.Int64
}

func (s *echoService) UnaryCall(ctx context.Context, req *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
	s.calls.Add(1)
	if err := grpc.SetHeader(ctx, metadata.Pairs("x-up-header", "h")); err != nil {
		return nil, err
	}
	if err := grpc.SetTrailer(ctx, metadata.Pairs("x-up-trailer", "t")); err != nil {
		return nil, err
	}
	return &testgrpc.SimpleResponse{Payload: &testgrpc.Payload{Body: append([]byte("echo:"), req.GetPayload().GetBody()...)}}, nil
}

// A gRPC unary call goes through the shipped bootstrap (its connection manager serves HTTP/2;
// the upstream cluster is switched to HTTP/2, as a gRPC service's must be) and the processor
// with its message, headers and trailers, and nothing of the processor's added: the processor
// passes gRPC requests through untouched.
func TestGrpcUnaryPassesThroughUntouched(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	svc := &echoService{}
	srv := grpc.NewServer()
	testgrpc.RegisterTestServiceServer(srv, svc)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(ln)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})

	s := newStack(t, stackOptions{
		upstream: "http://" + ln.Addr().String(),
		envoy:    func(b *bootstrapv3.Bootstrap) error { return envoyconf.EnableUpstreamHTTP2(b) },
	})
	conn, err := grpc.NewClient(strings.TrimPrefix(s.url, "http://"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	client := testgrpc.NewTestServiceClient(conn)

	for i, key := range []string{"", "k-1"} {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		if key != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, "idempotency-key", key)
		}
		var hdr, trl metadata.MD
		resp, err := client.UnaryCall(ctx, &testgrpc.SimpleRequest{Payload: &testgrpc.Payload{Body: []byte("hi")}}, grpc.Header(&hdr), grpc.Trailer(&trl))
		cancel()
		require.NoError(t, err)
		require.Equal(t, "echo:hi", string(resp.GetPayload().GetBody()))
		require.Equal(t, []string{"h"}, hdr.Get("x-up-header"))
		require.Equal(t, []string{"t"}, trl.Get("x-up-trailer"))
		for _, md := range []metadata.MD{hdr, trl} {
			for k := range md {
				require.False(t, strings.HasPrefix(k, "x-idempotency-"), "the processor added %q", k)
			}
		}
		require.EqualValues(t, i+1, svc.calls.Load(), "every call reaches the upstream")
	}
}
