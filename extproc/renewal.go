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
// awayRetry, and once the lease may have expired it re-asserts it instead (hold.go). It runs on
// the clock's timer goroutines and shares only the hold with its owner.
type renewal struct {
	mu      sync.Mutex
	stopped bool
	timer   clock.Timer
	cancel  context.CancelFunc // ends the renewal in flight, if any
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

// renewEvery starts r renewing h's lease every lock_ttl/3 until stop is called or the context of
// o, the store calls it renews for, ends; it returns r. Each renewal is one of o's calls: bounded
// by its context, traced as its span, logged with its identity.
func (s *Server) renewEvery(r *renewal, o *leaseCall, h *hold) *renewal {
	interval := h.claim.LockTTL / 3
	var tick func()
	tick = func() {
		// The context exists only while a renewal runs: most requests end before their first.
		ctx, cancel := context.WithCancel(o.ctx)
		defer cancel()
		r.mu.Lock()
		if r.stopped {
			r.mu.Unlock()
			return
		}
		r.cancel = cancel
		r.mu.Unlock()
		// Outside the lock, so that stop never waits for a store call: a renewal that lands
		// after the completion or release is refused by the store (the record is no longer
		// pending), and one cut short by stop changes nothing.
		err := s.keep(ctx, o.storeSpan("renew"), h, o.event)
		next := interval
		switch {
		case ctx.Err() != nil:
			return
		case errors.Is(err, cache.ErrLeaseLost):
			s.leaseLost(h, o.event, "renewal")
			return
		case errors.Is(err, errContested):
			o.event(s.log.Warn()).Msg("re-asserting the claim found another owner's record; trying again until lock_ttl has passed")
			next = awayRetry(h.claim.LockTTL)
		case err != nil:
			o.event(s.log.Warn()).Str("op", "renew").Err(err).Msg("store operation failed")
			next = awayRetry(h.claim.LockTTL)
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		r.cancel = nil
		if !r.stopped {
			r.timer = s.clock.AfterFunc(next, tick)
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock() // a clock that panics leaves r usable: its owner's finish stops it
	r.timer = s.clock.AfterFunc(interval, tick)
	return r
}

// stop prevents further renewals and cuts short one in flight, without waiting for it: the
// owner's next store call is its only one in the phase. It is safe on a nil renewal.
func (r *renewal) stop() {
	if r == nil {
		return
	}
	r.mu.Lock()
	r.stopped = true
	if r.timer != nil {
		r.timer.Stop()
	}
	cancel := r.cancel
	r.mu.Unlock()
	if cancel != nil {
		cancel()
	}
}
