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
	"slices"
	"strings"
	"sync"
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

// chargeService is a TestService whose UnaryCall counts its executions; a payload "slow" waits
// for release, and a payload "unavailable" fails UNAVAILABLE.
type chargeService struct {
	testgrpc.UnimplementedTestServiceServer
	calls   atomic.Int64
	started chan struct{}
	release chan struct{}
}

func (s *chargeService) UnaryCall(_ context.Context, req *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
	s.calls.Add(1)
	switch string(req.GetPayload().GetBody()) {
	case "slow":
		s.started <- struct{}{}
		<-s.release
	case "unavailable":
		return nil, status.Error(codes.Unavailable, "try later")
	}
	return &testgrpc.SimpleResponse{Payload: &testgrpc.Payload{Body: append([]byte("charged:"), req.GetPayload().GetBody()...)}}, nil
}

// serve serves register on a loopback port until the test ends, and returns the address.
func serve(t *testing.T, register func(*grpc.Server), opts ...grpc.ServerOption) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	gs := grpc.NewServer(opts...)
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

// proc is the processor on the memory store, behind a recorder of what grpc-go's filter tells it
// of each call's end.
type proc struct {
	addr    string
	policy  *policy.Policy
	store   *cache.Memory
	metrics *prometheus.Registry

	mu   sync.Mutex
	ends [][]string // the header names of each response_trailers, or trailers-only response_headers
}

// processor starts the processor on route "charge".
//
// grpc-go 1.85's ext_proc filter does forward a unary call's trailers, and the call waits for
// their answer: grpc-go's clientStreamWrapper.RecvMsg (stream.go:207-225) calls the filter's
// RecvMsg a second time, whose recvFromDataplane
// (internal/xds/httpfilter/extproc/ext_proc.go:1241-1252) gets io.EOF or the call's error, sends
// the trailers (initiateResponseTrailerProcessing, ext_proc.go:2000) and waits for their answer
// (waitForTrailerProcessing, ext_proc.go:2041); in
// body mode GRPC responseForwardingToProcServerLoop sends them the same way. But the trailers it
// sends are the call's trailer metadata (cs.dataplaneStream.Trailer(), ext_proc.go:2020, or
// :1971 for a trailers-only response; ConstructHeaderMap in internal/xds/httpfilter/extconfig.go:259
// copies that metadata only), and grpc-go's transport takes grpc-status and grpc-message out of
// the metadata into the call's status (internal/transport/http2_client.go:1572-1581, the status at
// :1700; only the rest becomes the trailer, :994; isReservedHeader in http_util.go:96-116). The
// error recvFromDataplane got is returned to the caller, never sent to the processor. So the
// processor never sees a grpc-status, and every call's outcome is unknown: unknown_outcome record
// keeps the key, and a retry is refused instead of running again.
func processor(t *testing.T) *proc {
	t.Helper()
	// The route matches no call's path: only the name the filter's initial_metadata gives
	// chooses it, as the first-message tap reads it.
	p, err := policy.Parse([]byte("routes: [{name: charge, match: {path_prefix: /no-call-has-this-path/}, grpc: true, unknown_outcome: record}]\n"))
	require.NoError(t, err)
	store, err := cache.NewMemory(cache.MemoryOptions{})
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	metrics, err := extproc.NewMetrics(reg)
	require.NoError(t, err)
	log := zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel)
	srv, err := extproc.NewServer(extproc.Options{Store: store, Policy: p, Logger: &log, Metrics: metrics})
	require.NoError(t, err)
	pr := &proc{policy: p, store: store, metrics: reg}
	// Served as the binary serves it (cmd/idempotency-extproc/run.go): the tap and the codec.
	pr.addr = serve(t, func(gs *grpc.Server) {
		extprocv3.RegisterExternalProcessorServer(gs, endRecorder{next: srv, proc: pr})
	}, grpc.InTapHandle(srv.TapHandle()), grpc.ForceServerCodecV2(srv.Codec()))
	return pr
}

// record waits until the record of key is written, and returns it.
func (p *proc) record(t *testing.T, key string) *cache.Record {
	t.Helper()
	r, hashed, err := extproc.KeyHash(p.policy, extproc.KeyRequest{Route: "charge", Key: key}, nil)
	require.NoError(t, err)
	var rec *cache.Record
	require.Eventually(t, func() bool {
		got, err := p.store.Lookup(context.Background(), r.KeyPrefix+hashed)
		if err != nil || got.State != cache.Completed {
			return false
		}
		rec = got
		return true
	}, 10*time.Second, 5*time.Millisecond, "the record of %s is written", key)
	return rec
}

