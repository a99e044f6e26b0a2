package cache_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// Replicas counts the master's replicas in sync: none, then one once it attaches.
func TestRedisReplicasStandalone(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t, redistest.Options{})
	s, err := cache.OpenRedis(cache.RedisOptions{URL: srv.URL(), Timeout: time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	n, err := s.Replicas(t.Context())
	require.NoError(t, err)
	require.Zero(t, n)
	redistest.StartReplicas(t, srv, 1)
	n, err = s.Replicas(t.Context())
	require.NoError(t, err)
	require.Equal(t, 1, n)
	srv.Stop()
	_, err = s.Replicas(t.Context())
	require.Error(t, err, "a master that does not answer")
}

// Under Cluster, Replicas is the fewest replicas any master has: each master's claims wait on it.
func TestRedisReplicasCluster(t *testing.T) {
	t.Parallel()
	cl := redistest.StartCluster(t, 3, 1)
	s, err := cache.OpenRedis(cache.RedisOptions{ClusterAddrs: cl.Addrs(), Timeout: time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	require.Eventually(t, func() bool {
		n, err := s.Replicas(t.Context())
		return err == nil && n == 1
	}, 10*time.Second, 50*time.Millisecond, "one replica per master")
	cl.Replicas()[1].Stop()
	require.Eventually(t, func() bool {
		n, err := s.Replicas(t.Context())
		return err == nil && n == 0
	}, 10*time.Second, 50*time.Millisecond, "a master that lost its replica")
}
