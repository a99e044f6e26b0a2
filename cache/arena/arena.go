// Package arena is a byte store for many small records whose bytes the Go garbage collector
// never scans: they are packed into large segments mapped outside the Go heap.
//
// An [Arena] hands out a [Handle] per record. Records are appended to the head segment; a deleted
// record leaves a hole. A segment whose records are all gone is reused (up to maxSpare of them
// are kept, the others freed), and [Arena.Compact] moves the live records of the segments with
// the most holes to the head when the holes exceed an eighth of the live bytes and two segments,
// so that the segment they leave can be reused or freed. A segment's end, too short for the
// record that came next, is not a hole: records are at most a sixteenth of a segment
// ([Arena.MaxInline]), so those ends waste at most that. So while records come, an arena that is
// compacted after each Put holds about 6/5 of its live bytes and a few segments at most,
// whatever their sizes and order. When records stop coming and are deleted, nothing is
// compacted: segments are freed as they empty.
//
// A record larger than MaxInline is held in an allocation of its own: there are few, and their
// bytes are large next to the collector's cost of one object.
//
// Segments are mapped outside the Go heap where the system allows it (Options.Map), and unmapped
// when freed, at Reset, or by a cleanup once an arena is unreachable; where mapping fails, a
// segment is an ordinary allocation, one object to the collector (Stats counts both kinds). The
// collector never sees a mapped segment: the Go heap of a process holding a full arena stays the
// size of its owner's index, and its heap goal (GOGC) is not set by the arena's bytes, which
// would let the process' garbage grow to the arena's size before each collection.
//
// An Arena is not safe for concurrent use: its owner serialises the calls (the memory store
// holds its lock).
package arena

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"slices"

	"github.com/idempotency-extproc/idempotency-extproc/cache/internal/chunks"
)

// DefaultSegmentSize is the size of an arena's segments when Options.SegmentSize is zero: large
// enough that a full memory store is a few hundred mappings (or, where segments are on the Go
// heap, objects to the collector), small enough that compacting one takes tens of microseconds.
const DefaultSegmentSize = 256 << 10

// recordHeader precedes a record's bytes in a segment: the record's handle and its length, so
// that a segment can be walked when it is compacted.
const recordHeader = 8

// maxSpare is how many empty segments an arena keeps allocated, to be reused.
const maxSpare = 2

// maxMoved bounds the live bytes one Compact moves, in segments, so that it takes a bounded time
// (a memmove of 1 MiB, about 0.1 ms). Four segments' worth frees at least a segment per call while
// the segments compacted are at most four fifths live.
const maxMoved = 4

// single marks a record held on its own in loc.seg.
const single = -1

// Handle names a record of an Arena. The zero Handle names none.
type Handle uint32

// Options configures an Arena. The zero value gives the defaults.
type Options struct {
	// SegmentSize is the size of each segment (default DefaultSegmentSize); at least 1 KiB, and
	// records of up to a sixteenth of it are kept in segments.
	SegmentSize int
	// Map returns n zeroed bytes for a segment outside the Go heap, or an error, in which case the
	// segment is allocated on the heap (default: an anonymous private mapping where the system
	// has them, populated at once on Linux; elsewhere it always fails).
	Map func(n int) ([]byte, error)
	// Unmap gives back what Map returned (default munmap). An error leaves the segment mapped and
	// counted in Stats.UnmapFailures.
	Unmap func([]byte) error
}

// Stats describes what an arena holds.
type Stats struct {
	// Records counts the live records; BigRecords those of them held on their own.
	Records, BigRecords int
	// LiveBytes are the bytes of the live records in segments, with their headers; BigBytes the
	// bytes of those held on their own.
	LiveBytes, BigBytes int
	// WrittenBytes are the bytes written to the segments in use: LiveBytes and the holes.
	WrittenBytes int
	// Segments counts the segments allocated; SegmentsInUse those that are the head or hold
	// live records (the others are spares).
	Segments, SegmentsInUse int
	// SegmentSize is the size of each segment.
	SegmentSize int
	// MappedBytes are the bytes of the segments mapped outside the Go heap (counted in the
	// process' resident memory, not in the Go runtime's memory statistics).
	MappedBytes int64
	// HeapSegments counts the segments allocated on the Go heap because mapping one failed or is
	// not supported on this system, over the arena's life.
	HeapSegments int64
	// UnmapFailures counts the freed segments the system refused to unmap (see Options.Unmap),
	// which stay mapped and unused, over the arena's life.
	UnmapFailures int64
	// MovedBytes are the bytes Compact moved, over the arena's life.
	MovedBytes int64
}

