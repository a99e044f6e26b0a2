package cache_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// BenchmarkRedisAcquire reports the allocations of a claim on real Redis, through the store as
// shipped (batched): of a free key, and of a key another request holds. A free key's SET NX GET
// answers nil, which go-redis passes through its retry and bad-connection predicates (shouldRetry,
// isBadConn) before the store sees it: that, and the per-call deadline, is most of what a free
// key's claim allocates beyond a taken one's.
func BenchmarkRedisAcquire(b *testing.B) {
	srv := redistest.Start(b, redistest.Options{})
	s, err := cache.OpenRedis(cache.RedisOptions{URL: srv.URL(), Timeout: 10 * time.Second})
	require.NoError(b, err)
	b.Cleanup(func() { _ = s.Close() })
	claim := cache.Claim{Fingerprint: make([]byte, 32), LockTTL: 30 * time.Second, TTL: time.Hour}
	ctx := context.Background()
	next := 0
	b.Run("free", func(b *testing.B) {
		keys := make([]string, b.N)
		for i := range keys {
			next++
			keys[i] = "idempotency:alloc:" + strconv.Itoa(next)
		}
		b.ReportAllocs()
		b.ResetTimer()
		for i := range b.N {
			l, _, err := s.Acquire(ctx, keys[i], claim)
			if err != nil || !l.Held() {
				b.Fatal(err)
			}
		}
	})
	l, _, err := s.Acquire(ctx, "idempotency:alloc:taken", claim)
	require.NoError(b, err)
	require.True(b, l.Held())
	b.Run("taken", func(b *testing.B) {
		b.ReportAllocs()
		b.ResetTimer()
		for range b.N {
			l, rec, err := s.Acquire(ctx, "idempotency:alloc:taken", claim)
			if err != nil || l.Held() || rec == nil {
				b.Fatal(err)
			}
		}
	})
}
