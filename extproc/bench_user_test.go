package extproc_test

import (
	"net"
	"os"
	"strconv"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/extproctest"
	"github.com/idempotency-extproc/idempotency-extproc/internal/logbatch"
)

// The user-shaped benchmark: first executions as the user bench (e2e/bench -mode user) sends
// them to the shipped binary, run in-process so that each difference from BenchmarkProcess can
// be turned off alone and its cost read with allocation counts.

// userPolicyChart is the policy the user bench gives the binary: the measured path is matched by
// the last route, after a disabled prefix route and a path_regex route.
const userPolicyChart = `routes:
  - name: health
    match: { path_prefix: /healthz }
    enabled: false
  - name: ledger-transactions
    match: { path_regex: '^/v1/organizations/(?P<org>[^/]+)/ledgers/(?P<ledger>[^/]+)/transactions' }
    scope_path_params: [org, ledger]
  - name: payments
    match: { path_prefix: /v1/payments }
`

const userPolicyOne = "routes:\n  - name: payments\n    match: { path_prefix: /v1/payments }\n"

// The attributes Envoy sends with the shipped configuration (envoy/envoy.yaml).
var (
	userReqAttrs  = map[string]*structpb.Struct{"envoy.filters.http.ext_proc": mustStructpb(map[string]any{"xds.route_name": "payments"})}
	userRespAttrs = map[string]*structpb.Struct{"envoy.filters.http.ext_proc": mustStructpb(map[string]any{"response.code_details": "via_upstream", "upstream.request_attempt_count": 1})}
)

func mustStructpb(m map[string]any) *structpb.Struct {
	s, err := structpb.NewStruct(m)
	if err != nil {
		panic(err)
	}
	return s
}

// userMessages builds the four messages of one BUFFERED first execution with Envoy's header set
// (short: method, path and key only) and 33-byte bodies.
func userMessages(short bool, key string, n int64) []*extprocv3.ProcessingRequest {
	body := []byte(`{"amount":100,"currency":"EUR"}xx`)
	hs := []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte("POST")},
		{Key: ":path", RawValue: []byte("/v1/payments")},
		{Key: "idempotency-key", RawValue: []byte(key)},
	}
	if !short {
		hs = extproctest.EnvoyRequestHeaders(key, "6f1c2b1e-9a4d-4c1e-8b1a-"+strconv.FormatInt(1e11+n, 10), len(body))
	}
	var reqAttrs, respAttrs map[string]*structpb.Struct
	if !short {
		reqAttrs, respAttrs = userReqAttrs, userRespAttrs
	}
	return []*extprocv3.ProcessingRequest{
		{
			Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
				Headers: &corev3.HeaderMap{Headers: hs},
			}},
			Attributes: reqAttrs,
			ProtocolConfig: &extprocv3.ProtocolConfiguration{
				RequestBodyMode: filterextproc.ProcessingMode_BUFFERED, ResponseBodyMode: filterextproc.ProcessingMode_BUFFERED,
			},
		},
		requestBody(body),
		{
			Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
				Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
					{Key: ":status", RawValue: []byte("201")},
					{Key: "content-type", RawValue: []byte("application/json")},
					{Key: "content-length", RawValue: []byte(strconv.Itoa(len(body)))},
					{Key: "date", RawValue: []byte("Mon, 07 Dec 2026 10:00:00 GMT")},
					{Key: "x-envoy-upstream-service-time", RawValue: []byte("3")},
				}},
			}},
			Attributes: respAttrs,
		},
		responseBody(body, true),
	}
}

// userVariant is the shipped binary's set-up with at most one difference turned off.
type userVariant struct {
	name      string
	noLog     bool // no logger (the shipped binary logs at info through logbatch)
	noMetrics bool // no metrics
	oneRoute  bool // a one-route policy
	short     bool // method, path and key only, no attributes
}

// BenchmarkProcessUser runs first executions on an empty memory store as the user bench sends
// them, for the shipped set-up ("shipped") and for the same with one difference taken away, next
// to the null processor on the same messages.
func BenchmarkProcessUser(b *testing.B) {
	variants := []userVariant{
		{name: "shipped"},
		{name: "no-log", noLog: true},
		{name: "no-metrics", noMetrics: true},
		{name: "one-route", oneRoute: true},
		{name: "short-headers", short: true},
		{name: "bare", noLog: true, noMetrics: true, oneRoute: true, short: true},
	}
	b.Run("null", func(b *testing.B) { runUser(b, extproctest.NullProcessor{}, false) })
	for _, v := range variants {
		b.Run(v.name, func(b *testing.B) { runUser(b, userServer(b, v), v.short) })
	}
}

