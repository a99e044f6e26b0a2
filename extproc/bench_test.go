package extproc_test

import (
	"context"
	"io"
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"google.golang.org/grpc"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/extproctest"
	"github.com/idempotency-extproc/idempotency-extproc/internal/logbatch"
)

// These benchmarks run the stream handler on an in-memory stream, without gRPC, to show what the
// processor itself costs per request, next to a null processor that answers CONTINUE to every
// phase on the same stream.

// memStream is an ExternalProcessor_ProcessServer that plays Envoy's side in lock-step: it
// returns the messages of one request, stopping early when the server answers with an
// ImmediateResponse or turns later phases off, unless script is set: then it hands over every
// message whatever the server answers.
type memStream struct {
	grpc.ServerStream
	ctx    context.Context
	msgs   []*extprocv3.ProcessingRequest
	next   int
	script bool
}

func (s *memStream) Context() context.Context { return s.ctx }

func (s *memStream) Recv() (*extprocv3.ProcessingRequest, error) {
	if s.next >= len(s.msgs) {
		return nil, io.EOF
	}
	m := s.msgs[s.next]
	s.next++
	return m, nil
}

func (s *memStream) Send(r *extprocv3.ProcessingResponse) error {
	if s.script {
		return nil
	}
	if r.GetImmediateResponse() != nil {
		s.next = len(s.msgs)
	}
	if mo := r.GetModeOverride(); mo != nil && mo.GetResponseHeaderMode() == filterextproc.ProcessingMode_SKIP {
		s.next = len(s.msgs)
	}
	return nil
}

var _ extprocv3.ExternalProcessor_ProcessServer = (*memStream)(nil)

var benchBody = []byte(`{"amount":100,"currency":"EUR","reference":"order-8812","customer":"c_12"}`)

// benchRequest builds Envoy's messages for one request with the given key ("" for none).
func benchRequest(method, key string) []*extprocv3.ProcessingRequest {
	r := request{method: method, path: "/v1/payments", headers: []string{
		"content-type", "application/json", "authorization", "Bearer 0123456789abcdef", "user-agent", "bench/1.0",
	}, body: benchBody}
	if key != "" {
		r.headers = append(r.headers, "idempotency-key", key)
	}
	if method == "GET" {
		r.body = nil
	}
	up := upstream{status: 201, headers: []string{"content-type", "application/json", "x-envoy-upstream-service-time", "2"}, body: make([]byte, 1024)}
	msgs := []*extprocv3.ProcessingRequest{requestHeaders(r)}
	if len(r.body) > 0 {
		msgs = append(msgs, requestBody(r.body))
	}
	return append(msgs, responseHeaders(up), responseBody(up.body, true))
}

type benchTarget struct {
	name string
	srv  extprocv3.ExternalProcessorServer
}

func benchTargets(b *testing.B) []benchTarget {
	mem, err := cache.NewMemory(cache.MemoryOptions{})
	require.NoError(b, err)
	b.Cleanup(func() { _ = mem.Close() })
	srv, err := extproc.NewServer(extproc.Options{Store: mem, Policy: policy.Default()})
	require.NoError(b, err)
	// Tracing on: every span sampled and handed to an exporter that drops it, so that the cost
	// shown is the processor's and the SDK's, not an exporter's I/O.
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()), sdktrace.WithBatcher(discardSpans{}))
	b.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	traced, err := extproc.NewServer(extproc.Options{Store: mem, Policy: policy.Default(), Tracer: tp.Tracer("bench")})
	require.NoError(b, err)
	return []benchTarget{{"null", extproctest.NullProcessor{}}, {"memory", srv}, {"memory-traced", traced}}
}

// discardSpans is a span exporter that drops every span.
type discardSpans struct{}

func (discardSpans) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (discardSpans) Shutdown(context.Context) error                             { return nil }

var benchSeq atomic.Int64

// BenchmarkProcess measures one request's handling per workload and target: uncovered GET,
// first execution (four messages) and replay of a completed key.
func BenchmarkProcess(b *testing.B) {
	workloads := []struct {
		name string
		msgs func() []*extprocv3.ProcessingRequest
	}{
		{"uncovered", func() []*extprocv3.ProcessingRequest { return benchRequest("GET", "") }},
		{"first", func() []*extprocv3.ProcessingRequest {
			return benchRequest("POST", "key-"+strconv.FormatInt(benchSeq.Add(1), 10))
		}},
		{"replay", func() []*extprocv3.ProcessingRequest { return benchRequest("POST", "replayed") }},
	}
	for _, w := range workloads {
		for _, t := range benchTargets(b) {
			b.Run(w.name+"/"+t.name, func(b *testing.B) {
				ctx := b.Context()
				run := func(msgs []*extprocv3.ProcessingRequest) {
					if err := t.srv.Process(&memStream{ctx: ctx, msgs: msgs}); err != nil {
						b.Fatal(err)
					}
				}
				run(benchRequest("POST", "replayed"))
				// Messages are built outside the timer: Envoy builds them, not the processor.
				batch := make([][]*extprocv3.ProcessingRequest, 0, 1024)
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if i%1024 == 0 {
						b.StopTimer()
						batch = batch[:0]
						for range min(1024, b.N-i) {
							batch = append(batch, w.msgs())
						}
						b.StartTimer()
					}
					run(batch[i%1024])
				}
			})
		}
	}
}

