package cache_test

import (
	"bytes"
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/cache/storetest"
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// These tests start real redis-server processes on loopback. Without redis-server they skip
// and say so; CI installs it and sets IDEMPOTENCY_REQUIRE_REDIS=1, which turns a skip into a
// failure.

// realTime is Advance for a store on the wall clock.
func realTime(d time.Duration) { time.Sleep(d) }

// realTimeScale stretches the contract suite's leases (300 ms at scale 1) for stores on real
// time, where the suite sleeps and a call can stall for a good part of a lease on a loaded
// 2-core machine running other packages' tests.
const realTimeScale = 3

func TestRedisConformanceStandalone(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t, redistest.Options{})
	admin := srv.Client(t)
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		require.NoError(t, admin.FlushAll(t.Context()).Err())
		s, err := cache.OpenRedis(cache.RedisOptions{URL: srv.URL(), Timeout: time.Second})
		require.NoError(t, err)
		return storetest.Harness{
			Store:   s,
			Advance: realTime,
			Scale:   realTimeScale,
			Outage: func() func() {
				srv.Stop()
				return srv.Restart
			},
		}
	})
}

func TestRedisConformanceStandaloneUnbatched(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t, redistest.Options{})
	admin := srv.Client(t)
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		require.NoError(t, admin.FlushAll(t.Context()).Err())
		s, err := cache.OpenRedis(cache.RedisOptions{URL: srv.URL(), Timeout: time.Second, DisableBatching: true})
		require.NoError(t, err)
		return storetest.Harness{
			Store:   s,
			Advance: realTime,
			Scale:   realTimeScale,
			Outage: func() func() {
				srv.Stop()
				return srv.Restart
			},
		}
	})
}

// TestRedisClusterLargeRecords completes large records, whose bytes are staged in a second key,
// under keys whose names tag their slot and keys whose names cannot be tagged: each lands whole,
// with the owner checked, and no staged bytes stay on any master.
func TestRedisClusterLargeRecords(t *testing.T) {
	t.Parallel()
	cl := redistest.StartCluster(t, 3, 0)
	s, err := cache.OpenRedis(cache.RedisOptions{ClusterAddrs: cl.Addrs(), Timeout: 2 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	body := bytes.Repeat([]byte{0x42}, 256<<10)
	keys := []string{"idempotency:a", "idempotency:b", "idempotency:{tenant}:c", "x{y}z", "a}b", "a{}b", "a{b", "{}"}
	for _, key := range keys {
		l, _, err := s.Acquire(t.Context(), key, testClaim)
		require.NoError(t, err, key)
		require.NoError(t, s.Complete(t.Context(), l, cache.Response{Status: 200, Body: body}), key)
		rec, err := s.Lookup(t.Context(), key)
		require.NoError(t, err, key)
		require.Equal(t, cache.Completed, rec.State, key)
		require.Equal(t, body, rec.Response.Body, key)
	}
	var n int64
	for _, m := range cl.Masters() {
		size, err := m.Client(t).DBSize(t.Context()).Result()
		require.NoError(t, err)
		n += size
	}
	require.Equal(t, int64(len(keys)), n, "one key per record, no staged bytes left")
}

func TestRedisConformanceCluster(t *testing.T) {
	t.Parallel()
	cl := redistest.StartCluster(t, 3, 0)
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		for _, m := range cl.Masters() {
			require.NoError(t, m.Client(t).FlushAll(t.Context()).Err())
		}
		s, err := cache.OpenRedis(cache.RedisOptions{ClusterAddrs: cl.Addrs(), Timeout: time.Second})
		require.NoError(t, err)
		return storetest.Harness{Store: s, Advance: realTime, Scale: realTimeScale}
	})
}

func TestRedisConformanceSentinel(t *testing.T) {
	t.Parallel()
	sn := redistest.StartSentinel(t)
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		require.NoError(t, sn.Master().Client(t).FlushAll(t.Context()).Err())
		s, err := cache.OpenRedis(cache.RedisOptions{SentinelAddrs: sn.Addrs(), SentinelMaster: sn.MasterName(), Timeout: 3 * time.Second})
		require.NoError(t, err)
		return storetest.Harness{Store: s, Advance: realTime, Scale: realTimeScale, Replicas: 1}
	})
}

