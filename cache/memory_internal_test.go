package cache

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache/arena"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

var internalClaim = Claim{LockTTL: 30 * time.Second, TTL: time.Hour}

func newInternalMemory(t *testing.T, maxBytes int64) (*Memory, *clock.Fake) {
	t.Helper()
	return newMemoryWith(t, maxBytes, arena.Options{})
}

// newMemoryWith is newInternalMemory with its arena's options: small segments, so that records
// are both in segments and on their own, and segments fill, empty and are compacted.
func newMemoryWith(t *testing.T, maxBytes int64, ao arena.Options) (*Memory, *clock.Fake) {
	t.Helper()
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	m, err := newMemory(MemoryOptions{MaxBytes: maxBytes, Clock: clk}, ao)
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	return m, clk
}

// arenaOf returns m's arena, for the checks that reach into it.
func arenaOf(m *Memory) *arena.Arena { return m.arena.(*arena.Arena) }

// checkMemory checks every structure of m against the others: the index and its hash chains,
// the slots, the free list, both deadline heaps (order, membership by state, back indexes), the
// lru list (completed records only, links both ways), the byte count and the arena (its own
// structures, and a record of the right size behind each slot).
func checkMemory(t *testing.T, m *Memory) {
	t.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	used := map[int32]bool{}
	var bytes int64
	for h, first := range m.index {
		require.NotZero(t, first, "hash %x names the lru head", h)
		keys := map[string]bool{}
		for i := first; i != 0; i = m.entry(i).same {
			require.False(t, used[i], "slot %d indexed twice", i)
			used[i] = true
			e := m.entry(i)
			key := string(m.keyOf(i))
			require.False(t, keys[key], "key %s indexed twice", key)
			keys[key] = true
			require.Equal(t, h, e.hash, "key %s", key)
			require.Equal(t, h, m.hash(key), "key %s: its hash", key)
			bytes += e.cost()
			require.LessOrEqual(t, e.respLen, e.n-e.keyLen, "key %s", key)
			hp := m.heapOf(e)
			require.Less(t, e.heapIdx, hp.slots.Len(), "key %s", key)
			require.Equal(t, i, *hp.slots.At(e.heapIdx), "key %s: its heap index", key)
			require.Equal(t, e.state == Completed, e.next != unlinked, "key %s: in the lru list iff completed", key)
		}
	}
	require.Equal(t, bytes, m.bytes)
	free := map[int32]bool{}
	for _, i := range m.free {
		require.False(t, used[i], "slot %d both free and used", i)
		require.False(t, free[i], "slot %d free twice", i)
		free[i] = true
		require.Equal(t, memEntry{}, *m.entry(i), "free slot %d is zeroed", i)
	}
	require.Equal(t, int(m.entries.Len())-1, len(used)+len(m.free), "every slot but the lru head is used or free")
	for _, h := range []*deadlineHeap{&m.pending, &m.completed} {
		for k := range h.slots.Len() {
			i := *h.slots.At(k)
			require.True(t, used[i], "heap slot %d is a record", i)
			require.Same(t, h, m.heapOf(m.entry(i)), "slot %d is in its state's heap", i)
			if k > 0 {
				parent := *h.slots.At((k - 1) / 2)
				require.LessOrEqual(t, m.entry(parent).deadline, m.entry(i).deadline, "heap order at %d", k)
			}
		}
	}
	require.Equal(t, len(used), m.pending.Len()+m.completed.Len())
	n := 0
	for i := m.entry(0).next; i != 0; i = m.entry(i).next {
		require.True(t, used[i], "lru slot %d is a record", i)
		require.Equal(t, Completed, m.entry(i).state)
		require.Equal(t, i, m.entry(m.entry(i).prev).next, "lru links of %d", i)
		n++
		require.LessOrEqual(t, n, len(used), "the lru list ends")
	}
	checkArena(t, m, used)
}

