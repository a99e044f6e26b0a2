package cache

import (
	"encoding/binary"
	"sync/atomic"
)

// defaultSegmentSize is the size of the arena's segments: large enough that a full store is a few
// hundred mappings (or, where segments are on the Go heap, objects to the garbage collector),
// small enough that compacting one holds the lock for tens of microseconds.
const defaultSegmentSize = 256 << 10

// recordHeader precedes a record's bytes in a segment: the record's slot and its length, so that
// a segment can be walked when it is compacted.
const recordHeader = 8

// single marks a record whose bytes are held on their own (memEntry.seg).
const single = -1

// arena holds the bytes of a Memory store's records in segments: large byte slices that the
// garbage collector never scans (see below for where they live). Records are appended to the head
// segment; a removed record (completed, released, expired, evicted) leaves a hole. A segment whose
// records are all gone is reused (up to maxSpare of them are kept, the others freed), and when the
// holes in the segments in use exceed an eighth of the live bytes and two segments, the segment
// with the most holes is compacted: its live records are appended to the head, and it is reused
// or freed. A segment's end, too short for the record that came next, is not a hole: records are
// at most a sixteenth of a segment, so those ends waste at most that. So while records come, the
// arena holds about 6/5 of its live bytes and a few segments at most, whatever their sizes and
// order, once compaction has caught up with a wave of removals (it moves up to maxMoved segments'
// worth per new head; TestMemoryArenaStaysCompact, TestMemoryArenaSameSizeRecords). When records
// stop coming and expire, nothing is compacted: segments are freed as they empty.
//
// A record larger than a sixteenth of a segment is held in an allocation of its own (big): there
// are few, and their bytes are large next to the collector's cost of one object.
//
// Segments are mapped outside the Go heap where the system allows it (mapSegment), and unmapped
// when freed, when the store is closed, or by a cleanup once an unclosed store is unreachable;
// where mapping fails, a segment is an ordinary allocation, one object to the collector
// (SegmentStats counts both kinds). The collector never sees a mapped segment: the Go heap of a process holding a full store stays the size of
// the index and the requests' garbage, and its heap goal (GOGC) is not set by the store's bytes,
// which would let that garbage grow to the store's size before each collection, spread over that
// much memory. No slice of a segment outlives the store's lock: readers copy what they take.
type arena struct {
	segSize int
	segs    [][]byte // nil once freed
	mapped  []bool   // per segment: outside the Go heap, to be unmapped
	// munmap unmaps a segment: munmapSegment, or a test's stand-in for this arena only (a
	// cleanup may unmap another store's segments at any time).
	munmap func([]byte) error
	live   []int // bytes of live records, with their headers, per segment
	fill   []int // bytes written per segment
	// spare lists the segments allocated but not in use (nothing live, not the head), reused
	// first; unused lists those freed, whose numbers are reused next.
	spare, unused []int32
	head          int32            // the segment records are appended to, or -1
	liveBytes     int              // over every segment
	written       int              // the sum of fill
	moved         int64            // bytes compaction moved, over the store's life (for tests)
	big           map[int32][]byte // the bytes held on their own, by slot
}

// init readies an empty arena of segments of segSize bytes.
func (a *arena) init(segSize int) {
	a.segSize = segSize
	if a.munmap == nil {
		a.munmap = munmapSegment
	}
	a.reset()
}

// reset drops everything the arena holds but its segment size.
func (a *arena) reset() {
	a.unmapAll()
	a.segs, a.mapped, a.live, a.fill, a.spare, a.unused = nil, nil, nil, nil, nil, nil
	a.head, a.liveBytes, a.written, a.moved = -1, 0, 0, 0
	a.big = map[int32][]byte{}
}

// maxInline is the size of the largest record kept in a segment.
func (a *arena) maxInline() int { return a.segSize / 16 }

// maxSpare is how many empty segments the arena keeps allocated, to be reused.
const maxSpare = 2

// held returns the segments allocated: all but those freed.
func (a *arena) held() int { return len(a.segs) - len(a.unused) }

// inUse returns the segments in use: the head and those with live records.
func (a *arena) inUse() int { return len(a.segs) - len(a.spare) - len(a.unused) }

// slack is the holes the segments in use may hold before one is compacted.
func (a *arena) slack() int { return a.liveBytes/8 + 2*a.segSize }

// overfull reports whether a segment should be compacted.
func (a *arena) overfull() bool { return a.written-a.liveBytes > a.slack() }

