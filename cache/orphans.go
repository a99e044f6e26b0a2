package cache

import (
	"errors"
	"sync"
	"time"

	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

const (
	// maxOrphans bounds the leases waiting to be freed; beyond it, a lease expires by itself at
	// its lock TTL, as it would have without this.
	maxOrphans = 10_000
	// orphanBatch is how many releases go in one pipelined round trip. The batches of a pass go
	// one after the other, on one connection at a time (one per node under Cluster), so that
	// live calls keep the pool.
	orphanBatch = 256
	// orphanMaxWait is the longest pause between two attempts while Redis fails.
	orphanMaxWait = time.Second
)

// orphan is a lease its Acquire may have taken unbeknown to its caller, who was told the call
// failed. It is worth freeing until it expires by itself.
type orphan struct {
	lease Lease
	until time.Time
	// lockTTL is the lease's: the life of the record if the call is applied late.
	lockTTL time.Duration
}

// orphans frees such leases in the background, retrying while Redis fails, so that a slow or
// flapping Redis does not leave keys that answer 409 for a whole lease after it recovers while
// nothing runs. A release is owner-checked: it frees nothing but the lease's own record.
type orphans struct {
	clock clock.Clock
	queue chan orphan
	done  chan struct{}
	once  sync.Once
}

// newOrphans returns an empty queue of orphans whose expiry and retries follow clk.
func newOrphans(clk clock.Clock) *orphans {
	return &orphans{clock: clk, queue: make(chan orphan, maxOrphans), done: make(chan struct{})}
}

// add queues l, which expires by itself after lockTTL; it drops it if the queue is full.
func (o *orphans) add(l Lease, lockTTL time.Duration) {
	select {
	case o.queue <- orphan{lease: l, until: o.clock.Now().Add(lockTTL), lockTTL: lockTTL}:
	default:
	}
}

// stop ends run; the leases still waiting expire by themselves.
func (o *orphans) stop() { o.once.Do(func() { close(o.done) }) }

// releaseFunc releases leases in one round trip and returns each one's error.
type releaseFunc func([]Lease) []error

// run frees the queued leases with release until stop, retrying those whose release did not
// answer, with a growing pause, until they expire. Each pass takes every lease
// queued by then.
func (o *orphans) run(release releaseFunc, firstWait time.Duration) {
	var waiting []orphan
	var next time.Time
	wait := firstWait
	for {
		var retry chan struct{}
		var timer clock.Timer
		if len(waiting) > 0 {
			retry = make(chan struct{})
			if d := next.Sub(o.clock.Now()); d > 0 {
				timer = o.clock.AfterFunc(d, func() { close(retry) })
			} else {
				close(retry) // due now: a clock's timers fire only once it moves past now
			}
		}
		select {
		case <-o.done:
			if timer != nil {
				timer.Stop()
			}
			return
		case l := <-o.queue:
			if timer != nil {
				timer.Stop()
			}
			if len(waiting) == 0 {
				next = o.clock.Now()
			}
			if len(waiting) < maxOrphans {
				waiting = append(waiting, l)
			}
			continue
		case <-retry:
		}
		waiting = o.drain(waiting)
		waiting = freeOnce(waiting, release, o.clock.Now())
		if len(waiting) == 0 {
			wait = firstWait
			continue
		}
		next = o.clock.Now().Add(wait)
		wait = min(2*wait, orphanMaxWait)
	}
}

// drain moves what is queued into waiting, up to maxOrphans.
func (o *orphans) drain(waiting []orphan) []orphan {
	for len(waiting) < maxOrphans {
		select {
		case l := <-o.queue:
			waiting = append(waiting, l)
		default:
			return waiting
		}
	}
	return waiting
}

// freeOnce tries each lease unexpired at now once, in batches, and returns those to try again.
// Once a batch finds Redis unreachable, the pass stops: the rest would fail alike, and an outage
// should not cost a connection attempt per batch every pass.
//
// A lease tried again is worth freeing for a lock TTL past now (and the longest pause before the
// next try): an Acquire sent while Redis did not answer may still wait in a connection's buffers
// (a stopped or partitioned server), and a SET applied when Redis answers again holds its key
// for a whole lock TTL from then.
func freeOnce(waiting []orphan, release releaseFunc, now time.Time) []orphan {
	var kept, batch []orphan
	leases := make([]Lease, 0, orphanBatch)
	down := false
	flush := func() {
		if len(batch) == 0 {
			return
		}
		if down {
			for _, l := range batch {
				l.until = later(l.until, now.Add(l.lockTTL+orphanMaxWait))
				kept = append(kept, l)
			}
			batch = batch[:0]
			return
		}
		leases = leases[:0]
		for _, l := range batch {
			leases = append(leases, l.lease)
		}
		for i, err := range release(leases) {
			// Only the script's answer settles a lease: freed, or not this lease's. Any other
			// error, a reply such as LOADING, READONLY or TRYAGAIN included, means it did not
			// run; retrying is safe, as the release checks the owner.
			if err != nil && !errors.Is(err, ErrLeaseLost) && !errors.Is(err, ErrClosed) {
				l := batch[i]
				l.until = later(l.until, now.Add(l.lockTTL+orphanMaxWait))
				kept = append(kept, l)
			}
			down = down || unreachable(err)
		}
		batch = batch[:0]
	}
	for _, l := range waiting {
		if now.After(l.until) {
			continue
		}
		if batch = append(batch, l); len(batch) == orphanBatch {
			flush()
		}
	}
	flush()
	return kept
}

// later returns the later of a and b.
func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
