package cache_test

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// processCPU returns the CPU time this process has used so far, every thread.
func processCPU(tb testing.TB) time.Duration {
	var ru syscall.Rusage
	require.NoError(tb, syscall.Getrusage(syscall.RUSAGE_SELF, &ru))
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// naiveCost is what one side of BenchmarkRedisAgainstNaive spent in one round.
type naiveCost struct {
	ops            int
	wall, cpu, srv time.Duration
	mallocs        uint64
}

func (c *naiveCost) add(d naiveCost) {
	c.ops += d.ops
	c.wall += d.wall
	c.cpu += d.cpu
	c.srv += d.srv
	c.mallocs += d.mallocs
}

func (c naiveCost) per(d time.Duration) float64 {
	return float64(d.Nanoseconds()) / 1e3 / float64(c.ops)
}

// BenchmarkRedisAgainstNaive runs the store's Redis calls of a first execution (Acquire, then
// Complete of a 33-byte response, and of a 4 KiB one, which is staged) and of a replay (Acquire of a completed key) against what the
// naive processor of the user bench (e2e/bench) sends for the same requests on go-redis as it
// is (SET NX, then a SET of status and body; SET NX, then GET of a taken key), in the same
// process, on the same redis-server, in interleaved rounds, with 1 and 32 concurrent callers.
// It reports each side's process CPU, allocations and redis-server CPU per request, and the
// store's over the naive side's: the ratios are the figures, the machine being shared.
func BenchmarkRedisAgainstNaive(b *testing.B) {
	srv := redistest.Start(b, redistest.Options{})
	admin := srv.Client(b)
	s, err := cache.OpenRedis(cache.RedisOptions{URL: srv.URL(), Timeout: time.Second})
	require.NoError(b, err)
	b.Cleanup(func() { _ = s.Close() })
	naive := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	b.Cleanup(func() { _ = naive.Close() })
	ctx := context.Background()
	claim := cache.Claim{Fingerprint: make([]byte, 32), LockTTL: 30 * time.Second, TTL: 24 * time.Hour, Route: "payments"}
	body := make([]byte, 33)
	var seq atomic.Int64
	key := func() string { return "k:" + strconv.FormatInt(seq.Add(1), 10) }

	// Each side's request, on a key of its own, with a response body of size bytes.
	productFirstOf := func(size int) func(string) error {
		resp := cache.Response{Status: 201, Headers: []cache.Header{{Name: "content-type", Value: []byte("application/json")}}, Body: make([]byte, size)}
		return func(k string) error {
			l, _, err := s.Acquire(ctx, "idempotency:"+k, claim)
			if err != nil {
				return err
			}
			return s.Complete(ctx, l, resp)
		}
	}
	naiveFirstOf := func(size int) func(string) error {
		body := make([]byte, size)
		return func(k string) error {
			k = "naive:" + k
			ok, err := naive.SetNX(ctx, k, "", 30*time.Second).Result()
			if err != nil || !ok {
				return fmt.Errorf("naive claim: %v, %w", ok, err)
			}
			return naive.Set(ctx, k, "201 "+string(body), 24*time.Hour).Err()
		}
	}
	productFirst, naiveFirst := productFirstOf(len(body)), naiveFirstOf(len(body))
	require.NoError(b, productFirst("replayed"))
	require.NoError(b, naiveFirst("replayed"))
	productReplay := func(string) error {
		l, rec, err := s.Acquire(ctx, "idempotency:replayed", claim)
		if err != nil || l.Held() || rec == nil || rec.State != cache.Completed {
			return fmt.Errorf("product replay: %v, %w", rec, err)
		}
		return nil
	}
	naiveReplay := func(string) error {
		ok, err := naive.SetNX(ctx, "naive:replayed", "", 30*time.Second).Result()
		if err != nil || ok {
			return fmt.Errorf("naive replay claimed: %w", err)
		}
		_, err = naive.Get(ctx, "naive:replayed").Result()
		return err
	}

	for _, load := range []struct {
		name           string
		product, naive func(string) error
	}{
		{"first", productFirst, naiveFirst},
		{"first-4KiB", productFirstOf(4 << 10), naiveFirstOf(4 << 10)},
		{"replay", productReplay, naiveReplay},
	} {
		for _, workers := range []int{1, 4, 32} {
			b.Run(fmt.Sprintf("%s/callers=%d", load.name, workers), func(b *testing.B) {
				n := max(b.N, 2000)
				measure := func(op func(string) error) naiveCost {
					var ms0, ms1 runtime.MemStats
					runtime.ReadMemStats(&ms0)
					srv0, cpu0, start := serverCPU(b, admin), processCPU(b), time.Now()
					var next atomic.Int64
					var failed atomic.Value
					var wg sync.WaitGroup
					for range workers {
						wg.Go(func() {
							for next.Add(1) <= int64(n) {
								if err := op(key()); err != nil {
									failed.CompareAndSwap(nil, err)
									return
								}
							}
						})
					}
					wg.Wait()
					c := naiveCost{ops: n, wall: time.Since(start), cpu: processCPU(b) - cpu0}
					c.srv = serverCPU(b, admin) - srv0
					runtime.ReadMemStats(&ms1)
					c.mallocs = ms1.Mallocs - ms0.Mallocs
					if err, _ := failed.Load().(error); err != nil {
						b.Fatal(err)
					}
					return c
				}
				const rounds = 4
				var prod, nai naiveCost
				b.ResetTimer()
				for r := range rounds {
					// Each round starts with the other side.
					if r%2 == 0 {
						prod.add(measure(load.product))
						nai.add(measure(load.naive))
					} else {
						nai.add(measure(load.naive))
						prod.add(measure(load.product))
					}
				}
				b.StopTimer()
				b.ReportMetric(prod.per(prod.cpu), "cpu-µs/op")
				b.ReportMetric(nai.per(nai.cpu), "naive-cpu-µs/op")
				b.ReportMetric(prod.per(prod.cpu)-nai.per(nai.cpu), "cpu-µs-over-naive")
				b.ReportMetric(float64(prod.cpu)/float64(prod.ops)/(float64(nai.cpu)/float64(nai.ops)), "cpu×naive")
				b.ReportMetric(float64(prod.mallocs)/float64(prod.ops), "allocs/req")
				b.ReportMetric(float64(nai.mallocs)/float64(nai.ops), "naive-allocs/req")
				b.ReportMetric(prod.per(prod.srv), "server-µs/op")
				b.ReportMetric(float64(prod.srv)/float64(prod.ops)/max(float64(nai.srv)/float64(nai.ops), 1), "server×naive")
				b.ReportMetric(float64(nai.wall)/float64(nai.ops)/(float64(prod.wall)/float64(prod.ops)), "throughput×naive")
				b.ReportMetric(0, "ns/op")
			})
		}
	}
	require.NoError(b, admin.FlushAll(ctx).Err())
}