// loc is where a record's bytes are: a segment and an offset, or single and the big map.
type loc struct {
	seg, off, n int32
}

// Arena is a byte store of records in segments; see the package documentation.
type Arena struct {
	segSize int
	mem     *segments
	live    []int // bytes of live records, with their headers, per segment
	fill    []int // bytes written per segment
	// spare lists the segments allocated but not in use (nothing live, not the head), reused
	// first; unused lists those freed, whose numbers are reused next.
	spare, unused []int32
	head          int32 // the segment records are appended to, or -1
	liveBytes     int   // over every segment
	written       int   // the sum of fill
	moved         int64
	// locs holds each handle's record; handle 0 is never used, and free lists the handles free.
	locs     chunks.Array[loc]
	free     []Handle
	big      map[Handle][]byte
	bigBytes int
}

// segments are the arena's memory, an object of its own so that a cleanup can unmap them once
// the arena is unreachable without reaching the arena.
type segments struct {
	mapSeg   func(n int) ([]byte, error)
	unmapSeg func([]byte) error
	segs     [][]byte // nil once freed
	mapped   []bool   // per segment: outside the Go heap, to be unmapped
	// The counters of Stats: the bytes mapped now, and over the arena's life the segments put
	// on the heap and those the system refused to unmap.
	mappedBytes, heapSegs, unmapKO int64
}

// New returns an empty arena.
func New(opts Options) (*Arena, error) {
	if opts.SegmentSize == 0 {
		opts.SegmentSize = DefaultSegmentSize
	}
	if opts.SegmentSize < 1<<10 || opts.SegmentSize > 1<<30 {
		return nil, fmt.Errorf("arena: segment size %d is not 1 KiB to 1 GiB", opts.SegmentSize)
	}
	if opts.Map == nil {
		opts.Map = mapSegment
	}
	if opts.Unmap == nil {
		opts.Unmap = munmapSegment
	}
	a := &Arena{segSize: opts.SegmentSize, mem: &segments{mapSeg: opts.Map, unmapSeg: opts.Unmap}}
	a.Reset()
	// An arena dropped without Reset gives its segments back, as a heap one would.
	runtime.AddCleanup(a, (*segments).unmapAll, a.mem)
	return a, nil
}

// MaxInline is the size of the largest record kept in a segment.
func (a *Arena) MaxInline() int { return a.segSize / 16 }

// Put stores b as a new record and returns its handle. A record of at most MaxInline bytes is
// copied into a segment, and b stays the caller's; a larger one is kept as it is, without a copy,
// and Put reports so: the caller must not change b afterwards. Put never moves other records.
func (a *Arena) Put(b []byte) (Handle, bool) {
	h := a.handle()
	if len(b) > a.MaxInline() {
		a.big[h] = b
		a.bigBytes += len(b)
		*a.locs.At(int32(h)) = loc{seg: single, n: int32(len(b))}
		return h, true
	}
	seg, off := a.place(h, len(b))
	copy(a.mem.segs[seg][off:], b)
	*a.locs.At(int32(h)) = loc{seg: seg, off: off, n: int32(len(b))}
	return h, false
}

// Get returns the bytes of record h, which must be live. The bytes of a record kept in a segment
// stay valid until the next Put, Delete, Compact or Reset, which may move or overwrite them; those
// of a record larger than MaxInline are its own and never change.
func (a *Arena) Get(h Handle) []byte {
	l := a.locs.At(int32(h))
	if l.seg == single {
		return a.big[h]
	}
	return a.mem.segs[l.seg][l.off : l.off+l.n : l.off+l.n]
}

// Delete removes record h, which must be live; h may name another record afterwards.
func (a *Arena) Delete(h Handle) {
	l := a.locs.At(int32(h))
	if l.seg == single {
		a.bigBytes -= len(a.big[h])
		delete(a.big, h)
	} else {
		a.release(l.seg, int(l.n))
	}
	*l = loc{}
	a.free = append(a.free, h)
}

// Compact closes holes when they exceed the slack (an eighth of the live bytes and two
// segments): it moves the live records of the segments with the most holes to the head, up to
// maxMoved segments' worth of bytes, and returns the bytes it moved. Within the slack it does
// nothing and costs a comparison. Handles stay as they were; their bytes move.
func (a *Arena) Compact() int {
	moved := 0
	for moved < maxMoved*a.segSize && a.overfull() {
		n := a.compactOne()
		if n < 0 {
			break
		}
		moved += n
	}
	return moved
}

