package main

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"runtime/metrics"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/cache/seal"
)

// The targets of -mode costs beside those of the default mode: each a feature turned on.
const (
	targetMemoryTraced   = "memory store, tracing on"     // exporting every request's spans over OTLP/HTTP
	targetMemorySealed   = "memory store, sealed"         // a keyring seals every record
	targetMemoryWait     = "memory store, in_flight_wait" // duplicates of a request in flight wait for its replay
	targetRedisUnbatched = "redis store, batching off"    // a round trip per store call
)

// benchKeyring is a keyring of one fresh random key, as a key file of one line would give.
func benchKeyring() (*seal.Keyring, error) {
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		return nil, err
	}
	return seal.ParseKeyring([]byte("bench-1:" + base64.StdEncoding.EncodeToString(key) + "\n"))
}

// measureSealOverhead stores a probe record in m and the same record in a store without a
// keyring, and returns how many more bytes m accounts for it: the seal's header and tag when m
// seals, 0 when it does not. The probe is removed from m.
func measureSealOverhead(m *cache.Memory) (int64, error) {
	plain, err := cache.NewMemory(cache.MemoryOptions{})
	if err != nil {
		return 0, err
	}
	defer plain.Close()
	size := func(s *cache.Memory) (int64, error) {
		ctx := context.Background()
		before := s.Bytes()
		l, _, err := s.Acquire(ctx, "bench-seal-probe", cache.Claim{Fingerprint: make([]byte, 32), LockTTL: time.Minute, TTL: time.Hour})
		if err != nil {
			return 0, err
		}
		if err := s.Complete(ctx, l, cache.Response{Status: 201, Body: responseBody}); err != nil {
			return 0, err
		}
		n := s.Bytes() - before
		return n, s.Purge(ctx, "bench-seal-probe")
	}
	sealed, err := size(m)
	if err != nil {
		return 0, err
	}
	unsealed, err := size(plain)
	return sealed - unsealed, err
}

// startTracing sets tracing up as the binary does (cmd/idempotency-extproc/tracing.go) with its
// default protocol, OTLP over HTTP/protobuf, and its default sampler (every trace), exporting to
// the receiver at addr through the SDK's batch span processor.
// Each span ended is counted into ended, by the target itself: a span's export may come after
// its round's counters are read (the batch processor's timer), into another target's round.
func startTracing(addr string, ended *atomic.Int64) (*sdktrace.TracerProvider, error) {
	if addr == "" {
		return nil, fmt.Errorf("%s: no OTLP receiver", envOTLP)
	}
	exporter, err := otlptracehttp.New(context.Background(), otlptracehttp.WithEndpoint(addr), otlptracehttp.WithInsecure())
	if err != nil {
		return nil, err
	}
	res, err := resource.New(context.Background(), resource.WithAttributes(semconv.ServiceName("idempotency-extproc")), resource.WithTelemetrySDK())
	if err != nil {
		return nil, err
	}
	return sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter), sdktrace.WithSpanProcessor(spanCounter{ended}), sdktrace.WithResource(res)), nil
}

// spanCounter is a span processor that counts the spans ended.
type spanCounter struct{ ended *atomic.Int64 }

func (spanCounter) OnStart(context.Context, sdktrace.ReadWriteSpan) {}
func (c spanCounter) OnEnd(sdktrace.ReadOnlySpan)                   { c.ended.Add(1) }
func (spanCounter) Shutdown(context.Context) error                  { return nil }
func (spanCounter) ForceFlush(context.Context) error                { return nil }

// spanReceiver is an OTLP/HTTP trace receiver that counts the spans it is sent and discards
// them, in the benchmark's process: a collector's place.
type spanReceiver struct {
	spans, exports atomic.Int64
	srv            *http.Server
	addr           string
}

func startSpanReceiver() (*spanReceiver, error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	r := &spanReceiver{addr: lis.Addr().String()}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/traces", func(w http.ResponseWriter, req *http.Request) {
		body, err := io.ReadAll(req.Body)
		var msg collectortrace.ExportTraceServiceRequest
		if err == nil {
			err = proto.Unmarshal(body, &msg)
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		var n int64
		for _, rs := range msg.GetResourceSpans() {
			for _, ss := range rs.GetScopeSpans() {
				n += int64(len(ss.GetSpans()))
			}
		}
		r.spans.Add(n)
		r.exports.Add(1)
		out, _ := proto.Marshal(&collectortrace.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		_, _ = w.Write(out)
	})
	r.srv = &http.Server{Handler: mux}
	go func() { _ = r.srv.Serve(lis) }()
	return r, nil
}

func (r *spanReceiver) close() { _ = r.srv.Close() }

// memUsage is a target process' memory at one moment.
type memUsage struct {
	LiveHeap   int64 // the heap live at the last collection's mark (/gc/heap/live:bytes)
	Stacks     int64 // goroutine stacks (/memory/classes/heap/stacks:bytes)
	RSS        int64 // resident now
	Goroutines int64
}

// serveMemory answers the process' memory now; with ?gc=1, after two collections (the second
// empties the sync.Pools the first only moved to their victim caches), so that the live heap is
// what is reachable now.
func serveMemory(w http.ResponseWriter, r *http.Request) {
	if r.URL.Query().Get("gc") == "1" {
		runtime.GC()
		runtime.GC()
	}
	_ = json.NewEncoder(w).Encode(readMemory())
}

func readMemory() memUsage {
	s := []metrics.Sample{{Name: "/gc/heap/live:bytes"}, {Name: "/sched/goroutines:goroutines"}, {Name: "/memory/classes/heap/stacks:bytes"}}
	metrics.Read(s)
	u := memUsage{LiveHeap: int64(s[0].Value.Uint64()), Goroutines: int64(s[1].Value.Uint64()), Stacks: int64(s[2].Value.Uint64())}
	if b, err := os.ReadFile("/proc/self/statm"); err == nil {
		if f := strings.Fields(string(b)); len(f) > 1 {
			pages, _ := strconv.ParseInt(f[1], 10, 64)
			u.RSS = pages * int64(os.Getpagesize())
		}
	}
	return u
}

// memory reads the target's memory now (after a collection with gc).
func (t *targetProcess) memory(ctx context.Context, gc bool) (memUsage, error) {
	var u memUsage
	path := "/mem"
	if gc {
		path += "?gc=1"
	}
	return u, t.getJSON(ctx, path, &u)
}