// TestRedisClusterSpreadsKeys checks that records land on every master: one key per
// operation, no hash tags.
func TestRedisClusterSpreadsKeys(t *testing.T) {
	t.Parallel()
	cl := redistest.StartCluster(t, 3, 0)
	s, err := cache.OpenRedis(cache.RedisOptions{ClusterAddrs: cl.Addrs(), Timeout: 500 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	for i := range 60 {
		l, _, err := s.Acquire(t.Context(), "idempotency:"+string(rune('a'+i%26))+time.Duration(i).String(), testClaim)
		require.NoError(t, err)
		require.NoError(t, s.Complete(t.Context(), l, cache.Response{Status: 200}))
	}
	for _, m := range cl.Masters() {
		n, err := m.Client(t).DBSize(t.Context()).Result()
		require.NoError(t, err)
		require.Positive(t, n, "master %s holds no record", m.Addr())
	}
	require.NoError(t, s.Ping(t.Context()))
}

func TestRedisTLSAndACL(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t, redistest.Options{TLS: true, ACLUser: "idempotency", ACLPassword: "s3cret-pass"})
	require.Contains(t, srv.URL(), "rediss://")

	s, err := cache.OpenRedis(cache.RedisOptions{URL: srv.URL(), TLSConfig: srv.TLSConfig(), Timeout: time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	require.NoError(t, s.Ping(t.Context()))
	l, _, err := s.Acquire(t.Context(), "k", testClaim)
	require.NoError(t, err)
	require.NoError(t, s.Complete(t.Context(), l, cache.Response{Status: 200, Body: []byte("over tls")}))

	bad := []cache.RedisOptions{
		{URL: "rediss://idempotency:wrong@" + srv.Addr() + "/0", TLSConfig: srv.TLSConfig()},
		{URL: "rediss://" + srv.Addr() + "/0", TLSConfig: srv.TLSConfig()},
		{URL: "redis://idempotency:s3cret-pass@" + srv.Addr() + "/0"}, // no TLS
		{URL: srv.URL()}, // TLS without trusting the test CA
	}
	for _, o := range bad {
		o.Timeout = time.Second
		s, err := cache.OpenRedis(o)
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
		require.Error(t, s.Ping(ctx), "%s must be refused", o.URL)
		cancel()
		_ = s.Close()
	}
}

// documentedACL returns the arguments of the ACL SETUSER line docs/deploying.md gives, its
// password replaced by password.
func documentedACL(t *testing.T, password string) []any {
	t.Helper()
	doc, err := os.ReadFile("../docs/deploying.md")
	require.NoError(t, err)
	_, line, ok := strings.Cut(string(doc), "\nACL SETUSER ")
	require.True(t, ok, "docs/deploying.md gives an ACL SETUSER line")
	line, _, _ = strings.Cut(line, "\n")
	var args []any
	for _, f := range strings.Fields(line) {
		if f == ">PASSWORD" {
			f = ">" + password
		}
		args = append(args, f)
	}
	return args
}

// The ACL user docs/deploying.md gives, limited to the records' key prefix, can do everything the
// store does: claim, renew, re-assert, complete small and staged records (under stagingTTL and
// over it), a retried completion, look up, list, purge and release.
func TestRedisACLKeyPrefix(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t, redistest.Options{})
	admin := srv.Client(t)
	acl := documentedACL(t, "s3cret-pass")
	require.NoError(t, admin.Do(t.Context(), append([]any{"ACL", "SETUSER"}, acl...)...).Err())
	user := acl[0].(string)
	s, err := cache.OpenRedis(cache.RedisOptions{URL: "redis://" + user + ":s3cret-pass@" + srv.Addr() + "/0", Timeout: 2 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	ctx := t.Context()
	_, _, err = s.Acquire(ctx, "other:k", testClaim)
	require.ErrorContains(t, err, "NOPERM", "the user is limited to the prefix")
	short := testClaim
	short.TTL = 5 * time.Second
	for i, c := range []struct {
		body  []byte
		claim cache.Claim
	}{{[]byte("small"), testClaim}, {bytes.Repeat([]byte("l"), 256<<10), testClaim}, {bytes.Repeat([]byte("s"), 4<<10), short}} {
		key := "idempotency:" + strconv.Itoa(i)
		l, _, err := s.Acquire(ctx, key, c.claim)
		require.NoError(t, err)
		require.NoError(t, s.Renew(ctx, l, time.Minute))
		_, err = s.Reassert(ctx, l)
		require.NoError(t, err)
		resp := cache.Response{Status: 200, Body: c.body}
		require.NoError(t, s.Complete(ctx, l, resp))
		require.NoError(t, s.Complete(ctx, l, resp), "a retried completion")
		rec, err := s.Lookup(ctx, key)
		require.NoError(t, err)
		require.Equal(t, c.body, rec.Response.Body)
		keys, _, err := s.Keys(ctx, "idempotency:", "", 10)
		require.NoError(t, err)
		require.Contains(t, keys, key)
		require.NoError(t, s.Purge(ctx, key))
		l, _, err = s.Acquire(ctx, key, c.claim)
		require.NoError(t, err)
		require.NoError(t, s.Release(ctx, l))
	}
}

func TestRedisUnreachableAtStart(t *testing.T) {
	// Opening never connects: a process can start while Redis is down and report itself unready.
	s, err := cache.OpenRedis(cache.RedisOptions{URL: "redis://127.0.0.1:1/0", Timeout: 100 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	start := time.Now()
	require.Error(t, s.Ping(t.Context()))
	_, _, err = s.Acquire(t.Context(), "k", testClaim)
	require.Error(t, err)
	require.Less(t, time.Since(start), time.Second)
}

// warm makes a Cluster client load its slot map and its table of commands, which it reads from
// any node, a paused replica included: done once the replicas are paused, that would take the
// client's timeouts.
func warm(t *testing.T, s *cache.Redis) *cache.Redis {
	l, _, err := s.Acquire(t.Context(), "warm", testClaim)
	require.NoError(t, err)
	require.NoError(t, s.Release(t.Context(), l))
	return s
}

// pauser returns a Harness.PauseReplicas that pauses servers and resumes them, at the latest
// when t's case ends.
func pauser(t *testing.T, servers []*redistest.Server) func() func() {
	resume := func() {
		for _, r := range servers {
			r.Resume()
		}
	}
	t.Cleanup(resume)
	return func() func() {
		for _, r := range servers {
			r.Pause()
		}
		return resume
	}
}

// The durable claims on a standalone master with one replica, batched and not.
func TestRedisDurabilityStandalone(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t, redistest.Options{})
	replicas := redistest.StartReplicas(t, srv, 1)
	admin := srv.Client(t)
	for _, unbatched := range []bool{false, true} {
		t.Run("unbatched="+strconv.FormatBool(unbatched), func(t *testing.T) {
			storetest.RunDurability(t, func(t *testing.T) storetest.Harness {
				require.NoError(t, admin.FlushAll(t.Context()).Err())
				s, err := cache.OpenRedis(cache.RedisOptions{URL: srv.URL(), Timeout: 5 * time.Second, DisableBatching: unbatched})
				require.NoError(t, err)
				return storetest.Harness{Store: s, Advance: realTime, Scale: realTimeScale, Replicas: 1, PauseReplicas: pauser(t, replicas)}
			})
		})
	}
}

// The durable claims under Sentinel, on a master with two replicas.
func TestRedisDurabilitySentinel(t *testing.T) {
	t.Parallel()
	sn := redistest.StartSentinelReplicas(t, 2)
	master, replicas := sn.Master(), sn.Replicas()
	storetest.RunDurability(t, func(t *testing.T) storetest.Harness {
		require.NoError(t, master.Client(t).FlushAll(t.Context()).Err())
		s, err := cache.OpenRedis(cache.RedisOptions{SentinelAddrs: sn.Addrs(), SentinelMaster: sn.MasterName(), Timeout: 5 * time.Second})
		require.NoError(t, err)
		return storetest.Harness{Store: s, Advance: realTime, Scale: realTimeScale, Replicas: 2, PauseReplicas: pauser(t, replicas)}
	})
}

// The durable claims under Cluster, three masters with a replica each.
func TestRedisDurabilityCluster(t *testing.T) {
	t.Parallel()
	cl := redistest.StartCluster(t, 3, 1)
	storetest.RunDurability(t, func(t *testing.T) storetest.Harness {
		for _, m := range cl.Masters() {
			require.NoError(t, m.Client(t).FlushAll(t.Context()).Err())
		}
		s, err := cache.OpenRedis(cache.RedisOptions{ClusterAddrs: cl.Addrs(), Timeout: 5 * time.Second})
		require.NoError(t, err)
		return storetest.Harness{Store: warm(t, s), Advance: realTime, Scale: realTimeScale, Replicas: 1, PauseReplicas: pauser(t, cl.Replicas())}
	})
}

// Under Cluster a durable write waits on the master that owns its key's slot: with one shard's
// replica paused, the claims of that shard's keys are refused and the others' confirmed. A WAIT
// sent to any other master would find its replica in sync and confirm them all.
func TestRedisClusterWaitsOnTheKeysMaster(t *testing.T) {
	t.Parallel()
	cl := redistest.StartCluster(t, 3, 1)
	s, err := cache.OpenRedis(cache.RedisOptions{ClusterAddrs: cl.Addrs(), Timeout: 5 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	warm(t, s)
	admin := cl.Masters()[0].Client(t)
	shardOf := func(key string) int {
		slot, err := admin.ClusterKeySlot(t.Context(), key).Result()
		require.NoError(t, err)
		return int(slot) * 3 / 16384 // StartCluster gives shard i the i-th third of the slots
	}
	paused := cl.Replicas()[1]
	paused.Pause()
	t.Cleanup(paused.Resume)

	claim := cache.Claim{LockTTL: time.Minute, TTL: time.Hour, Replicas: 1, ReplicaTimeout: 300 * time.Millisecond}
	seen := map[int]int{}
	for i := range 30 {
		key := "idempotency:" + strconv.Itoa(i)
		shard := shardOf(key)
		seen[shard]++
		l, _, err := s.Acquire(t.Context(), key, claim)
		if shard == 1 {
			require.ErrorIs(t, err, cache.ErrUnconfirmed, "%s is on the paused replica's shard", key)
			_, err := s.Lookup(t.Context(), key)
			require.ErrorIs(t, err, cache.ErrNotFound, key)
			continue
		}
		require.NoError(t, err, "%s is on shard %d", key, shard)
		require.NoError(t, s.Complete(t.Context(), l, cache.Response{Status: 200}), key)
	}
	require.Len(t, seen, 3, "keys on every shard: %v", seen)
}

// A completion sent again on another connection than the first one is confirmed only once the
// replicas hold the record, which the first one wrote: the other connection's own earlier writes,
// long acknowledged, say nothing of it.
func TestRedisDurableCompleteAgainOnAnotherConnection(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t, redistest.Options{})
	replica := redistest.StartReplicas(t, srv, 1)[0]
	open := func() *cache.Redis {
		s, err := cache.OpenRedis(cache.RedisOptions{URL: srv.URL(), Timeout: 5 * time.Second, DisableBatching: true, PoolSize: 1})
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		return s
	}
	first, other := open(), open()
	claim := cache.Claim{LockTTL: time.Minute, TTL: time.Hour, Replicas: 1, ReplicaTimeout: 300 * time.Millisecond}
	l, _, err := first.Acquire(t.Context(), "k", claim)
	require.NoError(t, err)
	// The other store's one connection writes, and its write is acknowledged.
	_, _, err = other.Acquire(t.Context(), "other", claim)
	require.NoError(t, err)

	replica.Pause()
	t.Cleanup(replica.Resume)
	resp := cache.Response{Status: 200, Body: []byte("once")}
	require.ErrorIs(t, first.Complete(t.Context(), l, resp), cache.ErrUnconfirmed)
	require.ErrorIs(t, other.Complete(t.Context(), l, resp), cache.ErrUnconfirmed, "the replica still lacks the record")
	replica.Resume()
	require.NoError(t, other.Complete(t.Context(), l, resp))
	rec, err := replica.Client(t).Get(t.Context(), "k").Result()
	require.NoError(t, err)
	require.Contains(t, rec, "once", "the replica holds the completed record")
}
