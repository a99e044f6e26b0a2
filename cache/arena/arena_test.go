package arena

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"runtime"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func newArena(t *testing.T, opts Options) *Arena {
	t.Helper()
	a, err := New(opts)
	require.NoError(t, err)
	t.Cleanup(a.Reset)
	return a
}

// refuseMapping makes every segment an allocation on the heap, as where mapping is not supported
// or an address space limit is reached.
func refuseMapping(int) ([]byte, error) { return nil, errors.New("mapping refused by the test") }

func mappingWorks() bool {
	b, err := mapSegment(4 << 10)
	if err == nil {
		_ = munmapSegment(b)
	}
	return err == nil
}

// record returns the bytes of the i-th record of a test: its length and content both follow i.
func record(i, n int) []byte {
	b := make([]byte, n)
	for k := range b {
		b[k] = byte(i + k)
	}
	return b
}

// TestArenaAgainstAModel runs random puts, deletes and compactions and checks, as it goes, that
// every live record reads back its own bytes and that the arena's structures agree, with
// segments mapped outside the Go heap and, as where mapping fails, on it.
func TestArenaAgainstAModel(t *testing.T) {
	for _, mapped := range []bool{true, false} {
		t.Run("mapped="+strconv.FormatBool(mapped), func(t *testing.T) {
			if mapped && !mappingWorks() {
				t.Skip("this system maps no segments")
			}
			for seed := range uint64(5) {
				opts := Options{SegmentSize: 4 << 10}
				if !mapped {
					opts.Map = refuseMapping
				}
				a := newArena(t, opts)
				rnd := rand.New(rand.NewPCG(seed, 7))
				model := map[Handle][]byte{}
				var handles []Handle
				for op := range 5000 {
					switch r := rnd.IntN(10); {
					case r < 5 || len(handles) == 0:
						// Mostly small, a few too large for a segment.
						n := rnd.IntN(a.MaxInline() + 1)
						if rnd.IntN(20) == 0 {
							n = a.MaxInline() + 1 + rnd.IntN(1000)
						}
						b := record(op, n)
						h, kept := a.Put(b)
						require.NotZero(t, h)
						require.Equal(t, n > a.MaxInline(), kept, "op %d: kept only if too large for a segment", op)
						_, taken := model[h]
						require.False(t, taken, "op %d: handle %d handed out twice", op, h)
						model[h] = bytes.Clone(b)
						handles = append(handles, h)
					case r < 9:
						k := rnd.IntN(len(handles))
						h := handles[k]
						handles = append(handles[:k], handles[k+1:]...)
						a.Delete(h)
						delete(model, h)
					default:
						a.Compact()
					}
					if op%7 == 0 {
						a.Compact()
					}
					if op%50 == 0 {
						require.NoError(t, a.Check(), "op %d", op)
						for h, want := range model {
							require.Equal(t, want, a.Get(h), "op %d: record %d", op, h)
						}
					}
				}
				require.NoError(t, a.Check())
				st := a.Stats()
				require.Equal(t, len(model), st.Records)
				if mapped {
					require.Zero(t, st.HeapSegments)
					require.Positive(t, st.MappedBytes)
				} else {
					require.Positive(t, st.HeapSegments, "segments on the heap are counted")
					require.Zero(t, st.MappedBytes)
				}
				require.Positive(t, st.MovedBytes, "records were moved")
			}
		})
	}
}

// checkBounds checks what the arena holds against its live bytes, for a workload where records go
// about as fast as they come: holes within the slack and two segments more, those that deletes
// open while a head fills; segments in use full but for an end shorter than the largest record
// (and the head); spare segments at most maxSpare.
func checkBounds(t *testing.T, a *Arena, op int) {
	t.Helper()
	st := a.Stats()
	require.LessOrEqual(t, st.WrittenBytes-st.LiveBytes, st.LiveBytes/8+4*st.SegmentSize, "op %d: holes", op)
	require.LessOrEqual(t, (st.SegmentsInUse-1)*(st.SegmentSize-a.MaxInline()-recordHeader), st.WrittenBytes, "op %d: segments in use", op)
	require.LessOrEqual(t, st.Segments, st.SegmentsInUse+maxSpare, "op %d: segments held", op)
}

