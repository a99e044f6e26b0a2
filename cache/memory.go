package cache

import (
	"container/heap"
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

// entryOverhead estimates the bytes a record costs beyond its key, token, fingerprint and
// response: the entry itself, its map slot and its place in the expiry heap. The heap benchmark in
// memory_test.go checks the estimate against the Go heap.
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

	mu      sync.Mutex
	closed  bool
	tokens  uint64 // the last token handed out
	bytes   int64
	entries map[string]*memEntry
	expiry  expiryHeap
	// lru is a circular list of completed entries: lru.next is the most recently used.
	lru memEntry
}

var _ Local = (*Memory)(nil)

// Local implements [Local]: every call is a few map and heap operations under a mutex.
func (m *Memory) Local() {}

type memEntry struct {
	key      string
	token    string
	fp       []byte
	resp     []byte // the encoded response of a completed record; never modified once set
	ttl      time.Duration
	deadline int64 // when the record expires, in nanoseconds since the store's epoch
	// heapKey orders the entry in the expiry heap. It may be earlier than deadline, never later:
	// a deadline that moves later leaves the entry in place until it surfaces (see expire).
	heapKey int64
	size    int64
	heapIdx int
	state   State

	prev, next *memEntry // lru links, set only while completed
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
	m := &Memory{clock: opts.Clock, maxBytes: opts.MaxBytes, epoch: opts.Clock.Now(), entries: make(map[string]*memEntry)}
	m.lru.next, m.lru.prev = &m.lru, &m.lru
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
	if e := m.entries[key]; e != nil {
		rec := Record{State: e.state, Fingerprint: e.fp}
		blob := e.resp
		if e.state == Completed {
			m.touch(e)
		}
		m.mu.Unlock()
		// Records are never modified in place, so they can be copied outside the lock.
		rec.Fingerprint = append([]byte(nil), rec.Fingerprint...)
		if rec.State == Completed {
			resp, err := decodeResponse(append([]byte(nil), blob...))
			if err != nil {
				return Lease{}, nil, err
			}
			rec.Response = resp
		}
		return Lease{}, &rec, nil
	}
	// Tokens only need to be unique within this store, which a counter guarantees.
	m.tokens++
	token := strconv.FormatUint(m.tokens, 36)
	e := &memEntry{
		key:      key,
		token:    token,
		fp:       append([]byte(nil), c.Fingerprint...),
		ttl:      c.TTL,
		deadline: now + int64(c.LockTTL),
		state:    Pending,
	}
	e.heapKey = e.deadline
	e.size = int64(len(key)+len(token)+len(e.fp)) + entryOverhead
	m.entries[key] = e
	heap.Push(&m.expiry, e)
	m.bytes += e.size
	m.evict(nil)
	m.mu.Unlock()
	return Lease{key: key, token: token}, nil, nil
}

// Renew implements [Store.Renew].
func (m *Memory) Renew(ctx context.Context, l Lease, d time.Duration) error {
	if d < time.Millisecond {
		return fmt.Errorf("cache: renew: lease duration must be at least 1ms, got %v", d)
	}
	return m.update(ctx, l, func(e *memEntry, now int64) {
		m.setDeadline(e, now+int64(d))
	})
}

// Complete implements [Store.Complete].
func (m *Memory) Complete(ctx context.Context, l Lease, resp Response) error {
	if resp.BodyOmitted {
		resp.Body = nil
	}
	blob := appendResponse(make([]byte, 0, encodedResponseSize(resp)), resp)
	err := m.update(ctx, l, func(e *memEntry, now int64) {
		size := int64(len(e.key)+len(e.token)+len(e.fp)+len(blob)) + entryOverhead
		if size > m.maxBytes {
			// Keep the key claimed rather than let a duplicate run again.
			blob = appendResponse(nil, Response{Status: resp.Status, BodyOmitted: true})
			size = int64(len(e.key)+len(e.token)+len(e.fp)+len(blob)) + entryOverhead
		}
		e.state = Completed
		e.resp = blob
		m.setDeadline(e, now+int64(e.ttl))
		m.bytes += size - e.size
		e.size = size
		m.touch(e)
		m.evict(e)
	})
	if errors.Is(err, ErrLeaseLost) && m.completedBy(l) {
		return nil
	}
	return err
}

