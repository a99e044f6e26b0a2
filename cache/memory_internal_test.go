package cache

import (
	"context"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

var internalClaim = Claim{LockTTL: 30 * time.Second, TTL: time.Hour}

func newInternalMemory(t *testing.T, maxBytes int64) (*Memory, *clock.Fake) {
	t.Helper()
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	m, err := NewMemory(MemoryOptions{MaxBytes: maxBytes, Clock: clk})
	require.NoError(t, err)
	return m, clk
}

// checkMemory checks every structure of m against the others: the index and the slots, the
// free list, both deadline heaps (order, membership by state, back indexes), the lru list
// (completed records only, links both ways) and the byte count.
func checkMemory(t *testing.T, m *Memory) {
	t.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	used := map[int32]bool{}
	var bytes int64
	for key, i := range m.index {
		e := &m.entries[i]
		require.Equal(t, key, e.key, "slot %d", i)
		require.False(t, used[i], "slot %d indexed twice", i)
		used[i] = true
		bytes += e.size
		require.Equal(t, int64(len(e.key)+len(e.data))+entryOverhead, e.size, "key %s", key)
		h := m.heapOf(e)
		require.Less(t, int(e.heapIdx), len(h.slots), "key %s", key)
		require.Equal(t, i, h.slots[e.heapIdx], "key %s: its heap index", key)
		require.Equal(t, e.state == Completed, e.next != unlinked, "key %s: in the lru list iff completed", key)
	}
	require.Equal(t, bytes, m.bytes)
	free := map[int32]bool{}
	for _, i := range m.free {
		require.False(t, used[i], "slot %d both free and used", i)
		require.False(t, free[i], "slot %d free twice", i)
		free[i] = true
		require.Equal(t, memEntry{}, m.entries[i], "free slot %d is zeroed", i)
	}
	require.Equal(t, len(m.entries)-1, len(m.index)+len(m.free), "every slot but the lru head is used or free")
	for _, h := range []*deadlineHeap{&m.pending, &m.completed} {
		for k, i := range h.slots {
			require.True(t, used[i], "heap slot %d is a record", i)
			require.Same(t, h, m.heapOf(&m.entries[i]), "slot %d is in its state's heap", i)
			if k > 0 {
				parent := h.slots[(k-1)/2]
				require.LessOrEqual(t, m.entries[parent].deadline, m.entries[i].deadline, "heap order at %d", k)
			}
		}
	}
	require.Equal(t, len(m.index), len(m.pending.slots)+len(m.completed.slots))
	n := 0
	for i := m.entries[0].next; i != 0; i = m.entries[i].next {
		require.True(t, used[i], "lru slot %d is a record", i)
		require.Equal(t, Completed, m.entries[i].state)
		require.Equal(t, i, m.entries[m.entries[i].prev].next, "lru links of %d", i)
		n++
		require.LessOrEqual(t, n, len(m.index), "the lru list ends")
	}
}

// lookup returns key's record, or nil when the key is free (and then frees it again).
func lookup(m *Memory, key string) (*Record, error) {
	l, rec, err := m.Acquire(context.Background(), key, internalClaim)
	if err == nil && l.Held() {
		err = m.Release(context.Background(), l)
	}
	return rec, err
}

// TestMemoryStaysConsistent runs random calls, with the clock moving, against a store and checks
// its structures as it goes.
func TestMemoryStaysConsistent(t *testing.T) {
	for seed := range uint64(10) {
		t.Run(strconv.FormatUint(seed, 10), func(t *testing.T) {
			rnd := rand.New(rand.NewPCG(seed, seed))
			// More keys than expireBudget, and now and then a long jump of the clock, so that
			// expired records outlast a call's budget and are met by lookups; half the seeds
			// bound the store tightly, so that records are evicted too.
			bound := int64(1 << 20)
			if seed%2 == 0 {
				bound = 12 << 10
			}
			m, clk := newInternalMemory(t, bound)
			ctx := context.Background()
			var leases []Lease
			for op := range 2000 {
				key := "k" + strconv.Itoa(rnd.IntN(1000))
				claim := Claim{LockTTL: time.Duration(1+rnd.IntN(20)) * time.Second, TTL: time.Duration(1+rnd.IntN(120)) * time.Second, Fingerprint: []byte(key)}
				switch r := rnd.IntN(10); {
				case r < 4:
					l, _, err := m.Acquire(ctx, key, claim)
					require.NoError(t, err)
					if l.Held() {
						leases = append(leases, l)
					}
				case r < 8 && len(leases) > 0:
					k := rnd.IntN(len(leases))
					l := leases[k]
					leases = append(leases[:k], leases[k+1:]...)
					var err error
					switch rnd.IntN(4) {
					case 0:
						err = m.Release(ctx, l)
					case 1:
						err = m.Renew(ctx, l, time.Duration(1+rnd.IntN(20))*time.Second)
						leases = append(leases, l)
					default:
						err = m.Complete(ctx, l, Response{Status: 200, Body: make([]byte, rnd.IntN(400))})
					}
					if err != nil {
						require.ErrorIs(t, err, ErrLeaseLost)
					}
				case rnd.IntN(100) == 0:
					clk.Advance(time.Duration(rnd.IntN(200)) * time.Second)
				default:
					clk.Advance(time.Duration(rnd.IntN(100)) * time.Millisecond)
				}
				if op%4 == 0 { // a broken structure stays broken: every fourth call is enough
					checkMemory(t, m)
				}
			}
			checkMemory(t, m)
		})
	}
}

// TestMemoryExpiresABoundedNumberPerCall: after many records expire at once, one call removes at
// most expireBudget of them. The others still count as absent when their key is looked up and as
// lost when their lease is used, and go before any live record is evicted for space.
func TestMemoryExpiresABoundedNumberPerCall(t *testing.T) {
	const n = 4 * expireBudget
	m, clk := newInternalMemory(t, 0)
	ctx := context.Background()
	// The least recently used record, but one that outlives the others.
	l, _, err := m.Acquire(ctx, "old", Claim{LockTTL: time.Minute, TTL: 10 * time.Hour})
	require.NoError(t, err)
	require.NoError(t, m.Complete(ctx, l, Response{Status: 200}))
	// n pending and n completed records that expire together...
	for i := range 2 * n {
		l, _, err := m.Acquire(ctx, "k"+strconv.Itoa(i), internalClaim)
		require.NoError(t, err)
		if i%2 == 0 {
			require.NoError(t, m.Complete(ctx, l, Response{Status: 200}))
		}
	}
	// ...and three that expire just after them, so that no call's budget reaches them first.
	late := Claim{LockTTL: internalClaim.LockTTL + time.Second, TTL: internalClaim.TTL + time.Second}
	lostComplete, _, err := m.Acquire(ctx, "late-complete", late)
	require.NoError(t, err)
	lostRenew, _, err := m.Acquire(ctx, "late-renew", late)
	require.NoError(t, err)
	l, _, err = m.Acquire(ctx, "late-done", late)
	require.NoError(t, err)
	require.NoError(t, m.Complete(ctx, l, Response{Status: 200}))
	clk.Advance(late.TTL + time.Second)
	records := 1 + 2*n + 3

	// A lease that ran out is lost although its record is still there; the call removed
	// expireBudget other records, then that one.
	require.ErrorIs(t, m.Complete(ctx, lostComplete, Response{Status: 200}), ErrLeaseLost)
	records -= expireBudget + 1
	require.Equal(t, records, m.Len())
	require.ErrorIs(t, m.Renew(ctx, lostRenew, time.Minute), ErrLeaseLost)
	records -= expireBudget + 1
	require.Equal(t, records, m.Len())
	checkMemory(t, m)

	// An expired record not yet removed is absent: its key can be claimed again.
	l, rec, err := m.Acquire(ctx, "late-done", internalClaim)
	require.NoError(t, err)
	require.Nil(t, rec)
	require.True(t, l.Held())
	require.Equal(t, records-expireBudget, m.Len(), "removed: expireBudget, and the old late-done; added: the new one")
	checkMemory(t, m)

	// Space goes to expired records first: bounding the store to what the live records and one
	// more take removes every expired record, and not "old", the least recently used.
	m.mu.Lock()
	var live int64
	for _, i := range m.index {
		if m.entries[i].deadline > m.now() {
			live += m.entries[i].size
		}
	}
	m.maxBytes = live + int64(len("after")) + entryOverhead
	m.mu.Unlock()
	_, _, err = m.Acquire(ctx, "after", internalClaim)
	require.NoError(t, err)
	require.Equal(t, 3, m.Len(), `"old", the reclaimed "late-done" and "after" remain`)
	rec, err = lookup(m, "old")
	require.NoError(t, err)
	require.NotNil(t, rec, `"old" was not evicted`)
	checkMemory(t, m)
}
