package cache

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

// DefaultMemoryMaxBytes is the default bound of a Memory store: 256 MiB.
const DefaultMemoryMaxBytes = 256 << 20

// entryOverhead estimates the bytes a record costs beyond its key, fingerprint and response: its
// slot in the entries slice, its map slot and its place in the expiry heap, with the slack of
// each. TestMemoryHeapPerRecord checks the estimate against the Go heap.
const entryOverhead = 224

// MemoryOptions configures a Memory store. The zero value gives the defaults.
type MemoryOptions struct {
	// MaxBytes bounds the bytes the store holds (default DefaultMemoryMaxBytes).
	MaxBytes int64
	// Clock tells the time for leases and TTLs (default the wall clock).
	Clock clock.Clock
}

// Memory is a Store that keeps records in this process. It is the default for a single replica.
//
// It holds at most MaxBytes: when a new or completed record would exceed the bound, the least
// recently used completed records are evicted first (a replay counts as a use). Pending records
// are never evicted for space: each lives at most its lease. A completed record that could not fit
// even alone keeps its status but not its headers or body, so its key stays claimed and
// duplicates are told it cannot be replayed rather than running again. Expired records are
// removed as later calls find them, so the store needs no background goroutine.
//
// An evicted completed record is forgotten before its TTL: a retry after that runs again. Size
// MaxBytes for the replay window you need.
type Memory struct {
	clock    clock.Clock
	maxBytes int64
	// epoch is the origin of deadlines, which are nanoseconds since it (monotonic on the wall
	// clock).
	epoch time.Time

	// The records live in one slice and refer to each other by index, so that the garbage
	// collector follows two pointers per record (its key and its bytes), not a graph of them.
	mu     sync.Mutex
	closed bool
	tokens uint64 // the last token handed out
	bytes  int64
	index  map[string]int32 // key -> slot in entries
	// entries holds the records; slot 0 is the head of the lru list, and free slots are listed
	// in free. It never shrinks: a burst of pending records (bounded by the requests in flight)
	// leaves empty slots of about 100 bytes each, zeroed, to be reused.
	entries []memEntry
	free    []int32
	expiry  []int32 // a min-heap of slots by heapKey
}

var _ Local = (*Memory)(nil)

// Local implements [Local]: every call is a few map and heap operations under a mutex.
func (m *Memory) Local() {}

// unlinked marks the lru links of an entry that is not in the list (a pending one).
const unlinked = -1

type memEntry struct {
	key string
	// data is the encoded response of a completed record (its first respLen bytes), then the
	// fingerprint. It is never modified once set, so it can be read outside the lock.
	data    []byte
	respLen int
	token   uint64
	ttl     time.Duration
	// deadline is when the record expires, in nanoseconds since the store's epoch.
	deadline int64
	// heapKey orders the entry in the expiry heap. It may be earlier than deadline, never later:
	// a deadline that moves later leaves the entry in place until it surfaces (see expire).
	heapKey    int64
	size       int64
	heapIdx    int32
	prev, next int32 // lru links while completed, else unlinked
	state      State
}

// NewMemory returns an empty Memory store.
func NewMemory(opts MemoryOptions) (*Memory, error) {
	if opts.MaxBytes == 0 {
		opts.MaxBytes = DefaultMemoryMaxBytes
	}
	if opts.MaxBytes < 0 {
		return nil, fmt.Errorf("cache: memory max bytes must be positive, got %d", opts.MaxBytes)
	}
	if opts.Clock == nil {
		opts.Clock = clock.Real{}
	}
	m := &Memory{clock: opts.Clock, maxBytes: opts.MaxBytes, epoch: opts.Clock.Now(), index: make(map[string]int32)}
	m.entries = []memEntry{{}} // the lru head, alone in its circular list
	return m, nil
}

