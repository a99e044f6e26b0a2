// Package cache persists idempotency records: one record per stored key, first pending (a lease
// held by the request that runs) and then completed (the response to replay).
//
// [Store] is the contract. [Memory] is the embedded single-replica implementation and [Redis] the
// shared one; both pass the same conformance suite in package storetest.
package cache

import (
	"context"
	"errors"
	"time"
)

// Errors returned by every Store. Other errors (a store that cannot be reached, a deadline) are
// returned wrapped with the operation that failed.
var (
	// ErrLeaseLost means the caller no longer owns the record it tried to renew, complete or
	// release: its lease expired, another request took the key after that, or the record was
	// purged. Nothing was changed.
	ErrLeaseLost = errors.New("cache: lease lost: it expired or another owner took the key")
	// ErrNotFound means Lookup or Purge found no live record for the key.
	ErrNotFound = errors.New("cache: no record for the key")
	// ErrCorrupt means a stored record could not be decoded: an unknown encoding version, or bytes
	// that do not follow it.
	ErrCorrupt = errors.New("cache: stored record cannot be decoded")
	// ErrFull means the store refused a write because it is full: Redis at maxmemory under the
	// noeviction policy answers OOM. Nothing was written.
	ErrFull = errors.New("cache: the store is full and refuses writes")
	// ErrClosed means the store was closed.
	ErrClosed = errors.New("cache: store closed")
	// ErrUnconfirmed means a write of a durable claim (Claim.Replicas above 0) was not
	// acknowledged by that many replicas within Claim.ReplicaTimeout, so a failover could lose
	// it. What has happened then depends on the method: Acquire withdrew its claim, Complete
	// wrote its record and left it (see Store).
	ErrUnconfirmed = errors.New("cache: write not confirmed by enough replicas")
)

