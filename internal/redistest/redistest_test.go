package redistest_test

import (
	"fmt"
	"net"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

func TestStandalone(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := redistest.Start(t, redistest.Options{})
	require.Equal(t, fmt.Sprintf("127.0.0.1:%d", s.Port()), s.Addr())
	require.Equal(t, fmt.Sprintf("redis://127.0.0.1:%d/0", s.Port()), s.URL())
	require.Nil(t, s.TLSConfig())
	require.Empty(t, s.CAFile())

	c := s.Client(t)
	require.NoError(t, c.Ping(ctx).Err())
	require.NoError(t, c.Set(ctx, "k", "v", 0).Err())
	require.Equal(t, "v", c.Get(ctx, "k").Val())

	opt, err := redis.ParseURL(s.URL())
	require.NoError(t, err)
	fromURL := redis.NewClient(opt)
	t.Cleanup(func() { _ = fromURL.Close() })
	require.Equal(t, "v", fromURL.Get(ctx, "k").Val())
}

func TestStopRestart(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := redistest.Start(t, redistest.Options{})
	c := s.Client(t)
	require.NoError(t, c.Set(ctx, "k", "v", 0).Err())

	s.Stop()
	s.Stop() // idempotent
	require.False(t, s.Running())
	require.Error(t, c.Ping(ctx).Err())

	port := s.Port()
	s.Restart()
	require.True(t, s.Running())
	require.Equal(t, port, s.Port())
	require.Eventually(t, func() bool { return c.Ping(ctx).Err() == nil }, 5*time.Second, 20*time.Millisecond)
	require.ErrorIs(t, c.Get(ctx, "k").Err(), redis.Nil, "nothing is persisted")
	require.NoError(t, c.Set(ctx, "k", "v2", 0).Err())
	require.Equal(t, "v2", c.Get(ctx, "k").Val())

	s.Restart() // while running: stops first
	require.Eventually(t, func() bool { return c.Ping(ctx).Err() == nil }, 5*time.Second, 20*time.Millisecond)
}

func TestKill(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := redistest.Start(t, redistest.Options{})
	c := s.Client(t)
	require.NoError(t, c.Ping(ctx).Err())

	s.Kill()
	s.Kill()
	require.False(t, s.Running())
	require.Error(t, c.Ping(ctx).Err())

	s.Restart()
	require.Eventually(t, func() bool { return c.Ping(ctx).Err() == nil }, 5*time.Second, 20*time.Millisecond)
}

func TestFixedPort(t *testing.T) {
	t.Parallel()
	first := redistest.Start(t, redistest.Options{})
	port := first.Port()
	first.Stop()
	s := redistest.Start(t, redistest.Options{Port: port})
	require.Equal(t, port, s.Port())
	require.NoError(t, s.Client(t).Ping(t.Context()).Err())
}

func TestTLS(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := redistest.Start(t, redistest.Options{TLS: true})
	require.NotNil(t, s.TLSConfig())
	require.FileExists(t, s.CAFile())
	require.True(t, strings.HasPrefix(s.URL(), "rediss://127.0.0.1:"), s.URL())

	c := redis.NewClient(&redis.Options{Addr: s.Addr(), TLSConfig: s.TLSConfig()})
	t.Cleanup(func() { _ = c.Close() })
	require.NoError(t, c.Set(ctx, "k", "v", 0).Err())
	require.Equal(t, "v", c.Get(ctx, "k").Val())

	opt, err := redis.ParseURL(s.URL())
	require.NoError(t, err)
	opt.TLSConfig = s.TLSConfig()
	fromURL := redis.NewClient(opt)
	t.Cleanup(func() { _ = fromURL.Close() })
	require.Equal(t, "v", fromURL.Get(ctx, "k").Val())

	plain := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: time.Second})
	t.Cleanup(func() { _ = plain.Close() })
	require.Error(t, plain.Ping(ctx).Err(), "plain text must not be served")

	untrusted := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1, TLSConfig: s.TLSConfig()})
	untrusted.Options().TLSConfig.RootCAs = nil
	t.Cleanup(func() { _ = untrusted.Close() })
	require.ErrorContains(t, untrusted.Ping(ctx).Err(), "certificate")

	s.Restart()
	require.Eventually(t, func() bool { return c.Ping(ctx).Err() == nil }, 5*time.Second, 20*time.Millisecond)
}