// misconfigurations returns idempotency_envoy_misconfig_total, all kinds.
func (p *proc) misconfigurations(t *testing.T) float64 {
	t.Helper()
	families, err := p.metrics.Gather()
	require.NoError(t, err)
	var n float64
	for _, f := range families {
		if f.GetName() == "idempotency_envoy_misconfig_total" {
			for _, m := range f.GetMetric() {
				n += m.GetCounter().GetValue()
			}
		}
	}
	return n
}

// callEnds returns the header names of each call's end the processor has received.
func (p *proc) callEnds() [][]string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.ends)
}

// endRecorder passes every stream to next, keeping what each call's end carried.
type endRecorder struct {
	extprocv3.UnimplementedExternalProcessorServer
	next extprocv3.ExternalProcessorServer
	proc *proc
}

func (e endRecorder) Process(s extprocv3.ExternalProcessor_ProcessServer) error {
	return e.next.Process(recordingStream{ExternalProcessor_ProcessServer: s, proc: e.proc})
}

type recordingStream struct {
	extprocv3.ExternalProcessor_ProcessServer
	proc *proc
}

func (r recordingStream) Recv() (*extprocv3.ProcessingRequest, error) {
	req, err := r.ExternalProcessor_ProcessServer.Recv()
	var end *corev3.HeaderMap
	switch {
	case req.GetResponseTrailers() != nil:
		end = req.GetResponseTrailers().GetTrailers()
	case req.GetResponseHeaders().GetEndOfStream():
		end = req.GetResponseHeaders().GetHeaders()
	default:
		return req, err
	}
	names := []string{}
	for _, h := range end.GetHeaders() {
		names = append(names, h.GetKey())
	}
	r.proc.mu.Lock()
	r.proc.ends = append(r.proc.ends, names)
	r.proc.mu.Unlock()
	return req, err
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
// first call's record is written (the test waits for the record in the store) is refused
// FAILED_PRECONDITION outcome-unknown, not ALREADY_EXISTS with the original status: the trailers
// reach the processor, but without grpc-status (see processor), so the record holds an unknown
// outcome, for a call that failed UNAVAILABLE as for one that succeeded.
func TestProxylessRetriedCallRunsOnce(t *testing.T) {
	for _, mode := range []filterextproc.ProcessingMode_BodySendMode{filterextproc.ProcessingMode_NONE, filterextproc.ProcessingMode_GRPC} {
		t.Run(mode.String(), func(t *testing.T) {
			svc := &chargeService{started: make(chan struct{}, 1), release: make(chan struct{})}
			backend := serve(t, func(gs *grpc.Server) { testgrpc.RegisterTestServiceServer(gs, svc) })
			proc := processor(t)
			name := "charge-" + strings.ToLower(mode.String())
			client := xdsClient(t, name, proc.addr, resources(t, name, backend, proc.addr, mode))
			call := func(key, payload string) (*testgrpc.SimpleResponse, error) {
				ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "idempotency-key", key), 20*time.Second)
				defer cancel()
				return client.UnaryCall(ctx, &testgrpc.SimpleRequest{Payload: &testgrpc.Payload{Body: []byte(payload)}}, grpc.WaitForReady(true))
			}
			refusedUnknown := func(err error) {
				t.Helper()
				require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
				require.Equal(t, "idempotency_outcome-unknown", status.Convert(err).Message())
			}

			resp, err := call("k-1", "10 EUR")
			require.NoError(t, err, "no first call fails because of the processor")
			require.Equal(t, "charged:10 EUR", string(resp.GetPayload().GetBody()))
			rec := proc.record(t, "k-1")
			require.True(t, rec.Response.OutcomeUnknown, "the call ended OK, but its status never reached the processor")
			ends := proc.callEnds()
			require.Len(t, ends, 1, "the first call's trailers reached the processor")
			require.NotContains(t, ends[0], "grpc-status")

			_, err = call("k-1", "10 EUR")
			refusedUnknown(err)
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

			_, err = call("k-3", "unavailable")
			require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
			require.True(t, proc.record(t, "k-3").Response.OutcomeUnknown)
			_, err = call("k-3", "unavailable")
			refusedUnknown(err)
			require.EqualValues(t, 3, svc.calls.Load(), "a failed call is not run again either")

			ends = proc.callEnds()
			require.Len(t, ends, 3, "each call that ran sent its end")
			for _, names := range ends {
				require.NotContains(t, names, "grpc-status")
			}
			require.Zero(t, proc.misconfigurations(t), "that client sends no response attributes: not a misconfiguration")
		})
	}
}
