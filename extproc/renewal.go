package extproc

import (
	"context"
	"errors"
	"sync"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

// renewal extends a lease every lock_ttl/3 while its stream lives, so that a long request never
// loses its lock and a crashed replica blocks a key for at most lock_ttl (SPEC §4). It runs on
// the clock's timer goroutines and shares only the lease with its stream.
type renewal struct {
	mu      sync.Mutex
	stopped bool
	timer   clock.Timer
	cancel  context.CancelFunc // ends the renewal in flight, if any
}

// startRenewal starts renewing the stream's lease.
func (st *stream) startRenewal() {
	r := &renewal{}
	lease, lockTTL := st.lease, st.route.LockTTL
	interval := lockTTL / 3
	var tick func()
	tick = func() {
		// The context exists only while a renewal runs: most requests end before their first.
		ctx, cancel := context.WithCancel(st.ctx)
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
		err := st.s.renew(ctx, st.storeSpan("renew"), lease, lockTTL)
		switch {
		case ctx.Err() != nil:
			return
		case errors.Is(err, cache.ErrLeaseLost):
			st.event(st.s.log.Warn()).Msg("lease lost while the request was running; its completion will not be recorded")
			return
		case err != nil:
			st.event(st.s.log.Warn()).Str("op", "renew").Err(err).Msg("store operation failed")
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		r.cancel = nil
		if !r.stopped {
			r.timer = st.s.clock.AfterFunc(interval, tick)
		}
	}
	r.mu.Lock()
	r.timer = st.s.clock.AfterFunc(interval, tick)
	r.mu.Unlock()
	st.renewal = r
}

// stop prevents further renewals and cuts short one in flight, without waiting for it: the
// stream's next store call is its only one in the phase (SPEC §4). It is safe on a nil renewal.
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
