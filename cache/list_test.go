package cache_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// Keys pages through the live keys under a prefix, each once, whatever the page size; a prefix
// with a glob character matches only itself, and a cursor the store never gave is refused.
func TestKeys(t *testing.T) {
	stores := map[string]func(t *testing.T) interface {
		cache.Store
		cache.Lister
	}{
		"memory": func(t *testing.T) interface {
			cache.Store
			cache.Lister
		} {
			m, err := cache.NewMemory(cache.MemoryOptions{})
			require.NoError(t, err)
			return m
		},
		"redis": func(t *testing.T) interface {
			cache.Store
			cache.Lister
		} {
			s, err := cache.OpenRedis(cache.RedisOptions{URL: redistest.Start(t, redistest.Options{}).URL(), Timeout: time.Second})
			require.NoError(t, err)
			return s
		},
	}
	for name, open := range stores {
		t.Run(name, func(t *testing.T) {
			s := open(t)
			t.Cleanup(func() { _ = s.Close() })
			claim := cache.Claim{LockTTL: time.Minute, TTL: time.Minute}
			want := map[string]bool{}
			for i := range 60 {
				for _, prefix := range []string{"a*:", "ab:", "b:"} {
					key := fmt.Sprintf("%s%03d", prefix, i)
					_, _, err := s.Acquire(t.Context(), key, claim)
					require.NoError(t, err)
					if prefix == "a*:" {
						want[key] = true
					}
				}
			}
			for _, count := range []int{1, 7, 1000} {
				got := map[string]bool{}
				cursor, pages := "", 0
				for {
					keys, next, err := s.Keys(t.Context(), "a*:", cursor, count)
					require.NoError(t, err)
					for _, k := range keys {
						require.True(t, strings.HasPrefix(k, "a*:"), "%q under the prefix, the * taken as itself", k)
						require.False(t, got[k], "%q listed twice", k)
						got[k] = true
					}
					pages++
					require.Less(t, pages, 1000)
					if cursor = next; cursor == "" {
						break
					}
				}
				require.Equal(t, want, got, "count %d", count)
			}
			_, _, err := s.Keys(t.Context(), "a*:", "not-a-cursor", 10)
			require.ErrorIs(t, err, cache.ErrBadCursor)
		})
	}
}
