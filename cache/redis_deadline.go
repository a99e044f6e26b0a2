package cache

import (
	"context"
	"sync/atomic"
	"time"
)

// deadlines gives the Redis store's calls their deadlines without a timer each. A
// context.WithDeadline per call (its timer, its cancel context, its registration with the caller's
// context) was about 5 of a call's allocations and a tenth of its CPU
// (BenchmarkRedisAgainstNaive). The calls that start within the same step share one deadline
// slot instead: one context and one timer, at the end of the store timeout rounded down to the
// step, so that no call is given more than the store timeout. A slot's timer fires at its
// deadline and frees it; nothing else needs freeing.
type deadlines struct {
	timeout time.Duration
	step    time.Duration
	cur     atomic.Pointer[deadlineSlot]
}

// deadlineSlot is one shared deadline: ctx ends at it.
type deadlineSlot struct {
	at     time.Time
	wall   int64 // at in Unix nanoseconds: the slot's identity (at's monotonic reading varies by a few ns between callers)
	ctx    context.Context
	cancel context.CancelFunc // never called: the timer ends ctx at at
}

// newDeadlines returns the deadlines of calls bounded by timeout: shared by the calls of each
// hundredth of it, up to a millisecond.
func newDeadlines(timeout time.Duration) *deadlines {
	return &deadlines{timeout: timeout, step: max(min(timeout/100, time.Millisecond), time.Microsecond)}
}

// slot returns the slot of a call that starts at now: its deadline is at most now + timeout, and
// later than now + timeout - step.
func (d *deadlines) slot(now time.Time) *deadlineSlot {
	at := now.Add(d.timeout)
	wall := at.UnixNano()
	at = at.Add(-time.Duration(wall % int64(d.step)))
	wall -= wall % int64(d.step)
	s := d.cur.Load()
	if s != nil && s.wall == wall {
		return s
	}
	ns := &deadlineSlot{at: at, wall: wall}
	ns.ctx, ns.cancel = context.WithDeadline(context.Background(), at)
	// A caller that read the clock earlier than the one that made the current slot keeps its own
	// slot: a later one would give it more than the timeout.
	if s == nil || s.wall < wall {
		d.cur.CompareAndSwap(s, ns)
	}
	return ns
}

// callCtx is the context of one store call: the caller's values, and the deadline of its slot,
// whose Done and Err it has. The caller's own cancellation is not its: the store's waits watch it
// apart (callerDone), and go-redis, which sets each connection's deadlines from Deadline, ends
// its own waits (for a pooled connection, between retries) at the call's deadline.
type callCtx struct {
	context.Context // the caller's
	slot            *deadlineSlot
}

func (c *callCtx) Deadline() (time.Time, bool) { return c.slot.at, true }
func (c *callCtx) Done() <-chan struct{}       { return c.slot.ctx.Done() }
func (c *callCtx) Err() error                  { return c.slot.ctx.Err() }

// callerDone returns the Done channel of the caller's own context behind ctx (nil when it never
// ends), where ctx's own Done does not end with it.
func callerDone(ctx context.Context) <-chan struct{} {
	if c, ok := ctx.(*callCtx); ok {
		return c.Context.Done()
	}
	return nil
}

// callerErr returns ctx's error, or the caller's behind it (callCtx) when that ended first.
func callerErr(ctx context.Context) error {
	if c, ok := ctx.(*callCtx); ok {
		if err := c.Context.Err(); err != nil {
			return err
		}
	}
	return ctx.Err()
}