// Store holds idempotency records. Implementations are safe for concurrent use by any number of
// goroutines and, for shared stores, by any number of processes.
//
// Deadlines: every method bounds its own work by the store's configured timeout, counted from
// the call (RedisOptions.Timeout; the memory store does no I/O and returns at once), and also
// honours the deadline and cancellation of ctx, whichever ends first. Callers need no deadline of
// their own: a call under context.WithoutCancel still returns within the store's timeout. A method
// that returns an error other than ErrLeaseLost, ErrNotFound or ErrUnconfirmed (whose effects
// Acquire and Complete state) may or may not have taken effect (the store could have applied it
// before the connection broke); every method is safe to retry with the same arguments.
//
// Times: a record's lifetimes (Claim.LockTTL, Claim.TTL, Renew's d) count from the moment the
// store applies the call. Record.CreatedAt and Record.ExpiresAt are read on the clock of the
// process that wrote them (MemoryOptions.Clock, RedisOptions.Clock); for a shared store they are
// as good as the replicas' clocks agree.
type Store interface {
	// Acquire claims key in one atomic step and one store round trip (and one more to withdraw a
	// durable claim that is not confirmed, below).
	//
	// If no live record exists for key, Acquire creates a pending one: a lease of c.LockTTL owned
	// by a fresh random token, carrying c.Fingerprint, c.TTL (the lifetime the completed record
	// will get) and the time of the claim (the record's CreatedAt). It returns the Lease and a nil
	// Record.
	//
	// Otherwise it changes nothing and returns the existing Record (pending with its fingerprint,
	// or completed with its fingerprint and response, each with its CreatedAt and ExpiresAt) and a
	// zero Lease. Of any number of concurrent Acquire calls for one free key, exactly one gets the
	// Lease.
	//
	// When Acquire fails, the caller holds nothing. If the failure came after the store may have
	// created the record (a deadline while waiting for the reply), the store removes it in the
	// background, best effort; otherwise it expires after LockTTL.
	//
	// A durable claim (c.Replicas above 0) also waits, up to c.ReplicaTimeout, until c.Replicas
	// replicas acknowledge the pending record it created. If fewer do, Acquire withdraws the
	// record with the owner check, as Release does, so that nothing is left pending, and returns
	// an error wrapping ErrUnconfirmed and a zero Lease: the caller holds nothing and must not run
	// the request, which a failover could then run a second time. The withdrawal counts within
	// the claim's deadline (the store's timeout, or ctx's deadline when that is earlier): if it
	// fails too, or that deadline has passed, the store retries it in the background, best
	// effort, and otherwise the pending record expires after c.LockTTL. An Acquire that finds a
	// record returns it whatever the replicas say: it wrote nothing. A store without replicas
	// (Memory) returns ErrUnconfirmed for every durable claim it would create, and creates
	// nothing.
	//
	// The Lease carries c (Lease.Claim), which Complete and Reassert write. A store may keep
	// c.Fingerprint itself rather than a copy (Memory does): the caller must not change it while
	// it holds the Lease.
	Acquire(ctx context.Context, key string, c Claim) (Lease, *Record, error)

	// Lookup returns the live record for key, pending or completed, as Acquire would find it, and
	// changes nothing (a completed record's use does not count for eviction). It returns
	// ErrNotFound when key holds no live record.
	Lookup(ctx context.Context, key string) (*Record, error)

	// Renew extends a pending lease to d from now. It returns ErrLeaseLost if the lease expired,
	// was taken by another owner, was purged or was already completed or released.
	Renew(ctx context.Context, l Lease, d time.Duration) error

	// Reassert restores the caller's claim after the store may have let its lease expire: a
	// holder whose renewals could not reach the store for a whole lease calls it once the store
	// answers again. Where key holds no record, it writes back l's pending record as Acquire
	// wrote it (l's token, its claim's fingerprint, route and TTL, and its CreatedAt) with a lease
	// of the claim's LockTTL from now, and reports restored; where key holds l's own pending
	// record, it renews it to that LockTTL, as Renew does, and reports restored false. The check
	// and the write are one atomic step on the one key (one slot under Redis Cluster): it returns
	// ErrLeaseLost, and changes nothing, when key holds any other record (another owner's, or l's
	// own completed one), so it never overwrites a record. Like Renew, it never waits for
	// replicas.
	//
	// It cannot tell a record that expired from one that was purged: whether to call it is the
	// holder's decision (docs/guarantees.md#a-store-outage-longer-than-lock_ttl).
	Reassert(ctx context.Context, l Lease) (restored bool, err error)

	// Complete turns the caller's pending record into a completed one holding resp, which lives
	// for the TTL given to Acquire from now on. The owner check and the write are one atomic step:
	// it returns ErrLeaseLost, and writes nothing, if the caller no longer owns a pending record
	// for the key. Completing again with the same lease after a success is a no-op that succeeds,
	// so a retry after a lost reply is safe.
	//
	// A lease of a durable claim (Claim.Replicas above 0) makes Complete wait as Acquire did,
	// for the completed record. If fewer replicas acknowledge it in time, the record has still
	// been written, and stays: Complete returns an error wrapping ErrUnconfirmed, the lease is
	// spent as after a success (there is nothing to release), and only a failover before the
	// replicas catch up can lose the record, which leaves the pending record the claim's replicas
	// hold, to expire after its lease. Completing again with the same lease waits again and
	// returns nil once the replicas hold the record.
	Complete(ctx context.Context, l Lease, resp Response) error

	// Release deletes the caller's pending record so that the key is free at once. The owner check
	// and the delete are one atomic step: it returns ErrLeaseLost, and deletes nothing, if the
	// caller no longer owns a pending record for the key; a completed record is never released.
	//
	// Renew and Release never wait for replicas, whatever the claim: a failover that loses a
	// renewal leaves the lease the renewal before it gave, which the next renewal extends, and
	// one that loses a release leaves the pending record to expire after its lease.
	Release(ctx context.Context, l Lease) error

	// Purge deletes the record for key whatever its state, in one atomic step, so that the next
	// Acquire for key wins. A lease on the purged record is lost: its Renew, Complete and Release
	// return ErrLeaseLost and change nothing, even after another request has claimed the key. It
	// returns ErrNotFound when key holds no live record.
	Purge(ctx context.Context, key string) error

	// Ping reports whether the store answers.
	Ping(ctx context.Context) error

	// Close releases the store's resources. Calls after Close return ErrClosed or a wrapped
	// connection error.
	Close() error
}