// BenchmarkProcessOverhead alternates the null processor and the memory-store processor on the
// same requests and reports the processor's time as a multiple of the null processor's.
func BenchmarkProcessOverhead(b *testing.B) {
	targets := benchTargets(b)[:2]
	for _, w := range []string{"first", "replay"} {
		b.Run(w, func(b *testing.B) {
			ctx := b.Context()
			var spent [2]time.Duration
			for i := 0; i < b.N; i++ {
				key := "replayed"
				if w == "first" {
					key = "overhead-" + strconv.FormatInt(benchSeq.Add(1), 10)
				}
				msgs := [2][]*extprocv3.ProcessingRequest{benchRequest("POST", key), benchRequest("POST", key)}
				for j, t := range targets {
					start := time.Now()
					if err := t.srv.Process(&memStream{ctx: ctx, msgs: msgs[j]}); err != nil {
						b.Fatal(err)
					}
					spent[j] += time.Since(start)
				}
			}
			b.ReportMetric(float64(spent[1])/float64(spent[0]), "×null")
			b.ReportMetric(float64(spent[1]-spent[0])/float64(b.N), "added-ns/req")
		})
	}
}

// BenchmarkSettledMetadata measures what the access log's dynamic metadata costs a settled
// request: building it (a copy of the route's encoded template with the key_hash written in) and
// encoding the answer that carries it, against encoding the same answer without it.
func BenchmarkSettledMetadata(b *testing.B) {
	for _, withMD := range []bool{false, true} {
		name := "without"
		if withMD {
			name = "with"
		}
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := extproc.EncodeSettledAnswer(withMD); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkRequestLogLine measures the one line a covered request logs at info, formatted by
// zerolog and written to /dev/null as the binary writes its log: one line at a time ("unbatched",
// a system call each), and in batches (logbatch, the binary's writer).
func BenchmarkRequestLogLine(b *testing.B) {
	for _, batched := range []bool{false, true} {
		name := "unbatched"
		if batched {
			name = "batched"
		}
		b.Run(name, func(b *testing.B) {
			devNull, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
			require.NoError(b, err)
			defer devNull.Close()
			var w io.Writer = devNull
			if batched {
				lw := logbatch.New(devNull, 50*time.Millisecond)
				defer lw.Close()
				w = lw
			}
			log := zerolog.New(w).Level(zerolog.InfoLevel).With().Timestamp().Logger()
			b.ReportAllocs()
			b.ResetTimer()
			extproc.LogRequestLines(&log, b.N)
		})
	}
}

// BenchmarkFeaturesElsewhere runs first executions on a route that uses no optional feature, in a
// policy that has only that route and in one whose other routes use shadow mode, in_flight_wait,
// problem templates and the expiry headers: a feature costs only the routes that turn it on.
// It reports the second's time per request as a multiple of the first's, in the same run.
func BenchmarkFeaturesElsewhere(b *testing.B) {
	const plain = `
defaults: {expires_header: "", first_sent_header: ""}
routes:
  - {name: plain, match: {path_prefix: /v1/payments}}
`
	const elsewhere = plain + `
  - {name: shadowed, match: {path_prefix: /v1/shadow}, mode: shadow}
  - {name: waiting, match: {path_prefix: /v1/wait}, in_flight_wait: 2s}
  - {name: templated, match: {path_prefix: /v1/midaz}, expires_header: x-idempotency-expires,
     problems: {request-in-progress: {status: 409, body: '{"code":"0084","title":"{{.Title}}"}', content_type: application/json}}}
`
	var servers [2]*extproc.Server
	for i, p := range []string{plain, elsewhere} {
		pol, err := policy.Parse([]byte(p))
		require.NoError(b, err)
		mem, err := cache.NewMemory(cache.MemoryOptions{})
		require.NoError(b, err)
		b.Cleanup(func() { _ = mem.Close() })
		servers[i], err = extproc.NewServer(extproc.Options{Store: mem, Policy: pol})
		require.NoError(b, err)
	}
	ctx := b.Context()
	var spent [2]time.Duration
	for i := 0; i < b.N; i++ {
		key := "elsewhere-" + strconv.FormatInt(benchSeq.Add(1), 10)
		msgs := [2][]*extprocv3.ProcessingRequest{benchRequest("POST", key), benchRequest("POST", key)}
		for j := range servers {
			// Alternate which goes first, so that neither always meets a warm cache.
			j := (j + i) % 2
			start := time.Now()
			if err := servers[j].Process(&memStream{ctx: ctx, msgs: msgs[j]}); err != nil {
				b.Fatal(err)
			}
			spent[j] += time.Since(start)
		}
	}
	b.ReportMetric(float64(spent[1])/float64(spent[0]), "×plain")
	b.ReportMetric(float64(spent[0])/float64(b.N), "plain-ns/req")
}
