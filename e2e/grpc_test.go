package e2e_test

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/envoyconf"
	"github.com/idempotency-extproc/idempotency-extproc/internal/check"
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// echoService is a grpc-go TestService whose UnaryCall echoes the payload and sends a header and
// a trailer. A payload "unavailable" fails UNAVAILABLE, "unavailable once" the first time; a
// payload "slow" waits for release.
// StreamingInputCall counts the messages it receives.
type echoService struct {
	testgrpc.UnimplementedTestServiceServer
	calls   atomic.Int64
	failed  atomic.Bool   // a call "unavailable once" failed
	started chan struct{} // receives once per "slow" call started
	release chan struct{} // lets "slow" calls finish
}

func (s *echoService) StreamingInputCall(stream testgrpc.TestService_StreamingInputCallServer) error {
	s.calls.Add(1)
	n := 0
	for {
		_, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return stream.SendAndClose(&testgrpc.StreamingInputCallResponse{AggregatedPayloadSize: int32(n)})
		}
		if err != nil {
			return err
		}
		n++
	}
}

func (s *echoService) UnaryCall(ctx context.Context, req *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
	s.calls.Add(1)
	switch string(req.GetPayload().GetBody()) {
	case "unavailable":
		return nil, status.Error(codes.Unavailable, "try again")
	case "unavailable once":
		if s.failed.CompareAndSwap(false, true) {
			return nil, status.Error(codes.Unavailable, "try again")
		}
	case "slow":
		s.started <- struct{}{}
		<-s.release
	}
	if err := grpc.SetHeader(ctx, metadata.Pairs("x-up-header", "h")); err != nil {
		return nil, err
	}
	if err := grpc.SetTrailer(ctx, metadata.Pairs("x-up-trailer", "t")); err != nil {
		return nil, err
	}
	return &testgrpc.SimpleResponse{Payload: &testgrpc.Payload{Body: append([]byte("echo:"), req.GetPayload().GetBody()...)}}, nil
}

// startGRPCUpstream serves svc on a loopback port until the test ends.
func startGRPCUpstream(t *testing.T, svc *echoService) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
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
	return "http://" + ln.Addr().String()
}

