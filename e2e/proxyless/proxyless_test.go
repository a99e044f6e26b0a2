// Package proxyless_test drives the processor through grpc-go's own ext_proc filter (gRFC A93):
// a real grpc-go client dialing xds:///…, configured by an in-process xDS server built on
// go-control-plane, calls a real grpc-go backend, and its filter calls the processor.
package proxyless_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/xds"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// extProcEnv turns grpc-go's client ext_proc filter on; grpc-go reads it when its packages
// initialise (internal/envconfig/xds.go), so the tests run in a child process started with it.
const extProcEnv = "GRPC_EXPERIMENTAL_XDS_EXT_PROC_ON_CLIENT"

func TestMain(m *testing.M) {
	if os.Getenv(extProcEnv) != "true" {
		cmd := exec.Command(os.Args[0], os.Args[1:]...)
		cmd.Env = append(os.Environ(), extProcEnv+"=true")
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		err := cmd.Run()
		var exit *exec.ExitError
		switch {
		case errors.As(err, &exit):
			os.Exit(exit.ExitCode())
		case err != nil:
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// chargeService is a TestService whose UnaryCall counts its executions by key; a payload "slow"
// waits for release.
type chargeService struct {
	testgrpc.UnimplementedTestServiceServer
	calls   atomic.Int64
	started chan struct{}
	release chan struct{}
}

func (s *chargeService) UnaryCall(_ context.Context, req *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
	s.calls.Add(1)
	if string(req.GetPayload().GetBody()) == "slow" {
		s.started <- struct{}{}
		<-s.release
	}
	return &testgrpc.SimpleResponse{Payload: &testgrpc.Payload{Body: append([]byte("charged:"), req.GetPayload().GetBody()...)}}, nil
}

// serve serves register on a loopback port until the test ends, and returns the address.
func serve(t *testing.T, register func(*grpc.Server)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	gs := grpc.NewServer()
	register(gs)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = gs.Serve(ln)
	}()
	t.Cleanup(func() {
		gs.Stop()
		<-done
	})
	return ln.Addr().String()
}

// processor starts the processor on the memory store and returns its address and a function
// that reads idempotency_requests_total for an outcome of route "charge".
func processor(t *testing.T) (string, func(outcome string) float64) {
	t.Helper()
	// grpc-go 1.85's client does not let the processor learn a unary call's outcome. In its
	// internal/xds/httpfilter/extproc/ext_proc.go the trailers go to the processor only from
	// clientStream.initiateResponseTrailerProcessing, called by Trailer() (which the unary path
	// does not call on the filter's stream: grpc.Trailer reads the inner stream), by
	// recvFromDataplane after a failed RecvMsg (a unary call reads one message and stops), and
	// by responseForwardingToProcServerLoop (body mode GRPC) after the call has returned; with
	// the caller's context kept past the call and the default unknown_outcome, the processor
	// still released the key unknown in both body modes. unknown_outcome record keeps the key,
	// and a retry is refused instead of running again.
	p, err := policy.Parse([]byte("routes: [{name: charge, match: {path_prefix: /payments.v1.Payments/}, grpc: true, unknown_outcome: record}]\n"))
	require.NoError(t, err)
	store, err := cache.NewMemory(cache.MemoryOptions{})
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	metrics, err := extproc.NewMetrics(reg)
	require.NoError(t, err)
	log := zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel)
	srv, err := extproc.NewServer(extproc.Options{Store: store, Policy: p, Logger: &log, Metrics: metrics})
	require.NoError(t, err)
	addr := serve(t, func(gs *grpc.Server) { extprocv3.RegisterExternalProcessorServer(gs, srv) })
	return addr, func(outcome string) float64 {
		families, err := reg.Gather()
		require.NoError(t, err)
		for _, f := range families {
			if f.GetName() != "idempotency_requests_total" {
				continue
			}
			for _, m := range f.GetMetric() {
				labels := map[string]string{}
				for _, l := range m.GetLabel() {
					labels[l.GetName()] = l.GetValue()
				}
				if labels["route"] == "charge" && labels["outcome"] == outcome {
					return m.GetCounter().GetValue()
				}
			}
		}
		return 0
	}
}

// resources are the xDS resources of a client of listener name whose calls go to backend
// through the ext_proc filter in body mode mode, calling the processor at proc with the policy
// route named in the filter's grpc_service.initial_metadata.
func resources(t *testing.T, name, backend, proc string, mode filterextproc.ProcessingMode_BodySendMode) map[resource.Type][]types.Resource {
	t.Helper()
	cluster := name + "-backend"
	extProc, err := anypb.New(&filterextproc.ExternalProcessor{
		GrpcService: &corev3.GrpcService{
			TargetSpecifier: &corev3.GrpcService_GoogleGrpc_{GoogleGrpc: &corev3.GrpcService_GoogleGrpc{TargetUri: proc, StatPrefix: "extproc"}},
			InitialMetadata: []*corev3.HeaderValue{{Key: "x-idempotency-route", Value: "charge"}},
		},
		ProcessingMode: &filterextproc.ProcessingMode{
			RequestHeaderMode:   filterextproc.ProcessingMode_SEND,
			RequestBodyMode:     mode,
			ResponseHeaderMode:  filterextproc.ProcessingMode_SEND,
			ResponseBodyMode:    mode,
			ResponseTrailerMode: filterextproc.ProcessingMode_SEND,
		},
	})
	require.NoError(t, err)
	router, err := anypb.New(&routerv3.Router{})
	require.NoError(t, err)
	hcm, err := anypb.New(&hcmv3.HttpConnectionManager{
		RouteSpecifier: &hcmv3.HttpConnectionManager_RouteConfig{RouteConfig: &routev3.RouteConfiguration{
			Name: name + "-routes",
			VirtualHosts: []*routev3.VirtualHost{{
				Name: name, Domains: []string{"*"},
				Routes: []*routev3.Route{{
					Match:  &routev3.RouteMatch{PathSpecifier: &routev3.RouteMatch_Prefix{Prefix: "/"}},
					Action: &routev3.Route_Route{Route: &routev3.RouteAction{ClusterSpecifier: &routev3.RouteAction_Cluster{Cluster: cluster}}},
				}},
			}},
		}},
		HttpFilters: []*hcmv3.HttpFilter{
			{Name: "extproc", ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: extProc}},
			{Name: "router", ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: router}},
		},
	})
	require.NoError(t, err)
	host, port, err := net.SplitHostPort(backend)
	require.NoError(t, err)
	var portNum uint32
	_, err = fmt.Sscan(port, &portNum)
	require.NoError(t, err)
	return map[resource.Type][]types.Resource{
		resource.ListenerType: {&listenerv3.Listener{Name: name, ApiListener: &listenerv3.ApiListener{ApiListener: hcm}}},
		resource.ClusterType: {&clusterv3.Cluster{
			Name:                 cluster,
			ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_EDS},
			EdsClusterConfig:     &clusterv3.Cluster_EdsClusterConfig{EdsConfig: &corev3.ConfigSource{ConfigSourceSpecifier: &corev3.ConfigSource_Ads{Ads: &corev3.AggregatedConfigSource{}}}},
			LbPolicy:             clusterv3.Cluster_ROUND_ROBIN,
		}},
		resource.EndpointType: {&endpointv3.ClusterLoadAssignment{
			ClusterName: cluster,
			Endpoints: []*endpointv3.LocalityLbEndpoints{{
				Locality:            &corev3.Locality{Region: "here"},
				LoadBalancingWeight: wrapperspb.UInt32(1),
				LbEndpoints: []*endpointv3.LbEndpoint{{HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{
					Address: &corev3.Address{Address: &corev3.Address_SocketAddress{SocketAddress: &corev3.SocketAddress{
						Address: host, PortSpecifier: &corev3.SocketAddress_PortValue{PortValue: portNum},
					}}},
				}}}},
			}},
		}},
	}
}

