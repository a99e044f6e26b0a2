package cache

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// TestDeadlineSlots checks the shared deadlines of store calls: never more than the timeout from
// a call's start, less by at most one step; one slot for the calls of a step; a caller whose
// clock reading is older than the current slot's gets a slot of its own, not the later one; and a
// slot's context ends at its deadline.
func TestDeadlineSlots(t *testing.T) {
	const timeout = 50 * time.Millisecond
	d := newDeadlines(timeout)
	require.Equal(t, 500*time.Microsecond, d.step)
	require.Equal(t, 10*time.Millisecond, newDeadlines(time.Second).step, "a hundredth of the timeout")
	require.Equal(t, time.Microsecond, newDeadlines(50*time.Microsecond).step, "at least a microsecond")
	base := time.Now()
	for _, tc := range []struct {
		name string
		now  time.Time
	}{
		{"first", base},
		{"later", base.Add(3 * time.Millisecond)},
		{"earlier than the current slot", base.Add(time.Millisecond)},
		{"a step earlier still", base.Add(-time.Millisecond)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := d.slot(tc.now)
			limit := tc.now.Add(timeout)
			require.False(t, s.at.After(limit), "deadline %v after now+timeout %v", s.at, limit)
			require.True(t, s.at.After(limit.Add(-d.step)), "deadline %v a step or more before now+timeout %v", s.at, limit)
			dl, ok := s.ctx.Deadline()
			require.True(t, ok)
			require.Equal(t, s.at, dl)
		})
	}
	// The same step gives the same slot, whatever the nanoseconds: under a timeout no stall of
	// this test outlasts, so that the slot is still live when asked for again.
	long := newDeadlines(time.Hour)
	a := long.slot(time.Now())
	at := a.at.Add(-time.Hour) // a reading in a's step, at its start
	require.Same(t, a, long.slot(at))
	require.Same(t, a, long.slot(at.Add(long.step-1)))
	require.NotSame(t, a, long.slot(at.Add(long.step)))
	long.close()

	s := newDeadlines(10 * time.Millisecond).slot(time.Now())
	select {
	case <-s.ctx.Done():
		require.False(t, time.Now().Before(s.at), "ended before its deadline")
		require.ErrorIs(t, s.ctx.Err(), context.DeadlineExceeded)
	case <-time.After(10 * time.Second):
		t.Fatal("the slot's context did not end at its deadline")
	}
}

// TestCallCtx checks a call's context: the slot's deadline, Done and Err, the caller's values,
// and the caller's cancellation seen through callerDone and callerErr only.
func TestCallCtx(t *testing.T) {
	type key struct{}
	caller, cancel := context.WithCancel(context.WithValue(t.Context(), key{}, "v"))
	s := newDeadlines(time.Minute).slot(time.Now())
	ctx := context.Context(&callCtx{Context: caller, slot: s})
	dl, ok := ctx.Deadline()
	require.True(t, ok)
	require.Equal(t, s.at, dl)
	require.Equal(t, "v", ctx.Value(key{}))
	require.NoError(t, callerErr(ctx))
	cancel()
	require.NoError(t, ctx.Err(), "the slot has not ended")
	require.ErrorIs(t, callerErr(ctx), context.Canceled)
	select {
	case <-callerDone(ctx):
	default:
		t.Fatal("callerDone did not end with the caller")
	}
	require.Nil(t, callerDone(t.Context()), "a context of the caller's own has no callerDone")

	// Alone on the caller's goroutine, a call runs under the caller's own context, limited to
	// the slot's deadline, when the caller can give up; under the call's context otherwise.
	live, stop := context.WithCancel(context.WithValue(t.Context(), key{}, "v"))
	own, release := alone(&callCtx{Context: live, slot: s})
	defer release()
	dl, ok = own.Deadline()
	require.True(t, ok)
	require.Equal(t, s.at, dl)
	require.Equal(t, "v", own.Value(key{}))
	stop()
	require.ErrorIs(t, own.Err(), context.Canceled, "the caller's cancellation ends it")
	forever := &callCtx{Context: context.WithoutCancel(live), slot: s}
	same, release2 := alone(forever)
	defer release2()
	require.Same(t, forever, same, "a caller that cannot give up keeps the slot")
	plain, release3 := alone(t.Context())
	defer release3()
	require.Equal(t, t.Context(), plain, "a caller's context with its own, earlier deadline is kept")
}

