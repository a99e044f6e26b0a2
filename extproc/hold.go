package extproc

import (
	"context"
	"errors"
	"sync"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
)

// A lease this replica holds is a hold, from the claim until its completion is written (or given
// up) or the lease is released. While it lives:
//
//   - the server's holds map its stored key to it, so that a duplicate on this replica is
//     answered (409, or a wait) without asking the store: whatever the store says, this replica
//     never starts a request for a key it is itself running or completing;
//   - it remembers when a call last reached the store with the lease held, so that it can tell a
//     lease the store may have let expire (its renewals could not reach the store for a whole
//     lock_ttl) from one that was removed while the store answered (a purge, a flush, a failover
//     to a replica without it). The first is re-asserted once the store answers again
//     (cache.Store.Reassert: written back where the key is absent, never over another record);
//     the second stays removed, and is counted and logged as a lost lease.
type hold struct {
	// lease carries the claim Acquire was given (cache.Lease.Claim), which Reassert writes back.
	lease cache.Lease
	// renewal is the stream's renewal of the lease (the completion's retries start their own).
	renewal renewal

	mu sync.Mutex
	// reached is when the last call that found the lease held (the claim, a renewal, a
	// re-assertion) was sent: the lease lasts at least until reached plus lock_ttl.
	reached time.Time
	// lost: the lease was found lost and not re-asserted; counted and logged once.
	lost bool
	// contested is when a re-assertion first found another owner's record (see errContested);
	// zero otherwise.
	contested time.Time

	// writing serialises the completion's writes and the release with the renewals' calls: a
	// renewal never runs beside a completion, which would find the key completed by it and take
	// the lease for lost, nor lands after a release, which its re-assertion would undo.
	// spent (under writing): the record was written, or the lease released; a renewal due after
	// it does nothing.
	writing sync.Mutex
	spent   bool
}

// errContested means a re-assertion found the key held by another owner, and the holder goes on
// trying for up to lock_ttl before it counts its lease as lost. The other record may be a claim
// whose caller gave up on it: a duplicate whose Acquire timed out while the store was away, and
// which the store applied when it came back. Its replica removes such a claim as soon as the
// store answers (cache.Store.Acquire), and its lease ends within lock_ttl otherwise; a claim
// that is not one of those is still there after lock_ttl, or completed.
var errContested = errors.New("the key is held by another owner: trying again")

// contend notes that a re-assertion at now found another owner's record, and returns the error
// that says what follows: errContested within lock_ttl of the first such finding, else
// cache.ErrLeaseLost.
func (h *hold) contend(now time.Time) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.contested.IsZero() {
		h.contested = now
	}
	if now.Sub(h.contested) < h.lease.Claim().LockTTL {
		return errContested
	}
	return cache.ErrLeaseLost
}

// record is how a duplicate on this replica sees a hold: a pending record of its
// fingerprint and route, judged as the store's would be (judgeRecord).
func (h *hold) record() *cache.Record {
	c := h.lease.Claim()
	return &cache.Record{State: cache.Pending, Fingerprint: c.Fingerprint, Route: c.Route}
}

// mayHaveLapsed reports whether the store may have let the lease expire by now: no call has
// reached the store with it for a whole lock_ttl. A lease found lost before that was removed,
// not expired. A lost lease never lapses again: it is not re-asserted.
func (h *hold) mayHaveLapsed(now time.Time) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return !h.lost && now.Sub(h.reached) >= h.lease.Claim().LockTTL
}

// reachedAt records that a call sent at t found the lease held.
func (h *hold) reachedAt(t time.Time) {
	h.mu.Lock()
	if t.After(h.reached) {
		h.reached = t
	}
	h.contested = time.Time{}
	h.mu.Unlock()
}

// holdSet maps the stored keys this replica holds to their holds. It is sharded by key, so that
// concurrent streams seldom share a lock, and its maps reuse their space: a claim adds no
// allocation to the hold itself. Its zero value is empty and ready.
type holdSet struct {
	shards [64]struct {
		sync.Mutex
		m map[string]*hold
		_ [48]byte // a cache line each
	}
}

