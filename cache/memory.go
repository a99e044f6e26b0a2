package cache

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"math"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/idempotency-extproc/idempotency-extproc/cache/arena"
	"github.com/idempotency-extproc/idempotency-extproc/cache/internal/chunks"
	"github.com/idempotency-extproc/idempotency-extproc/cache/seal"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

// DefaultMemoryMaxBytes is the default bound of a Memory store: 256 MiB.
const DefaultMemoryMaxBytes = 256 << 20

// entryOverhead estimates the bytes a record costs beyond its key, fingerprint and response: its
// entry (80 bytes), its map slot (about 25), its heap slot (4), and in the arena its location
// (12) and header (8), about 130 bytes, and its share of the arena's holes and segment ends: a
// completed record leaves the hole of its pending bytes (its key and fingerprint, about 110 bytes
// for a usual key), which stays until its segment is compacted. TestMemoryBytesPerRecord checks
// the estimate against the Go heap and the mapped segments a record takes.
const entryOverhead = 240

// MemoryOptions configures a Memory store. The zero value gives the defaults.
type MemoryOptions struct {
	// MaxBytes bounds the bytes the store holds (default DefaultMemoryMaxBytes).
	MaxBytes int64
	// Clock tells the time for leases and TTLs (default the wall clock).
	Clock clock.Clock
	// Keyring, when set, seals every response the store keeps (status, headers and body) with
	// its active key, bound to the record's key, and opens them on Acquire (docs/guarantees.md#stored-responses-at-rest). Responses
	// stored without a keyring still read; one that cannot be opened (its key is not in the
	// keyring, it was altered or moved, or the store has no keyring) gives ErrUnreadable.
	Keyring *seal.Keyring
}

// Memory is a Store that keeps records in this process. It is the default for a single replica:
// a map of leases and records by key (its index, entries, deadline heaps and lru list) whose bytes
// are in a byte store (byteStore, an [arena.Arena]).
//
// It holds at most MaxBytes: when a new or completed record would exceed the bound, the least
// recently used completed records are evicted first (a replay counts as a use). Pending records
// are never evicted for space: each lives at most its lease. A completed record that could not fit
// even alone keeps its status but not its headers or body, so its key stays claimed and
// duplicates are told it cannot be replayed rather than running again. Expired records are
// removed by later calls (a bounded number each, beyond those a call looks up or needs the space
// of; see expireBudget), so the store needs no background goroutine.
//
// An evicted completed record is forgotten before its TTL: a retry after that runs again. Size
// MaxBytes for the replay window you need.
//
// Nothing the store holds per record is a pointer (but for records over a sixteenth of an arena
// segment, 16 KiB, held on their own), so the garbage collector neither scans nor marks its
// records: their bytes (key, encoded response, fingerprint) are packed into large segments mapped
// outside the Go heap (package arena), the records refer to each other by index, and keys are
// indexed by a keyed hash. A full store of a few hundred MiB would otherwise add tens of
// milliseconds of marking and sweeping to every collection of the process
// (BenchmarkMemoryCollection), and, on the heap, set the collector's goal: the process would hold
// about twice the store.
//
// Its calls do no I/O: each is a few map and heap operations under one mutex, so it returns at
// once and needs no timeout of its own (see Store); a call whose ctx has ended does nothing.
type Memory struct {
	clock    clock.Clock
	maxBytes int64
	// epoch is the origin of deadlines, which are nanoseconds since it (monotonic on the wall
	// clock).
	epoch time.Time
	hash  func(key string) uint64
	// maxRecord bounds a record's bytes, whose sizes are kept as int32: a larger response is
	// stored as too large to replay.
	maxRecord int
	// ring seals responses, when set.
	ring *seal.Keyring
	// maxInline is the largest record the arena copies into a segment; it keeps larger ones as
	// they are.
	maxInline int
	// buffers holds the buffers completions encode records that fit in a segment into.
	buffers sync.Pool

	mu     sync.Mutex
	closed bool
	// routes are the route names records carry, by index (routes[0] is ""), and routeIDs their
	// indexes.
	routes   []string
	routeIDs map[string]uint16
	tokens   uint64 // the last token handed out
	bytes    int64
	// index maps the hash of a key to the slot of its record; records whose keys share a hash
	// follow each other through memEntry.same.
	index map[uint64]int32
	// entries holds the records; slot 0 is the head of the lru list, and free slots are listed
	// in free. It never shrinks: a burst of pending records (bounded by the requests in flight)
	// leaves empty slots of 80 bytes each, zeroed, to be reused. It grows by chunks: growing
	// never copies it.
	entries chunks.Array[memEntry]
	free    []int32
	// Two min-heaps of slots by deadline: pending records (as many as requests in flight) and
	// completed ones. A record moves from the first to the second when completed; since TTLs are
	// usually alike, its new deadline is the latest and the push stops at once.
	pending, completed deadlineHeap
	// arena holds the records' bytes.
	arena byteStore
	// scratch is where a pending record's bytes are put together, under the lock.
	scratch []byte
}