// xdsClient serves the resources from a go-control-plane xDS server and returns a client of
// xds:///name whose bootstrap allows the processor at proc.
func xdsClient(t *testing.T, name, proc string, res map[resource.Type][]types.Resource) testgrpc.TestServiceClient {
	t.Helper()
	const node = "proxyless-test"
	snapshots := cachev3.NewSnapshotCache(false, cachev3.IDHash{}, nil)
	snap, err := cachev3.NewSnapshot("1", res)
	require.NoError(t, err)
	require.NoError(t, snapshots.SetSnapshot(t.Context(), node, snap))
	xdsServer := serverv3.NewServer(context.WithoutCancel(t.Context()), snapshots, nil)
	addr := serve(t, func(gs *grpc.Server) { discoveryv3.RegisterAggregatedDiscoveryServiceServer(gs, xdsServer) })
	bootstrap := fmt.Sprintf(`{
		"xds_servers": [{"server_uri": %q, "channel_creds": [{"type": "insecure"}], "server_features": ["xds_v3"]}],
		"node": {"id": %q},
		"allowed_grpc_services": {%q: {"channel_creds": [{"type": "insecure"}]}}
	}`, addr, node, proc)
	builder, err := xds.NewXDSResolverWithConfigForTesting([]byte(bootstrap))
	require.NoError(t, err)
	conn, err := grpc.NewClient("xds:///"+name, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithResolvers(builder))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return testgrpc.NewTestServiceClient(conn)
}

