package cache

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// BenchmarkRedisReplayUnderWork asks whether the batcher holds a replay behind other batches
// longer than the round trips it saves: 32 callers each spend some CPU (the rest of a request's
// work) and then replay a completed key, through the batcher with one slot (as shipped) and with
// two, without batching, and as the naive processor does (SET NX, then GET), in interleaved
// rounds on one redis-server. It reports each side's replays per second.
func BenchmarkRedisReplayUnderWork(b *testing.B) {
	srv := redistest.Start(b, redistest.Options{})
	ctx := context.Background()
	open := func(o RedisOptions) *Redis {
		o.URL, o.Timeout = srv.URL(), time.Second
		s, err := OpenRedis(o)
		require.NoError(b, err)
		b.Cleanup(func() { _ = s.Close() })
		return s
	}
	batched, twoSlots, unbatched := open(RedisOptions{}), open(RedisOptions{}), open(RedisOptions{DisableBatching: true})
	twoSlots.send = newPipeline(twoSlots.client, 2)
	naive := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	b.Cleanup(func() { _ = naive.Close() })
	claim := Claim{Fingerprint: make([]byte, 32), LockTTL: 30 * time.Second, TTL: time.Hour, Route: "payments"}
	l, _, err := batched.Acquire(ctx, "idempotency:replayed", claim)
	require.NoError(b, err)
	require.NoError(b, batched.Complete(ctx, l, Response{Status: 201, Body: make([]byte, 33)}))
	require.NoError(b, naive.Set(ctx, "naive:replayed", "201 "+string(make([]byte, 33)), time.Hour).Err())
	replay := func(s *Redis) func() error {
		return func() error {
			l, rec, err := s.Acquire(ctx, "idempotency:replayed", claim)
			if err == nil && (l.Held() || rec == nil || rec.State != Completed) {
				err = fmt.Errorf("not a replay: %v", rec)
			}
			return err
		}
	}
	sides := []struct {
		name string
		op   func() error
	}{
		{"one-slot", replay(batched)}, {"two-slots", replay(twoSlots)}, {"unbatched", replay(unbatched)},
		{"naive", func() error {
			if err := naive.SetNX(ctx, "naive:replayed", "", 30*time.Second).Err(); err != nil {
				return err
			}
			return naive.Get(ctx, "naive:replayed").Err()
		}},
	}
	var sink atomic.Int64
	spin := func(d time.Duration) {
		x := int64(0)
		for end := time.Now().Add(d); time.Now().Before(end); {
			x++
		}
		sink.Add(x)
	}
	for _, work := range []time.Duration{0, 30 * time.Microsecond, 100 * time.Microsecond} {
		b.Run(fmt.Sprintf("work=%v", work), func(b *testing.B) {
			const rounds, per = 4, 500 * time.Millisecond
			done := make([]int64, len(sides))
			var took [4]time.Duration
			b.ResetTimer()
			for r := range rounds {
				for i := range sides {
					j := (i + r) % len(sides)
					var n atomic.Int64
					var failed atomic.Value
					start := time.Now()
					stop := start.Add(per)
					var wg sync.WaitGroup
					for range 32 {
						wg.Go(func() {
							for time.Now().Before(stop) {
								spin(work)
								if err := sides[j].op(); err != nil {
									failed.CompareAndSwap(nil, err)
									return
								}
								n.Add(1)
							}
						})
					}
					wg.Wait()
					if err, _ := failed.Load().(error); err != nil {
						b.Fatal(err)
					}
					done[j] += n.Load()
					took[j] += time.Since(start)
				}
			}
			b.StopTimer()
			for i, s := range sides {
				b.ReportMetric(float64(done[i])/took[i].Seconds(), s.name+"-replays/s")
			}
			b.ReportMetric(0, "ns/op")
		})
	}
}