// TestArenaStaysCompact: with a few records kept while others are deleted around them, segments
// fill with holes; compacting after each put keeps the segments in use within the slack of the
// live bytes, and moves records without changing their bytes.
func TestArenaStaysCompact(t *testing.T) {
	a := newArena(t, Options{SegmentSize: 8 << 10})
	rnd := rand.New(rand.NewPCG(1, 2))
	type rec struct {
		h Handle
		i int
	}
	var fifo []rec
	var kept []rec
	size := func(i int) int { return 10 + i%400 }
	for op := range 20_000 {
		h, _ := a.Put(record(op, size(op)))
		a.Compact()
		r := rec{h, op}
		if rnd.IntN(10) == 0 {
			kept = append(kept, r) // stays, and holes open around it
		} else {
			fifo = append(fifo, r)
		}
		for len(fifo) > 300 {
			a.Delete(fifo[0].h)
			fifo = fifo[1:]
		}
		for len(kept) > 100 {
			k := rnd.IntN(len(kept))
			a.Delete(kept[k].h)
			kept = append(kept[:k], kept[k+1:]...)
		}
		if op > 1000 {
			checkBounds(t, a, op)
		}
		if op%500 == 0 {
			require.NoError(t, a.Check())
			for _, r := range append(fifo, kept...) {
				require.Equal(t, record(r.i, size(r.i)), a.Get(r.h))
			}
		}
	}
	require.Positive(t, a.Stats().MovedBytes)
}

// TestArenaSameSizeRecords: records of one size leave each segment an end too short for the next,
// up to the largest record kept in a segment. Those ends are not holes compaction could close:
// the bounds hold with the sizes that waste the most, and every call completes.
func TestArenaSameSizeRecords(t *testing.T) {
	const segSize = 4 << 10
	for _, n := range []int{segSize / 16, segSize/16 - 1, segSize/17 + 1, segSize/32 + 1, 40, segSize/4 - recordHeader - 1} {
		t.Run(strconv.Itoa(n), func(t *testing.T) {
			a := newArena(t, Options{SegmentSize: segSize})
			var live []Handle
			for i := range 3000 {
				h, _ := a.Put(record(i, n))
				a.Compact()
				live = append(live, h)
				if i%7 != 0 && len(live) > 120 { // some stay, so that holes open among the others
					a.Delete(live[len(live)-120])
					live = append(live[:len(live)-120], live[len(live)-119:]...)
				}
				if i > 200 {
					checkBounds(t, a, i)
				}
			}
			require.NoError(t, a.Check())
		})
	}
}

// TestArenaShrinksAsRecordsGo: when records stop coming and are deleted, the arena frees its
// segments as they empty, down to the spares.
func TestArenaShrinksAsRecordsGo(t *testing.T) {
	a := newArena(t, Options{SegmentSize: 8 << 10})
	var hs []Handle
	for i := range 2000 {
		h, _ := a.Put(record(i, 50+i%400))
		hs = append(hs, h)
	}
	peak := a.Stats().Segments
	require.Greater(t, peak, 20)
	for _, h := range hs {
		a.Delete(h)
	}
	require.NoError(t, a.Check())
	st := a.Stats()
	require.Zero(t, st.Records)
	require.LessOrEqual(t, st.Segments, maxSpare+1, "segments held once every record went, of %d", peak)
}

// A record too large for a segment is kept as it is: Put takes the caller's bytes, and Get
// returns them, unchanged by later puts, deletes and compactions.
func TestArenaKeepsLargeRecords(t *testing.T) {
	a := newArena(t, Options{SegmentSize: 4 << 10})
	b := record(1, a.MaxInline()+1)
	h, kept := a.Put(b)
	require.True(t, kept)
	require.Same(t, &b[0], &a.Get(h)[0], "no copy")
	for i := range 500 {
		h, _ := a.Put(record(i, 100))
		if i%2 == 0 {
			a.Delete(h)
		}
		a.Compact()
	}
	require.Equal(t, record(1, a.MaxInline()+1), a.Get(h))
	st := a.Stats()
	require.Equal(t, 1, st.BigRecords)
	require.Equal(t, a.MaxInline()+1, st.BigBytes)
	a.Delete(h)
	require.Zero(t, a.Stats().BigBytes)
	require.NoError(t, a.Check())

	small := record(2, 10)
	h, kept = a.Put(small)
	require.False(t, kept)
	small[0] = 0xff
	require.Equal(t, record(2, 10), a.Get(h), "a small record is copied")
}