var _ Store = (*Memory)(nil)

// byteStore holds the bytes of a Memory store's records, each under a handle: [arena.Arena], whose
// doc states what each method guarantees. The store holds its lock around every call.
type byteStore interface {
	// Put stores b and returns its handle; it keeps b itself, and reports so, when b is over the
	// store's inline size (arena.Arena.MaxInline), and copies it otherwise.
	Put(b []byte) (arena.Handle, bool)
	// Get returns the bytes of h, valid until the next change of the store unless over the inline
	// size (then they never change).
	Get(h arena.Handle) []byte
	// Delete removes h.
	Delete(h arena.Handle)
	// Compact closes holes left by deletes, within a bounded amount of work per call.
	Compact() int
	// Stats describes what the store holds.
	Stats() arena.Stats
	// Reset drops everything.
	Reset()
}

// expireBudget bounds the expired records one call removes, so that the first call after a quiet
// spell does not hold the lock while it removes everything that expired meanwhile. The rest goes
// at later calls, and to free space before any live record is evicted; until then an expired
// record is treated as absent when its key is looked up.
const expireBudget = 64

// unlinked marks the lru links of an entry that is not in the list (a pending one).
const unlinked = -1

// memEntry is a record. Its bytes are its key, then its data: the encoded response of a
// completed record (its first respLen bytes), then the fingerprint.
type memEntry struct {
	hash  uint64
	token uint64
	ttl   time.Duration
	// created is when the key was claimed and deadline when the record expires, in nanoseconds
	// since the store's epoch.
	created, deadline int64
	rec               arena.Handle // its bytes in the arena
	n, keyLen         int32        // its bytes, and of them its key's
	respLen           int32
	same              int32 // the next record whose key has the same hash, or 0
	heapIdx           int32 // in the pending or the completed heap, by state
	prev, next        int32 // lru links while completed, else unlinked
	state             State
	route             uint16 // its Claim.Route, an index of Memory.routes; 0 for none
}

// NewMemory returns an empty Memory store.
func NewMemory(opts MemoryOptions) (*Memory, error) {
	return newMemory(opts, arena.Options{})
}