func userServer(b *testing.B, v userVariant) extprocv3.ExternalProcessorServer {
	src := userPolicyChart
	if v.oneRoute {
		src = userPolicyOne
	}
	pol, err := policy.Parse([]byte(src))
	require.NoError(b, err)
	mem, err := cache.NewMemory(cache.MemoryOptions{})
	require.NoError(b, err)
	b.Cleanup(func() { _ = mem.Close() })
	opts := extproc.Options{Store: mem, Policy: pol}
	if !v.noLog {
		devNull, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
		require.NoError(b, err)
		lines := logbatch.New(devNull, 50*time.Millisecond)
		b.Cleanup(func() { _ = lines.Close(); _ = devNull.Close() })
		log := zerolog.New(lines).Level(zerolog.InfoLevel).With().Timestamp().Logger()
		opts.Logger = &log
	}
	if !v.noMetrics {
		m, err := extproc.NewMetrics(prometheus.NewRegistry())
		require.NoError(b, err)
		opts.Metrics = m
	}
	srv, err := extproc.NewServer(opts)
	require.NoError(b, err)
	return srv
}

func runUser(b *testing.B, srv extprocv3.ExternalProcessorServer, short bool) {
	ctx := b.Context()
	batch := make([][]*extprocv3.ProcessingRequest, 0, 1024)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if i%1024 == 0 {
			// Messages are built outside the timer: Envoy builds them, not the processor.
			b.StopTimer()
			batch = batch[:0]
			for range min(1024, b.N-i) {
				n := benchSeq.Add(1)
				batch = append(batch, userMessages(short, "user-"+strconv.FormatInt(n, 10), n))
			}
			b.StartTimer()
		}
		if err := srv.Process(&memStream{ctx: ctx, msgs: batch[i%1024]}); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkProcessUserGRPC serves the shipped set-up over loopback gRPC with the binary's server
// options (stream workers, the first-message tap, the panic interceptor) and the null processor
// on a plain grpc.NewServer, as the user bench does, at 32 concurrent streams: a CPU profile of it
// (-cpuprofile) shows the gRPC layer's share next to the handler's.
//
// With IDEMPOTENCY_BENCH_TARGET set to an address, it sends the same load to a process started
// apart instead: the shipped binary with --admin-pprof=true, to profile it at /debug/pprof/.
func BenchmarkProcessUserGRPC(b *testing.B) {
	if addr := os.Getenv("IDEMPOTENCY_BENCH_TARGET"); addr != "" {
		b.Run("external", func(b *testing.B) { runUserGRPC(b, addr) })
		return
	}
	shipped := userServer(b, userVariant{}).(*extproc.Server)
	targets := []struct {
		name string
		srv  *grpc.Server
		impl extprocv3.ExternalProcessorServer
	}{
		{"null-plain", grpc.NewServer(), extproctest.NullProcessor{}},
		{"shipped", grpc.NewServer(grpc.ChainStreamInterceptor(shipped.StreamInterceptor()), grpc.InTapHandle(shipped.TapHandle()), grpc.ForceServerCodecV2(shipped.Codec()), grpc.NumStreamWorkers(extproc.StreamWorkers)), shipped},
	}
	for _, t := range targets {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(b, err)
		extprocv3.RegisterExternalProcessorServer(t.srv, t.impl)
		go func() { _ = t.srv.Serve(lis) }()
		b.Cleanup(t.srv.Stop)
		b.Run(t.name, func(b *testing.B) { runUserGRPC(b, lis.Addr().String()) })
	}
}

// runUserGRPC sends first executions to the ext_proc server at addr from 32 concurrent streams.
func runUserGRPC(b *testing.B, addr string) {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(b, err)
	defer conn.Close()
	client := extprocv3.NewExternalProcessorClient(conn)
	b.SetParallelism(16) // 32 streams on 2 cores
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			n := benchSeq.Add(1)
			msgs := userMessages(false, "grpc-"+strconv.FormatInt(n, 10), n)
			s, err := client.Process(b.Context())
			if err != nil {
				b.Error(err)
				return
			}
			for _, m := range msgs {
				if err := s.Send(m); err != nil {
					b.Error(err)
					return
				}
				if _, err := s.Recv(); err != nil {
					b.Error(err)
					return
				}
			}
			_ = s.CloseSend()
		}
	})
}
