package cache_test

import (
	"bytes"
	"fmt"
	"runtime"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// benchStores are the stores the benchmarks compare: memory and a real redis-server.
func benchStores(b *testing.B) map[string]func(b *testing.B) cache.Store {
	return map[string]func(b *testing.B) cache.Store{
		"memory": func(b *testing.B) cache.Store {
			m, err := cache.NewMemory(cache.MemoryOptions{})
			require.NoError(b, err)
			return m
		},
		"redis": func(b *testing.B) cache.Store {
			srv := redistest.Start(b, redistest.Options{})
			s, err := cache.OpenRedis(cache.RedisOptions{URL: srv.URL(), Timeout: time.Second, PoolSize: 64})
			require.NoError(b, err)
			return s
		},
	}
}

var benchClaim = cache.Claim{Fingerprint: bytes.Repeat([]byte{7}, 32), LockTTL: 30 * time.Second, TTL: time.Hour}

var benchResponse = cache.Response{
	Status: 201,
	Headers: []cache.Header{
		{Name: "content-type", Value: []byte("application/json")},
		{Name: "set-cookie", Value: []byte("a=1")},
		{Name: "x-request-trace", Value: []byte("0af7651916cd43dd8448eb211c80319c")},
	},
	Body: bytes.Repeat([]byte("x"), 1024),
}

var keySeq atomic.Int64

func freshKey() string { return "idempotency:bench:" + strconv.FormatInt(keySeq.Add(1), 10) }

// BenchmarkAcquire claims fresh keys: the first half of a first execution.
func BenchmarkAcquire(b *testing.B) {
	for name, open := range benchStores(b) {
		b.Run(name, func(b *testing.B) {
			s := open(b)
			defer s.Close()
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, _, err := s.Acquire(b.Context(), freshKey(), benchClaim); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}

// BenchmarkAcquireCompleted reads a completed 1 KiB record: the whole store cost of a replay.
func BenchmarkAcquireCompleted(b *testing.B) {
	for name, open := range benchStores(b) {
		b.Run(name, func(b *testing.B) {
			s := open(b)
			defer s.Close()
			l, _, err := s.Acquire(b.Context(), "idempotency:done", benchClaim)
			require.NoError(b, err)
			require.NoError(b, s.Complete(b.Context(), l, benchResponse))
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					_, rec, err := s.Acquire(b.Context(), "idempotency:done", benchClaim)
					if err != nil || rec == nil || len(rec.Response.Body) != 1024 {
						b.Errorf("replay read failed: %v", err)
						return
					}
				}
			})
		})
	}
}

// BenchmarkComplete records a 1 KiB response: the second half of a first execution.
func BenchmarkComplete(b *testing.B) {
	for name, open := range benchStores(b) {
		b.Run(name, func(b *testing.B) {
			s := open(b)
			defer s.Close()
			leases := make([]cache.Lease, b.N)
			for i := range leases {
				l, _, err := s.Acquire(b.Context(), freshKey(), benchClaim)
				require.NoError(b, err)
				leases[i] = l
			}
			var next atomic.Int64
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if err := s.Complete(b.Context(), leases[next.Add(1)-1], benchResponse); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}

// bytesPerRecord fills a memory store with n completed records of a 1 KiB response and returns
// the memory they hold, per record: the Go heap they take, and the store's segments mapped
// outside it.
func bytesPerRecord(tb testing.TB, n int) (heap, mapped float64) {
	m, err := cache.NewMemory(cache.MemoryOptions{MaxBytes: 1 << 40})
	require.NoError(tb, err)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for i := range n {
		l, _, err := m.Acquire(tb.Context(), fmt.Sprintf("idempotency:%064d", i), benchClaim)
		require.NoError(tb, err)
		require.NoError(tb, m.Complete(tb.Context(), l, benchResponse))
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	heap = float64(int64(after.HeapAlloc)-int64(before.HeapAlloc)) / float64(n)
	mapped = float64(m.Stats().Arena.MappedBytes) / float64(n)
	runtime.KeepAlive(m)
	return heap, mapped
}

// payloadBytes is what a record must hold at least: the response's body and headers.
func payloadBytes() int {
	n := len(benchResponse.Body)
	for _, h := range benchResponse.Headers {
		n += len(h.Name) + len(h.Value)
	}
	return n
}

// BenchmarkMemoryBytesPerRecord reports the memory a record of a 1 KiB response costs (Go heap
// and mapped segments), and its ratio to the payload (the target is at most 1.5).
func BenchmarkMemoryBytesPerRecord(b *testing.B) {
	heap, mapped := bytesPerRecord(b, max(b.N, 10_000))
	b.ReportMetric(heap, "heap-bytes/record")
	b.ReportMetric(mapped, "mapped-bytes/record")
	b.ReportMetric((heap+mapped)/float64(payloadBytes()), "bytes/payload")
}

// TestMemoryBytesPerRecord holds the memory store to at most 1.5 × the payload per record of a
// 1 KiB response, measured as the Go heap it takes plus its segments mapped outside that heap,
// and checks that the store's own accounting (which enforces --memory-max-bytes) does not
// undercount what it holds.
func TestMemoryBytesPerRecord(t *testing.T) {
	const n = 20_000
	heap, mapped := bytesPerRecord(t, n)
	per := heap + mapped
	ratio := per / float64(payloadBytes())
	t.Logf("%.0f bytes per record (%.0f on the Go heap, %.0f mapped) for a %d-byte payload: %.2f×", per, heap, mapped, payloadBytes(), ratio)
	require.LessOrEqual(t, ratio, 1.5)

	m, err := cache.NewMemory(cache.MemoryOptions{MaxBytes: 1 << 40})
	require.NoError(t, err)
	for i := range 1000 {
		l, _, err := m.Acquire(t.Context(), fmt.Sprintf("idempotency:%064d", i), benchClaim)
		require.NoError(t, err)
		require.NoError(t, m.Complete(t.Context(), l, benchResponse))
	}
	accounted := float64(m.Bytes()) / 1000
	require.GreaterOrEqual(t, accounted, per*0.9, "accounting %.0f bytes per record vs %.0f on the heap", accounted, per)
}

// BenchmarkMemoryCollection reports what a garbage collection costs per record a full memory
// store holds (records of a 1 KiB response), beyond a collection of the rest of the heap, next to
// the same cost for the records' bytes alone: one allocation each, held in a plain slice (the
// least a store that keeps each record in an allocation of its own can cost), and all in one
// allocation (a heap arena, as freecache and bigcache keep theirs). The collector's work grows
// with the objects it marks and sweeps, so this is what a large store adds to every collection of
// a replica. The store's segments are mapped outside the Go heap, so what it adds is its index
// and entries.
func BenchmarkMemoryCollection(b *testing.B) {
	const n = 100_000
	// collect returns the median time of a few collections while keep is reachable.
	collect := func(keep any) time.Duration {
		var ds []time.Duration
		for range 5 {
			start := time.Now()
			runtime.GC()
			ds = append(ds, time.Since(start))
		}
		runtime.KeepAlive(keep)
		slices.Sort(ds)
		return ds[len(ds)/2]
	}
	const size = 1280 // a record's key, encoded response and fingerprint, rounded up
	var store, plain, arena time.Duration
	for b.Loop() {
		m, err := cache.NewMemory(cache.MemoryOptions{MaxBytes: 1 << 40})
		require.NoError(b, err)
		for i := range n {
			l, _, err := m.Acquire(b.Context(), fmt.Sprintf("idempotency:%064d", i), benchClaim)
			require.NoError(b, err)
			require.NoError(b, m.Complete(b.Context(), l, benchResponse))
		}
		store += collect(m)
		m = nil
		blobs := make([][]byte, n)
		for i := range blobs {
			blobs[i] = make([]byte, size)
		}
		plain += collect(blobs)
		blobs = nil
		arena += collect(make([]byte, n*size))
		base := collect(nil)
		store -= base
		plain -= base
		arena -= base
	}
	b.ReportMetric(float64(store.Nanoseconds())/float64(b.N*n), "gc-ns/record")
	b.ReportMetric(float64(plain.Nanoseconds())/float64(b.N*n), "plain-gc-ns/record")
	b.ReportMetric(float64(arena.Nanoseconds())/float64(b.N*n), "arena-gc-ns/record")
	b.ReportMetric(float64(store)/float64(plain), "×plain")
}
