//go:build unix

package cache

import (
	"context"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache/arena"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

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

// unmapper unmaps for real, counts what it gave back, and refuses while refuse is set, as the
// system does beyond its limit of mappings; it outlives the store it serves.
type unmapper struct {
	mu       sync.Mutex
	unmapped int64
	refuse   bool
	refused  [][]byte
}

func (u *unmapper) unmap(b []byte) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.refuse {
		u.refused = append(u.refused, b)
		return syscall.ENOMEM
	}
	if err := syscall.Munmap(b); err != nil {
		return err
	}
	u.unmapped += int64(len(b))
	return nil
}

func (u *unmapper) total() int64 {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.unmapped
}

// mappedOf returns the bytes of m's segments mapped outside the Go heap, and checks that every
// segment it holds is mapped.
func mappedOf(t *testing.T, m *Memory) int64 {
	t.Helper()
	st := m.Stats().Arena
	require.Zero(t, st.HeapSegments, "every segment is mapped")
	require.Equal(t, int64(st.Segments*st.SegmentSize), st.MappedBytes)
	return st.MappedBytes
}

// TestMemorySegmentsAreUnmapped checks that a store's segments, mapped outside the Go heap, are
// unmapped when they empty beyond the spares, when the store is closed, and when a store is
// dropped without being closed.
func TestMemorySegmentsAreUnmapped(t *testing.T) {
	u := &unmapper{}
	m, clk := newMemoryWith(t, 0, arena.Options{SegmentSize: 16 << 10, Unmap: u.unmap})
	fillKiB(t, m, 300)
	held := mappedOf(t, m)
	require.GreaterOrEqual(t, held, int64(300*1000), "the records' bytes are in mapped segments")

	expireAll(t, m, clk, 300)
	kept := mappedOf(t, m)
	require.LessOrEqual(t, kept, int64(3*(16<<10)), "empty segments beyond the head and two spares are unmapped")
	require.Equal(t, held-kept, u.total())

	fillKiB(t, m, 300)
	held = mappedOf(t, m)
	before := u.total()
	require.NoError(t, m.Close())
	require.Equal(t, before+held, u.total(), "Close unmaps every segment")
	require.Zero(t, m.Stats().Arena.MappedBytes)

	du := &unmapper{}
	dropped, err := newMemory(MemoryOptions{}, arena.Options{Unmap: du.unmap})
	require.NoError(t, err)
	fillKiB(t, dropped, 1000)
	held = mappedOf(t, dropped)
	require.Positive(t, held)
	dropped = nil
	require.Eventually(t, func() bool {
		runtime.GC()
		return du.total() == held
	}, 10*time.Second, 10*time.Millisecond, "a store dropped without Close is unmapped by its arena's cleanup")
}

// TestMemorySurvivesARefusedUnmap: a segment the system refuses to unmap (its limit of mappings)
// is counted and left mapped; the store goes on.
func TestMemorySurvivesARefusedUnmap(t *testing.T) {
	u := &unmapper{}
	m, clk := newMemoryWith(t, 0, arena.Options{SegmentSize: 16 << 10, Unmap: u.unmap})
	fillKiB(t, m, 100)
	u.mu.Lock()
	u.refuse = true
	u.mu.Unlock()
	defer func() {
		u.mu.Lock()
		u.refuse = false
		refused := u.refused
		u.mu.Unlock()
		require.NoError(t, m.Close())
		for _, b := range refused {
			require.NoError(t, syscall.Munmap(b))
		}
	}()
	failures := m.Stats().Arena.UnmapFailures
	expireAll(t, m, clk, 100)
	u.mu.Lock()
	refused := len(u.refused)
	u.mu.Unlock()
	require.Positive(t, refused, "segments beyond the spares were freed")
	require.Equal(t, failures+int64(refused), m.Stats().Arena.UnmapFailures)
	// The store goes on.
	fillKiB(t, m, 1)
	checkMemory(t, m)
}
