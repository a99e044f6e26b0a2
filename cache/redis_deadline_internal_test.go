package cache

import (
	"context"
	"sync"
	"testing"
	"time"

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
	require.Equal(t, time.Millisecond, newDeadlines(time.Second).step, "at most a millisecond")
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
	// The same step gives the same slot, whatever the nanoseconds.
	a := d.slot(base.Add(10 * time.Millisecond))
	at := a.at.Add(-timeout) // a reading in a's step, at its start
	require.Same(t, a, d.slot(at))
	require.Same(t, a, d.slot(at.Add(d.step-1)))
	require.NotSame(t, a, d.slot(at.Add(d.step)))

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