func TestAuth(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		opts    redistest.Options
		url     string // URL without host
		wrong   redis.Options
		noCreds bool // whether a client without credentials works
	}{
		{
			name:  "acl user",
			opts:  redistest.Options{ACLUser: "app", ACLPassword: "s3cret pass"},
			url:   "redis://app:s3cret%20pass@",
			wrong: redis.Options{Username: "app", Password: "wrong"},
		},
		{
			name:  "password",
			opts:  redistest.Options{Password: "pw"},
			url:   "redis://:pw@",
			wrong: redis.Options{Password: "wrong"},
		},
		{
			name:  "acl user with tls",
			opts:  redistest.Options{ACLUser: "app", ACLPassword: "pw", TLS: true},
			url:   "rediss://app:pw@",
			wrong: redis.Options{Username: "app", Password: "wrong"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ctx := t.Context()
			s := redistest.Start(t, tt.opts)
			require.True(t, strings.HasPrefix(s.URL(), tt.url), s.URL())

			c := s.Client(t)
			require.NoError(t, c.Set(ctx, "k", "v", 0).Err())
			require.Equal(t, "v", c.Get(ctx, "k").Val())

			opt, err := redis.ParseURL(s.URL())
			require.NoError(t, err)
			opt.TLSConfig = s.TLSConfig()
			fromURL := redis.NewClient(opt)
			t.Cleanup(func() { _ = fromURL.Close() })
			require.Equal(t, "v", fromURL.Get(ctx, "k").Val())

			wrong := tt.wrong
			wrong.Addr, wrong.TLSConfig, wrong.MaxRetries = s.Addr(), s.TLSConfig(), -1
			wc := redis.NewClient(&wrong)
			t.Cleanup(func() { _ = wc.Close() })
			require.ErrorContains(t, wc.Ping(ctx).Err(), "WRONGPASS")

			anon := redis.NewClient(&redis.Options{Addr: s.Addr(), TLSConfig: s.TLSConfig(), MaxRetries: -1})
			t.Cleanup(func() { _ = anon.Close() })
			require.ErrorContains(t, anon.Get(ctx, "k").Err(), "NOAUTH")
		})
	}
}

func TestCluster(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	c := redistest.StartCluster(t, 3, 1)
	require.Len(t, c.Masters(), 3)
	require.Len(t, c.Replicas(), 3)
	require.Len(t, c.Addrs(), 6)

	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	t.Cleanup(func() { _ = cc.Close() })

	// One key per master, found by hashing keys until every master owns one.
	keyOf := map[string]string{} // master address -> key
	for i := 0; len(keyOf) < 3 && i < 1000; i++ {
		key := fmt.Sprintf("key-%d", i)
		m, err := cc.MasterForKey(ctx, key)
		require.NoError(t, err)
		keyOf[m.Options().Addr] = key
	}
	require.Len(t, keyOf, 3)
	for _, m := range c.Masters() {
		key, ok := keyOf[m.Addr()]
		require.True(t, ok, "no key routed to master %s", m.Addr())
		require.NoError(t, cc.Set(ctx, key, "v1", 0).Err())
		require.Equal(t, "v1", cc.Get(ctx, key).Val())
		require.Equal(t, "v1", m.Client(t).Get(ctx, key).Val(), "the key lives on its master")
	}

	// A manual failover of a running master.
	oldMaster, replica := c.Masters()[0], c.Replicas()[0]
	key := keyOf[oldMaster.Addr()]
	c.FailoverReplicaOf(0)
	require.Same(t, replica, c.Masters()[0])
	require.Same(t, oldMaster, c.Replicas()[0])
	require.Eventually(t, func() bool { return cc.Set(ctx, key, "v2", 0).Err() == nil }, 10*time.Second, 50*time.Millisecond)
	require.Equal(t, "v2", replica.Client(t).Get(ctx, key).Val())

	// A takeover after the master was killed, and the killed master rejoining as a replica.
	oldMaster, replica = c.Masters()[1], c.Replicas()[1]
	key = keyOf[oldMaster.Addr()]
	oldMaster.Kill()
	c.FailoverReplicaOf(1)
	require.Same(t, replica, c.Masters()[1])
	// go-redis re-reads the slot map on MOVED, but a dead master answers nothing: without this it
	// keeps dialling the dead node until its cached map is 10 s old.
	cc.ReloadState(ctx)
	require.Eventually(t, func() bool { return cc.Set(ctx, key, "v3", 0).Err() == nil }, 10*time.Second, 50*time.Millisecond)
	require.Equal(t, "v3", cc.Get(ctx, key).Val())
	oldMaster.Restart()
	rejoined := oldMaster.Client(t)
	require.Eventually(t, func() bool {
		info, err := rejoined.Info(ctx, "replication").Result()
		return err == nil && strings.Contains(info, "role:slave") && strings.Contains(info, "master_link_status:up")
	}, 15*time.Second, 50*time.Millisecond)
}