// Stats returns what the arena holds.
func (a *Arena) Stats() Stats {
	return Stats{
		Records:       int(a.locs.Len()) - 1 - len(a.free),
		BigRecords:    len(a.big),
		LiveBytes:     a.liveBytes,
		BigBytes:      a.bigBytes,
		WrittenBytes:  a.written,
		Segments:      len(a.mem.segs) - len(a.unused),
		SegmentsInUse: len(a.mem.segs) - len(a.spare) - len(a.unused),
		SegmentSize:   a.segSize,
		MappedBytes:   a.mem.mappedBytes,
		HeapSegments:  a.mem.heapSegs,
		UnmapFailures: a.mem.unmapKO,
		MovedBytes:    a.moved,
	}
}

// Reset drops every record and frees every segment; the counters of Stats over the arena's life
// stay.
func (a *Arena) Reset() {
	a.mem.unmapAll()
	a.mem.segs, a.mem.mapped = nil, nil
	a.live, a.fill, a.spare, a.unused = nil, nil, nil, nil
	a.head, a.liveBytes, a.written = -1, 0, 0
	a.locs = chunks.Array[loc]{}
	a.locs.Push(loc{})
	a.free = nil
	a.big = map[Handle][]byte{}
	a.bigBytes = 0
}

// handle returns a free handle.
func (a *Arena) handle() Handle {
	if n := len(a.free); n > 0 {
		h := a.free[n-1]
		a.free = a.free[:n-1]
		return h
	}
	a.locs.Push(loc{})
	return Handle(a.locs.Len() - 1)
}

// slack is the holes the segments in use may hold before one is compacted.
func (a *Arena) slack() int { return a.liveBytes/8 + 2*a.segSize }

// overfull reports whether a segment should be compacted.
func (a *Arena) overfull() bool { return a.written-a.liveBytes > a.slack() }

// place appends a header for n bytes of record h to the head segment, opening a new head if they
// do not fit, and returns where the bytes go.
func (a *Arena) place(h Handle, n int) (int32, int32) {
	if a.head < 0 || a.fill[a.head]+recordHeader+n > a.segSize {
		a.newHead()
	}
	seg, off := a.head, a.fill[a.head]
	b := a.mem.segs[seg][off:]
	binary.LittleEndian.PutUint32(b, uint32(h))
	binary.LittleEndian.PutUint32(b[4:], uint32(n))
	a.fill[seg] += recordHeader + n
	a.written += recordHeader + n
	a.live[seg] += recordHeader + n
	a.liveBytes += recordHeader + n
	return seg, int32(off + recordHeader)
}

// release frees n bytes of a record in seg.
func (a *Arena) release(seg int32, n int) {
	a.live[seg] -= recordHeader + n
	a.liveBytes -= recordHeader + n
	if a.live[seg] == 0 && seg != a.head {
		a.toSpare(seg)
	}
}

// newHead makes a spare or new segment the head.
func (a *Arena) newHead() {
	if h := a.head; h >= 0 {
		a.head = -1
		if a.live[h] == 0 {
			a.toSpare(h)
		}
	}
	switch {
	case len(a.spare) > 0:
		k := len(a.spare)
		a.head = a.spare[k-1]
		a.spare = a.spare[:k-1]
	case len(a.unused) > 0:
		k := len(a.unused)
		a.head = a.unused[k-1]
		a.unused = a.unused[:k-1]
		a.mem.segs[a.head], a.mem.mapped[a.head] = a.mem.alloc(a.segSize)
	default:
		b, mapped := a.mem.alloc(a.segSize)
		a.mem.segs = append(a.mem.segs, b)
		a.mem.mapped = append(a.mem.mapped, mapped)
		a.live = append(a.live, 0)
		a.fill = append(a.fill, 0)
		a.head = int32(len(a.mem.segs) - 1)
	}
}

// toSpare takes seg out of use: it keeps it as a spare, or frees it if maxSpare are kept.
func (a *Arena) toSpare(seg int32) {
	a.written -= a.fill[seg]
	a.fill[seg] = 0
	if len(a.spare) < maxSpare {
		a.spare = append(a.spare, seg)
		return
	}
	a.mem.free(seg)
	a.unused = append(a.unused, seg)
}

