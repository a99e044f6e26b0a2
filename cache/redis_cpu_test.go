package cache_test

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// serverCPURE reads the CPU time redis-server's main thread reports in INFO cpu (getrusage, in
// microseconds). The main thread runs every command; the others (jemalloc's purging of freed
// pages, lazy frees) would charge one round the cleanup of the round before.
var serverCPURE = regexp.MustCompile(`used_cpu_(?:user|sys)_main_thread:([0-9.]+)`)

// serverCPU returns the CPU time redis-server's main thread has used so far.
func serverCPU(tb testing.TB, c *redis.Client) time.Duration {
	tb.Helper()
	info, err := c.Info(context.Background(), "cpu").Result()
	require.NoError(tb, err)
	var d time.Duration
	ms := serverCPURE.FindAllStringSubmatch(info, -1)
	require.Len(tb, ms, 2, "INFO cpu: %s", info)
	for _, m := range ms {
		s, err := strconv.ParseFloat(m[1], 64)
		require.NoError(tb, err)
		d += time.Duration(s * float64(time.Second))
	}
	return d
}

// BenchmarkRedisFirstExecutionCPU measures what a first execution (Acquire, then Complete of a
// response of the given body size) costs redis-server in CPU, against a plain SET of the same
// record's bytes (with the same expiry) and against that SET plus the small commands a first
// execution needs anyway (Acquire, and Complete of an empty response), on the same server in the
// same run, in alternating rounds. It reports the ratios: the target is at most 2 × the SET plus
// the small commands, at every size. The calls go one at a time, so that neither side shares
// round trips with itself.
func BenchmarkRedisFirstExecutionCPU(b *testing.B) {
	srv := redistest.Start(b, redistest.Options{})
	admin := srv.Client(b)
	s, err := cache.OpenRedis(cache.RedisOptions{URL: srv.URL(), Timeout: 10 * time.Second})
	require.NoError(b, err)
	b.Cleanup(func() { _ = s.Close() })
	claim := cache.Claim{Fingerprint: make([]byte, 32), LockTTL: 30 * time.Second, TTL: time.Hour}
	ctx := context.Background()
	for _, size := range []int{1 << 10, 64 << 10, 256 << 10, 1 << 20} {
		b.Run(fmt.Sprintf("body=%dKiB", size>>10), func(b *testing.B) {
			// Enough calls per round that redis-server's own background work (its cron) is
			// small beside them, few enough that a round's records stay under 64 MiB.
			n := max(b.N, min(2000, (64<<20)/size))
			resp := cache.Response{Status: 201, Headers: []cache.Header{{Name: "content-type", Value: []byte("application/json")}}, Body: make([]byte, size)}
			// The bytes a record of resp holds, about: the key, the header, the fingerprint and the
			// encoded response.
			record := make([]byte, size+140)
			var key int
			next := func() string { key++; return "idempotency:cpu:" + strconv.Itoa(key) }
			measure := func(op func() error) time.Duration {
				require.NoError(b, admin.FlushAll(ctx).Err())
				before := serverCPU(b, admin)
				for range n {
					require.NoError(b, op())
				}
				return serverCPU(b, admin) - before
			}
			firstExecution := func(r cache.Response) func() error {
				return func() error {
					l, _, err := s.Acquire(ctx, next(), claim)
					if err != nil {
						return err
					}
					return s.Complete(ctx, l, r)
				}
			}
			plainSet := func() error { return admin.Set(ctx, next(), record, time.Hour).Err() }
			const rounds = 3
			var first, set, small time.Duration
			b.ResetTimer()
			for range rounds {
				set += measure(plainSet)
				first += measure(firstExecution(resp))
				small += measure(firstExecution(cache.Response{Status: 204}))
			}
			b.StopTimer()
			per := func(d time.Duration) float64 { return float64(d.Microseconds()) / float64(rounds*n) }
			b.ReportMetric(per(first), "server-µs/first")
			b.ReportMetric(per(set), "server-µs/set")
			b.ReportMetric(per(small), "server-µs/small")
			b.ReportMetric(float64(first)/float64(set), "×set")
			b.ReportMetric(float64(first)/float64(set+small), "×(set+small)")
			require.NoError(b, admin.FlushAll(ctx).Err())
		})
	}
}

// commandUsecRE reads a command's average execution time from INFO commandstats.
var commandUsecRE = regexp.MustCompile(`cmdstat_(\w+):calls=\d+,usec=\d+,usec_per_call=([0-9.]+)`)

// BenchmarkRedisCommandCost reports what redis-server spends executing each command of a first
// execution (INFO commandstats, usec_per_call: the command alone, without reading and writing its
// connection): Acquire's SET NX GET, Complete's owner-checked script (EVALSHA), and a plain SET of
// the same completed record's bytes, which a completion without the owner check would send. The
// calls go one at a time.
func BenchmarkRedisCommandCost(b *testing.B) {
	srv := redistest.Start(b, redistest.Options{})
	admin := srv.Client(b)
	s, err := cache.OpenRedis(cache.RedisOptions{URL: srv.URL(), Timeout: 10 * time.Second})
	require.NoError(b, err)
	b.Cleanup(func() { _ = s.Close() })
	ctx := context.Background()
	claim := cache.Claim{Fingerprint: make([]byte, 32), LockTTL: 30 * time.Second, TTL: time.Hour, Route: "payments"}
	resp := cache.Response{Status: 201, Headers: []cache.Header{{Name: "content-type", Value: []byte("application/json")}}, Body: make([]byte, 33)}
	record := make([]byte, 200) // about the completed record's size
	usec := func() map[string]float64 {
		info, err := admin.Info(ctx, "commandstats").Result()
		require.NoError(b, err)
		out := map[string]float64{}
		for _, m := range commandUsecRE.FindAllStringSubmatch(info, -1) {
			out[m[1]], err = strconv.ParseFloat(m[2], 64)
			require.NoError(b, err)
		}
		return out
	}
	require.NoError(b, admin.ConfigResetStat(ctx).Err())
	b.ResetTimer()
	for i := range b.N {
		l, _, err := s.Acquire(ctx, "idempotency:cost:"+strconv.Itoa(i), claim)
		require.NoError(b, err)
		require.NoError(b, s.Complete(ctx, l, resp))
	}
	b.StopTimer()
	first := usec()
	require.NoError(b, admin.ConfigResetStat(ctx).Err())
	for i := range b.N {
		require.NoError(b, admin.Set(ctx, "idempotency:plain:"+strconv.Itoa(i), record, time.Hour).Err())
	}
	b.ReportMetric(first["set"], "server-µs/acquire")
	b.ReportMetric(first["evalsha"], "server-µs/complete")
	b.ReportMetric(usec()["set"], "server-µs/plain-set")
	require.NoError(b, admin.FlushAll(ctx).Err())
}