func grpcClient(t *testing.T, s *stack) testgrpc.TestServiceClient {
	t.Helper()
	conn, err := grpc.NewClient(strings.TrimPrefix(s.url, "http://"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return testgrpc.NewTestServiceClient(conn)
}

// A gRPC call without a key goes through the shipped bootstrap (its connection manager serves
// HTTP/2; the upstream cluster is switched to HTTP/2, as a gRPC service's must be) and the
// processor with its message, headers and trailers, and nothing of the processor's added.
func TestGrpcUnaryPassesThroughUntouched(t *testing.T) {
	svc := &echoService{}
	s := newStack(t, stackOptions{
		upstream: startGRPCUpstream(t, svc),
		envoy:    func(b *bootstrapv3.Bootstrap) error { return envoyconf.EnableUpstreamHTTP2(b) },
	})
	client := grpcClient(t, s)
	for i := range 2 {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
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

// grpcRoute is the Envoy route of the protected gRPC service: its request body mode
// FULL_DUPLEX_STREAMED (so the processor holds its answer to the request headers until the
// message came, and can answer a duplicate with the stored response), both trailer modes SEND
// (the call's outcome is grpc-status in the response trailers).
func grpcRoute(b *bootstrapv3.Bootstrap) error {
	return grpcRouteTrailers(filterextproc.ProcessingMode_SEND)(b)
}

// grpcPolicy protects the "charge" Envoy route, by its name, as a gRPC route.
const grpcPolicy = "routes: [{name: charge, match: {route_name_exact: charge}, grpc: true}]\n"

// grpcRouteTrailers is grpcRoute with response_trailer_mode trailers.
func grpcRouteTrailers(trailers filterextproc.ProcessingMode_HeaderSendMode) func(*bootstrapv3.Bootstrap) error {
	return func(b *bootstrapv3.Bootstrap) error { return addGRPCRoute(b, trailers) }
}

func addGRPCRoute(b *bootstrapv3.Bootstrap, trailers filterextproc.ProcessingMode_HeaderSendMode, action ...func(*routev3.RouteAction)) error {
	if err := envoyconf.EnableUpstreamHTTP2(b); err != nil {
		return err
	}
	per, err := anypb.New(&filterextproc.ExtProcPerRoute{Override: &filterextproc.ExtProcPerRoute_Overrides{Overrides: &filterextproc.ExtProcOverrides{
		ProcessingMode: &filterextproc.ProcessingMode{
			RequestHeaderMode:   filterextproc.ProcessingMode_SEND,
			RequestBodyMode:     filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED,
			RequestTrailerMode:  filterextproc.ProcessingMode_SEND,
			ResponseHeaderMode:  filterextproc.ProcessingMode_SEND,
			ResponseBodyMode:    filterextproc.ProcessingMode_BUFFERED,
			ResponseTrailerMode: trailers,
		},
	}}})
	if err != nil {
		return err
	}
	return envoyconf.MutateHCM(b, func(hcm *hcmv3.HttpConnectionManager) error {
		filter := ""
		for _, f := range hcm.GetHttpFilters() {
			if f.GetTypedConfig().MessageIs(&filterextproc.ExternalProcessor{}) {
				filter = f.GetName()
			}
		}
		for _, vh := range hcm.GetRouteConfig().GetVirtualHosts() {
			for i, def := range vh.GetRoutes() {
				if def.GetName() != "default" {
					continue
				}
				r := proto.Clone(def).(*routev3.Route)
				r.Name = "charge"
				r.Match = &routev3.RouteMatch{PathSpecifier: &routev3.RouteMatch_Prefix{Prefix: "/grpc.testing.TestService/"}}
				r.TypedPerFilterConfig = map[string]*anypb.Any{filter: per}
				for _, fn := range action {
					fn(r.GetRoute())
				}
				vh.Routes = append(vh.Routes[:i:i], append([]*routev3.Route{r}, vh.Routes[i:]...)...)
				return nil
			}
		}
		return errors.New("no route named default")
	})
}

// The gRPC protection end to end: a real grpc-go client and upstream through the emulator (or
// Envoy) and the processor, on each store. A retried call runs once and its retry gets the first
// call's message, headers and trailers, status OK; a concurrent duplicate gets ABORTED; another
// message under the key FAILED_PRECONDITION; a call that failed UNAVAILABLE is not stored and
// runs again; a streaming call with two messages is refused INVALID_ARGUMENT grpc-not-unary.
func TestGrpcUnaryRetriedCallRunsOnce(t *testing.T) {
	stores := map[string]func(t *testing.T) []string{
		"memory": func(*testing.T) []string { return nil },
		"redis": func(t *testing.T) []string {
			return redisArgs(redistest.Start(t, redistest.Options{}))
		},
	}
	for name, args := range stores {
		t.Run(name, func(t *testing.T) {
			svc := &echoService{started: make(chan struct{}, 1), release: make(chan struct{})}
			s := newStack(t, stackOptions{
				upstream: startGRPCUpstream(t, svc),
				args:     args(t),
				envoy:    grpcRoute,
				policy:   grpcPolicy,
			})
			client := grpcClient(t, s)
			call := func(key, payload string, opts ...grpc.CallOption) (*testgrpc.SimpleResponse, error) {
				ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "idempotency-key", key), 15*time.Second)
				defer cancel()
				return client.UnaryCall(ctx, &testgrpc.SimpleRequest{Payload: &testgrpc.Payload{Body: []byte(payload)}}, opts...)
			}

			resp, err := call("k-1", "hi")
			require.NoError(t, err)
			require.Equal(t, "echo:hi", string(resp.GetPayload().GetBody()))
			require.EqualValues(t, 1, svc.calls.Load())

			var hdr, trl metadata.MD
			resp, err = call("k-1", "hi", grpc.Header(&hdr), grpc.Trailer(&trl))
			require.NoError(t, err, "the retry gets the first call's status")
			require.Equal(t, "echo:hi", string(resp.GetPayload().GetBody()), "and its message")
			require.Equal(t, []string{"h"}, hdr.Get("x-up-header"))
			require.Equal(t, []string{"t"}, trl.Get("x-up-trailer"))
			require.Equal(t, []string{"true"}, hdr.Get("x-idempotency-replayed"))
			require.EqualValues(t, 1, svc.calls.Load(), "the retry did not run")

			_, err = call("k-1", "something else")
			require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
			require.Equal(t, "idempotency-key-reused", status.Convert(err).Message())

			for i := range 2 {
				_, err = call("k-2", "unavailable")
				require.Equal(t, codes.Unavailable, status.Code(err))
				require.EqualValues(t, 2+i, svc.calls.Load(), "a failed call is not stored: it runs again")
			}

			first := make(chan error, 1)
			go func() {
				_, err := call("k-3", "slow")
				first <- err
			}()
			<-svc.started
			_, err = call("k-3", "slow")
			require.Equal(t, codes.Aborted, status.Code(err), "%v", err)
			require.Equal(t, "request-in-progress", status.Convert(err).Message())
			close(svc.release)
			require.NoError(t, <-first)
			require.EqualValues(t, 4, svc.calls.Load())

			ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "idempotency-key", "k-4"), 15*time.Second)
			defer cancel()
			stream, err := client.StreamingInputCall(ctx)
			require.NoError(t, err)
			for range 2 {
				require.NoError(t, stream.Send(&testgrpc.StreamingInputCallRequest{Payload: &testgrpc.Payload{Body: []byte("part")}}))
			}
			_, err = stream.CloseAndRecv()
			require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
			require.Equal(t, "grpc-not-unary", status.Convert(err).Message())
			require.EqualValues(t, 4, svc.calls.Load(), "never reached the upstream")
		})
	}
}