// newMemory is NewMemory with the arena's options, which tests set.
func newMemory(opts MemoryOptions, ao arena.Options) (*Memory, error) {
	if opts.MaxBytes == 0 {
		opts.MaxBytes = DefaultMemoryMaxBytes
	}
	if opts.MaxBytes < 0 {
		return nil, fmt.Errorf("cache: memory max bytes must be positive, got %d", opts.MaxBytes)
	}
	if opts.Clock == nil {
		opts.Clock = clock.Real{}
	}
	seed := maphash.MakeSeed()
	m := &Memory{
		clock:     opts.Clock,
		maxBytes:  opts.MaxBytes,
		epoch:     opts.Clock.Now(),
		hash:      func(key string) uint64 { return maphash.String(seed, key) },
		index:     make(map[uint64]int32),
		routes:    []string{""},
		routeIDs:  map[string]uint16{},
		maxRecord: math.MaxInt32,
		ring:      opts.Keyring,
	}
	a, err := arena.New(ao)
	if err != nil {
		return nil, err
	}
	m.arena, m.maxInline = a, a.MaxInline()
	m.resetEntries()
	m.pending.m, m.completed.m = m, m
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
	if len(key)+len(c.Fingerprint) > m.maxRecord-128 { // room for the stub Complete may write, sealed or not
		return Lease{}, nil, fmt.Errorf("cache: acquire: key and fingerprint of %d bytes, more than a record holds", len(key)+len(c.Fingerprint))
	}
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return Lease{}, nil, ErrClosed
	}
	now := m.now()
	m.expire(now)
	i, h, ok := m.live(key, now)
	if ok {
		rec, err := m.record(i, true, key)
		return Lease{}, rec, err
	}
	if c.Replicas > 0 {
		m.mu.Unlock()
		return Lease{}, nil, fmt.Errorf("cache: acquire: %w: the memory store has no replicas", ErrUnconfirmed)
	}
	// Tokens only need to be unique within this store, which a counter guarantees.
	m.tokens++
	token := m.tokens
	m.insertPending(key, h, token, c, now, now)
	m.mu.Unlock()
	// The lease keeps the caller's fingerprint, which the caller leaves unchanged while it holds
	// the lease (Store.Acquire): a copy would cost every claim an allocation.
	c.Route = routeOf(c.Route)
	return Lease{key: key, token: strconv.FormatUint(token, 36), claim: c, created: m.at(now)}, nil, nil
}

// insertPending creates the pending record of claim c for key (whose hash is h), owned by token,
// claimed at created, at now. The lock must be held and key must hold no live record.
func (m *Memory) insertPending(key string, h, token uint64, c Claim, created, now int64) {
	i := m.slot()
	*m.entry(i) = memEntry{
		token:    token,
		ttl:      c.TTL,
		created:  created,
		deadline: now + int64(c.LockTTL),
		prev:     unlinked,
		next:     unlinked,
		state:    Pending,
		route:    m.routeID(c.Route),
	}
	m.put(i, key, c.Fingerprint)
	e := m.entry(i)
	m.insert(i, h)
	m.pending.push(i)
	m.bytes += e.cost()
	m.evict(unlinked, now)
}

// record returns a copy of the record in slot i and unlocks the store; touch counts the call as a
// use of a completed record. The lock must be held.
func (m *Memory) record(i int32, touch bool, key string) (*Record, error) {
	e := m.entry(i)
	state, respLen := e.state, int(e.respLen)
	rec := &Record{State: state, Route: m.routes[e.route], CreatedAt: m.at(e.created), ExpiresAt: m.at(e.deadline)}
	data := m.bytesOf(i)[e.keyLen:]
	single := int(e.n) > m.maxInline
	var buf []byte
	if !single {
		// Arena bytes move and are reused: they are copied under the lock.
		buf = append([]byte(nil), data...)
	}
	if touch && state == Completed {
		m.touch(i)
	}
	m.mu.Unlock()
	if single {
		// Bytes held on their own are never modified: they are copied outside the lock.
		buf = append([]byte(nil), data...)
	}
	// One copy: the response and the fingerprint share it, each capped at its own end.
	if len(buf) > respLen {
		rec.Fingerprint = buf[respLen:len(buf):len(buf)]
	}
	if state == Completed {
		resp, err := decodeStoredResponse(buf[:respLen:respLen], m.ring, key)
		if err != nil {
			return nil, err
		}
		rec.Response = resp
	}
	return rec, nil
}