// compactOne moves the live records of the segment in use with the most holes to the head,
// which takes it out of use, and returns the bytes it moved, or -1 if no segment has holes.
func (a *Arena) compactOne() int {
	victim := int32(-1)
	for s := range a.mem.segs {
		s := int32(s)
		if s != a.head && a.fill[s] > a.live[s] && (victim < 0 || a.fill[s]-a.live[s] > a.fill[victim]-a.live[victim]) {
			victim = s
		}
	}
	if victim < 0 {
		return -1
	}
	moved, seg := a.live[victim], a.mem.segs[victim]
	// The last release lists the segment as spare and ends the walk.
	for off := 0; off < a.fill[victim]; {
		h := Handle(binary.LittleEndian.Uint32(seg[off:]))
		n := int(binary.LittleEndian.Uint32(seg[off+4:]))
		at := int32(off + recordHeader)
		off += recordHeader + n
		l := a.locs.At(int32(h))
		if l.seg != victim || l.off != at {
			continue // a deleted record: its handle is free or names another
		}
		s, o := a.place(h, n)
		copy(a.mem.segs[s][o:], seg[at:int(at)+n])
		a.moved += int64(n)
		l.seg, l.off = s, o
		a.release(victim, n)
	}
	return moved
}

// alloc returns n zeroed bytes for a segment, and whether they are mapped outside the Go heap.
// Where mapping is not supported or fails (an address space limit, too many mappings), the
// segment is an ordinary allocation: the arena works the same, its bytes in the Go heap.
func (m *segments) alloc(n int) ([]byte, bool) {
	if b, err := m.mapSeg(n); err == nil {
		m.mappedBytes += int64(len(b))
		return b, true
	}
	m.heapSegs++
	return make([]byte, n), false
}

// free drops segment seg, unmapping it if it is mapped. Unmapping can fail: taking a segment out
// of the middle of a larger mapping splits it, which the system refuses beyond its limit of
// mappings (vm.max_map_count on Linux). The segment then stays mapped, unused, and is counted,
// rather than stop the process; the arena drops it either way.
func (m *segments) free(seg int32) {
	if b := m.segs[seg]; m.mapped[seg] {
		if m.unmapSeg(b) != nil {
			m.unmapKO++
		} else {
			m.mappedBytes -= int64(len(b))
		}
	}
	m.segs[seg], m.mapped[seg] = nil, false
}

// unmapAll unmaps every mapped segment. The segments must not be used after it but to reset them.
func (m *segments) unmapAll() {
	for s := range m.segs {
		if m.segs[s] != nil {
			m.free(int32(s))
		}
	}
}

// Check checks the arena's structures against each other and returns the first inconsistency
// found: each live record's header and bounds, no two records overlapping, the live and written
// bytes per segment, the spare and freed segments, the handles and the big records. It walks
// every record, and is meant for tests.
func (a *Arena) Check() error {
	free, err := a.checkFree()
	if err != nil {
		return err
	}
	use, err := a.checkRecords(free)
	if err != nil {
		return err
	}
	out, err := a.checkOutOfUse()
	if err != nil {
		return err
	}
	if len(a.mem.mapped) != len(a.mem.segs) || len(a.live) != len(a.mem.segs) || len(a.fill) != len(a.mem.segs) {
		return errors.New("per-segment lists of different lengths")
	}
	if err := a.checkSegments(use, out); err != nil {
		return err
	}
	if a.head >= 0 && a.mem.segs[a.head] == nil {
		return errors.New("the head is not allocated")
	}
	return nil
}

// checkFree checks the free handles (in range, listed once, their locations cleared) and
// returns them as a set.
func (a *Arena) checkFree() (map[Handle]bool, error) {
	free := map[Handle]bool{}
	for _, h := range a.free {
		if h == 0 || int32(h) >= a.locs.Len() || free[h] {
			return nil, fmt.Errorf("free handle %d: out of range or listed twice", h)
		}
		free[h] = true
		if *a.locs.At(int32(h)) != (loc{}) {
			return nil, fmt.Errorf("free handle %d: its location is not cleared", h)
		}
	}
	return free, nil
}

// span is the bytes a record takes in its segment, header included: [from, to).
type span struct{ from, to int }