// Acquire implements [Store.Acquire].
func (m *Memory) Acquire(ctx context.Context, key string, c Claim) (Lease, *Record, error) {
	if err := checkClaim(c); err != nil {
		return Lease{}, nil, err
	}
	if err := ctx.Err(); err != nil {
		return Lease{}, nil, err
	}
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return Lease{}, nil, ErrClosed
	}
	now := m.now()
	m.expire(now)
	if i, ok := m.index[key]; ok {
		e := &m.entries[i]
		state, data, respLen := e.state, e.data, e.respLen
		if state == Completed {
			m.touch(i)
		}
		m.mu.Unlock()
		// Record bytes are never modified in place, so they can be copied outside the lock.
		rec := Record{State: state}
		if fp := data[respLen:]; len(fp) > 0 {
			rec.Fingerprint = append([]byte(nil), fp...)
		}
		if state == Completed {
			resp, err := decodeResponse(append([]byte(nil), data[:respLen]...))
			if err != nil {
				return Lease{}, nil, err
			}
			rec.Response = resp
		}
		return Lease{}, &rec, nil
	}
	// Tokens only need to be unique within this store, which a counter guarantees.
	m.tokens++
	i := m.slot()
	e := &m.entries[i]
	*e = memEntry{
		key:      key,
		token:    m.tokens,
		ttl:      c.TTL,
		deadline: now + int64(c.LockTTL),
		prev:     unlinked,
		next:     unlinked,
		state:    Pending,
	}
	if len(c.Fingerprint) > 0 {
		e.data = append([]byte(nil), c.Fingerprint...)
	}
	e.heapKey = e.deadline
	e.size = int64(len(key)+len(e.data)) + entryOverhead
	m.index[key] = i
	m.heapPush(i)
	m.bytes += e.size
	m.evict(unlinked)
	token := m.tokens
	m.mu.Unlock()
	return Lease{key: key, token: strconv.FormatUint(token, 36)}, nil, nil
}

// Renew implements [Store.Renew].
func (m *Memory) Renew(ctx context.Context, l Lease, d time.Duration) error {
	if d < time.Millisecond {
		return fmt.Errorf("cache: renew: lease duration must be at least 1ms, got %v", d)
	}
	return m.update(ctx, l, func(i int32, now int64) {
		m.setDeadline(i, now+int64(d))
	})
}

// Complete implements [Store.Complete].
func (m *Memory) Complete(ctx context.Context, l Lease, resp Response) error {
	if resp.BodyOmitted {
		resp.Body = nil
	}
	// Encode outside the lock, with room for a usual fingerprint (a SHA-256) after the response.
	blob := appendResponse(make([]byte, 0, encodedResponseSize(resp)+32), resp)
	err := m.update(ctx, l, func(i int32, now int64) {
		e := &m.entries[i]
		data, respLen := append(blob, e.data...), len(blob)
		size := int64(len(e.key)+len(data)) + entryOverhead
		if size > m.maxBytes {
			// Keep the key claimed rather than let a duplicate run again.
			stub := appendResponse(nil, Response{Status: resp.Status, BodyOmitted: true})
			data, respLen = append(stub, e.data...), len(stub)
			size = int64(len(e.key)+len(data)) + entryOverhead
		}
		e.state = Completed
		e.data, e.respLen = data, respLen
		m.bytes += size - e.size
		e.size = size
		m.setDeadline(i, now+int64(e.ttl))
		m.touch(i)
		m.evict(i)
	})
	if errors.Is(err, ErrLeaseLost) && m.completedBy(l) {
		return nil
	}
	return err
}

// Release implements [Store.Release].
func (m *Memory) Release(ctx context.Context, l Lease) error {
	return m.update(ctx, l, func(i int32, _ int64) {
		m.remove(i)
	})
}

// Ping implements [Store.Ping]; a Memory store always answers unless closed.
func (m *Memory) Ping(ctx context.Context) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return ErrClosed
	}
	return ctx.Err()
}

// Close implements [Store.Close]. It drops every record.
func (m *Memory) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.closed = true
	m.index = nil
	m.entries = []memEntry{{}}
	m.free = nil
	m.expiry = nil
	m.bytes = 0
	return nil
}

// Bytes returns the bytes the store accounts for: every live record's key, fingerprint and
// encoded response plus a fixed per-record overhead (its slot, map and heap places). It never exceeds MaxBytes for long: only
// pending records, which are bounded by their leases, can hold it above.
func (m *Memory) Bytes() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.bytes
}

// Len returns the number of records held, including expired ones not yet removed.
func (m *Memory) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.index)
}

// update runs f on the slot of the live pending entry that l owns, under the lock.
func (m *Memory) update(ctx context.Context, l Lease, f func(i int32, now int64)) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return ErrClosed
	}
	now := m.now()
	m.expire(now)
	i, ok := m.owned(l)
	if !ok || m.entries[i].state != Pending {
		return ErrLeaseLost
	}
	f(i, now)
	return nil
}

// completedBy reports whether the live record for l's key is completed under l's token.
func (m *Memory) completedBy(l Lease) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	i, ok := m.owned(l)
	return ok && m.entries[i].state == Completed
}

// owned returns the slot of the record for l's key if l's token owns it.
func (m *Memory) owned(l Lease) (int32, bool) {
	token, err := strconv.ParseUint(l.token, 36, 64)
	if err != nil {
		return 0, false
	}
	i, ok := m.index[l.key]
	return i, ok && m.entries[i].token == token
}