// routeID returns the index of route in m.routes, adding it the first time: records carry their
// route as a number, so that an entry holds no pointer (the route names are few: the policy's).
// It is called with m.mu held; past the table's size, routes are not kept (0).
func (m *Memory) routeID(route string) uint16 {
	route = routeOf(route)
	if route == "" {
		return 0
	}
	if id, ok := m.routeIDs[route]; ok {
		return id
	}
	if len(m.routes) > math.MaxUint16 {
		return 0
	}
	id := uint16(len(m.routes))
	m.routes = append(m.routes, route)
	m.routeIDs[route] = id
	return id
}

// at returns the time of t nanoseconds since the store's epoch, as a wall-clock time.
func (m *Memory) at(t int64) time.Time { return m.epoch.Add(time.Duration(t)).Round(0) }

// Lookup implements [Store.Lookup].
func (m *Memory) Lookup(ctx context.Context, key string) (*Record, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil, ErrClosed
	}
	now := m.now()
	m.expire(now)
	i, _, ok := m.live(key, now)
	if !ok {
		m.mu.Unlock()
		return nil, ErrNotFound
	}
	return m.record(i, false, key)
}

// Purge implements [Store.Purge].
func (m *Memory) Purge(ctx context.Context, key string) error {
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
	i, _, ok := m.live(key, now)
	if !ok {
		return ErrNotFound
	}
	m.remove(i)
	return nil
}

// Renew implements [Store.Renew].
func (m *Memory) Renew(ctx context.Context, l Lease, d time.Duration) error {
	if err := checkRenewal(d); err != nil {
		return err
	}
	return m.update(ctx, l, func(i int32, now int64) {
		m.entry(i).deadline = now + int64(d)
		m.pending.fix(int(m.entry(i).heapIdx))
	})
}

// Reassert implements [Store.Reassert].
func (m *Memory) Reassert(ctx context.Context, l Lease) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	token, err := strconv.ParseUint(l.token, 36, 64)
	if err != nil || l.key == "" {
		return false, ErrLeaseLost
	}
	// The claim was checked by Acquire, the only maker of a lease that holds one.
	c := l.claim
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return false, ErrClosed
	}
	now := m.now()
	m.expire(now)
	i, h, ok := m.live(l.key, now)
	switch {
	case !ok:
		m.insertPending(l.key, h, token, c, int64(l.created.Sub(m.epoch)), now)
		return true, nil
	case m.entry(i).token == token && m.entry(i).state == Pending:
		m.entry(i).deadline = now + int64(c.LockTTL)
		m.pending.fix(int(m.entry(i).heapIdx))
		return false, nil
	}
	return false, ErrLeaseLost
}

// Complete implements [Store.Complete].
func (m *Memory) Complete(ctx context.Context, l Lease, resp Response) error {
	resp = resp.normalized()
	// Encode the record outside the lock: its key, its response, and room for a usual fingerprint
	// (a SHA-256). The arena keeps a record too big for a segment as it is, and copies one that
	// fits; the latter is encoded into a pooled buffer, so a completion leaves no garbage of its
	// size.
	size := len(l.key) + storedResponseSize(resp, m.ring) + 32
	var blob []byte
	var buf *[]byte
	if size > m.maxInline {
		blob = make([]byte, 0, size)
	} else {
		buf, _ = m.buffers.Get().(*[]byte)
		if buf == nil {
			buf = new([]byte)
		}
		blob = slices.Grow((*buf)[:0], size)
	}
	blob = append(blob, l.key...)
	blob = appendStoredResponse(blob, resp, m.ring, blob[:len(l.key)])
	kept := false
	err := m.update(ctx, l, func(i int32, now int64) {
		e := m.entry(i)
		fp := m.bytesOf(i)[e.keyLen:]
		rec, respLen := append(blob, fp...), len(blob)-len(l.key)
		if n := len(rec); int64(n)+entryOverhead > m.maxBytes || n > m.maxRecord {
			// Keep the key claimed rather than let a duplicate run again.
			stub := []byte(l.key)
			stub = appendStoredResponse(stub, Response{Status: resp.Status, BodyOmitted: true}, m.ring, stub)
			rec, respLen = append(stub, fp...), len(stub)-len(l.key)
		}
		// The record moves: its old bytes go, and the new ones may land anywhere.
		m.bytes -= e.cost()
		m.drop(i)
		kept = m.putRecord(i, rec, len(l.key))
		m.bytes += e.cost()
		m.pending.remove(int(e.heapIdx))
		e.state = Completed
		e.respLen = int32(respLen)
		e.deadline = now + int64(e.ttl)
		m.completed.push(i)
		m.touch(i)
		m.evict(i, now)
	})
	if buf != nil && !kept {
		// The record was copied into a segment: the buffer, grown or not, serves the next. (A
		// kept record has its own array as things are, since the fingerprint's append outgrows
		// a buffer sized for a segment; not handing it back keeps that from mattering.)
		*buf = blob[:0]
		m.buffers.Put(buf)
	}
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
	m.resetEntries()
	m.free = nil
	m.pending.slots, m.completed.slots = chunks.Array[int32]{}, chunks.Array[int32]{}
	m.arena.Reset()
	m.bytes = 0
	return nil
}