// checkRecords checks each live handle's record, held on its own or in a segment, and returns
// the spans the records take in each segment.
func (a *Arena) checkRecords(free map[Handle]bool) ([][]span, error) {
	spans := make([][]span, len(a.mem.segs))
	bigs, bigBytes := 0, 0
	for i := int32(1); i < a.locs.Len(); i++ {
		h, l := Handle(i), *a.locs.At(i)
		if free[h] {
			continue
		}
		if l.seg == single {
			b, ok := a.big[h]
			if !ok || len(b) != int(l.n) || len(b) <= a.MaxInline() {
				return nil, fmt.Errorf("record %d: held on its own: %v, %d bytes, %d in its location", h, ok, len(b), l.n)
			}
			bigs++
			bigBytes += len(b)
			continue
		}
		sp, err := a.checkInline(h, l)
		if err != nil {
			return nil, err
		}
		spans[l.seg] = append(spans[l.seg], sp)
	}
	if bigs != len(a.big) || bigBytes != a.bigBytes {
		return nil, fmt.Errorf("big records: %d of %d bytes located, %d of %d held", bigs, bigBytes, len(a.big), a.bigBytes)
	}
	return spans, nil
}

// checkInline checks the record of h held in a segment at l: the segment held, the bytes within
// what it holds, the header its own. It returns the span the record takes.
func (a *Arena) checkInline(h Handle, l loc) (span, error) {
	if l.seg < 0 || int(l.seg) >= len(a.mem.segs) || a.mem.segs[l.seg] == nil {
		return span{}, fmt.Errorf("record %d: in segment %d, which is not held", h, l.seg)
	}
	if int(l.n) > a.MaxInline() {
		return span{}, fmt.Errorf("record %d: %d bytes in a segment, over %d", h, l.n, a.MaxInline())
	}
	start, end := int(l.off)-recordHeader, int(l.off)+int(l.n)
	if start < 0 || end > a.fill[l.seg] {
		return span{}, fmt.Errorf("record %d: bytes %d to %d beyond what segment %d holds, %d", h, start, end, l.seg, a.fill[l.seg])
	}
	seg := a.mem.segs[l.seg]
	if Handle(binary.LittleEndian.Uint32(seg[start:])) != h || binary.LittleEndian.Uint32(seg[start+4:]) != uint32(l.n) {
		return span{}, fmt.Errorf("record %d: its header in segment %d is not its own", h, l.seg)
	}
	return span{start, end}, nil
}

// checkOutOfUse checks the segments out of use (spare ones allocated, unused ones not, each
// listed once, empty and not the head) and returns them as a set.
func (a *Arena) checkOutOfUse() (map[int32]bool, error) {
	out := map[int32]bool{}
	for _, list := range [][]int32{a.spare, a.unused} {
		for _, s := range list {
			if out[s] || s == a.head || a.fill[s] != 0 {
				return nil, fmt.Errorf("segment %d: out of use, listed twice, the head or not empty", s)
			}
			out[s] = true
		}
	}
	for _, s := range a.spare {
		if a.mem.segs[s] == nil {
			return nil, fmt.Errorf("spare segment %d is not allocated", s)
		}
	}
	for _, s := range a.unused {
		if a.mem.segs[s] != nil {
			return nil, fmt.Errorf("unused segment %d is allocated", s)
		}
	}
	return out, nil
}

// checkSegments checks each segment's counts against the records' spans in it (live bytes, no
// overlap, an empty segment in use only as the head) and the arena's totals.
func (a *Arena) checkSegments(spans [][]span, out map[int32]bool) error {
	total, written := 0, 0
	for s := range a.mem.segs {
		sp, live := spans[s], 0
		for _, x := range sp {
			live += x.to - x.from
		}
		if live != a.live[s] {
			return fmt.Errorf("segment %d: %d live bytes, counted %d", s, live, a.live[s])
		}
		if a.mem.mapped[s] && a.mem.segs[s] == nil {
			return fmt.Errorf("segment %d: mapped but not held", s)
		}
		if int32(s) != a.head && !out[int32(s)] && live == 0 {
			return fmt.Errorf("segment %d: in use but empty", s)
		}
		total += live
		written += a.fill[s]
		slices.SortFunc(sp, func(x, y span) int { return x.from - y.from })
		for i := 1; i < len(sp); i++ {
			if sp[i-1].to > sp[i].from {
				return fmt.Errorf("segment %d: records overlap at %d", s, sp[i].from)
			}
		}
	}
	if total != a.liveBytes || written != a.written {
		return fmt.Errorf("live bytes %d, counted %d; written %d, counted %d", total, a.liveBytes, written, a.written)
	}
	return nil
}