// single reports whether e's bytes are held on their own.
func (e *memEntry) single() bool { return e.seg == single }

// bytesOf returns the bytes of the record in slot i: its key, then its data.
func (m *Memory) bytesOf(i int32) []byte {
	e := m.entry(i)
	if e.single() {
		return m.arena.big[i]
	}
	return m.arena.segs[e.seg][e.off : e.off+e.n]
}

// put stores a copy of key and data as the bytes of the record in slot i, which holds none.
func (m *Memory) put(i int32, key string, data []byte) {
	n := len(key) + len(data)
	if n > m.arena.maxInline() {
		m.putRecord(i, append(append(make([]byte, 0, n), key...), data...), len(key))
		return
	}
	seg, off := m.place(i, n, true)
	b := m.arena.segs[seg][off:]
	copy(b[copy(b, key):], data)
	m.entry(i).setBytes(seg, off, n, len(key))
}

// putRecord stores rec, whose first keyLen bytes are the key, as the bytes of the record in slot
// i, which holds none, and reports whether it kept rec itself: a record too big for a segment is
// kept, and the caller gives rec up; a smaller one is copied into the arena.
func (m *Memory) putRecord(i int32, rec []byte, keyLen int) bool {
	if len(rec) > m.arena.maxInline() {
		m.arena.big[i] = rec
		m.entry(i).setBytes(single, 0, len(rec), keyLen)
		return true
	}
	seg, off := m.place(i, len(rec), true)
	copy(m.arena.segs[seg][off:], rec)
	m.entry(i).setBytes(seg, off, len(rec), keyLen)
	return false
}

func (e *memEntry) setBytes(seg, off int32, n, keyLen int) {
	e.seg, e.off, e.n, e.keyLen = seg, off, int32(n), int32(keyLen)
}

// drop frees the bytes of the record in slot i.
func (m *Memory) drop(i int32) {
	e := m.entry(i)
	if e.single() {
		delete(m.arena.big, i)
	} else {
		m.release(e.seg, int(e.n))
	}
	e.seg, e.off, e.n, e.keyLen = 0, 0, 0, 0
}

// place appends a header for n bytes of slot i to the head segment and returns where the bytes go.
// If it needs a new head, it compacts first when compact is set, and at most once: a head taken
// after that is empty, and n fits. Compaction itself places records without compacting.
func (m *Memory) place(i int32, n int, compact bool) (int32, int32) {
	a := m.arena
	for ; a.head < 0 || a.fill[a.head]+recordHeader+n > a.segSize; compact = false {
		m.newHead(compact)
	}
	seg, off := a.head, a.fill[a.head]
	b := a.segs[seg][off:]
	binary.LittleEndian.PutUint32(b, uint32(i))
	binary.LittleEndian.PutUint32(b[4:], uint32(n))
	a.fill[seg] += recordHeader + n
	a.written += recordHeader + n
	a.live[seg] += recordHeader + n
	a.liveBytes += recordHeader + n
	return seg, int32(off + recordHeader)
}

// release frees n bytes of a record in seg.
func (m *Memory) release(seg int32, n int) {
	a := m.arena
	a.live[seg] -= recordHeader + n
	a.liveBytes -= recordHeader + n
	if a.live[seg] == 0 && seg != a.head {
		a.toSpare(seg)
	}
}

// maxMoved bounds the live bytes one call's compaction moves, in segments, so that it holds the
// lock for a bounded time (a memmove of 1 MiB, about 0.1 ms). Four segments' worth frees at least
// a segment per new head while the segments compacted are at most four fifths live.
const maxMoved = 4

// newHead makes a spare or new segment the head, then, if compact is set, compacts segments while
// the arena is overfull, up to maxMoved segments' worth of live bytes.
func (m *Memory) newHead(compact bool) {
	a := m.arena
	if h := a.head; h >= 0 {
		a.head = -1
		if a.live[h] == 0 {
			a.toSpare(h)
		}
	}
	if k := len(a.spare); k > 0 {
		a.head = a.spare[k-1]
		a.spare = a.spare[:k-1]
	} else if k := len(a.unused); k > 0 {
		a.head = a.unused[k-1]
		a.unused = a.unused[:k-1]
		a.segs[a.head], a.mapped[a.head] = newSegment(a.segSize)
	} else {
		b, mapped := newSegment(a.segSize)
		a.segs = append(a.segs, b)
		a.mapped = append(a.mapped, mapped)
		a.live = append(a.live, 0)
		a.fill = append(a.fill, 0)
		a.head = int32(len(a.segs) - 1)
	}
	if !compact {
		return
	}
	for moved := 0; moved < maxMoved*a.segSize && a.overfull(); {
		n := m.compact()
		if n < 0 {
			break
		}
		moved += n
	}
}