// Bytes returns the bytes the store accounts for: every record's key, fingerprint and encoded
// response plus a fixed per-record overhead (its slot, map and heap places, its header in the
// arena), counting expired records not yet removed. It never exceeds MaxBytes for long: only
// pending records, which are bounded by their leases, can hold it above. The arena may hold more
// than its records: holes up to an eighth of them and two segments (512 KiB) before it compacts,
// segment ends up to a sixteenth, two spare segments.
func (m *Memory) Bytes() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.bytes
}

// Len returns the number of records held, including expired ones not yet removed.
func (m *Memory) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.len()
}

func (m *Memory) len() int { return int(m.entries.Len()) - 1 - len(m.free) }

// MemoryStats describes what a Memory store holds, for its metrics.
type MemoryStats struct {
	// Bytes are the bytes the store accounts for against MaxBytes (see Memory.Bytes).
	Bytes int64
	// Records counts the records held, including expired ones not yet removed.
	Records int
	// Arena describes the segments that hold the records' bytes: their mapped bytes, the
	// segments put on the Go heap and the unmap failures among them.
	Arena arena.Stats
}

// Stats returns what the store holds.
func (m *Memory) Stats() MemoryStats {
	m.mu.Lock()
	defer m.mu.Unlock()
	return MemoryStats{Bytes: m.bytes, Records: m.len(), Arena: m.arena.Stats()}
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
	i, ok := m.owned(l, now)
	if !ok || m.entry(i).state != Pending {
		return ErrLeaseLost
	}
	f(i, now)
	return nil
}

// completedBy reports whether the live record for l's key is completed under l's token.
func (m *Memory) completedBy(l Lease) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	i, ok := m.owned(l, m.now())
	return ok && m.entry(i).state == Completed
}

// owned returns the slot of the live record for l's key if l's token owns it.
func (m *Memory) owned(l Lease, now int64) (int32, bool) {
	token, err := strconv.ParseUint(l.token, 36, 64)
	if err != nil {
		return 0, false
	}
	i, _, ok := m.live(l.key, now)
	return i, ok && m.entry(i).token == token
}

// live returns the slot of key's record unless it has expired, in which case it removes it, and
// key's hash, to index a new record under.
func (m *Memory) live(key string, now int64) (int32, uint64, bool) {
	i, h, ok := m.find(key)
	if ok && m.entry(i).deadline <= now {
		m.remove(i)
		return 0, h, false
	}
	return i, h, ok
}

// find returns the slot of key's record, and key's hash.
func (m *Memory) find(key string) (int32, uint64, bool) {
	h := m.hash(key)
	for i := m.index[h]; i != 0; i = m.entry(i).same {
		if string(m.keyOf(i)) == key {
			return i, h, true
		}
	}
	return 0, h, false
}