func TestNewRefusesBadSegmentSizes(t *testing.T) {
	for _, n := range []int{-1, 1, 1023, 2 << 30} {
		_, err := New(Options{SegmentSize: n})
		require.Error(t, err, n)
	}
	a, err := New(Options{})
	require.NoError(t, err)
	require.Equal(t, DefaultSegmentSize, a.Stats().SegmentSize)
	require.Equal(t, DefaultSegmentSize/16, a.MaxInline())
}

// countingUnmap unmaps for real and counts the bytes it gave back, so that a test can follow an
// arena's mappings after it dropped the arena.
type countingUnmap struct{ unmapped atomic.Int64 }

func (c *countingUnmap) unmap(b []byte) error {
	if err := munmapSegment(b); err != nil {
		return err
	}
	c.unmapped.Add(int64(len(b)))
	return nil
}

// TestArenaSegmentsAreUnmapped checks that an arena's segments, mapped outside the Go heap, are
// unmapped when they empty beyond the spares, at Reset, and when an arena is dropped.
func TestArenaSegmentsAreUnmapped(t *testing.T) {
	if !mappingWorks() {
		t.Skip("this system maps no segments")
	}
	const segSize = 16 << 10
	fill := func(a *Arena, n int) []Handle {
		var hs []Handle
		for i := range n {
			h, _ := a.Put(record(i, 1000))
			hs = append(hs, h)
		}
		return hs
	}
	c := &countingUnmap{}
	a := newArena(t, Options{SegmentSize: segSize, Unmap: c.unmap})
	hs := fill(a, 300)
	held := a.Stats().MappedBytes
	require.GreaterOrEqual(t, held, int64(300*1000), "the records' bytes are in mapped segments")
	for _, h := range hs {
		a.Delete(h)
	}
	require.LessOrEqual(t, a.Stats().MappedBytes, int64((maxSpare+1)*segSize), "empty segments beyond the spares are unmapped")
	require.Equal(t, held-a.Stats().MappedBytes, c.unmapped.Load())

	fill(a, 300)
	before := c.unmapped.Load()
	held = a.Stats().MappedBytes
	a.Reset()
	require.Zero(t, a.Stats().MappedBytes)
	require.Equal(t, before+held, c.unmapped.Load(), "Reset unmaps every segment")

	dropped := &countingUnmap{}
	d, err := New(Options{SegmentSize: segSize, Unmap: dropped.unmap})
	require.NoError(t, err)
	fill(d, 1000)
	held = d.Stats().MappedBytes
	require.Positive(t, held)
	d = nil
	require.Eventually(t, func() bool {
		runtime.GC()
		return dropped.unmapped.Load() == held
	}, 10*time.Second, 10*time.Millisecond, "an arena dropped without Reset is unmapped by its cleanup")
}

// TestArenaSurvivesARefusedUnmap: a segment the system refuses to unmap (its limit of mappings)
// is counted and left mapped; the arena goes on.
func TestArenaSurvivesARefusedUnmap(t *testing.T) {
	if !mappingWorks() {
		t.Skip("this system maps no segments")
	}
	var refuse atomic.Bool
	var refused [][]byte
	a := newArena(t, Options{SegmentSize: 16 << 10, Unmap: func(b []byte) error {
		if refuse.Load() {
			refused = append(refused, b)
			return syscall.ENOMEM
		}
		return munmapSegment(b)
	}})
	var hs []Handle
	for i := range 100 {
		h, _ := a.Put(record(i, 1000))
		hs = append(hs, h)
	}
	refuse.Store(true)
	for _, h := range hs {
		a.Delete(h)
	}
	require.NotEmpty(t, refused, "segments beyond the spares were freed")
	require.Equal(t, int64(len(refused)), a.Stats().UnmapFailures)
	h, _ := a.Put(record(7, 1000))
	require.Equal(t, record(7, 1000), a.Get(h), "the arena goes on")
	require.NoError(t, a.Check())
	refuse.Store(false)
	for _, b := range refused {
		require.NoError(t, munmapSegment(b))
	}
}
