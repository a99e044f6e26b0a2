package extproc

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

// renewal extends a lease every lockTTL/3 for as long as its owner needs it: the stream of a
// running request, so that a long request never loses its lock and a crashed replica blocks a
// key for at most lock_ttl; then, when the completion could not be written, the background
// write that retries it (completions.go). While the store cannot be reached it tries again every
// awayRetry, and once the lease may have expired it re-asserts it instead (hold.go). It waits in
// the server's renewal queue, which all renewals share, and runs on a clock timer goroutine of
// its own once due; it shares only the hold with its owner.
type renewal struct {
	mu      sync.Mutex
	stopped bool
	cancel  context.CancelFunc // ends the renewal in flight, if any

	// Set by renewAfter, as the renewal is queued, and let go by stop: who renews what (o's
	// server keeps the queue).
	o *leaseCall
	h *hold

	// Guarded by the queue's mu: when the renewal is due, and its place in the queue's heap
	// (queued while it waits there).
	due    time.Time
	index  int
	queued bool
}

// maxAwayRetry bounds the wait between two tries to reach the store with a lease while it does
// not answer: the time from the store's return to a lapsed claim's re-assertion is at most this
// plus one store call.
const maxAwayRetry = 50 * time.Millisecond

// awayRetry is the wait before the next renewal after one that could not reach the store:
// lockTTL/6, at most maxAwayRetry, and at least a millisecond.
func awayRetry(lockTTL time.Duration) time.Duration {
	return max(min(lockTTL/6, maxAwayRetry), time.Millisecond)
}

// renewAfter queues r to renew h's lease d from now, and from then on every lock_ttl/3, until
// stop is called or the context of o, the store calls it renews for, ends; it returns r. Each
// renewal is one of o's calls, traced as its span and logged with its identity; its store call
// is bounded by the store's timeout and by stop, not by o's context (see tick). A renewal waits
// in the server's queue, which gives its place back when it is stopped: most requests end
// before their first renewal. A renewal stopped already is not queued.
func (o *leaseCall) renewAfter(d time.Duration, r *renewal, h *hold) *renewal {
	// Under r.mu: stop then finds the renewal queued, or stopped before it runs. A clock that
	// panics leaves r usable: its owner's finish stops it.
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.stopped {
		return r
	}
	r.o, r.h, r.cancel = o, h, nil
	q := &o.s.renewals
	q.mu.Lock()
	defer q.mu.Unlock()
	now := q.clock.Now()
	due := now.Add(d)
	if q.armed.IsZero() || due.Before(q.armed) {
		// First, so that a clock that panics queues nothing.
		if q.timer == nil {
			q.timer = q.clock.AfterFunc(d, q.fire)
		} else {
			q.timer.Reset(d)
		}
		q.armed = due
	}
	r.due, r.index, r.queued = due, len(q.heap), true
	q.heap = append(q.heap, r)
	q.up(r.index)
	return r
}

// tick renews once, then queues the next renewal unless r was stopped. It runs on a clock timer
// goroutine of its own, started by the queue when r is due.
func (r *renewal) tick() {
	r.mu.Lock()
	if r.stopped {
		r.mu.Unlock()
		return
	}
	s, o, h := r.o.s, r.o, r.h
	// The context exists only while a renewal runs: most requests end before their first. Only
	// stop ends it, not the stream's end: a release waits for the renewal's answer (hold.writing),
	// and a call cut short may still land later. The store bounds the call by its timeout.
	ctx, cancel := context.WithCancel(context.WithoutCancel(o.ctx))
	defer cancel()
	r.cancel = cancel
	r.mu.Unlock()
	// Outside the lock, so that stop never waits for a store call: a renewal cut short by the
	// completion's stop that lands after it is refused by the store (a completed record is never
	// renewed nor overwritten), and one cut short by leave only keeps the lease it was to keep.
	// A release waits for it instead (leaseCall.release). The completion's retries renew beside
	// their writes without stopping: a renewal waits for a write under way, and does nothing once
	// the record is written (hold.writing).
	h.writing.Lock()
	defer h.writing.Unlock()
	if h.spent {
		return
	}
	err := o.keep(ctx, o.storeSpan("renew"), h)
	next := h.lease.Claim().LockTTL / 3
	switch {
	case ctx.Err() != nil:
		return
	case errors.Is(err, cache.ErrLeaseLost):
		o.leaseLost(h, "renewal")
		return
	case errors.Is(err, errContested):
		o.event(s.log.Warn()).Msg("re-asserting the claim found another owner's record; trying again until lock_ttl has passed")
		next = awayRetry(h.lease.Claim().LockTTL)
	case err != nil:
		o.event(s.log.Warn()).Str("op", "renew").Err(err).Msg("store operation failed")
		next = awayRetry(h.lease.Claim().LockTTL)
	}
	if o.ctx.Err() != nil {
		// The owner is gone: its stream's finish (or the completions' Shutdown) ends the lease,
		// and no renewal is queued behind it, whatever path ends it.
		return
	}
	o.renewAfter(next, r, h)
}