// shard returns the index of key's shard: FNV-1a over the key's last 16 bytes, the end of a hex
// digest for every stored key.
func (hs *holdSet) shard(key string) int {
	h := uint32(2166136261)
	for i := max(0, len(key)-16); i < len(key); i++ {
		h = (h ^ uint32(key[i])) * 16777619
	}
	return int(h % uint32(len(hs.shards)))
}

// add registers h as this replica's hold on its key, and returns it.
func (hs *holdSet) add(h *hold) *hold {
	sh := &hs.shards[hs.shard(h.lease.Key())]
	sh.Lock()
	if sh.m == nil {
		sh.m = make(map[string]*hold)
	}
	sh.m[h.lease.Key()] = h
	sh.Unlock()
	return h
}

// remove forgets h, unless its key is held by another hold since: its key is this replica's no
// longer. Safe on nil.
func (hs *holdSet) remove(h *hold) {
	if h == nil {
		return
	}
	key := h.lease.Key()
	sh := &hs.shards[hs.shard(key)]
	sh.Lock()
	if sh.m[key] == h {
		delete(sh.m, key)
	}
	sh.Unlock()
}

// get returns this replica's hold on key, if any.
func (hs *holdSet) get(key string) *hold {
	sh := &hs.shards[hs.shard(key)]
	sh.Lock()
	h := sh.m[key]
	sh.Unlock()
	return h
}

// len returns how many keys are held.
func (hs *holdSet) len() int {
	n := 0
	for i := range hs.shards {
		sh := &hs.shards[i]
		sh.Lock()
		n += len(sh.m)
		sh.Unlock()
	}
	return n
}

// leaseLost counts and logs, once per hold, a lease lost while its request ran or its completion
// was pending: the record was removed while the store answered, or another request claimed the
// key before the holder could re-assert it. Its response will not be recorded, and a retry of the
// request may run again.
func (c *leaseCall) leaseLost(h *hold, during string) {
	s := c.s
	h.mu.Lock()
	first := !h.lost
	h.lost = true
	h.mu.Unlock()
	if !first {
		return
	}
	s.metrics.completionsAbandoned.WithLabelValues(abandonedLeaseLost).Inc()
	c.event(s.log.Error()).Str("reason", abandonedLeaseLost).Str("during", during).
		Msg("lease lost while the request ran or its completion was pending (the record was removed, or another request took the key after the store let it expire): its response will not be recorded, and a retry of the request may run again")
}

// keep renews h's lease, or re-asserts it when the store may have let it expire (see hold). It
// returns cache.ErrLeaseLost when the lease is lost, errContested while another owner's record
// may yet go away, and the store's error when it could not be reached.
func (c *leaseCall) keep(ctx context.Context, sp trace.Span, h *hold) error {
	sent := c.s.clock.Now()
	var err error
	if h.mayHaveLapsed(sent) {
		err = c.reassert(ctx, sp, h)
	} else {
		err = c.renew(ctx, sp, h)
		if errors.Is(err, cache.ErrLeaseLost) && h.mayHaveLapsed(c.s.clock.Now()) {
			// The renewal was answered after the lease could have expired: that may be all
			// that happened to it.
			err = c.reassert(ctx, nil, h)
		}
	}
	if err == nil {
		h.reachedAt(sent)
	}
	return err
}

// reassert writes h's claim back where its key is absent, or renews it (cache.Store.Reassert).
// Another owner's record is contended (hold.contend). It is counted as a renewal in the store
// metrics.
func (c *leaseCall) reassert(ctx context.Context, sp trace.Span, h *hold) error {
	s := c.s
	start := time.Now()
	restored, err := s.store.Reassert(ctx, h.lease)
	s.renewObs.Observe(time.Since(start).Seconds())
	c.storeDone("renew", sp, err)
	if errors.Is(err, cache.ErrLeaseLost) {
		err = h.contend(s.clock.Now())
	}
	if restored {
		c.event(s.log.Warn()).Msg("claim re-asserted: the store was unreachable for longer than lock_ttl and had let the lease expire; no other request had taken the key")
	}
	return err
}