// withWall returns a reading of the monotonic clock at mono whose wall clock reads wall's: what
// time.Now returns once the wall clock was stepped by wall-mono (NTP, a resumed VM). It writes
// the monotonic reading into a copy of wall, both being readings of time.Now, which carry one.
func withWall(mono, wall time.Time) time.Time {
	type layout struct { // time.Time's
		wall uint64
		ext  int64
		loc  *time.Location
	}
	t := wall
	(*layout)(unsafe.Pointer(&t)).ext = (*layout)(unsafe.Pointer(&mono)).ext
	return t
}

// TestDeadlineSlotAfterWallClockStepsBack checks that a slot is found by the monotonic clock:
// after the wall clock steps back to where it read when an ended slot was made, a call starting
// now gets a live slot, whose deadline is the timeout from now, less a step at most.
func TestDeadlineSlotAfterWallClockStepsBack(t *testing.T) {
	const timeout = 20 * time.Millisecond
	d := newDeadlines(timeout)
	before := time.Now()
	ended := d.slot(before)
	<-ended.ctx.Done()
	now := time.Now()
	stepped := withWall(now, before)
	require.Equal(t, before.UnixNano(), stepped.UnixNano(), "the forged reading has the earlier wall clock")
	require.Greater(t, stepped.Sub(before), timeout, "and the later monotonic one")
	s := d.slot(stepped)
	require.NotSame(t, ended, s)
	require.NoError(t, s.ctx.Err(), "a call starting now got a slot that has ended")
	require.LessOrEqual(t, s.at.Sub(stepped), timeout)
	require.Greater(t, s.at.Sub(stepped), timeout-d.step)
	require.Greater(t, time.Until(s.at), timeout-d.step-time.Since(now), "the deadline is on the monotonic clock")
}

// TestDeadlineSlotsLiveAtOnce checks that about a hundred slots live at once whatever the store
// timeout: calls spread over one timeout (a slot made at its start lives to its end) get at most
// 101 slots, not one each.
func TestDeadlineSlotsLiveAtOnce(t *testing.T) {
	const calls = 1000
	// Timeouts no stall of the loop outlasts: a slot that ended before its step is over is
	// replaced, rightly, and a short timeout would count a slow machine's stalls.
	for _, timeout := range []time.Duration{30 * time.Second, time.Hour, 10 * 365 * 24 * time.Hour} {
		t.Run(timeout.String(), func(t *testing.T) {
			d := newDeadlines(timeout)
			base := time.Now()
			slots := map[*deadlineSlot]bool{}
			for i := range calls {
				slots[d.slot(base.Add(timeout/calls*time.Duration(i)))] = true
			}
			require.LessOrEqual(t, len(slots), 101, "slots live at once over %v", timeout)
			for s := range slots {
				s.cancel()
			}
		})
	}
}

// TestDeadlineSlotEndedByCloseIsNotShared checks that close ends the current slot and that a
// call of the same step then gets a live one.
func TestDeadlineSlotEndedByCloseIsNotShared(t *testing.T) {
	d := newDeadlines(time.Hour)
	now := time.Now()
	s := d.slot(now)
	d.close()
	require.ErrorIs(t, s.ctx.Err(), context.Canceled)
	n := d.slot(now)
	require.NotSame(t, s, n)
	require.NoError(t, n.ctx.Err())
	require.Same(t, n, d.slot(now), "the new slot is shared")
	n.cancel()
}

