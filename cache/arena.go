package cache

import "encoding/binary"

// defaultSegmentSize is the size of the arena's segments: large enough that a full store is a
// few hundred objects to the garbage collector, small enough that compacting one holds the lock
// for tens of microseconds.
const defaultSegmentSize = 256 << 10

// recordHeader precedes a record's bytes in a segment: the record's slot and its length, so that
// a segment can be walked when it is compacted.
const recordHeader = 8

// single marks a record whose bytes are held on their own (memEntry.seg).
const single = -1

// arena holds the bytes of a Memory store's records in segments: large byte slices, which the
// garbage collector sees as one object each and never scans. Records are appended to the head
// segment; a removed record leaves a hole. A segment whose records are all gone is reused, and
// when the segments in use exceed the live bytes by more than an eighth of them and two segments,
// the one with the fewest live bytes is compacted: its live records are appended to the head, and
// it is freed. So while records come, the arena holds about 9/8 of its live bytes and a few
// segments at most, whatever the order in which records go (TestMemoryArenaStaysCompact). When
// they stop coming and records expire, nothing is compacted: segments are freed as they empty.
//
// A record larger than a quarter of a segment is held in an allocation of its own (big):
// there are few, and their bytes are large next to the collector's cost of one object.
type arena struct {
	segSize int
	segs    [][]byte // nil once freed
	live    []int    // bytes of live records, with their headers, per segment
	fill    []int    // bytes written per segment
	// spare lists the segments allocated but not in use (nothing live, not the head), reused
	// first; unused lists those freed, whose numbers are reused next.
	spare, unused []int32
	head          int32 // the segment records are appended to, or -1
	liveBytes     int   // over every segment
	held          int   // segments allocated
	compacting    bool
	moved         int64            // bytes compaction moved, over the store's life
	big           map[int32][]byte // the bytes held on their own, by slot
}

// init readies an empty arena of segments of segSize bytes.
func (a *arena) init(segSize int) {
	a.segSize = segSize
	a.reset()
}

// reset drops everything the arena holds but its segment size.
func (a *arena) reset() {
	a.segs, a.live, a.fill, a.spare, a.unused = nil, nil, nil, nil, nil
	a.head, a.liveBytes, a.held, a.moved = -1, 0, 0, 0
	a.big = map[int32][]byte{}
}

// maxInline is the size of the largest record kept in a segment.
func (a *arena) maxInline() int { return a.segSize / 4 }

// inUse returns the segments in use: the head and those with live records.
func (a *arena) inUse() int { return len(a.segs) - len(a.spare) - len(a.unused) }

// slack is what the segments in use may hold beyond their live bytes before one is compacted.
func (a *arena) slack() int { return a.liveBytes/8 + 2*a.segSize }

// overfull reports whether a segment should be compacted.
func (a *arena) overfull() bool { return a.inUse()*a.segSize > a.liveBytes+a.slack() }

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

// put stores key and data as the bytes of the record in slot i, which holds none.
func (m *Memory) put(i int32, key string, data []byte) {
	a := &m.arena
	n := len(key) + len(data)
	seg, off := int32(single), int32(0)
	if n > a.maxInline() {
		b := make([]byte, 0, n)
		a.big[i] = append(append(b, key...), data...)
	} else {
		seg, off = m.place(i, n)
		b := a.segs[seg][off:]
		copy(b[copy(b, key):], data)
	}
	e := m.entry(i)
	e.seg, e.off, e.n, e.keyLen = seg, off, int32(n), int32(len(key))
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
func (m *Memory) place(i int32, n int) (int32, int32) {
	a := &m.arena
	for a.head < 0 || a.fill[a.head]+recordHeader+n > a.segSize {
		m.newHead()
	}
	seg, off := a.head, a.fill[a.head]
	b := a.segs[seg][off:]
	binary.LittleEndian.PutUint32(b, uint32(i))
	binary.LittleEndian.PutUint32(b[4:], uint32(n))
	a.fill[seg] += recordHeader + n
	a.live[seg] += recordHeader + n
	a.liveBytes += recordHeader + n
	return seg, int32(off + recordHeader)
}

// release frees n bytes of a record in seg.
func (m *Memory) release(seg int32, n int) {
	a := &m.arena
	a.live[seg] -= recordHeader + n
	a.liveBytes -= recordHeader + n
	if a.live[seg] == 0 && seg != a.head {
		a.toSpare(seg)
	}
}

// newHead makes a spare or new segment the head, then compacts up to two segments if those in
// use are overfull: at most two, so that a call holds the lock for a bounded time, and two, so
// that an overfull arena shrinks by a segment each time it needs a new one.
func (m *Memory) newHead() {
	a := &m.arena
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
		a.segs[a.head] = make([]byte, a.segSize)
		a.held++
	} else {
		a.segs = append(a.segs, make([]byte, a.segSize))
		a.live = append(a.live, 0)
		a.fill = append(a.fill, 0)
		a.held++
		a.head = int32(len(a.segs) - 1)
	}
	if a.compacting {
		return
	}
	a.compacting = true
	for range 2 {
		if !a.overfull() {
			break
		}
		m.compact()
	}
	a.compacting = false
}

// toSpare takes seg out of use, as a spare; then it frees spares while the segments held exceed
// the slack of the live bytes and one more, so that spares kept when the store was fuller go too.
func (a *arena) toSpare(seg int32) {
	a.fill[seg] = 0
	a.spare = append(a.spare, seg)
	for k := len(a.spare); k > 0 && a.held*a.segSize > a.liveBytes+a.slack()+a.segSize; k-- {
		s := a.spare[k-1]
		a.spare = a.spare[:k-1]
		a.segs[s] = nil
		a.held--
		a.unused = append(a.unused, s)
	}
}

// compact moves the live records of the segment in use with the fewest live bytes to the head,
// which frees it.
func (m *Memory) compact() {
	a := &m.arena
	victim := int32(-1)
	for s := range a.segs {
		s := int32(s)
		if s != a.head && a.fill[s] > 0 && (victim < 0 || a.live[s] < a.live[victim]) {
			victim = s
		}
	}
	if victim < 0 {
		return
	}
	seg := a.segs[victim]
	// The last release lists the segment as spare and ends the walk.
	for off := 0; off < a.fill[victim]; {
		i := int32(binary.LittleEndian.Uint32(seg[off:]))
		n := int(binary.LittleEndian.Uint32(seg[off+4:]))
		at := int32(off + recordHeader)
		off += recordHeader + n
		if e := m.entry(i); e.seg != victim || e.off != at {
			continue // a removed record: its slot is free or holds another
		}
		s, o := m.place(i, n)
		copy(a.segs[s][o:], seg[at:int(at)+n])
		a.moved += int64(n)
		e := m.entry(i)
		e.seg, e.off = s, o
		m.release(victim, n)
	}
}
