package cache

import (
	"context"
	"errors"
	"strconv"
	"sync"
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

// pipelineCounter counts the script calls sent alone and in pipelines. While hold is set,
// every command waits for release to be closed, so that both slots stay busy and later calls
// queue; held counts the script calls waiting so.
type pipelineCounter struct {
	single, batched, batches, held atomic.Int64
	hold                           atomic.Bool
	release                        chan struct{}
}

func (h *pipelineCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *pipelineCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.hold.Load() {
			h.held.Add(1)
			<-h.release
		}
		h.single.Add(1)
		return next(ctx, cmd)
	}
}
func (h *pipelineCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if h.hold.Load() {
			h.held.Add(int64(len(cmds)))
			<-h.release
		}
		h.batches.Add(1)
		h.batched.Add(int64(len(cmds)))
		return next(ctx, cmds)
	}
}

// newHeldRedis returns a Redis store on miniredis whose commands the returned hook can hold.
// RESP2 keeps connection set-up (HELLO) out of the hook.
func newHeldRedis(t *testing.T) (*Redis, *miniredis.Miniredis, *pipelineCounter) {
	mr := miniredis.RunT(t)
	client := redis.NewClient(&redis.Options{Addr: mr.Addr(), Protocol: 2})
	hook := &pipelineCounter{release: make(chan struct{})}
	client.AddHook(hook)
	return NewRedis(client, 10*time.Second), mr, hook
}

// waitAllWaiting waits until every one of n calls is either held in the hook or queued.
func waitAllWaiting(t *testing.T, s *Redis, hook *pipelineCounter, n int) int {
	t.Helper()
	var queued int
	require.Eventually(t, func() bool {
		s.pipe.mu.Lock()
		queued = len(s.pipe.queue)
		s.pipe.mu.Unlock()
		return int(hook.held.Load())+queued == n
	}, 10*time.Second, time.Millisecond)
	return queued
}

func TestRedisPipelinesConcurrentCalls(t *testing.T) {
	s, mr, hook := newHeldRedis(t)
	t.Cleanup(func() { _ = s.Close() })
	ctx := t.Context()

	// Load the scripts, then flush them so that a batch finds NOSCRIPT and must reload.
	_, _, err := s.Acquire(ctx, "warm", Claim{LockTTL: time.Hour, TTL: time.Hour})
	require.NoError(t, err)
	mr.FlushAll()
	require.NoError(t, s.client.ScriptFlush(ctx).Err())

	hook.hold.Store(true)
	const n = 100
	var wg sync.WaitGroup
	leases := make([]Lease, n)
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			leases[i], _, errs[i] = s.Acquire(ctx, "k"+strconv.Itoa(i), Claim{LockTTL: time.Hour, TTL: time.Hour})
		}()
	}
	queued := waitAllWaiting(t, s, hook, n)
	require.Positive(t, queued, "with both slots busy, calls queue")
	hook.hold.Store(false)
	close(hook.release)
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i])
		require.True(t, leases[i].Held(), "call %d", i)
		require.NoError(t, s.Complete(ctx, leases[i], Response{Status: 200}))
	}
	require.Positive(t, hook.batches.Load(), "queued calls left in pipelined batches")
	require.Greater(t, hook.batched.Load(), hook.batches.Load(), "batches carried several calls")
	require.Len(t, mr.Keys(), n, "every call ran exactly once")
}

func TestRedisPipelineClose(t *testing.T) {
	s, _, hook := newHeldRedis(t)
	hook.hold.Store(true)
	const n = 10
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _, err := s.Acquire(t.Context(), "c"+strconv.Itoa(i), Claim{LockTTL: time.Hour, TTL: time.Hour})
			errs <- err
		}()
	}
	queued := waitAllWaiting(t, s, hook, n)
	s.pipe.close()
	hook.hold.Store(false)
	close(hook.release)
	wg.Wait()
	close(errs)
	closed := 0
	for err := range errs {
		if errors.Is(err, ErrClosed) {
			closed++
		}
	}
	require.Equal(t, queued, closed, "the calls still queued at Close fail with ErrClosed")
	require.NoError(t, s.Close())
	_, _, err := s.Acquire(t.Context(), "after", Claim{LockTTL: time.Hour, TTL: time.Hour})
	require.Error(t, err)
}