// Release implements [Store.Release].
func (m *Memory) Release(ctx context.Context, l Lease) error {
	return m.update(ctx, l, func(e *memEntry, _ int64) {
		m.remove(e)
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
	m.entries = nil
	m.expiry = nil
	m.lru.next, m.lru.prev = &m.lru, &m.lru
	m.bytes = 0
	return nil
}

// Bytes returns the bytes the store accounts for: every live record's key, token, fingerprint
// and encoded response plus a fixed per-record overhead. It never exceeds MaxBytes for long: only
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
	return len(m.entries)
}

// update runs f on the live pending entry that l owns, under the lock.
func (m *Memory) update(ctx context.Context, l Lease, f func(e *memEntry, now int64)) error {
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
	e := m.entries[l.key]
	if e == nil || l.token == "" || e.token != l.token || e.state != Pending {
		return ErrLeaseLost
	}
	f(e, now)
	return nil
}

// completedBy reports whether the live record for l's key is completed under l's token.
func (m *Memory) completedBy(l Lease) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	e := m.entries[l.key]
	return e != nil && l.token != "" && e.token == l.token && e.state == Completed
}

func (m *Memory) now() int64 { return int64(m.clock.Now().Sub(m.epoch)) }

// setDeadline moves e's deadline. A later deadline costs nothing now: the entry keeps its place
// in the heap and is moved when it surfaces. Only an earlier one is moved at once.
func (m *Memory) setDeadline(e *memEntry, deadline int64) {
	e.deadline = deadline
	if deadline < e.heapKey {
		e.heapKey = deadline
		heap.Fix(&m.expiry, e.heapIdx)
	}
}

// expire removes every entry whose deadline has passed.
func (m *Memory) expire(now int64) {
	for len(m.expiry) > 0 && m.expiry[0].heapKey <= now {
		e := m.expiry[0]
		if e.deadline > now {
			e.heapKey = e.deadline
			heap.Fix(&m.expiry, 0)
			continue
		}
		m.remove(e)
	}
}

// evict removes least recently used completed entries, except keep, until the bound holds.
func (m *Memory) evict(keep *memEntry) {
	for m.bytes > m.maxBytes {
		victim := m.lru.prev
		if victim == &m.lru {
			return
		}
		if victim == keep {
			victim = victim.prev
			if victim == &m.lru {
				return
			}
		}
		m.remove(victim)
	}
}

func (m *Memory) remove(e *memEntry) {
	delete(m.entries, e.key)
	heap.Remove(&m.expiry, e.heapIdx)
	if e.next != nil {
		e.prev.next, e.next.prev = e.next, e.prev
		e.prev, e.next = nil, nil
	}
	m.bytes -= e.size
}

// touch moves a completed entry to the front of the lru list.
func (m *Memory) touch(e *memEntry) {
	if e.next != nil {
		e.prev.next, e.next.prev = e.next, e.prev
	}
	e.prev, e.next = &m.lru, m.lru.next
	m.lru.next.prev = e
	m.lru.next = e
}

func checkClaim(c Claim) error {
	if c.LockTTL < time.Millisecond || c.TTL < time.Millisecond {
		return fmt.Errorf("cache: acquire: lock TTL and TTL must be at least 1ms, got %v and %v", c.LockTTL, c.TTL)
	}
	return nil
}

// expiryHeap orders entries by deadline.
type expiryHeap []*memEntry

func (h expiryHeap) Len() int           { return len(h) }
func (h expiryHeap) Less(i, j int) bool { return h[i].heapKey < h[j].heapKey }
func (h expiryHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].heapIdx = i
	h[j].heapIdx = j
}
func (h *expiryHeap) Push(x any) {
	e := x.(*memEntry)
	e.heapIdx = len(*h)
	*h = append(*h, e)
}
func (h *expiryHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return e
}