// stop prevents further renewals and cuts short one in flight, without waiting for it: the
// owner's next store call is its only one in the phase (a release waits for it first: see
// leaseCall.release). It is safe on a nil renewal and on one never started.
func (r *renewal) stop() {
	if r == nil {
		return
	}
	r.mu.Lock()
	r.stopped = true
	if r.o != nil {
		// Off the queue, if it waits there; the timer is stopped when no renewal waits.
		q := &r.o.s.renewals
		q.mu.Lock()
		if r.queued {
			q.delete(r.index)
			if len(q.heap) == 0 && !q.armed.IsZero() {
				q.timer.Stop()
				q.armed = time.Time{}
			}
		}
		q.mu.Unlock()
	}
	// A stopped renewal lets go of its owner: the hold the completions' retries keep must not
	// keep the stream's call, and with it the request's headers and body, in memory.
	r.o, r.h = nil, nil
	cancel := r.cancel
	r.mu.Unlock()
	if cancel != nil {
		cancel()
	}
}

// renewalQueue holds the renewals waiting for their next turn, in a heap by due time, and one
// timer armed for a time at or before the first one's. When it fires it starts the renewals due,
// each on a timer goroutine of its own (a store call may take the store's whole timeout, and
// must not hold up the others), and arms itself for the next one. A renewal stopped before it is
// due leaves the heap; the timer is stopped only when the heap empties, and re-armed (Reset) when
// a renewal comes due before it. So a request that ends before lock_ttl/3 costs a heap insertion
// and a removal, where a timer of its own cost about 0.85 µs and six allocations to arm and stop.
type renewalQueue struct {
	clock clock.Clock

	mu    sync.Mutex
	heap  []*renewal
	timer clock.Timer // nil until first armed
	armed time.Time   // when the timer fires; zero while it is stopped
}

// fire starts the renewals due and arms the timer for the next one, if any. A firing whose
// renewals were all stopped finds none due, and only re-arms.
func (q *renewalQueue) fire() {
	q.mu.Lock()
	now := q.clock.Now()
	var due []*renewal
	for len(q.heap) > 0 && !q.heap[0].due.After(now) {
		r := q.heap[0]
		q.delete(0)
		due = append(due, r)
	}
	q.armed = time.Time{}
	if len(q.heap) > 0 {
		q.armed = q.heap[0].due
		q.timer.Reset(q.armed.Sub(now))
	}
	q.mu.Unlock()
	for _, r := range due {
		q.clock.AfterFunc(0, r.tick)
	}
}

// delete takes the renewal at i off the heap. Called with q.mu held.
func (q *renewalQueue) delete(i int) {
	h := q.heap
	last := len(h) - 1
	h[i].queued = false
	if i != last {
		h[i] = h[last]
		h[i].index = i
	}
	h[last] = nil
	q.heap = h[:last]
	if i != last {
		q.down(i)
		q.up(i)
	}
}

func (q *renewalQueue) up(i int) {
	h := q.heap
	for i > 0 {
		p := (i - 1) / 2
		if !h[i].due.Before(h[p].due) {
			return
		}
		q.swap(i, p)
		i = p
	}
}

func (q *renewalQueue) down(i int) {
	h := q.heap
	for {
		c := 2*i + 1
		if c >= len(h) {
			return
		}
		if c+1 < len(h) && h[c+1].due.Before(h[c].due) {
			c++
		}
		if !h[c].due.Before(h[i].due) {
			return
		}
		q.swap(i, c)
		i = c
	}
}

func (q *renewalQueue) swap(i, j int) {
	h := q.heap
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
