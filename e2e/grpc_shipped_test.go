package e2e_test

import (
	"context"
	"testing"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding/gzip"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/envoyconf"
)

// The shipped gRPC bootstrap, envoy/envoy-grpc.yaml, run as shipped under envoy/grpc-policy.yaml
// (the emulator, or a real Envoy when one is on PATH), with only its protected route's method
// pointed at the test's service, its grpc: {} match kept: a retried unary call runs once and gets
// the first call's message back, status OK; another message under the key, or the same message
// compressed, gets FAILED_PRECONDITION; a call of another method, on the default route, is not
// covered and runs each time.
func TestGrpcShippedBootstrap(t *testing.T) {
	svc := &echoService{}
	s := newStack(t, stackOptions{
		bootstrap: "envoy/envoy-grpc.yaml",
		upstream:  startGRPCUpstream(t, svc),
		policy:    string(readRepoFile(t, "envoy/grpc-policy.yaml")),
		envoy: func(b *bootstrapv3.Bootstrap) error {
			return envoyconf.MutateRoute(b, "payments-grpc", func(r *routev3.Route) error {
				r.GetMatch().PathSpecifier = &routev3.RouteMatch_Path{Path: "/grpc.testing.TestService/UnaryCall"}
				return nil
			})
		},
	})
	client := grpcClient(t, s)
	call := func(key, payload string, opts ...grpc.CallOption) (*testgrpc.SimpleResponse, error) {
		ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "idempotency-key", key), 15*time.Second)
		defer cancel()
		return client.UnaryCall(ctx, &testgrpc.SimpleRequest{Payload: &testgrpc.Payload{Body: []byte(payload)}}, opts...)
	}

	resp, err := call("shipped-1", "hi")
	require.NoError(t, err)
	require.Equal(t, "echo:hi", string(resp.GetPayload().GetBody()))
	require.EqualValues(t, 1, svc.calls.Load())

	var hdr, trl metadata.MD
	resp, err = call("shipped-1", "hi", grpc.Header(&hdr), grpc.Trailer(&trl))
	require.NoError(t, err, "the retry gets the first call's status")
	require.Equal(t, "echo:hi", string(resp.GetPayload().GetBody()), "and its message")
	require.Equal(t, []string{"t"}, trl.Get("x-up-trailer"))
	require.Equal(t, []string{"true"}, hdr.Get("x-idempotency-replayed"))
	require.EqualValues(t, 1, svc.calls.Load(), "the retry did not run")

	_, err = call("shipped-1", "something else")
	require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
	require.EqualValues(t, 1, svc.calls.Load())

	// The fingerprint covers the message as the client encoded it: the same message compressed
	// on the retry is another body (docs/outcomes.md#grpc-calls).
	_, err = call("shipped-1", "hi", grpc.UseCompressor(gzip.Name))
	require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
	require.Equal(t, "idempotency-key-reused", status.Convert(err).Message())
	require.EqualValues(t, 1, svc.calls.Load())
	resp, err = call("shipped-3", "hi", grpc.UseCompressor(gzip.Name))
	require.NoError(t, err, "a compressed call is protected like any other")
	require.Equal(t, "echo:hi", string(resp.GetPayload().GetBody()))
	resp, err = call("shipped-3", "hi", grpc.UseCompressor(gzip.Name))
	require.NoError(t, err)
	require.Equal(t, "echo:hi", string(resp.GetPayload().GetBody()), "its retry, compressed alike, gets the first call's message")
	require.EqualValues(t, 2, svc.calls.Load())

	// Another method goes to the default route, which the policy does not cover.
	for i := range 2 {
		ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "idempotency-key", "shipped-2"), 15*time.Second)
		stream, err := client.StreamingInputCall(ctx)
		require.NoError(t, err)
		require.NoError(t, stream.Send(&testgrpc.StreamingInputCallRequest{Payload: &testgrpc.Payload{Body: []byte("part")}}))
		_, err = stream.CloseAndRecv()
		cancel()
		require.NoError(t, err)
		require.EqualValues(t, 3+i, svc.calls.Load(), "an uncovered method runs each time")
	}
}

// The shipped gRPC bootstrap with its route's response trailers withheld (response_trailer_mode
// SKIP, which check refuses): no call's grpc-status reaches the processor, so the retry runs
// again, and the processor counts each call in idempotency_grpc_trailers_missing_total and says
// once what to fix.
func TestGrpcShippedBootstrapTrailersWithheld(t *testing.T) {
	svc := &echoService{}
	s := newStack(t, stackOptions{
		bootstrap: "envoy/envoy-grpc.yaml",
		upstream:  startGRPCUpstream(t, svc),
		policy:    string(readRepoFile(t, "envoy/grpc-policy.yaml")),
		envoy: func(b *bootstrapv3.Bootstrap) error {
			if err := envoyconf.MutateRoute(b, "payments-grpc", func(r *routev3.Route) error {
				r.GetMatch().PathSpecifier = &routev3.RouteMatch_Path{Path: "/grpc.testing.TestService/UnaryCall"}
				return nil
			}); err != nil {
				return err
			}
			return envoyconf.MutateExtProcPerRoute(b, "payments-grpc", func(p *filterextproc.ExtProcPerRoute) {
				p.GetOverrides().GetProcessingMode().ResponseTrailerMode = filterextproc.ProcessingMode_SKIP
			})
		},
	})
	client := grpcClient(t, s)
	for i := range 2 {
		ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "idempotency-key", "withheld-1"), 15*time.Second)
		resp, err := client.UnaryCall(ctx, &testgrpc.SimpleRequest{Payload: &testgrpc.Payload{Body: []byte("hi")}})
		cancel()
		require.NoError(t, err)
		require.Equal(t, "echo:hi", string(resp.GetPayload().GetBody()))
		require.EqualValues(t, i+1, svc.calls.Load(), "no outcome was seen: the retry runs again")
		// The count grows when the call's stream ends, which may follow the client's answer.
		require.Eventually(t, func() bool {
			return metricOf(t, s, `idempotency_grpc_trailers_missing_total{route="payments-charge"}`) == float64(i+1)
		}, 10*time.Second, 10*time.Millisecond)
	}
	line := s.procs[0].waitLog("a covered gRPC call's response ended without trailers, so its grpc-status was not seen and its outcome is unknown; if every call does this, set response_trailer_mode: SEND on its Envoy route (Envoy Gateway: processingMode.response.body: FullDuplexStreamed); idempotency_grpc_trailers_missing_total counts them", 10*time.Second)
	require.Equal(t, "payments-charge", line["route"])
	require.Equal(t, "warn", line["level"])
}
