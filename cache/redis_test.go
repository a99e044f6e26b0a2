package cache_test

import (
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/cache/storetest"
)

func TestRedisConformanceMiniredis(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		mr := miniredis.RunT(t)
		s, err := cache.OpenRedis(cache.RedisOptions{URL: "redis://" + mr.Addr() + "/0", Timeout: 500 * time.Millisecond})
		require.NoError(t, err)
		return storetest.Harness{
			Store:   s,
			Advance: mr.FastForward,
			Outage: func() func() {
				mr.Close()
				return func() { require.NoError(t, mr.Restart()) }
			},
		}
	})
}

func TestRedisCorruptRecords(t *testing.T) {
	mr := miniredis.RunT(t)
	s, err := cache.OpenRedis(cache.RedisOptions{URL: "redis://" + mr.Addr() + "/0"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	ctx := t.Context()

	require.NoError(t, c.HSet(ctx, "future", "v", "99", "st", "c", "fp", "x", "resp", "\x07whatever").Err())
	require.NoError(t, c.HSet(ctx, "garbage", "v", "1", "st", "c", "fp", "x", "resp", "\x01\xff").Err())
	require.NoError(t, c.HSet(ctx, "state", "v", "1", "st", "?", "fp", "x").Err())
	for _, key := range []string{"future", "garbage", "state"} {
		_, _, err := s.Acquire(ctx, key, testClaim)
		require.ErrorIs(t, err, cache.ErrCorrupt, key)
	}
	require.NoError(t, c.Set(ctx, "string", "not a hash", 0).Err())
	_, _, err = s.Acquire(ctx, "string", testClaim)
	require.Error(t, err)
	require.NotErrorIs(t, err, cache.ErrLeaseLost)
}

func TestRedisRecordLayoutAndExpiry(t *testing.T) {
	mr := miniredis.RunT(t)
	s, err := cache.OpenRedis(cache.RedisOptions{URL: "redis://" + mr.Addr() + "/0"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	ctx := t.Context()

	l, rec, err := s.Acquire(ctx, "idempotency:k", cache.Claim{Fingerprint: []byte("fp"), LockTTL: 30 * time.Second, TTL: 2 * time.Hour})
	require.NoError(t, err)
	require.Nil(t, rec)
	require.Equal(t, "1", mr.HGet("idempotency:k", "v"))
	require.Equal(t, "p", mr.HGet("idempotency:k", "st"))
	require.Equal(t, "7200000", mr.HGet("idempotency:k", "ttl"))
	require.Equal(t, 30*time.Second, mr.TTL("idempotency:k"))
	require.Len(t, mr.Keys(), 1, "one key per record")

	require.NoError(t, s.Complete(ctx, l, cache.Response{Status: 200}))
	require.Equal(t, "c", mr.HGet("idempotency:k", "st"))
	require.Equal(t, 2*time.Hour, mr.TTL("idempotency:k"))
	require.Len(t, mr.Keys(), 1)
}

func TestOpenRedisOptions(t *testing.T) {
	cases := []struct {
		name string
		opts cache.RedisOptions
		err  string
	}{
		{"default url", cache.RedisOptions{}, ""},
		{"tls url", cache.RedisOptions{URL: "rediss://user:pass@localhost:6380/2"}, ""},
		{"cluster", cache.RedisOptions{ClusterAddrs: []string{"127.0.0.1:7000"}}, ""},
		{"sentinel", cache.RedisOptions{SentinelAddrs: []string{"127.0.0.1:26379"}, SentinelMaster: "mymaster"}, ""},
		{"bad scheme", cache.RedisOptions{URL: "http://localhost"}, "redis url"},
		{"both", cache.RedisOptions{ClusterAddrs: []string{"a:1"}, SentinelAddrs: []string{"b:2"}}, "not both"},
		{"cluster db", cache.RedisOptions{URL: "redis://localhost:6379/3", ClusterAddrs: []string{"a:1"}}, "database 0"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s, err := cache.OpenRedis(c.opts)
			if c.err != "" {
				require.ErrorContains(t, err, c.err)
				return
			}
			require.NoError(t, err)
			require.NoError(t, s.Close())
		})
	}
}