// toSpare takes seg out of use: it keeps it as a spare, or frees it if maxSpare are kept.
func (a *arena) toSpare(seg int32) {
	a.written -= a.fill[seg]
	a.fill[seg] = 0
	if len(a.spare) < maxSpare {
		a.spare = append(a.spare, seg)
		return
	}
	a.free(seg)
	a.unused = append(a.unused, seg)
}

// free drops segment seg, unmapping it if it is mapped.
func (a *arena) free(seg int32) {
	if a.mapped[seg] {
		a.unmapSegment(a.segs[seg])
	}
	a.segs[seg], a.mapped[seg] = nil, false
}

// unmapAll unmaps every mapped segment. The arena must not be used after it but to reset it.
func (a *arena) unmapAll() {
	for s := range a.segs {
		if a.segs[s] != nil {
			a.free(int32(s))
		}
	}
}

// The process' segments, over every store: what SegmentStats reports.
var mappedBytes, heapSegments, unmapFailures atomic.Int64

// SegmentStats describes the memory stores' segments in this process.
type SegmentStats struct {
	// MappedBytes are the bytes of the segments mapped outside the Go heap (counted in the
	// process' resident memory, not in the Go runtime's memory statistics).
	MappedBytes int64
	// HeapSegments counts the segments allocated on the Go heap because mapping one failed or
	// is not supported on this system, over the process' life.
	HeapSegments int64
	// UnmapFailures counts the freed segments the system refused to unmap (see unmapSegment),
	// which stay mapped and unused.
	UnmapFailures int64
}

// Segments returns the memory stores' segment statistics for this process.
func Segments() SegmentStats {
	return SegmentStats{MappedBytes: mappedBytes.Load(), HeapSegments: heapSegments.Load(), UnmapFailures: unmapFailures.Load()}
}

// newSegment returns n zeroed bytes for a segment, and whether they are mapped outside the Go
// heap. Where mapping is not supported or fails (an address space limit, too many mappings), the
// segment is an ordinary allocation: the store works the same, its bytes in the Go heap.
func newSegment(n int) ([]byte, bool) {
	if b, err := mapSegment(n); err == nil {
		mappedBytes.Add(int64(len(b)))
		return b, true
	}
	heapSegments.Add(1)
	return make([]byte, n), false
}

// unmapSegment unmaps b, which newSegment mapped. Unmapping can fail: taking a segment out of
// the middle of a larger mapping splits it, which the system refuses beyond its limit of mappings
// (vm.max_map_count on Linux). The segment then stays mapped, unused, and is counted, rather than
// stop the process; the store drops it either way.
func (a *arena) unmapSegment(b []byte) {
	if a.munmap(b) != nil {
		unmapFailures.Add(1)
		return
	}
	mappedBytes.Add(-int64(len(b)))
}

// compact moves the live records of the segment in use with the most holes to the head, which
// takes it out of use, and returns the bytes it moved, or -1 if no segment has holes.
func (m *Memory) compact() int {
	a := m.arena
	victim := int32(-1)
	for s := range a.segs {
		s := int32(s)
		if s != a.head && a.fill[s] > a.live[s] && (victim < 0 || a.fill[s]-a.live[s] > a.fill[victim]-a.live[victim]) {
			victim = s
		}
	}
	if victim < 0 {
		return -1
	}
	moved, seg := a.live[victim], a.segs[victim]
	// The last release lists the segment as spare and ends the walk.
	for off := 0; off < a.fill[victim]; {
		i := int32(binary.LittleEndian.Uint32(seg[off:]))
		n := int(binary.LittleEndian.Uint32(seg[off+4:]))
		at := int32(off + recordHeader)
		off += recordHeader + n
		e := m.entry(i)
		if e.seg != victim || e.off != at {
			continue // a removed record: its slot is free or holds another
		}
		s, o := m.place(i, n, false)
		copy(a.segs[s][o:], seg[at:int(at)+n])
		a.moved += int64(n)
		e.seg, e.off = s, o
		m.release(victim, n)
	}
	return moved
}