// insert indexes slot i under the hash h of its key.
func (m *Memory) insert(i int32, h uint64) {
	e := m.entry(i)
	e.hash, e.same = h, m.index[h]
	m.index[h] = i
}

// unindex removes slot i from the index.
func (m *Memory) unindex(i int32) {
	e := m.entry(i)
	first := m.index[e.hash]
	switch {
	case first != i:
		p := first
		for m.entry(p).same != i {
			p = m.entry(p).same
		}
		m.entry(p).same = e.same
	case e.same != 0:
		m.index[e.hash] = e.same
	default:
		delete(m.index, e.hash)
	}
}

func (m *Memory) keyOf(i int32) []byte { return m.bytesOf(i)[:m.entry(i).keyLen] }

func (m *Memory) now() int64 { return int64(m.clock.Now().Sub(m.epoch)) }

// cost is what the record counts against the store's bound: its bytes and entryOverhead.
func (e *memEntry) cost() int64 { return int64(e.n) + entryOverhead }

// entry returns the entry in slot i.
func (m *Memory) entry(i int32) *memEntry { return m.entries.At(i) }

// resetEntries leaves the lru head alone in entries, in its circular list.
func (m *Memory) resetEntries() {
	m.entries = chunks.Array[memEntry]{}
	m.entries.Push(memEntry{})
}

// slot returns a free slot of entries.
func (m *Memory) slot() int32 {
	if n := len(m.free); n > 0 {
		i := m.free[n-1]
		m.free = m.free[:n-1]
		return i
	}
	m.entries.Push(memEntry{})
	return m.entries.Len() - 1
}

// expire removes up to expireBudget records whose deadline has passed.
func (m *Memory) expire(now int64) {
	for range expireBudget {
		if !m.expireOne(now) {
			return
		}
	}
}

// expireOne removes an expired record, if there is one, and reports whether it did: the pending
// record whose lease ran out first, else the completed record that expired first.
func (m *Memory) expireOne(now int64) bool {
	for _, h := range []*deadlineHeap{&m.pending, &m.completed} {
		if i, ok := h.min(); ok && m.entry(i).deadline <= now {
			m.remove(i)
			return true
		}
	}
	return false
}

// evict removes expired records, then least recently used completed ones except keep, until the
// bound holds.
func (m *Memory) evict(keep int32, now int64) {
	for m.bytes > m.maxBytes {
		if m.expireOne(now) {
			continue
		}
		victim := m.entry(0).prev
		if victim == keep {
			victim = m.entry(victim).prev
		}
		if victim == 0 {
			return
		}
		m.remove(victim)
	}
}

// remove drops the entry in slot i and frees the slot.
func (m *Memory) remove(i int32) {
	e := m.entry(i)
	m.unindex(i)
	m.heapOf(e).remove(int(e.heapIdx))
	m.unlink(i)
	m.bytes -= e.cost()
	m.drop(i)
	*m.entry(i) = memEntry{}
	m.free = append(m.free, i)
}

// touch moves a completed entry to the front of the lru list.
func (m *Memory) touch(i int32) {
	m.unlink(i)
	first := m.entry(0).next
	m.entry(i).prev, m.entry(i).next = 0, first
	m.entry(first).prev = i
	m.entry(0).next = i
}

func (m *Memory) unlink(i int32) {
	e := m.entry(i)
	if e.next == unlinked {
		return
	}
	m.entry(e.prev).next = e.next
	m.entry(e.next).prev = e.prev
	e.prev, e.next = unlinked, unlinked
}

// heapOf returns the deadline heap e is in.
func (m *Memory) heapOf(e *memEntry) *deadlineHeap {
	if e.state == Pending {
		return &m.pending
	}
	return &m.completed
}

// deadlineHeap is a min-heap of slots by their entries' deadlines, run by container/heap
// (through Fix only, so nothing is boxed). Each entry keeps its index in heapIdx.
type deadlineHeap struct {
	m     *Memory
	slots chunks.Array[int32]
}