// checkArena checks the arena's structures, and that the records of the slots in used each have
// bytes of their own, of their size, there.
func checkArena(t *testing.T, m *Memory, used map[int32]bool) {
	t.Helper()
	a := arenaOf(m)
	require.NoError(t, a.Check())
	handles := map[arena.Handle]int32{}
	for i := range used {
		e := m.entry(i)
		require.NotZero(t, e.rec, "slot %d has bytes", i)
		other, taken := handles[e.rec]
		require.False(t, taken, "slots %d and %d share handle %d", i, other, e.rec)
		handles[e.rec] = i
		require.Len(t, a.Get(e.rec), int(e.n), "slot %d", i)
	}
	require.Equal(t, len(used), a.Stats().Records, "the arena holds the records of the slots, and only those")
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
// its structures as it goes, with its segments mapped outside the Go heap and, as where mapping
// fails, on it.
func TestMemoryStaysConsistent(t *testing.T) {
	t.Run("mapped", func(t *testing.T) { testMemoryStaysConsistent(t, nil) })
	t.Run("heap", func(t *testing.T) { testMemoryStaysConsistent(t, refuseMapping) })
}

// refuseMapping makes every segment an allocation on the heap, as where mapping is not supported
// or an address space limit is reached.
func refuseMapping(int) ([]byte, error) { return nil, errors.New("mapping refused by the test") }

// testMemoryStaysConsistent runs on segments that mapSegment gives, the system's when nil.
func testMemoryStaysConsistent(t *testing.T, mapSegment func(int) ([]byte, error)) {
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
			// Small segments, so that bodies of up to 400 bytes are both in segments and on
			// their own, and segments fill, empty and are compacted; half the seeds hash keys so
			// badly that they share a few hashes.
			m, clk := newMemoryWith(t, bound, arena.Options{SegmentSize: 4 << 10, Map: mapSegment})
			if seed%4 < 2 {
				m.hash = func(key string) uint64 { return uint64(len(key)) }
			}
			ctx := context.Background()
			var leases []Lease
			for op := range 2000 {
				key := "k" + strconv.Itoa(rnd.IntN(1000))
				claim := Claim{LockTTL: time.Duration(1+rnd.IntN(20)) * time.Second, TTL: time.Duration(1+rnd.IntN(120)) * time.Second, Fingerprint: []byte(key)}
				switch r := rnd.IntN(10); {
				case r < 4:
					l, rec, err := m.Acquire(ctx, key, claim)
					require.NoError(t, err)
					if rec != nil {
						require.Equal(t, claim.Fingerprint, rec.Fingerprint, "the record found is key %s's", key)
					}
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
			st := m.Stats().Arena
			require.Positive(t, st.Segments)
			if mapSegment != nil {
				require.Zero(t, st.MappedBytes, "no segment is mapped outside the Go heap")
				require.Positive(t, st.HeapSegments, "segments on the heap are counted")
			} else if st.HeapSegments == 0 {
				require.Equal(t, int64(st.Segments*st.SegmentSize), st.MappedBytes, "every segment is mapped outside the Go heap")
			}
			require.NoError(t, m.Close())
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
	for i := int32(1); i < m.entries.Len(); i++ {
		if e := m.entry(i); e.state != 0 && e.deadline > m.now() {
			live += e.cost()
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

// checkArenaBounds checks what the arena holds against its live bytes, for a workload where
// records go about as fast as they come (evicted, not expired in waves): holes within the slack
// (an eighth of the live bytes and two segments) and two segments more, those that records
// removed while a head fills may open; segments in use full but for an end shorter than the
// largest record and its 8-byte header (and the head); spare segments at most two.
func checkArenaBounds(t *testing.T, m *Memory, op int) {
	t.Helper()
	a := m.arena.Stats()
	require.LessOrEqual(t, a.WrittenBytes-a.LiveBytes, a.LiveBytes/8+4*a.SegmentSize, "op %d: holes", op)
	require.LessOrEqual(t, (a.SegmentsInUse-1)*(a.SegmentSize-m.maxInline-8), a.WrittenBytes, "op %d: segments in use", op)
	require.LessOrEqual(t, a.Segments, a.SegmentsInUse+2, "op %d: segments held", op)
}

// TestMemoryArenaSameSizeRecords: records of one size leave each segment an end too short for the
// next, up to the largest record kept in a segment. Those ends are not holes compaction could
// close: filling, evicting and compacting with records of the sizes that waste the most ends,
// and completes every call.
func TestMemoryArenaSameSizeRecords(t *testing.T) {
	const segSize = 4 << 10
	// The last size, of records kept on their own, is the size that could hang the store when
	// records of a quarter of a segment were kept in segments and their ends counted as holes.
	for _, n := range []int{segSize / 16, segSize/16 - 1, segSize/17 + 1, segSize/32 + 1, 40, segSize/4 - 8 - 1} {
		t.Run(strconv.Itoa(n), func(t *testing.T) {
			m, _ := newMemoryWith(t, 512<<10, arena.Options{SegmentSize: segSize}) // many segments: their ends add up
			ctx := context.Background()
			for i := range 3000 {
				key := fmt.Sprintf("k%05d", i)
				l, _, err := m.Acquire(ctx, key, internalClaim)
				require.NoError(t, err)
				// The record's bytes: the key (6), the encoded response (its 9-byte head and
				// the body), no fingerprint.
				body := make([]byte, max(0, n-len(key)-9))
				require.NoError(t, m.Complete(ctx, l, Response{Status: 200, Body: body}))
				if i%7 == 0 { // replays keep some records, so that holes open among the others
					_, err := lookup(m, fmt.Sprintf("k%05d", i/2))
					require.NoError(t, err)
				}
				if i > 200 {
					checkArenaBounds(t, m, i)
				}
			}
			checkMemory(t, m)
		})
	}
}

// TestMemoryArenaStaysCompact: with replays keeping some old records while others are evicted
// around them, the arena's segments fill with holes. Compaction keeps the segments in use within
// the slack of the live bytes, frees the memory of those it no longer needs, and moves records
// without changing their bytes.
func TestMemoryArenaStaysCompact(t *testing.T) {
	m, _ := newMemoryWith(t, 64<<10, arena.Options{SegmentSize: 8 << 10})
	rnd := rand.New(rand.NewPCG(1, 2))
	ctx := context.Background()
	body := func(k int) []byte { return []byte(strings.Repeat(strconv.Itoa(k), 10+k%90)) }
	replays := 0
	for op := range 20_000 {
		k := rnd.IntN(2000)
		if rnd.IntN(2) == 0 {
			k = rnd.IntN(100) // some keys come back often, and stay
		}
		key := "k" + strconv.Itoa(k)
		l, rec, err := m.Acquire(ctx, key, internalClaim)
		require.NoError(t, err)
		if l.Held() {
			require.NoError(t, m.Complete(ctx, l, Response{Status: 200, Body: body(k)}))
		} else {
			replays++
			require.Equal(t, body(k), rec.Response.Body, "key %s", key)
		}
		if op > 1000 {
			checkArenaBounds(t, m, op)
		}
		if op%100 == 0 {
			checkMemory(t, m)
		}
	}
	require.Greater(t, replays, 5000)
	require.Positive(t, m.arena.Stats().MovedBytes, "records were moved")
	checkMemory(t, m)
}

// TestMemoryConcurrentReplaysKeepTheirBytes: arena bytes move and are reused under the lock, so a
// replay copies its record before releasing it. With small segments reused all the time, every
// replay still reads its own record's bytes (and the race detector sees no unguarded read).
func TestMemoryConcurrentReplaysKeepTheirBytes(t *testing.T) {
	m, _ := newMemoryWith(t, 16<<10, arena.Options{SegmentSize: 2 << 10})
	body := func(k int) []byte { return []byte(strings.Repeat(strconv.Itoa(k), 5+k%40)) }
	var wg sync.WaitGroup
	var replays atomic.Int64
	for g := range 4 {
		wg.Go(func() {
			rnd := rand.New(rand.NewPCG(uint64(g), 0))
			for range 5000 {
				k := rnd.IntN(200)
				key := "k" + strconv.Itoa(k)
				l, rec, err := m.Acquire(context.Background(), key, internalClaim)
				if !assert.NoError(t, err) {
					return
				}
				switch {
				case l.Held():
					if !assert.NoError(t, m.Complete(context.Background(), l, Response{Status: 200, Body: body(k)})) {
						return
					}
				case rec.State == Completed:
					replays.Add(1)
					if !assert.Equal(t, body(k), rec.Response.Body, "key %s", key) {
						return
					}
				}
			}
		})
	}
	wg.Wait()
	require.Greater(t, replays.Load(), int64(1000))
	checkMemory(t, m)
}

// TestMemoryGrowsWithoutMoving: a growing store never moves its entries, which would copy them
// all (and fault in the pages of the copy) under the lock: appending to one slice of entries
// stalled a call for 3 to 150 ms each time it grew, as an empty store filled.
func TestMemoryGrowsWithoutMoving(t *testing.T) {
	m, _ := newMemoryWith(t, 0, arena.Options{SegmentSize: 2 << 10})
	ctx := context.Background()
	first := m.entry(0)
	const n = 3*4096 + 10 // over three chunks of entries
	for i := range n {
		l, _, err := m.Acquire(ctx, "k"+strconv.Itoa(i), internalClaim)
		require.NoError(t, err)
		require.NoError(t, m.Complete(ctx, l, Response{Status: 200, Body: make([]byte, 10+i%100)}))
	}
	checkMemory(t, m)
	require.Same(t, first, m.entry(0), "entries did not move")
	require.Equal(t, n+1, int(m.entries.Len()))
	require.Greater(t, m.arena.Stats().Segments, 100, "the arena grew")
}

// TestMemoryArenaShrinksAsRecordsExpire: when records stop coming and expire, the arena frees
// its segments as they empty, down to the few its slack allows.
func TestMemoryArenaShrinksAsRecordsExpire(t *testing.T) {
	m, clk := newMemoryWith(t, 512<<10, arena.Options{SegmentSize: 8 << 10})
	ctx := context.Background()
	for i := range 4000 { // twice the bound and more: every segment is used, emptied and reused
		l, _, err := m.Acquire(ctx, "k"+strconv.Itoa(i), internalClaim)
		require.NoError(t, err)
		require.NoError(t, m.Complete(ctx, l, Response{Status: 200, Body: make([]byte, 50+i%400)}))
	}
	peak := m.arena.Stats().Segments
	require.Greater(t, peak, 20)
	clk.Advance(internalClaim.TTL)
	for m.Len() > 0 {
		_, err := lookup(m, "absent") // each call removes up to expireBudget expired records
		require.NoError(t, err)
	}
	checkMemory(t, m)
	require.LessOrEqual(t, m.arena.Stats().Segments, 3, "segments held once every record expired, of %d", peak)
}

// TestMemoryRecordTooLargeForItsSizes: a record whose bytes would not fit the int32 sizes of an
// entry is kept as a response too large to replay, as one over the store's bound is; a key and
// fingerprint that large are refused.
func TestMemoryRecordTooLargeForItsSizes(t *testing.T) {
	m, _ := newInternalMemory(t, 0)
	m.maxRecord = 200
	ctx := context.Background()
	l, _, err := m.Acquire(ctx, "k", Claim{LockTTL: time.Minute, TTL: time.Hour, Fingerprint: []byte("fp")})
	require.NoError(t, err)
	require.NoError(t, m.Complete(ctx, l, Response{Status: 201, Body: make([]byte, 300)}))
	rec, err := lookup(m, "k")
	require.NoError(t, err)
	require.Equal(t, Completed, rec.State)
	require.Equal(t, 201, rec.Response.Status)
	require.True(t, rec.Response.BodyOmitted)
	require.Equal(t, []byte("fp"), rec.Fingerprint)

	_, _, err = m.Acquire(ctx, strings.Repeat("k", 201), internalClaim)
	require.ErrorContains(t, err, "more than a record holds")
	checkMemory(t, m)
}

// TestMemoryBigCompletionCopiesOnce: a record too big for a segment keeps the bytes Complete
// encoded outside the lock; it is not allocated and copied again under it.
func TestMemoryBigCompletionCopiesOnce(t *testing.T) {
	m, _ := newInternalMemory(t, 0)
	ctx := context.Background()
	const n = 50 // AllocsPerRun makes one call more than the runs it averages over
	claim := internalClaim
	claim.Fingerprint = make([]byte, 32)
	leases := make([]Lease, n+1)
	for i := range leases {
		l, _, err := m.Acquire(ctx, "big-"+strconv.Itoa(i), claim)
		require.NoError(t, err)
		leases[i] = l
	}
	resp := Response{Status: 201, Body: make([]byte, 4*m.maxInline)}
	next := 0
	allocs := testing.AllocsPerRun(n, func() {
		resp.Body[0] = byte(next)
		if err := m.Complete(ctx, leases[next], resp); err != nil {
			t.Fatal(err)
		}
		next++
	})
	require.Equal(t, 1.0, allocs, "allocations per big completion: its encoding only")
	for i := 0; i < next; i++ {
		rec, err := lookup(m, "big-"+strconv.Itoa(i))
		require.NoError(t, err)
		require.Equal(t, Completed, rec.State)
		require.Len(t, rec.Response.Body, 4*m.maxInline)
		require.Equal(t, byte(i), rec.Response.Body[0], "record %d keeps its own body", i)
		require.Equal(t, claim.Fingerprint, rec.Fingerprint)
	}
	checkMemory(t, m)
}

// TestMemoryCompletionReusesItsBuffer checks that completing a record that fits in a segment
// allocates nothing (its encoding's buffer is reused) and that reusing it mixes no records up.
func TestMemoryCompletionReusesItsBuffer(t *testing.T) {
	m, _ := newInternalMemory(t, 0)
	ctx := context.Background()
	const warm, n = 10, 200
	claim := internalClaim
	claim.Fingerprint = make([]byte, 32)
	leases := make([]Lease, warm+n)
	for i := range leases {
		l, _, err := m.Acquire(ctx, "small-"+strconv.Itoa(i), claim)
		require.NoError(t, err)
		leases[i] = l
	}
	resp := Response{Status: 201, Headers: []Header{{Name: "content-type", Value: []byte("application/json")}}, Body: make([]byte, 1024)}
	complete := func(i int) {
		resp.Body[0], resp.Body[1023] = byte(i), byte(i)
		require.NoError(t, m.Complete(ctx, leases[i], resp))
	}
	// The first calls fill the pool of each P the test runs on.
	for i := range warm {
		complete(i)
	}
	// Counted over all the calls, not averaged down: a collection may empty the pool, or the
	// test move to another P, now and then; a buffer lost at every other call must show.
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for i := warm; i < warm+n; i++ {
		complete(i)
	}
	runtime.ReadMemStats(&after)
	allocs := after.Mallocs - before.Mallocs
	if raceEnabled {
		// The race detector drops a quarter of what is put in a pool, on purpose, and adds
		// allocations of its own: `make allocs` counts without it.
		t.Logf("%d allocations in %d completions, not counted under the race detector", allocs, n)
	} else {
		require.Less(t, allocs, uint64(n/10), "allocations in %d completions of a 1 KiB response", n)
	}
	next := warm + n
	for i := 0; i < next; i++ {
		rec, err := lookup(m, "small-"+strconv.Itoa(i))
		require.NoError(t, err)
		require.Equal(t, Completed, rec.State)
		require.Len(t, rec.Response.Body, 1024)
		require.Equal(t, byte(i), rec.Response.Body[0], "record %d keeps its own body", i)
		require.Equal(t, byte(i), rec.Response.Body[1023], "record %d keeps its own body", i)
		require.Equal(t, resp.Headers, rec.Response.Headers)
		require.Equal(t, claim.Fingerprint, rec.Fingerprint)
	}
	checkMemory(t, m)
}

// TestMemoryLongFingerprintRecord: a record encoded into a pooled buffer (it looked small enough
// for a segment) that a long fingerprint makes too big for one is held on its own, whole, and
// stays so while later completions reuse the pool.
func TestMemoryLongFingerprintRecord(t *testing.T) {
	m, _ := newMemoryWith(t, 0, arena.Options{SegmentSize: 8 << 10}) // records over 512 bytes are held on their own
	ctx := context.Background()
	claim := internalClaim
	claim.Fingerprint = bytes.Repeat([]byte{'f'}, 300)
	l, _, err := m.Acquire(ctx, "long-fingerprint", claim)
	require.NoError(t, err)
	body := bytes.Repeat([]byte{'a'}, 300) // with the key and 32 bytes of room, it fits; with 300, it does not
	require.NoError(t, m.Complete(ctx, l, Response{Status: 200, Body: body}))
	// The next completions reuse whatever buffer the pool holds.
	for i := range 20 {
		l, _, err := m.Acquire(ctx, "next-"+strconv.Itoa(i), internalClaim)
		require.NoError(t, err)
		require.NoError(t, m.Complete(ctx, l, Response{Status: 201, Body: bytes.Repeat([]byte{'b'}, 300)}))
	}
	rec, err := lookup(m, "long-fingerprint")
	require.NoError(t, err)
	require.Equal(t, Completed, rec.State)
	require.Equal(t, body, rec.Response.Body, "the kept record's bytes are its own")
	require.Equal(t, claim.Fingerprint, rec.Fingerprint)
	checkMemory(t, m)
}
