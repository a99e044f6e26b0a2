package cache_test

import (
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/cache/storetest"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
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

// The same store with batching off: every call in a round trip of its own.
func TestRedisConformanceMiniredisUnbatched(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		mr := miniredis.RunT(t)
		s, err := cache.OpenRedis(cache.RedisOptions{URL: "redis://" + mr.Addr() + "/0", Timeout: 500 * time.Millisecond, DisableBatching: true})
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

	token := strings.Repeat("T", 26)
	header := func(layout, state string, fpLen string) string {
		return layout + state + token + "0000000060000" + fpLen
	}
	records := map[string]string{
		"short":     "2p",
		"future":    header("9", "c", "00000000") + "\x01anything",
		"state":     header("2", "?", "00000000"),
		"fp length": header("2", "p", "zzzzzzzz"),
		"fp beyond": header("2", "p", "00000010") + "fp",
		"response":  header("2", "c", "00000002") + "fp" + "\x01\xff",
		"no format": header("2", "c", "00000002") + "fp",
	}
	for key, v := range records {
		require.NoError(t, c.Set(ctx, key, v, 0).Err())
	}
	require.NoError(t, c.HSet(ctx, "hash", "v", "1", "st", "c").Err())
	for _, key := range append(slices.Sorted(maps.Keys(records)), "hash") {
		_, _, err := s.Acquire(ctx, key, testClaim)
		require.ErrorIs(t, err, cache.ErrCorrupt, key)
		require.True(t, mr.Exists(key), "%s: a corrupt record is reported, not overwritten", key)
	}
}

func TestRedisRecordLayoutAndExpiry(t *testing.T) {
	mr := miniredis.RunT(t)
	clk := clock.NewFake(time.UnixMilli(1_700_000_000_000))
	s, err := cache.OpenRedis(cache.RedisOptions{URL: "redis://" + mr.Addr() + "/0", Clock: clk})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	ctx := t.Context()

	l, rec, err := s.Acquire(ctx, "idempotency:k", cache.Claim{Fingerprint: []byte("fp"), LockTTL: 30 * time.Second, TTL: 2 * time.Hour})
	require.NoError(t, err)
	require.Nil(t, rec)
	v, err := mr.Get("idempotency:k")
	require.NoError(t, err)
	require.Regexp(t, `^3p[A-Z2-7]{26}0000007200000`+`1700000000000`+`1700000030000`+`00000002fp00$`, v,
		"layout 3, pending, token, TTL ms, created and lease end in Unix ms, fingerprint, route (none)")
	token := v[2:28]
	require.Equal(t, 30*time.Second, mr.TTL("idempotency:k"))
	require.Len(t, mr.Keys(), 1, "one key per record")

	clk.Advance(time.Second)
	require.NoError(t, s.Renew(ctx, l, time.Minute))
	v, err = mr.Get("idempotency:k")
	require.NoError(t, err)
	require.Equal(t, "3p"+token+"0000007200000"+"1700000000000"+"1700000061000"+"00000002fp00", v, "a renewal moves the lease's end")
	require.Equal(t, time.Minute, mr.TTL("idempotency:k"))

	clk.Advance(time.Second)
	require.NoError(t, s.Complete(ctx, l, cache.Response{Status: 200}))
	v, err = mr.Get("idempotency:k")
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(v, "3c"+token+"0000007200000"+"1700000000000"+"1700007202000"+"00000002fp00\x01"),
		"completed, same owner, created unchanged, expiry at the TTL's end, no route, then the response (format 1): %q", v)
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
		// net/url quotes the whole URL in its errors; the password must not reach a log.
		{"bad port", cache.RedisOptions{URL: "redis://user:s3cret-pw@host:63 79/0"}, "percent-encoded"},
		{"unescaped #", cache.RedisOptions{URL: "redis://user:s3cret#pw@host:6379/0"}, "redis url"},
		{"bad db", cache.RedisOptions{URL: "redis://user:s3cret-pw@host:6379/s3cret-pw"}, "invalid database number"},
		// A '/' in the password makes the rest of it the path.
		{"password with a slash", cache.RedisOptions{URL: "redis://user:1234/s3cret@host/0"}, "invalid URL path"},
		{"password with a slash, no user", cache.RedisOptions{URL: "redis://:6379/s3cret@host:6379/0"}, "invalid URL path"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			checkErr := cache.CheckRedisOptions(c.opts)
			s, err := cache.OpenRedis(c.opts)
			if c.err != "" {
				require.ErrorContains(t, err, c.err)
				require.Equal(t, err.Error(), checkErr.Error(), "CheckRedisOptions refuses what OpenRedis refuses")
				require.NotContains(t, err.Error(), "s3cret")
				return
			}
			require.NoError(t, checkErr)
			require.NoError(t, err)
			require.NoError(t, s.Close())
		})
	}
}