// The retry test through grpc-go's own ext_proc filter, in headers-only and GRPC body modes: the
// backend runs once per key across a retry and a concurrent duplicate, no first call fails
// because of the processor, and a concurrent duplicate gets ABORTED. A duplicate sent once the
// first call's record is written (the test waits for its outcome to be counted) is refused
// FAILED_PRECONDITION outcome-unknown: the client never forwards the trailers that would have
// made it ALREADY_EXISTS with the original status (see processor).
func TestProxylessRetriedCallRunsOnce(t *testing.T) {
	for _, mode := range []filterextproc.ProcessingMode_BodySendMode{filterextproc.ProcessingMode_NONE, filterextproc.ProcessingMode_GRPC} {
		t.Run(mode.String(), func(t *testing.T) {
			svc := &chargeService{started: make(chan struct{}, 1), release: make(chan struct{})}
			backend := serve(t, func(gs *grpc.Server) { testgrpc.RegisterTestServiceServer(gs, svc) })
			proc, outcomes := processor(t)
			name := "charge-" + strings.ToLower(mode.String())
			client := xdsClient(t, name, proc, resources(t, name, backend, proc, mode))
			call := func(key, payload string) (*testgrpc.SimpleResponse, error) {
				ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "idempotency-key", key), 20*time.Second)
				defer cancel()
				return client.UnaryCall(ctx, &testgrpc.SimpleRequest{Payload: &testgrpc.Payload{Body: []byte(payload)}}, grpc.WaitForReady(true))
			}

			resp, err := call("k-1", "10 EUR")
			require.NoError(t, err, "no first call fails because of the processor")
			require.Equal(t, "charged:10 EUR", string(resp.GetPayload().GetBody()))
			require.Eventually(t, func() bool { return outcomes("executed") == 1 }, 10*time.Second, 5*time.Millisecond, "the first call's record is written")

			_, err = call("k-1", "10 EUR")
			require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
			require.Equal(t, "idempotency_outcome-unknown", status.Convert(err).Message())
			require.EqualValues(t, 1, svc.calls.Load(), "the retry did not run")

			first := make(chan error, 1)
			go func() {
				_, err := call("k-2", "slow")
				first <- err
			}()
			<-svc.started
			_, err = call("k-2", "slow")
			require.Equal(t, codes.Aborted, status.Code(err), "%v", err)
			close(svc.release)
			require.NoError(t, <-first)
			require.EqualValues(t, 2, svc.calls.Load(), "one execution per key")
		})
	}
}
