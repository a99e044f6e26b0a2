package cache

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// deadlines gives the Redis store's calls their deadlines without a timer each. A
// context.WithDeadline per call (its timer, its cancel context, its registration with the caller's
// context) was about 5 of a call's allocations and a tenth of its CPU
// (BenchmarkRedisAgainstNaive). The calls that start within the same step share one deadline
// slot instead: one context and one timer, at the end of the store timeout rounded down to the
// step, so that no call is given more than the store timeout. A slot's timer fires at its
// deadline and frees it; nothing else needs freeing.
//
// Steps are counted on the monotonic clock from origin, as timers run: a step of the wall clock
// (NTP, a resumed VM) neither hands a new call a slot that has ended nor moves its deadline. The
// step is a hundredth of the timeout, so about a hundred slots live at once whatever the timeout,
// and a deadline is at most 1% early.
type deadlines struct {
	timeout time.Duration
	step    time.Duration
	origin  time.Time // holds a monotonic reading
	cur     atomic.Pointer[deadlineSlot]
}

// deadlineSlot is one shared deadline: ctx ends at it.
type deadlineSlot struct {
	at     time.Time
	n      int64 // at's step since origin: the slot's identity
	ctx    context.Context
	cancel context.CancelFunc // Close ends the current slot early; its timer ends the others at at
}

// newDeadlines returns the deadlines of calls bounded by timeout: shared by the calls of each
// hundredth of it, down to a microsecond.
func newDeadlines(timeout time.Duration) *deadlines {
	return &deadlines{timeout: timeout, step: max(timeout/100, time.Microsecond), origin: time.Now()}
}

// slot returns the slot of a call that starts at now (a reading of time.Now, with its monotonic
// clock): its deadline is at most now + timeout, and later than now + timeout - step.
func (d *deadlines) slot(now time.Time) *deadlineSlot {
	off := now.Sub(d.origin) + d.timeout
	n := int64(off / d.step)
	if off < 0 && off%d.step != 0 {
		n-- // round down, before origin too
	}
	s := d.cur.Load()
	if s != nil && s.n == n {
		select {
		case <-s.ctx.Done(): // ended early (Close): never shared
		default:
			return s
		}
	}
	ns := &deadlineSlot{at: d.origin.Add(time.Duration(n) * d.step), n: n}
	ns.ctx, ns.cancel = context.WithDeadline(context.Background(), ns.at)
	// A caller that read the clock earlier than the one that made the current slot keeps its own
	// slot: a later one would give it more than the timeout.
	if s == nil || s.n <= n {
		d.cur.CompareAndSwap(s, ns)
	}
	return ns
}

// close ends the current slot, whose timer would otherwise live on to its deadline: it is the
// one most calls share. The calls still under it end with it.
func (d *deadlines) close() {
	if s := d.cur.Load(); s != nil {
		s.cancel()
	}
}

// callCtx is the context of one store call: the caller's values, and the deadline of its slot,
// whose Done and Err it has. The caller's own cancellation is not its: the store's waits watch it
// apart (callerDone), and a call that runs alone on its caller's goroutine runs under a context
// of the caller's (alone), since go-redis ends its own waits (for a pooled connection, between
// retries, while dialing) when Done does.
type callCtx struct {
	context.Context // the caller's
	slot            *deadlineSlot
}

func (c *callCtx) Deadline() (time.Time, bool) { return c.slot.at, true }
func (c *callCtx) Done() <-chan struct{}       { return c.slot.ctx.Done() }
func (c *callCtx) Err() error                  { return c.slot.ctx.Err() }

// alone returns the context under which a call whose context is ctx runs when it runs alone on
// its caller's goroutine: the caller's own, limited to the slot's deadline, when the caller can
// give up (so that go-redis lets it go at once); otherwise ctx. cancel frees it.
func alone(ctx context.Context) (context.Context, context.CancelFunc) {
	if c, ok := ctx.(*callCtx); ok && c.Context.Done() != nil {
		return context.WithDeadline(c.Context, c.slot.at)
	}
	return ctx, noCancel
}

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

// gaveUp returns cmd, or the caller's own error in its place when the caller behind ctx gave up
// (its context ended: Canceled, or its own deadline) and cmd's error leaves unknown what the call
// did: the error the call ended with (a slot's deadline, a broken connection) is not the reason
// the caller has none. A reply of the server's, which the caller can use, is kept.
func gaveUp(ctx context.Context, cmd *redis.Cmd) *redis.Cmd {
	if err := cmd.Err(); err == nil || !unanswered(err) {
		return cmd
	}
	own := ctx
	if c, ok := ctx.(*callCtx); ok {
		own = c.Context
	}
	if err := own.Err(); err != nil {
		return errorCmd(ctx, err)
	}
	return cmd
}