// response_trailer_mode SKIP on a gRPC route: the call's grpc-status never reaches the processor,
// so the stream ends with the outcome unknown, and under unknown_outcome release (the default)
// the retry runs again.
func TestHarmGRPCResponseTrailersSkipped(t *testing.T) {
	t.Parallel()
	svc := &echoService{}
	s := harmStack(t, check.Kind("grpc-response-trailers"), grpcPolicy, grpcRouteTrailers(filterextproc.ProcessingMode_SKIP), stackOptions{upstream: startGRPCUpstream(t, svc)})
	client := grpcClient(t, s)
	for range 2 {
		ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "idempotency-key", "grts-1"), 15*time.Second)
		resp, err := client.UnaryCall(ctx, &testgrpc.SimpleRequest{Payload: &testgrpc.Payload{Body: []byte("hi")}})
		cancel()
		require.NoError(t, err)
		require.Equal(t, "echo:hi", string(resp.GetPayload().GetBody()))
	}
	require.EqualValues(t, 2, svc.calls.Load(), "the retry ran again")
}

// A gRPC route under FULL_DUPLEX_STREAMED on an Envoy before 1.37: the processor replays the
// completed call as a streamed_immediate_response, a field that Envoy does not know, so the
// response oneof is unset and Filter::onReceiveMessage (ext_proc.cc) takes it for a spurious
// message. The retry fails instead of getting the first call's message.
func TestHarmGRPCStreamedReplayUnsupported(t *testing.T) {
	t.Parallel()
	if envoyBin != "" {
		t.Skip("the harm is that of an Envoy before 1.37, which this test has the emulator play")
	}
	requireCheckFindsFor(t, "1.36", grpcPolicy, grpcRoute, check.Kind("grpc-streamed-replay-unsupported"))
	svc := &echoService{}
	s := newStack(t, stackOptions{upstream: startGRPCUpstream(t, svc), policy: grpcPolicy, envoy: grpcRoute, before137: true})
	client := grpcClient(t, s)
	call := func() (*testgrpc.SimpleResponse, error) {
		ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "idempotency-key", "gsr-1"), 15*time.Second)
		defer cancel()
		return client.UnaryCall(ctx, &testgrpc.SimpleRequest{Payload: &testgrpc.Payload{Body: []byte("hi")}})
	}
	resp, err := call()
	require.NoError(t, err)
	require.Equal(t, "echo:hi", string(resp.GetPayload().GetBody()))
	resp, err = call()
	// The spurious message fails the request with status_on_error (500), which Envoy's gRPC
	// local reply carries as grpc-status UNKNOWN.
	require.Equal(t, codes.Unknown, status.Code(err), "the retry does not get the first call's message (got %q, %v)", resp.GetPayload().GetBody(), err)
	require.EqualValues(t, 1, svc.calls.Load(), "the retry did not run either")
}

// The router's gRPC retry condition on a gRPC route: the upstream answered UNAVAILABLE (it may
// have run the call), and the router sends the claimed call again under the same lease: the
// upstream runs twice for one call.
func TestHarmGRPCRouterRetry(t *testing.T) {
	t.Parallel()
	svc := &echoService{}
	edit := func(b *bootstrapv3.Bootstrap) error {
		return addGRPCRoute(b, filterextproc.ProcessingMode_SEND, func(ra *routev3.RouteAction) {
			ra.RetryPolicy = &routev3.RetryPolicy{RetryOn: "unavailable"}
		})
	}
	s := harmStack(t, check.Kind("grpc-router-retry"), grpcPolicy, edit, stackOptions{upstream: startGRPCUpstream(t, svc)})
	client := grpcClient(t, s)
	ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "idempotency-key", "grr-1"), 15*time.Second)
	defer cancel()
	_, err := client.UnaryCall(ctx, &testgrpc.SimpleRequest{Payload: &testgrpc.Payload{Body: []byte("unavailable once")}})
	require.NoError(t, err)
	require.EqualValues(t, 2, svc.calls.Load(), "one call ran twice")
}
