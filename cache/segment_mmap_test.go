//go:build unix

package cache

import (
	"context"
	"runtime"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

// mappedOf returns the bytes of m's segments mapped outside the Go heap, and checks that every
// segment it holds is mapped.
func mappedOf(t *testing.T, m *Memory) int64 {
	t.Helper()
	m.mu.Lock()
	unmapped := -1
	for s, b := range m.arena.segs {
		if b != nil && !m.arena.mapped[s] {
			unmapped = s
		}
	}
	m.mu.Unlock()
	require.Equal(t, -1, unmapped, "every segment is mapped")
	return m.MappedBytes()
}

// fillKiB completes n records of a 1000-byte body in m, under keys k0 to kn-1.
func fillKiB(t *testing.T, m *Memory, n int) {
	t.Helper()
	ctx := context.Background()
	for i := range n {
		l, _, err := m.Acquire(ctx, "k"+strconv.Itoa(i), internalClaim)
		require.NoError(t, err)
		require.NoError(t, m.Complete(ctx, l, Response{Status: 200, Body: make([]byte, 1000)}))
	}
}

// expireAll lets the n records fillKiB put in m expire and looks their keys up, which removes
// them: their segments empty.
func expireAll(t *testing.T, m *Memory, clk *clock.Fake, n int) {
	t.Helper()
	clk.Advance(internalClaim.TTL + time.Second)
	for i := range n {
		rec, err := lookup(m, "k"+strconv.Itoa(i))
		require.NoError(t, err)
		require.Nil(t, rec)
	}
	checkMemory(t, m)
}

// TestMemorySegmentsAreUnmapped checks that a store's segments, mapped outside the Go heap, are
// unmapped when they empty beyond the spares, when the store is closed, and when a store is
// dropped without being closed. Other tests' stores may be unmapped meanwhile (their cleanups),
// never mapped (no test runs beside this one): the process' mapped bytes only fall by more.
func TestMemorySegmentsAreUnmapped(t *testing.T) {
	m, clk := newInternalMemory(t, 0)
	m.arena.init(16 << 10)
	before := mappedBytes.Load()
	fillKiB(t, m, 300)
	held := mappedOf(t, m)
	require.GreaterOrEqual(t, held, int64(300*1000), "the records' bytes are in mapped segments")
	require.LessOrEqual(t, mappedBytes.Load(), before+held, "the process maps nothing else meanwhile")

	expireAll(t, m, clk, 300)
	kept := mappedOf(t, m)
	require.LessOrEqual(t, kept, int64((maxSpare+1)*(16<<10)), "empty segments beyond the spares are unmapped")
	require.LessOrEqual(t, mappedBytes.Load(), before+kept)

	fillKiB(t, m, 300)
	held = mappedOf(t, m)
	now := mappedBytes.Load()
	require.NoError(t, m.Close())
	require.LessOrEqual(t, mappedBytes.Load(), now-held, "Close unmaps every segment")

	dropped, err := NewMemory(MemoryOptions{})
	require.NoError(t, err)
	fillKiB(t, dropped, 1000)
	held = mappedOf(t, dropped)
	require.Positive(t, held)
	now = mappedBytes.Load()
	dropped = nil
	require.Eventually(t, func() bool {
		runtime.GC()
		return mappedBytes.Load() <= now-held
	}, 10*time.Second, 10*time.Millisecond, "a store dropped without Close is unmapped by its cleanup")
}

// TestMemorySurvivesARefusedUnmap: a segment the system refuses to unmap (its limit of mappings)
// is counted and left mapped; the store goes on.
func TestMemorySurvivesARefusedUnmap(t *testing.T) {
	m, clk := newInternalMemory(t, 0)
	m.arena.init(16 << 10)
	fillKiB(t, m, 100)
	// Only this store's unmapping is refused: other stores' cleanups may run meanwhile.
	var refused [][]byte
	m.arena.munmap = func(b []byte) error {
		refused = append(refused, b)
		return syscall.ENOMEM
	}
	defer func() {
		m.arena.munmap = munmapSegment
		require.NoError(t, m.Close())
		for _, b := range refused {
			require.NoError(t, munmapSegment(b))
			mappedBytes.Add(-int64(len(b)))
		}
	}()
	failures := Segments().UnmapFailures
	expireAll(t, m, clk, 100)
	require.NotEmpty(t, refused, "segments beyond the spares were freed")
	require.Equal(t, failures+int64(len(refused)), Segments().UnmapFailures)
	// The store goes on.
	fillKiB(t, m, 1)
	checkMemory(t, m)
}
