package cache

import (
	"errors"
	"sync"
	"sync/atomic"
	"time"
)

const (
	// maxOrphans bounds the leases waiting to be freed; beyond it, a lease expires by itself at
	// its lock TTL, as it would have without this.
	maxOrphans = 10_000
	// orphanConcurrency bounds the releases in flight at once (the pipeline batches them).
	orphanConcurrency = 256
	// orphanMaxWait is the longest pause between two attempts while Redis fails.
	orphanMaxWait = time.Second
)

// orphan is a lease its Acquire may have taken unbeknown to its caller, who was told the call
// failed. It is worth freeing until it expires by itself.
type orphan struct {
	lease Lease
	until time.Time
}

// orphans frees such leases in the background, retrying while Redis fails, so that a slow or
// flapping Redis does not leave keys that answer 409 for a whole lease after it recovers while
// nothing runs. A release is owner-checked: it frees nothing but the lease's own record.
type orphans struct {
	queue chan orphan
	done  chan struct{}
	once  sync.Once
}

func newOrphans() *orphans {
	return &orphans{queue: make(chan orphan, maxOrphans), done: make(chan struct{})}
}

// add queues l, which expires by itself after lockTTL; it drops it if the queue is full.
func (o *orphans) add(l Lease, lockTTL time.Duration) {
	select {
	case o.queue <- orphan{lease: l, until: time.Now().Add(lockTTL)}:
	default:
	}
}

// stop ends run; the leases still waiting expire by themselves.
func (o *orphans) stop() { o.once.Do(func() { close(o.done) }) }

// run frees the queued leases with release until stop, retrying those whose release could not
// tell what happened, with a growing pause, until they expire.
func (o *orphans) run(release func(Lease) error, firstWait time.Duration) {
	var waiting []orphan
	var next time.Time
	wait := firstWait
	for {
		var retry <-chan time.Time
		if len(waiting) > 0 {
			retry = time.After(time.Until(next))
		}
		select {
		case <-o.done:
			return
		case l := <-o.queue:
			if len(waiting) == 0 {
				next = time.Now()
			}
			if len(waiting) < maxOrphans {
				waiting = append(waiting, l)
			}
			continue
		case <-retry:
		}
		waiting = freeOnce(waiting, release)
		if len(waiting) == 0 {
			wait = firstWait
			continue
		}
		next = time.Now().Add(wait)
		wait = min(2*wait, orphanMaxWait)
	}
}

// freeOnce tries each unexpired lease once and returns those to try again. Once a release finds
// Redis unreachable, the pass stops starting new ones: they would fail alike, and an outage
// should not cost a connection attempt per waiting lease every pass.
func freeOnce(waiting []orphan, release func(Lease) error) []orphan {
	now := time.Now()
	again := make([]bool, len(waiting))
	sem := make(chan struct{}, orphanConcurrency)
	var down atomic.Bool
	var wg sync.WaitGroup
	for i, l := range waiting {
		if now.After(l.until) {
			continue
		}
		if down.Load() {
			again[i] = true
			continue
		}
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			err := release(l.lease)
			// A reply of Redis' (freed, or not this lease's) settles it; anything else may
			// not have reached Redis.
			again[i] = err != nil && !errors.Is(err, ErrLeaseLost) && unanswered(err)
			if unreachable(err) {
				down.Store(true)
			}
		}()
	}
	wg.Wait()
	kept := waiting[:0]
	for i, l := range waiting {
		if again[i] {
			kept = append(kept, l)
		}
	}
	return kept
}