func (m *Memory) now() int64 { return int64(m.clock.Now().Sub(m.epoch)) }

// slot returns a free slot of entries.
func (m *Memory) slot() int32 {
	if n := len(m.free); n > 0 {
		i := m.free[n-1]
		m.free = m.free[:n-1]
		return i
	}
	m.entries = append(m.entries, memEntry{})
	return int32(len(m.entries) - 1)
}

// setDeadline moves i's deadline. A later deadline costs nothing now: the entry keeps its place
// in the heap and is moved when it surfaces. Only an earlier one is moved at once.
func (m *Memory) setDeadline(i int32, deadline int64) {
	e := &m.entries[i]
	e.deadline = deadline
	if deadline < e.heapKey {
		e.heapKey = deadline
		m.heapFix(int(e.heapIdx))
	}
}

// expire removes every entry whose deadline has passed.
func (m *Memory) expire(now int64) {
	for len(m.expiry) > 0 {
		i := m.expiry[0]
		e := &m.entries[i]
		if e.heapKey > now {
			return
		}
		if e.deadline > now {
			e.heapKey = e.deadline
			m.heapFix(0)
			continue
		}
		m.remove(i)
	}
}

// evict removes least recently used completed entries, except keep, until the bound holds.
func (m *Memory) evict(keep int32) {
	for m.bytes > m.maxBytes {
		victim := m.entries[0].prev
		if victim == keep {
			victim = m.entries[victim].prev
		}
		if victim == 0 {
			return
		}
		m.remove(victim)
	}
}

// remove drops the entry in slot i and frees the slot.
func (m *Memory) remove(i int32) {
	e := &m.entries[i]
	delete(m.index, e.key)
	m.heapRemove(int(e.heapIdx))
	m.unlink(i)
	m.bytes -= e.size
	m.entries[i] = memEntry{}
	m.free = append(m.free, i)
}

// touch moves a completed entry to the front of the lru list.
func (m *Memory) touch(i int32) {
	m.unlink(i)
	first := m.entries[0].next
	m.entries[i].prev, m.entries[i].next = 0, first
	m.entries[first].prev = i
	m.entries[0].next = i
}

func (m *Memory) unlink(i int32) {
	e := &m.entries[i]
	if e.next == unlinked {
		return
	}
	m.entries[e.prev].next = e.next
	m.entries[e.next].prev = e.prev
	e.prev, e.next = unlinked, unlinked
}

// The expiry heap, as container/heap has it, on slots (which would be boxed through its
// interface).

func (m *Memory) heapLess(a, b int) bool {
	return m.entries[m.expiry[a]].heapKey < m.entries[m.expiry[b]].heapKey
}

func (m *Memory) heapSwap(a, b int) {
	h := m.expiry
	h[a], h[b] = h[b], h[a]
	m.entries[h[a]].heapIdx = int32(a)
	m.entries[h[b]].heapIdx = int32(b)
}

func (m *Memory) heapPush(i int32) {
	m.entries[i].heapIdx = int32(len(m.expiry))
	m.expiry = append(m.expiry, i)
	m.heapUp(len(m.expiry) - 1)
}

func (m *Memory) heapRemove(k int) {
	n := len(m.expiry) - 1
	if n != k {
		m.heapSwap(k, n)
		if !m.heapDown(k, n) {
			m.heapUp(k)
		}
	}
	m.expiry = m.expiry[:n]
}

func (m *Memory) heapFix(k int) {
	if !m.heapDown(k, len(m.expiry)) {
		m.heapUp(k)
	}
}

func (m *Memory) heapUp(j int) {
	for {
		i := (j - 1) / 2 // parent
		if i == j || !m.heapLess(j, i) {
			return
		}
		m.heapSwap(i, j)
		j = i
	}
}

func (m *Memory) heapDown(i0, n int) bool {
	i := i0
	for {
		j1 := 2*i + 1
		if j1 >= n || j1 < 0 { // j1 < 0 after int overflow
			break
		}
		j := j1 // left child
		if j2 := j1 + 1; j2 < n && m.heapLess(j2, j1) {
			j = j2 // right child
		}
		if !m.heapLess(j, i) {
			break
		}
		m.heapSwap(i, j)
		i = j
	}
	return i > i0
}

func checkClaim(c Claim) error {
	if c.LockTTL < time.Millisecond || c.TTL < time.Millisecond {
		return fmt.Errorf("cache: acquire: lock TTL and TTL must be at least 1ms, got %v and %v", c.LockTTL, c.TTL)
	}
	return nil
}