// TestRedisCancelledCallerIsLetGoDuringRetries checks that a caller that gives up while go-redis
// waits between retries is let go then, with its own error, not at the store timeout: Redis here
// drops every connection it accepts, go-redis retries after a backoff, the caller cancels during
// the first one. Batched (the caller's call goes alone) and not.
func TestRedisCancelledCallerIsLetGoDuringRetries(t *testing.T) {
	const (
		backoff = 200 * time.Millisecond
		cancel  = backoff / 4
		timeout = 10 * time.Second
	)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = c.Close()
		}
	}()
	for _, tc := range []struct {
		name     string
		batching bool
	}{{"batched", true}, {"direct", false}} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := OpenRedis(RedisOptions{
				URL:             fmt.Sprintf("redis://%s/0?max_retries=1000&min_retry_backoff=%v&max_retry_backoff=%v", ln.Addr(), backoff, backoff),
				Timeout:         timeout,
				DisableBatching: !tc.batching,
			})
			require.NoError(t, err)
			t.Cleanup(func() { _ = s.Close() })
			ctx, stop := context.WithCancel(t.Context())
			time.AfterFunc(cancel, stop)
			start := time.Now()
			_, _, err = s.Acquire(ctx, "k", Claim{LockTTL: time.Hour, TTL: time.Hour})
			took := time.Since(start)
			require.ErrorIs(t, err, context.Canceled)
			// Let go at the cancellation (a backoff or two later), not held to the store timeout:
			// the bound is half of it, which a busy machine's delays stay far below.
			require.Less(t, took, timeout/2, "Acquire returned %v after its caller gave up", took-cancel)
		})
	}
}

// pipelineOrder records the command names of each pipeline its client sends, but those that set
// up a connection.
type pipelineOrder struct {
	passHook
	mu    sync.Mutex
	sends [][]string
}

func (h *pipelineOrder) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		names := make([]string, len(cmds))
		for i, c := range cmds {
			names[i] = c.Name()
		}
		if names[0] != "client" && names[0] != "hello" {
			h.mu.Lock()
			h.sends = append(h.sends, names)
			h.mu.Unlock()
		}
		return next(ctx, cmds)
	}
}

// TestBatchSendsAScriptFirst checks that a batch's pipeline starts with a script where it holds
// one, whatever the calls' order (go-redis judges a pipeline by its first reply, and a free key's
// claim answers nil, which it passes through its retry predicates), and that each reply still
// goes to its own call.
func TestBatchSendsAScriptFirst(t *testing.T) {
	hook := &pipelineOrder{}
	s, mr := hookedRedis(t, hook, time.Second)
	require.NoError(t, releaseScript.Load(t.Context(), s.client).Err())
	mr.Set("taken", "v")
	claim := func(key string) *call { return &call{args: []any{"set", key, "p", "nx", "px", 60000, "get"}} }
	calls := []*call{claim("free"), claim("taken"), {script: releaseScript, keys: []string{"free2"}, args: []any{"token"}}}
	cmds := sendBatch(t.Context(), s.client, calls)
	require.ErrorIs(t, cmds[0].Err(), redis.Nil, "the free key's claim")
	v, err := cmds[1].Text()
	require.NoError(t, err)
	require.Equal(t, "v", v, "the taken key's claim")
	n, err := cmds[2].Int64()
	require.NoError(t, err)
	require.Zero(t, n, "nothing to release")
	require.Equal(t, [][]string{{"evalsha", "set", "set"}}, hook.sends)
	require.True(t, mr.Exists("free"))
}

// TestGaveUp checks the reply a caller gets when its call ends: the caller's own error in place
// of one that leaves unknown what the call did, once the caller gave up; otherwise the reply.
func TestGaveUp(t *testing.T) {
	s := newDeadlines(time.Minute).slot(time.Now())
	t.Cleanup(s.cancel)
	gone, stop := context.WithCancel(t.Context())
	stop()
	broken := errorCmd(t.Context(), errors.New("read: connection reset"))
	free := errorCmd(t.Context(), redis.Nil)
	for _, tc := range []struct {
		name string
		ctx  context.Context
		cmd  *redis.Cmd
		want error
	}{
		{"caller gave up, connection broke", &callCtx{Context: gone, slot: s}, broken, context.Canceled},
		{"caller gave up, its own context", gone, broken, context.Canceled},
		{"caller gave up, server replied", &callCtx{Context: gone, slot: s}, free, redis.Nil},
		{"caller waits", &callCtx{Context: t.Context(), slot: s}, broken, broken.Err()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.ErrorIs(t, gaveUp(tc.ctx, tc.cmd).Err(), tc.want)
		})
	}
}
