package cache

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// A reply lost after the server ran a script makes go-redis retry it with the same token: the
// retry must find the caller's own work, not a stranger's.
func TestRedisScriptsAreRetrySafe(t *testing.T) {
	mr := miniredis.RunT(t)
	s, err := OpenRedis(RedisOptions{URL: "redis://" + mr.Addr() + "/0"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	ctx := t.Context()

	args := []any{"token-1", "fp", int64(60_000), int64(30_000), recordVersion}
	for range 2 {
		res, err := acquireScript.Run(ctx, s.client, []string{"k"}, args...).Slice()
		require.NoError(t, err)
		require.Equal(t, []any{int64(1)}, res, "acquire retried by its owner must succeed")
	}
	other, err := acquireScript.Run(ctx, s.client, []string{"k"}, "token-2", "fp2", int64(60_000), int64(30_000), recordVersion).Slice()
	require.NoError(t, err)
	require.Equal(t, int64(0), other[0])

	l := Lease{key: "k", token: "token-1"}
	require.NoError(t, s.Complete(ctx, l, Response{Status: 200}))
	require.NoError(t, s.Complete(ctx, l, Response{Status: 200}))
	require.ErrorIs(t, s.Complete(ctx, Lease{key: "k", token: "token-2"}, Response{Status: 200}), ErrLeaseLost)
	require.Equal(t, time.Minute, mr.TTL("k"))
}

// lostReply makes every script call look as if its reply never arrived, after Redis ran it.
type lostReply struct{ on atomic.Bool }

func (h *lostReply) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *lostReply) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *lostReply) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if h.on.Load() && err == nil {
			cmd.SetErr(context.DeadlineExceeded)
			return context.DeadlineExceeded
		}
		return err
	}
}

func TestRedisAcquireWithLostReplyFreesTheKey(t *testing.T) {
	mr := miniredis.RunT(t)
	client := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	hook := &lostReply{}
	hook.on.Store(true)
	client.AddHook(hook)
	s := NewRedis(client, time.Second)
	t.Cleanup(func() { _ = s.Close() })

	_, _, err := s.Acquire(t.Context(), "k", Claim{LockTTL: time.Hour, TTL: time.Hour})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	hook.on.Store(false)
	require.Eventually(t, func() bool { return !mr.Exists("k") }, 5*time.Second, 10*time.Millisecond,
		"the record the failed call created must not block the key for its lease")
}