func TestSentinel(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := redistest.StartSentinel(t)
	require.Equal(t, "mymaster", s.MasterName())
	require.Len(t, s.Addrs(), 3)

	fc := redis.NewFailoverClient(&redis.FailoverOptions{MasterName: s.MasterName(), SentinelAddrs: s.Addrs()})
	t.Cleanup(func() { _ = fc.Close() })
	// servedBy returns the address of the server fc sends commands to.
	servedBy := func() string {
		info, err := fc.Info(ctx, "server").Result()
		if err != nil {
			return err.Error()
		}
		for line := range strings.Lines(info) {
			if port, ok := strings.CutPrefix(strings.TrimSpace(line), "tcp_port:"); ok {
				return "127.0.0.1:" + port
			}
		}
		return "no tcp_port in INFO server"
	}

	old := s.Master()
	require.NotSame(t, old, s.Replica())
	require.NoError(t, fc.Set(ctx, "k", "v1", 0).Err())
	require.Equal(t, old.Addr(), servedBy())

	s.Failover()
	promoted := s.Master()
	require.NotEqual(t, old.Addr(), promoted.Addr())
	require.Same(t, old, s.Replica())
	require.Eventually(t, func() bool { return fc.Set(ctx, "k", "v2", 0).Err() == nil && servedBy() == promoted.Addr() },
		10*time.Second, 50*time.Millisecond)
	require.Equal(t, "v2", promoted.Client(t).Get(ctx, "k").Val())
	oldClient := old.Client(t)
	require.Eventually(t, func() bool { return oldClient.Get(ctx, "k").Val() == "v2" }, 5*time.Second, 20*time.Millisecond,
		"the former master replicates the new one")

	// A second failover, away from a master that was killed, back to the first node.
	promoted.Kill()
	s.Failover()
	require.Same(t, old, s.Master())
	require.Eventually(t, func() bool { return fc.Set(ctx, "k", "v3", 0).Err() == nil && servedBy() == old.Addr() },
		10*time.Second, 50*time.Millisecond)
	require.Equal(t, "v3", oldClient.Get(ctx, "k").Val())
}

// fatalRecorder is a testing.TB whose Fatal and Fatalf record the message and end the goroutine,
// so that failures of redistest itself can be asserted on.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (r *fatalRecorder) Helper() {}

func (r *fatalRecorder) Fatal(args ...any) {
	r.msg = fmt.Sprint(args...)
	runtime.Goexit()
}

func (r *fatalRecorder) Fatalf(format string, args ...any) {
	r.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func TestStartFailureIsReported(t *testing.T) {
	t.Parallel()
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = busy.Close() })

	tests := []struct {
		name string
		opts redistest.Options
		want []string
	}{
		{
			name: "bad directive",
			opts: redistest.Options{Args: []string{"no-such-directive yes"}},
			want: []string{"exited", "before answering PING", "no-such-directive"},
		},
		{
			name: "port in use",
			opts: redistest.Options{Port: busy.Addr().(*net.TCPAddr).Port},
			want: []string{"still in use"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			r := &fatalRecorder{TB: t}
			done := make(chan struct{})
			go func() {
				defer close(done)
				redistest.Start(r, tt.opts)
			}()
			<-done
			for _, want := range tt.want {
				require.Contains(t, r.msg, want)
			}
		})
	}
}

