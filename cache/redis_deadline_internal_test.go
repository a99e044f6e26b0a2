package cache

import (
	"context"
	"testing"
	"time"

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