// Claim describes the record Acquire creates for a new key.
type Claim struct {
	// Fingerprint identifies the request's payload. It may be empty.
	Fingerprint []byte
	// LockTTL is the lease: how long the pending record lives unless renewed. 1ms to [MaxTTL].
	LockTTL time.Duration
	// TTL is how long the completed record will live once Complete is called. 1ms to [MaxTTL].
	TTL time.Duration
	// Route names the policy route that claimed the key, for operators (Lookup, the records
	// API). It is kept with the record, cut to MaxRouteBytes.
	Route string
	// Replicas, when above 0, makes the claim durable: Acquire and then Complete wait until this
	// many replicas of the store acknowledge their write, so that a failover cannot lose it (see
	// Store.Acquire and Store.Complete). 0, the default, waits for none.
	Replicas int
	// ReplicaTimeout bounds each of those waits; at least 1ms when Replicas is set. It counts
	// within the store's own timeout: a wait that outlasts the call's deadline fails the call as
	// any deadline does, and is not reported as ErrUnconfirmed (a claim is then withdrawn in the
	// background). A call that shares round trips with others (the Redis batcher) may first wait
	// for a round trip already waiting for replicas: with replicas that do not answer, only a
	// ReplicaTimeout below half the store's timeout leaves every claim the time to be refused
	// with ErrUnconfirmed.
	ReplicaTimeout time.Duration
}

// MaxRouteBytes is the longest Claim.Route a store keeps.
const MaxRouteBytes = 255

// MaxTTL is the longest lease or record life a store accepts: ten years. A deadline further out
// would overflow a clock in nanoseconds (the memory store) or Redis' limit on expiry times.
const MaxTTL = 10 * 365 * 24 * time.Hour

// Lease proves ownership of a pending record. Its zero value owns nothing.
type Lease struct {
	key   string
	token string
	// claim is the Claim the lease was acquired with, so that a store can write the completed
	// record whole without reading the pending one (Redis), and write the pending one back
	// (Reassert).
	claim   Claim
	created time.Time
}

// Key returns the stored key the lease is for, or "" for the zero Lease.
func (l Lease) Key() string { return l.key }

// Claim returns the Claim l was acquired with, its Route cut to MaxRouteBytes. Its Fingerprint
// may be the one the caller gave Acquire (Store.Acquire): neither is to be changed.
func (l Lease) Claim() Claim { return l.claim }

// Held reports whether l came from a successful Acquire.
func (l Lease) Held() bool { return l.token != "" }

// State is the life-cycle stage of a record.
type State uint8

// The two states of a record.
const (
	// Pending records are leases of requests that are still running.
	Pending State = 1
	// Completed records hold a response to replay.
	Completed State = 2
)

func (s State) String() string {
	switch s {
	case Pending:
		return "pending"
	case Completed:
		return "completed"
	}
	return "unknown"
}

// Record is a stored record, as Acquire found it or Lookup returned it.
type Record struct {
	State       State
	Fingerprint []byte
	// Response is set when State is Completed.
	Response Response
	// Route is the Claim's Route; empty for a record that does not carry it (a Redis record
	// written before layout 3).
	Route string
	// CreatedAt is when the first request claimed the key (the first-sent time). It is zero for
	// a record that does not carry it: a Redis record written before layout 3 (see redis.go).
	CreatedAt time.Time
	// ExpiresAt is when the record will expire unless something changes it: for a pending record
	// the end of its lease (as last renewed), for a completed one the end of its TTL. It is zero
	// when the store cannot tell without a second round trip (a Redis record of layout 2 found
	// by Acquire; Lookup reads it from the key's expiry).
	ExpiresAt time.Time
}

// Response is a completed upstream response.
type Response struct {
	// Status is the HTTP status code.
	Status int
	// Headers are the response headers to replay, in order; a repeated header is several entries
	// with the same name.
	Headers []Header
	// Body is the response body. It is empty when BodyOmitted is set.
	Body []byte
	// BodyOmitted marks a response whose body was not kept (too large, never seen whole, or not
	// to be stored): the request ran and completed, but it cannot be replayed.
	BodyOmitted bool
	// Trailers are the response trailers to replay, in order (a gRPC response's grpc-status and
	// grpc-message); nil for a response that had none.
	Trailers []Header
	// OutcomeUnknown marks a record of a request whose outcome nobody knows: it may or may not
	// have run upstream (unknown_outcome: record, docs/guarantees.md#ambiguous-outcomes). Such a response has no headers and no
	// body (BodyOmitted is set with it); Status is the status Envoy made, or 0 when the stream
	// ended before any response.
	OutcomeUnknown bool
}

// Header is one header field. Value holds the raw bytes, which need not be UTF-8.
type Header struct {
	Name  string
	Value []byte
}