// Replicas follow their master, with its credentials; a paused replica acknowledges nothing
// until it is resumed, and then catches up.
func TestReplicasPauseAndResume(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	master := redistest.Start(t, redistest.Options{Password: "pw"})
	replicas := redistest.StartReplicas(t, master, 2)
	require.Len(t, replicas, 2)
	c := master.Client(t)
	require.NoError(t, c.Set(ctx, "k", "v1", 0).Err())
	require.Equal(t, int64(2), c.Do(ctx, "wait", 2, 5000).Val(), "both replicas acknowledge")
	for _, r := range replicas {
		require.Equal(t, "v1", r.Client(t).Get(ctx, "k").Val())
	}

	replicas[0].Pause()
	replicas[0].Pause() // idempotent
	require.NoError(t, c.Set(ctx, "k", "v2", 0).Err())
	require.GreaterOrEqual(t, c.Do(ctx, "wait", 1, 5000).Val(), int64(1), "the running replica acknowledges")
	start := time.Now()
	require.Equal(t, int64(1), c.Do(ctx, "wait", 2, 300).Val(), "the paused replica acknowledges nothing")
	require.GreaterOrEqual(t, time.Since(start), 300*time.Millisecond, "WAIT ran out its timeout")

	replicas[0].Resume()
	replicas[0].Resume() // idempotent
	require.Equal(t, int64(2), c.Do(ctx, "wait", 2, 5000).Val(), "resumed, it catches up")
	require.Equal(t, "v2", replicas[0].Client(t).Get(ctx, "k").Val())

	// A paused server still stops.
	replicas[1].Pause()
	replicas[1].Stop()
	require.False(t, replicas[1].Running())
}

// With two replicas, the sentinels promote one of them when the master dies, and the other
// follows it.
func TestSentinelTwoReplicas(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := redistest.StartSentinelReplicas(t, 2)
	old := s.Master()
	replicas := s.Replicas()
	require.Len(t, replicas, 2)
	require.NotContains(t, replicas, old)
	require.Same(t, replicas[0], s.Replica())
	require.NoError(t, old.Client(t).Set(ctx, "k", "v1", 0).Err())
	require.Equal(t, int64(2), old.Client(t).Do(ctx, "wait", 2, 5000).Val())

	old.Kill()
	s.Failover()
	promoted := s.Master()
	require.Contains(t, replicas, promoted)
	require.Equal(t, "v1", promoted.Client(t).Get(ctx, "k").Val())
	require.NoError(t, promoted.Client(t).Set(ctx, "k", "v2", 0).Err())
	require.Equal(t, int64(1), promoted.Client(t).Do(ctx, "wait", 1, 5000).Val(), "the other replica follows the new master")
	require.Equal(t, []*redistest.Server{old, other(replicas, promoted)}, s.Replicas())
}

// other returns the server of pair that is not s.
func other(pair []*redistest.Server, s *redistest.Server) *redistest.Server {
	if pair[0] == s {
		return pair[1]
	}
	return pair[0]
}

// When a master with two replicas dies, Redis promotes one of them on its own, and the other
// follows it.
func TestClusterAwaitFailover(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	c := redistest.StartCluster(t, 3, 2)
	require.Len(t, c.Replicas(), 6)
	old, replicas := c.Masters()[0], c.Replicas()[:2]
	key := "k"
	for i := 0; ; i++ {
		slot, err := old.Client(t).ClusterKeySlot(ctx, key).Result()
		require.NoError(t, err)
		if slot < 16384/3 {
			break
		}
		key = fmt.Sprintf("k%d", i)
	}
	require.NoError(t, old.Client(t).Set(ctx, key, "v1", 0).Err())
	require.Equal(t, int64(2), old.Client(t).Do(ctx, "wait", 2, 5000).Val())

	old.Kill()
	c.AwaitFailoverOf(0)
	promoted := c.Masters()[0]
	require.Contains(t, replicas, promoted)
	require.Equal(t, []*redistest.Server{old, other(replicas, promoted)}, c.Replicas()[:2])
	require.Equal(t, "v1", promoted.Client(t).Get(ctx, key).Val())
	require.NoError(t, promoted.Client(t).Set(ctx, key, "v2", 0).Err())
	require.Equal(t, int64(1), promoted.Client(t).Do(ctx, "wait", 1, 5000).Val(), "the other replica follows the new master")
}