func (h *deadlineHeap) Len() int { return int(h.slots.Len()) }

func (h *deadlineHeap) Less(a, b int) bool {
	return h.m.entry(*h.slots.At(int32(a))).deadline < h.m.entry(*h.slots.At(int32(b))).deadline
}

func (h *deadlineHeap) Swap(a, b int) {
	sa, sb := h.slots.At(int32(a)), h.slots.At(int32(b))
	*sa, *sb = *sb, *sa
	h.m.entry(*sa).heapIdx = int32(a)
	h.m.entry(*sb).heapIdx = int32(b)
}

// Push and Pop complete heap.Interface; the store never calls heap.Push or heap.Pop.
func (h *deadlineHeap) Push(any) { panic("cache: deadlineHeap.Push") }
func (h *deadlineHeap) Pop() any { panic("cache: deadlineHeap.Pop") }

func (h *deadlineHeap) min() (int32, bool) {
	if h.slots.Len() == 0 {
		return 0, false
	}
	return *h.slots.At(0), true
}

func (h *deadlineHeap) push(i int32) {
	n := h.slots.Len()
	h.m.entry(i).heapIdx = n
	h.slots.Push(i)
	heap.Fix(h, int(n))
}

func (h *deadlineHeap) remove(k int) {
	n := h.Len() - 1
	if k != n {
		h.Swap(k, n)
	}
	h.slots.Pop()
	if k < n {
		heap.Fix(h, k)
	}
}

func (h *deadlineHeap) fix(k int) { heap.Fix(h, k) }

func checkClaim(c Claim) error {
	switch {
	case !validTTL(c.LockTTL) || !validTTL(c.TTL):
		return fmt.Errorf("cache: acquire: lock TTL and TTL must be 1ms to %v, got %v and %v", MaxTTL, c.LockTTL, c.TTL)
	case c.Replicas < 0:
		return fmt.Errorf("cache: acquire: replicas must not be negative, got %d", c.Replicas)
	case c.Replicas > 0 && !validTTL(c.ReplicaTimeout):
		// WAIT takes whole milliseconds, and 0 waits for ever.
		return fmt.Errorf("cache: acquire: the replica timeout must be 1ms to %v, got %v", MaxTTL, c.ReplicaTimeout)
	}
	return nil
}

func checkRenewal(d time.Duration) error {
	if !validTTL(d) {
		return fmt.Errorf("cache: renew: lease duration must be 1ms to %v, got %v", MaxTTL, d)
	}
	return nil
}

func validTTL(d time.Duration) bool { return d >= time.Millisecond && d <= MaxTTL }

// bytesOf returns the bytes of the record in slot i: its key, then its data.
func (m *Memory) bytesOf(i int32) []byte { return m.arena.Get(m.entry(i).rec) }

// put stores a copy of key and data as the bytes of the record in slot i, which holds none.
func (m *Memory) put(i int32, key string, data []byte) {
	m.scratch = append(append(m.scratch[:0], key...), data...)
	if m.putRecord(i, m.scratch, len(key)) {
		m.scratch = nil // kept by the arena
	}
}

// putRecord stores rec, whose first keyLen bytes are the key, as the bytes of the record in slot
// i, which holds none, and reports whether the arena kept rec itself (a record too big for a
// segment), in which case the caller gives rec up; a smaller one is copied. It then lets the
// arena compact what deletes left, a bounded amount each call.
func (m *Memory) putRecord(i int32, rec []byte, keyLen int) bool {
	h, kept := m.arena.Put(rec)
	e := m.entry(i)
	e.rec, e.n, e.keyLen = h, int32(len(rec)), int32(keyLen)
	m.arena.Compact()
	return kept
}

// drop frees the bytes of the record in slot i.
func (m *Memory) drop(i int32) {
	e := m.entry(i)
	m.arena.Delete(e.rec)
	e.rec, e.n, e.keyLen = 0, 0, 0
}
