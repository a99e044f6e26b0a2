// Package storetest is the conformance suite every [cache.Store] must pass, in the manner of
// testing/fstest: an implementation's tests call Run with a constructor for fresh stores.
package storetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
)

// Harness is a fresh, empty store under test and the means to move its time.
type Harness struct {
	Store cache.Store
	// Advance moves the store's clock forward by d: a fake clock's Advance, miniredis'
	// FastForward, or a sleep for a store on real time.
	Advance func(d time.Duration)
	// Outage, when set, makes the store's server unreachable and returns a function that brings
	// it back. Only real servers set it.
	Outage func() (restore func())
	// Scale, when over 1, multiplies the suite's leases and TTLs: a store on real time sets it
	// for margins against a loaded machine's stalls, at the cost of a slower suite.
	Scale int
	// Now, when set, is the store's clock (the times it stores in records); the wall clock
	// otherwise.
	Now func() time.Time
	// Replicas is how many replicas acknowledge each write of the store, so that a durable claim
	// of that many is confirmed: 0 for a store without replicas. A store with replicas needs a
	// timeout of a few seconds: the cases wait up to 2 s for them.
	Replicas int
	// PauseReplicas, when set, makes every replica stop acknowledging writes (SIGSTOP) and
	// returns a function that resumes them. Only real servers with replicas set it.
	PauseReplicas func() (resume func())

	lockTTL, ttl time.Duration
}

// claim is a claim of fingerprint fp with the suite's durations.
func (h Harness) claim(fp string) cache.Claim {
	return cache.Claim{Fingerprint: []byte(fp), LockTTL: h.lockTTL, TTL: h.ttl}
}

// The suite's durations at Scale 1, short enough to keep it quick.
const (
	lockTTL = 300 * time.Millisecond
	ttl     = 1500 * time.Millisecond
)

// Run runs the conformance suite. newHarness is called once per case.
func Run(t *testing.T, newHarness func(t *testing.T) Harness) {
	cases := []suiteCase{
		{"AcquireCreatesPending", testAcquireCreatesPending},
		{"ConcurrentAcquireOneOwner", testConcurrentAcquireOneOwner},
		{"LeaseExpiryFreesKey", testLeaseExpiryFreesKey},
		{"RenewKeepsLease", testRenewKeepsLease},
		{"NonOwnerChangesNothing", testNonOwnerChangesNothing},
		{"ExpiredOwnerChangesNothing", testExpiredOwnerChangesNothing},
		{"ReleaseFreesKey", testReleaseFreesKey},
		{"CompleteIsFinal", testCompleteIsFinal},
		{"CompletedExpiresAfterTTL", testCompletedExpiresAfterTTL},
		{"RoundTripExact", testRoundTripExact},
		{"LargeBody", testLargeBody},
		{"BodyOmitted", testBodyOmitted},
		{"OutcomeUnknown", testOutcomeUnknown},
		{"KeysAreIndependent", testKeysAreIndependent},
		{"ZeroLease", testZeroLease},
		{"InvalidArguments", testInvalidArguments},
		{"LongestTTL", testLongestTTL},
		{"CancelledContext", testCancelledContext},
		{"Outage", testOutage},
		{"LookupPending", testLookupPending},
		{"LookupCompleted", testLookupCompleted},
		{"LookupOutcomeUnknown", testLookupOutcomeUnknown},
		{"LookupAbsent", testLookupAbsent},
		{"RecordTimes", testRecordTimes},
		{"RecordRoute", testRecordRoute},
		{"PurgePending", testPurgePending},
		{"PurgeCompleted", testPurgeCompleted},
		{"PurgeAbsent", testPurgeAbsent},
		{"PurgeThenOldOwner", testPurgeThenOldOwner},
		{"LargeCompleteIsFinal", testLargeCompleteIsFinal},
		{"CancelledLookupAndPurge", testCancelledLookupAndPurge},
		{"ReassertAfterExpiry", testReassertAfterExpiry},
		{"ReassertRenewsOwn", testReassertRenewsOwn},
		{"ReassertNeverOverwrites", testReassertNeverOverwrites},
		{"ReassertConcurrentAcquire", testReassertConcurrentAcquire},
		{"LeaseCarriesItsClaim", testLeaseCarriesItsClaim},
	}
	run(t, newHarness, append(cases, durabilityCases...))
}

// RunDurability runs the suite's cases of durable claims alone, for stores whose other cases run
// elsewhere: a store on a master with replicas, whose Harness sets Replicas and PauseReplicas.
func RunDurability(t *testing.T, newHarness func(t *testing.T) Harness) {
	run(t, newHarness, durabilityCases)
}

// suiteCase is one case of the suite.
type suiteCase struct {
	name string
	f    func(t *testing.T, h Harness)
}

func run(t *testing.T, newHarness func(t *testing.T) Harness, cases []suiteCase) {
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t)
			t.Cleanup(func() { _ = h.Store.Close() })
			scale := time.Duration(max(h.Scale, 1))
			h.lockTTL, h.ttl = lockTTL*scale, ttl*scale
			if h.Now == nil {
				h.Now = time.Now
			}
			c.f(t, h)
		})
	}
}

func acquire(t *testing.T, s cache.Store, key string, c cache.Claim) (cache.Lease, *cache.Record) {
	t.Helper()
	l, rec, err := s.Acquire(t.Context(), key, c)
	require.NoError(t, err)
	require.True(t, l.Held() != (rec != nil), "Acquire must return either a lease or a record")
	return l, rec
}

func mustOwn(t *testing.T, s cache.Store, key string, c cache.Claim) cache.Lease {
	t.Helper()
	l, rec := acquire(t, s, key, c)
	require.Nil(t, rec, "key %q should be free", key)
	require.True(t, l.Held())
	require.Equal(t, key, l.Key())
	return l
}

func mustFind(t *testing.T, s cache.Store, key string) *cache.Record {
	t.Helper()
	l, rec := acquire(t, s, key, cache.Claim{Fingerprint: []byte("probe"), LockTTL: lockTTL, TTL: ttl})
	require.False(t, l.Held(), "key %q should be taken", key)
	require.NotNil(t, rec)
	return rec
}

func testAcquireCreatesPending(t *testing.T, h Harness) {
	s := h.Store
	mustOwn(t, s, "k", h.claim("fp-1"))
	rec := mustFind(t, s, "k")
	require.Equal(t, cache.Pending, rec.State)
	require.Equal(t, []byte("fp-1"), rec.Fingerprint)
}

func testConcurrentAcquireOneOwner(t *testing.T, h Harness) {
	const n = 64
	s := h.Store
	var (
		start   = make(chan struct{})
		wg      sync.WaitGroup
		mu      sync.Mutex
		owners  []string
		records []*cache.Record
		errs    []error
	)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			fp := fmt.Sprintf("fp-%d", i)
			<-start
			l, rec, err := s.Acquire(context.Background(), "contended", h.claim(fp))
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err != nil:
				errs = append(errs, err)
			case l.Held():
				owners = append(owners, fp)
			default:
				records = append(records, rec)
			}
		}()
	}
	close(start)
	wg.Wait()
	require.Empty(t, errs)
	require.Len(t, owners, 1, "exactly one of %d concurrent Acquire calls must own the key", n)
	require.Len(t, records, n-1)
	for _, rec := range records {
		require.Equal(t, cache.Pending, rec.State)
		require.Equal(t, owners[0], string(rec.Fingerprint), "others must see the owner's fingerprint")
	}
}

func testLeaseExpiryFreesKey(t *testing.T, h Harness) {
	s := h.Store
	mustOwn(t, s, "k", h.claim("a"))
	h.Advance(h.lockTTL / 3)
	require.Equal(t, cache.Pending, mustFind(t, s, "k").State)
	h.Advance(h.lockTTL)
	mustOwn(t, s, "k", h.claim("b"))
	require.Equal(t, []byte("b"), mustFind(t, s, "k").Fingerprint)
}

func testRenewKeepsLease(t *testing.T, h Harness) {
	s := h.Store
	l := mustOwn(t, s, "k", h.claim("a"))
	for range 3 {
		h.Advance(h.lockTTL * 2 / 3)
		require.NoError(t, s.Renew(t.Context(), l, h.lockTTL*2))
	}
	// 2×h.lockTTL has passed since Acquire: without renewals the key would be free.
	rec := mustFind(t, s, "k")
	require.Equal(t, cache.Pending, rec.State)
	require.Equal(t, []byte("a"), rec.Fingerprint)
	require.NoError(t, s.Complete(t.Context(), l, cache.Response{Status: 201}))
	require.Equal(t, cache.Completed, mustFind(t, s, "k").State)
}

func testNonOwnerChangesNothing(t *testing.T, h Harness) {
	s := h.Store
	stale := mustOwn(t, s, "k", h.claim("a"))
	h.Advance(h.lockTTL * 3 / 2)
	owner := mustOwn(t, s, "k", h.claim("b"))

	require.ErrorIs(t, s.Renew(t.Context(), stale, h.lockTTL), cache.ErrLeaseLost)
	require.ErrorIs(t, s.Complete(t.Context(), stale, cache.Response{Status: 200, Body: []byte("stale")}), cache.ErrLeaseLost)
	require.ErrorIs(t, s.Release(t.Context(), stale), cache.ErrLeaseLost)

	rec := mustFind(t, s, "k")
	require.Equal(t, cache.Pending, rec.State)
	require.Equal(t, []byte("b"), rec.Fingerprint)

	require.NoError(t, s.Complete(t.Context(), owner, cache.Response{Status: 200, Body: []byte("owner")}))
	require.ErrorIs(t, s.Complete(t.Context(), stale, cache.Response{Status: 200, Body: []byte("stale")}), cache.ErrLeaseLost)
	rec = mustFind(t, s, "k")
	require.Equal(t, cache.Completed, rec.State)
	require.Equal(t, []byte("owner"), rec.Response.Body)
}

func testExpiredOwnerChangesNothing(t *testing.T, h Harness) {
	s := h.Store
	l := mustOwn(t, s, "k", h.claim("a"))
	h.Advance(h.lockTTL * 3 / 2)
	require.ErrorIs(t, s.Renew(t.Context(), l, h.lockTTL), cache.ErrLeaseLost)
	require.ErrorIs(t, s.Complete(t.Context(), l, cache.Response{Status: 200}), cache.ErrLeaseLost)
	require.ErrorIs(t, s.Release(t.Context(), l), cache.ErrLeaseLost)
	// Nothing was written: the key is free.
	mustOwn(t, s, "k", h.claim("b"))
}

func testReleaseFreesKey(t *testing.T, h Harness) {
	s := h.Store
	l := mustOwn(t, s, "k", h.claim("a"))
	require.NoError(t, s.Release(t.Context(), l))
	require.ErrorIs(t, s.Release(t.Context(), l), cache.ErrLeaseLost)
	require.ErrorIs(t, s.Renew(t.Context(), l, h.lockTTL), cache.ErrLeaseLost, "a late renewal revives nothing")
	require.ErrorIs(t, s.Complete(t.Context(), l, cache.Response{Status: 200}), cache.ErrLeaseLost)
	l2 := mustOwn(t, s, "k", h.claim("b"))
	require.ErrorIs(t, s.Release(t.Context(), l), cache.ErrLeaseLost, "an old lease must not release a new owner's record")
	require.Equal(t, []byte("b"), mustFind(t, s, "k").Fingerprint)
	require.NoError(t, s.Release(t.Context(), l2))
}

func testCompleteIsFinal(t *testing.T, h Harness) {
	s := h.Store
	l := mustOwn(t, s, "k", h.claim("a"))
	resp := cache.Response{Status: 201, Headers: []cache.Header{{Name: "content-type", Value: []byte("application/json")}}, Body: []byte(`{"id":1}`)}
	require.NoError(t, s.Complete(t.Context(), l, resp))
	require.NoError(t, s.Complete(t.Context(), l, resp), "completing again with the same lease must succeed")
	require.ErrorIs(t, s.Renew(t.Context(), l, h.lockTTL), cache.ErrLeaseLost)
	require.ErrorIs(t, s.Release(t.Context(), l), cache.ErrLeaseLost, "a completed record is never released")
	rec := mustFind(t, s, "k")
	require.Equal(t, cache.Completed, rec.State)
	require.Equal(t, []byte("a"), rec.Fingerprint)
	requireResponse(t, resp, rec.Response)
}

func testCompletedExpiresAfterTTL(t *testing.T, h Harness) {
	s := h.Store
	l := mustOwn(t, s, "k", h.claim("a"))
	require.NoError(t, s.Complete(t.Context(), l, cache.Response{Status: 200}))
	h.Advance(h.lockTTL * 2)
	require.Equal(t, cache.Completed, mustFind(t, s, "k").State, "a completed record lives its TTL, not the lease")
	h.Advance(h.ttl - h.lockTTL*2 + h.lockTTL)
	mustOwn(t, s, "k", h.claim("b"))
}

func testRoundTripExact(t *testing.T, h Harness) {
	s := h.Store
	body := make([]byte, 512)
	for i := range body {
		body[i] = byte(i)
	}
	resp := cache.Response{
		Status: 299,
		Headers: []cache.Header{
			{Name: "set-cookie", Value: []byte("a=1; Path=/")},
			{Name: "content-type", Value: []byte("application/octet-stream")},
			{Name: "set-cookie", Value: []byte("b=2")},
			{Name: "x-empty", Value: nil},
			{Name: "set-cookie", Value: []byte("c=3")},
			{Name: "x-latin1", Value: []byte{'c', 'a', 'f', 0xe9}},
		},
		Body: body,
		// A gRPC response's status travels in its trailers.
		Trailers: []cache.Header{{Name: "grpc-status", Value: []byte("0")}, {Name: "grpc-message", Value: []byte("caf\xe9")}},
	}
	fp := []byte{0, 1, 2, 0xff, 0xfe, 0}
	l := mustOwn(t, s, "k", cache.Claim{Fingerprint: fp, LockTTL: h.lockTTL, TTL: h.ttl})
	require.NoError(t, s.Complete(t.Context(), l, resp))
	rec := mustFind(t, s, "k")
	require.Equal(t, fp, rec.Fingerprint)
	requireResponse(t, resp, rec.Response)
}

func testLargeBody(t *testing.T, h Harness) {
	s := h.Store
	body := bytes.Repeat([]byte{0xde, 0xad, 0xbe, 0xef}, 1<<18) // 1 MiB
	l := mustOwn(t, s, "k", h.claim("a"))
	require.NoError(t, s.Complete(t.Context(), l, cache.Response{Status: 200, Body: body}))
	rec := mustFind(t, s, "k")
	require.Equal(t, 200, rec.Response.Status)
	require.True(t, bytes.Equal(body, rec.Response.Body), "1 MiB body must round-trip exactly")
}

func testOutcomeUnknown(t *testing.T, h Harness) {
	s := h.Store
	for i, status := range []int{0, 504} {
		key := fmt.Sprintf("k%d", i)
		l := mustOwn(t, s, key, h.claim("a"))
		require.NoError(t, s.Complete(t.Context(), l, cache.Response{
			Status:         status,
			Headers:        []cache.Header{{Name: "content-type", Value: []byte("text/plain")}},
			Body:           []byte("dropped"),
			OutcomeUnknown: true,
		}))
		rec := mustFind(t, s, key)
		require.Equal(t, cache.Completed, rec.State)
		require.True(t, rec.Response.OutcomeUnknown)
		require.True(t, rec.Response.BodyOmitted)
		require.Empty(t, rec.Response.Body)
		require.Empty(t, rec.Response.Headers)
		require.Equal(t, status, rec.Response.Status)
		require.Equal(t, []byte("a"), rec.Fingerprint)
	}
}

func testBodyOmitted(t *testing.T, h Harness) {
	s := h.Store
	l := mustOwn(t, s, "k", h.claim("a"))
	require.NoError(t, s.Complete(t.Context(), l, cache.Response{
		Status:      200,
		Headers:     []cache.Header{{Name: "content-type", Value: []byte("text/plain")}},
		Body:        []byte("dropped"),
		BodyOmitted: true,
	}))
	rec := mustFind(t, s, "k")
	require.Equal(t, cache.Completed, rec.State)
	require.True(t, rec.Response.BodyOmitted)
	require.Empty(t, rec.Response.Body)
	require.Equal(t, 200, rec.Response.Status)
}

func testKeysAreIndependent(t *testing.T, h Harness) {
	s := h.Store
	la := mustOwn(t, s, "scope-a:k", h.claim("a"))
	lb := mustOwn(t, s, "scope-b:k", h.claim("b"))
	require.NoError(t, s.Complete(t.Context(), la, cache.Response{Status: 200, Body: []byte("a")}))
	require.ErrorIs(t, s.Complete(t.Context(), cache.Lease{}, cache.Response{Status: 200}), cache.ErrLeaseLost)
	require.Equal(t, cache.Pending, mustFind(t, s, "scope-b:k").State)
	require.NoError(t, s.Release(t.Context(), lb))
	require.Equal(t, []byte("a"), mustFind(t, s, "scope-a:k").Response.Body)
	mustOwn(t, s, "scope-b:k", h.claim("b2"))
}

func testZeroLease(t *testing.T, h Harness) {
	s := h.Store
	mustOwn(t, s, "k", h.claim("a"))
	var zero cache.Lease
	require.False(t, zero.Held())
	require.ErrorIs(t, s.Renew(t.Context(), zero, h.lockTTL), cache.ErrLeaseLost)
	require.ErrorIs(t, s.Complete(t.Context(), zero, cache.Response{Status: 200}), cache.ErrLeaseLost)
	require.ErrorIs(t, s.Release(t.Context(), zero), cache.ErrLeaseLost)
	require.Equal(t, cache.Pending, mustFind(t, s, "k").State)
}

func testInvalidArguments(t *testing.T, h Harness) {
	s := h.Store
	_, _, err := s.Acquire(t.Context(), "k", cache.Claim{LockTTL: 0, TTL: h.ttl})
	require.Error(t, err)
	_, _, err = s.Acquire(t.Context(), "k", cache.Claim{LockTTL: h.lockTTL, TTL: 0})
	require.Error(t, err)
	_, _, err = s.Acquire(t.Context(), "k", cache.Claim{LockTTL: cache.MaxTTL + 1, TTL: h.ttl})
	require.ErrorContains(t, err, "1ms to", "a lease past MaxTTL is refused, not left to overflow a deadline")
	_, _, err = s.Acquire(t.Context(), "k", cache.Claim{LockTTL: h.lockTTL, TTL: cache.MaxTTL + 1})
	require.Error(t, err)
	l := mustOwn(t, s, "k", h.claim("a"))
	require.Error(t, s.Renew(t.Context(), l, 0))
	require.NotErrorIs(t, s.Renew(t.Context(), l, 0), cache.ErrLeaseLost)
	require.Error(t, s.Renew(t.Context(), l, cache.MaxTTL+1))
	require.NotErrorIs(t, s.Renew(t.Context(), l, cache.MaxTTL+1), cache.ErrLeaseLost)
}

// testLongestTTL checks that the longest lease and record life a store takes keep their records:
// their deadlines neither overflow nor pass Redis' limit on expiry times.
func testLongestTTL(t *testing.T, h Harness) {
	s := h.Store
	longest := cache.Claim{Fingerprint: []byte("a"), LockTTL: cache.MaxTTL, TTL: cache.MaxTTL}
	l := mustOwn(t, s, "pending", longest)
	require.NoError(t, s.Renew(t.Context(), l, cache.MaxTTL))
	done := mustOwn(t, s, "completed", longest)
	require.NoError(t, s.Complete(t.Context(), done, cache.Response{Status: 200}))
	h.Advance(h.lockTTL * 2)
	require.Equal(t, cache.Pending, mustFind(t, s, "pending").State)
	require.Equal(t, cache.Completed, mustFind(t, s, "completed").State)
}

func testCancelledContext(t *testing.T, h Harness) {
	s := h.Store
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, _, err := s.Acquire(ctx, "k", h.claim("a"))
	require.Error(t, err)
	require.NotErrorIs(t, err, cache.ErrLeaseLost)
	require.Error(t, s.Ping(ctx))
	// The cancelled call created nothing.
	mustOwn(t, s, "k", h.claim("b"))
}

func testOutage(t *testing.T, h Harness) {
	if h.Outage == nil {
		t.Skip("this store has no server to stop")
	}
	s := h.Store
	l := mustOwn(t, s, "k", cache.Claim{Fingerprint: []byte("a"), LockTTL: time.Minute, TTL: time.Minute})
	require.NoError(t, s.Ping(t.Context()))

	restore := h.Outage()
	calls := map[string]func(ctx context.Context) error{
		"ping": s.Ping,
		"acquire": func(ctx context.Context) error {
			_, _, err := s.Acquire(ctx, "other", h.claim("x"))
			return err
		},
		"renew":    func(ctx context.Context) error { return s.Renew(ctx, l, time.Minute) },
		"complete": func(ctx context.Context) error { return s.Complete(ctx, l, cache.Response{Status: 200}) },
		"release":  func(ctx context.Context) error { return s.Release(ctx, l) },
		"lookup": func(ctx context.Context) error {
			_, err := s.Lookup(ctx, "k")
			return err
		},
		"purge": func(ctx context.Context) error { return s.Purge(ctx, "other") },
	}
	for name, call := range calls {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		start := time.Now()
		err := call(ctx)
		cancel()
		require.Error(t, err, "%s must fail while the server is down", name)
		require.NotErrorIs(t, err, cache.ErrLeaseLost, "%s: an outage is not a lost lease", name)
		require.NotErrorIs(t, err, cache.ErrNotFound, "%s: an outage is not a missing record", name)
		require.Less(t, time.Since(start), 5*time.Second, "%s must fail within the store's timeout, not the caller's 10 s", name)
	}
	restore()

	// The same store recovers by itself.
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := s.Ping(t.Context())
		if err == nil {
			break
		}
		require.True(t, time.Now().Before(deadline), "store did not recover: %v", err)
		time.Sleep(50 * time.Millisecond)
	}
	l2, rec, err := s.Acquire(t.Context(), "after-outage", h.claim("y"))
	require.NoError(t, err)
	require.Nil(t, rec)
	require.NoError(t, s.Complete(t.Context(), l2, cache.Response{Status: 200}))
	if err := s.Complete(t.Context(), l, cache.Response{Status: 200}); err != nil && !errors.Is(err, cache.ErrLeaseLost) {
		require.NoError(t, err, "the first lease is either still held or lost with the server's data")
	}
}

// window is the span of the store's clock a call ran in: its times must fall within it, give or
// take the millisecond a store may round them to.
type window struct{ from, to time.Time }

func (h Harness) around(f func()) window {
	from := h.Now()
	f()
	return window{from, h.Now()}
}

// requireWithin checks that got is at from+d to to+d, give or take a millisecond.
func requireWithin(t *testing.T, w window, d time.Duration, got time.Time, what string) {
	t.Helper()
	require.False(t, got.IsZero(), "%s is set", what)
	lo, hi := w.from.Add(d-time.Millisecond), w.to.Add(d+time.Millisecond)
	require.True(t, !got.Before(lo) && !got.After(hi), "%s: %v is not within [%v, %v]", what, got, lo, hi)
}

func lookup(t *testing.T, s cache.Store, key string) *cache.Record {
	t.Helper()
	rec, err := s.Lookup(t.Context(), key)
	require.NoError(t, err, "lookup %q", key)
	require.NotNil(t, rec)
	return rec
}

func requireAbsent(t *testing.T, s cache.Store, key string) {
	t.Helper()
	rec, err := s.Lookup(t.Context(), key)
	require.ErrorIs(t, err, cache.ErrNotFound, "key %q should hold no record", key)
	require.Nil(t, rec)
}

// requireSameRecord compares what Lookup and Acquire returned for one record.
func requireSameRecord(t *testing.T, want, got *cache.Record) {
	t.Helper()
	require.Equal(t, want.State, got.State)
	require.Equal(t, want.Fingerprint, got.Fingerprint)
	requireResponse(t, want.Response, got.Response)
	require.True(t, want.CreatedAt.Equal(got.CreatedAt), "created at: %v and %v", want.CreatedAt, got.CreatedAt)
	require.WithinDuration(t, want.ExpiresAt, got.ExpiresAt, time.Millisecond)
}

func testLookupPending(t *testing.T, h Harness) {
	s := h.Store
	var l cache.Lease
	w := h.around(func() { l = mustOwn(t, s, "k", h.claim("fp-1")) })
	rec := lookup(t, s, "k")
	require.Equal(t, cache.Pending, rec.State)
	require.Equal(t, []byte("fp-1"), rec.Fingerprint)
	requireWithin(t, w, 0, rec.CreatedAt, "a pending record's creation")
	requireWithin(t, w, h.lockTTL, rec.ExpiresAt, "a pending record's expiry, its lease's end")
	requireSameRecord(t, rec, mustFind(t, s, "k"))
	// Lookup changed nothing: the owner still completes.
	require.NoError(t, s.Complete(t.Context(), l, cache.Response{Status: 201}))
	require.Equal(t, cache.Completed, lookup(t, s, "k").State)
}

func testLookupCompleted(t *testing.T, h Harness) {
	s := h.Store
	var l cache.Lease
	created := h.around(func() { l = mustOwn(t, s, "k", h.claim("fp-1")) })
	resp := cache.Response{Status: 201, Headers: []cache.Header{{Name: "content-type", Value: []byte("application/json")}, {Name: "set-cookie", Value: []byte("a=1")}}, Body: []byte(`{"id":1}`)}
	h.Advance(h.lockTTL / 3)
	completed := h.around(func() { require.NoError(t, s.Complete(t.Context(), l, resp)) })
	rec := lookup(t, s, "k")
	require.Equal(t, cache.Completed, rec.State)
	require.Equal(t, []byte("fp-1"), rec.Fingerprint)
	requireResponse(t, resp, rec.Response)
	require.False(t, rec.Response.OutcomeUnknown)
	requireWithin(t, created, 0, rec.CreatedAt, "a completed record's creation, its claim's")
	requireWithin(t, completed, h.ttl, rec.ExpiresAt, "a completed record's expiry, its TTL's end")
	requireSameRecord(t, rec, mustFind(t, s, "k"))
}

func testLookupOutcomeUnknown(t *testing.T, h Harness) {
	s := h.Store
	l := mustOwn(t, s, "k", h.claim("fp-1"))
	require.NoError(t, s.Complete(t.Context(), l, cache.Response{Status: 504, Body: []byte("dropped"), OutcomeUnknown: true}))
	rec := lookup(t, s, "k")
	require.Equal(t, cache.Completed, rec.State)
	require.True(t, rec.Response.OutcomeUnknown)
	require.True(t, rec.Response.BodyOmitted)
	require.Empty(t, rec.Response.Body)
	require.Equal(t, 504, rec.Response.Status)
	require.Equal(t, []byte("fp-1"), rec.Fingerprint)
	requireSameRecord(t, rec, mustFind(t, s, "k"))
}

func testLookupAbsent(t *testing.T, h Harness) {
	s := h.Store
	requireAbsent(t, s, "never")
	l := mustOwn(t, s, "released", h.claim("a"))
	require.NoError(t, s.Release(t.Context(), l))
	requireAbsent(t, s, "released")
	mustOwn(t, s, "expired", h.claim("a"))
	done := mustOwn(t, s, "completed", h.claim("a"))
	require.NoError(t, s.Complete(t.Context(), done, cache.Response{Status: 200}))
	h.Advance(h.lockTTL * 3 / 2)
	requireAbsent(t, s, "expired")
	require.Equal(t, cache.Completed, lookup(t, s, "completed").State)
	h.Advance(h.ttl)
	requireAbsent(t, s, "completed")
	requireAbsent(t, s, "never")
}

// testRecordTimes follows a record's times through Acquire, Renew and Complete: the creation is
// the claim's and never moves; the expiry is the lease's end, moved by a renewal, then the TTL's.
// testRecordRoute: a record carries the route that claimed it, pending and completed, cut to
// MaxRouteBytes.
func testRecordRoute(t *testing.T, h Harness) {
	s := h.Store
	c := h.claim("fp")
	c.Route = "payments"
	l := mustOwn(t, s, "k", c)
	require.Equal(t, "payments", lookup(t, s, "k").Route)
	_, rec, err := s.Acquire(t.Context(), "k", c)
	require.NoError(t, err)
	require.Equal(t, "payments", rec.Route, "a duplicate's Acquire finds it too")
	require.NoError(t, s.Complete(t.Context(), l, cache.Response{Status: 201, Body: []byte("ok")}))
	got := lookup(t, s, "k")
	require.Equal(t, "payments", got.Route)
	require.Equal(t, []byte("ok"), got.Response.Body, "the route does not shift the response")
	require.Equal(t, []byte("fp"), got.Fingerprint)

	long := h.claim("fp")
	long.Route = strings.Repeat("r", cache.MaxRouteBytes+10)
	mustOwn(t, s, "long", long)
	require.Equal(t, strings.Repeat("r", cache.MaxRouteBytes), lookup(t, s, "long").Route)
	none := mustOwn(t, s, "none", h.claim("fp"))
	require.Empty(t, lookup(t, s, "none").Route)
	require.NoError(t, s.Release(t.Context(), none))
}

func testRecordTimes(t *testing.T, h Harness) {
	s := h.Store
	var l cache.Lease
	created := h.around(func() { l = mustOwn(t, s, "k", h.claim("a")) })
	rec := mustFind(t, s, "k")
	requireWithin(t, created, 0, rec.CreatedAt, "creation")
	requireWithin(t, created, h.lockTTL, rec.ExpiresAt, "the lease's end")
	first := rec.CreatedAt

	h.Advance(h.lockTTL / 3)
	renewed := h.around(func() { require.NoError(t, s.Renew(t.Context(), l, h.lockTTL*2)) })
	rec = mustFind(t, s, "k")
	require.True(t, first.Equal(rec.CreatedAt), "a renewal keeps the creation")
	requireWithin(t, renewed, h.lockTTL*2, rec.ExpiresAt, "the renewed lease's end")

	h.Advance(h.lockTTL / 3)
	completed := h.around(func() { require.NoError(t, s.Complete(t.Context(), l, cache.Response{Status: 200})) })
	rec = mustFind(t, s, "k")
	require.True(t, first.Equal(rec.CreatedAt), "completing keeps the creation")
	requireWithin(t, completed, h.ttl, rec.ExpiresAt, "the TTL's end")
}

func testPurgePending(t *testing.T, h Harness) {
	s := h.Store
	old := mustOwn(t, s, "k", h.claim("a"))
	require.NoError(t, s.Purge(t.Context(), "k"))
	requireAbsent(t, s, "k")
	owner := mustOwn(t, s, "k", h.claim("b"))
	require.ErrorIs(t, s.Renew(t.Context(), old, h.lockTTL), cache.ErrLeaseLost)
	require.ErrorIs(t, s.Complete(t.Context(), old, cache.Response{Status: 200, Body: []byte("old")}), cache.ErrLeaseLost)
	require.ErrorIs(t, s.Release(t.Context(), old), cache.ErrLeaseLost)
	rec := lookup(t, s, "k")
	require.Equal(t, cache.Pending, rec.State)
	require.Equal(t, []byte("b"), rec.Fingerprint, "the new owner's record is untouched")
	require.NoError(t, s.Complete(t.Context(), owner, cache.Response{Status: 200, Body: []byte("new")}))
	require.Equal(t, []byte("new"), mustFind(t, s, "k").Response.Body)
}

func testPurgeCompleted(t *testing.T, h Harness) {
	s := h.Store
	for i, resp := range []cache.Response{{Status: 200, Body: []byte("done")}, {Status: 0, OutcomeUnknown: true}} {
		key := fmt.Sprintf("k%d", i)
		l := mustOwn(t, s, key, h.claim("a"))
		require.NoError(t, s.Complete(t.Context(), l, resp))
		require.NoError(t, s.Purge(t.Context(), key))
		requireAbsent(t, s, key)
		require.ErrorIs(t, s.Complete(t.Context(), l, resp), cache.ErrLeaseLost, "a purged record is not completed again")
		requireAbsent(t, s, key)
		mustOwn(t, s, key, h.claim("b"))
	}
}

func testPurgeAbsent(t *testing.T, h Harness) {
	s := h.Store
	require.ErrorIs(t, s.Purge(t.Context(), "never"), cache.ErrNotFound)
	mustOwn(t, s, "k", h.claim("a"))
	require.NoError(t, s.Purge(t.Context(), "k"))
	require.ErrorIs(t, s.Purge(t.Context(), "k"), cache.ErrNotFound, "a purge is done once")
	mustOwn(t, s, "expired", h.claim("a"))
	h.Advance(h.lockTTL * 3 / 2)
	require.ErrorIs(t, s.Purge(t.Context(), "expired"), cache.ErrNotFound)
}

// testPurgeThenOldOwner: the owner of a purged record learns it lost its lease, and writes
// nothing, whether or not another request has claimed the key since.
func testPurgeThenOldOwner(t *testing.T, h Harness) {
	s := h.Store
	old := mustOwn(t, s, "k", h.claim("a"))
	require.NoError(t, s.Purge(t.Context(), "k"))
	require.ErrorIs(t, s.Complete(t.Context(), old, cache.Response{Status: 200, Body: bytes.Repeat([]byte("x"), 64<<10)}), cache.ErrLeaseLost)
	requireAbsent(t, s, "k")
	require.ErrorIs(t, s.Release(t.Context(), old), cache.ErrLeaseLost)
	require.ErrorIs(t, s.Renew(t.Context(), old, h.lockTTL), cache.ErrLeaseLost)
	requireAbsent(t, s, "k")
	mustOwn(t, s, "k", h.claim("b"))
}

// testLargeCompleteIsFinal is testCompleteIsFinal for a response large enough that a store may
// write it otherwise (Redis stages it), with a stale owner's completion between.
func testLargeCompleteIsFinal(t *testing.T, h Harness) {
	s := h.Store
	stale := mustOwn(t, s, "k", h.claim("a"))
	h.Advance(h.lockTTL * 3 / 2)
	l := mustOwn(t, s, "k", h.claim("b"))
	body := bytes.Repeat([]byte{0xab, 0xcd}, 40<<10)
	resp := cache.Response{Status: 201, Headers: []cache.Header{{Name: "content-type", Value: []byte("application/octet-stream")}}, Body: body}
	require.ErrorIs(t, s.Complete(t.Context(), stale, cache.Response{Status: 200, Body: bytes.Repeat([]byte("s"), 80<<10)}), cache.ErrLeaseLost)
	require.Equal(t, cache.Pending, mustFind(t, s, "k").State)
	require.NoError(t, s.Complete(t.Context(), l, resp))
	require.NoError(t, s.Complete(t.Context(), l, resp), "completing again with the same lease must succeed")
	require.ErrorIs(t, s.Complete(t.Context(), stale, cache.Response{Status: 200, Body: bytes.Repeat([]byte("s"), 80<<10)}), cache.ErrLeaseLost)
	require.ErrorIs(t, s.Release(t.Context(), l), cache.ErrLeaseLost)
	rec := mustFind(t, s, "k")
	require.Equal(t, cache.Completed, rec.State)
	require.Equal(t, []byte("b"), rec.Fingerprint)
	requireResponse(t, resp, rec.Response)
	requireSameRecord(t, rec, lookup(t, s, "k"))
}

func testCancelledLookupAndPurge(t *testing.T, h Harness) {
	s := h.Store
	mustOwn(t, s, "k", h.claim("a"))
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, err := s.Lookup(ctx, "k")
	require.Error(t, err)
	require.NotErrorIs(t, err, cache.ErrNotFound)
	err = s.Purge(ctx, "k")
	require.Error(t, err)
	require.NotErrorIs(t, err, cache.ErrNotFound)
	// The cancelled purge deleted nothing.
	require.Equal(t, cache.Pending, lookup(t, s, "k").State)
}

// requireResponse compares responses, treating nil and empty byte slices alike.
func requireResponse(t *testing.T, want, got cache.Response) {
	t.Helper()
	require.Equal(t, want.Status, got.Status)
	require.Equal(t, want.BodyOmitted, got.BodyOmitted)
	require.True(t, bytes.Equal(want.Body, got.Body), "body differs: want %q, got %q", want.Body, got.Body)
	for _, part := range []struct {
		what      string
		want, got []cache.Header
	}{{"header", want.Headers, got.Headers}, {"trailer", want.Trailers, got.Trailers}} {
		require.Len(t, part.got, len(part.want), part.what+"s")
		for i := range part.want {
			require.Equal(t, part.want[i].Name, part.got[i].Name, "%s %d", part.what, i)
			require.True(t, bytes.Equal(part.want[i].Value, part.got[i].Value), "%s %d %s: want %q, got %q", part.what, i, part.want[i].Name, part.want[i].Value, part.got[i].Value)
		}
	}
}

// testReassertAfterExpiry: a lease that expired while nobody took the key is written back whole,
// as Acquire wrote it (token, fingerprint, route, TTL, creation), with a fresh lease; the lease
// then completes as if it had never lapsed.
func testReassertAfterExpiry(t *testing.T, h Harness) {
	s := h.Store
	c := h.claim("fp")
	c.Route = "payments"
	l := mustOwn(t, s, "k", c)
	first := lookup(t, s, "k").CreatedAt
	h.Advance(h.lockTTL * 3 / 2)
	requireAbsent(t, s, "k")
	var restored bool
	w := h.around(func() {
		var err error
		restored, err = s.Reassert(t.Context(), l)
		require.NoError(t, err)
	})
	require.True(t, restored, "the key held no record: the claim is written back")
	rec := lookup(t, s, "k")
	require.Equal(t, cache.Pending, rec.State)
	require.Equal(t, []byte("fp"), rec.Fingerprint)
	require.Equal(t, "payments", rec.Route)
	require.True(t, first.Equal(rec.CreatedAt), "the creation is the first claim's: %v and %v", first, rec.CreatedAt)
	requireWithin(t, w, h.lockTTL, rec.ExpiresAt, "the restored lease's end")
	_, found := acquire(t, s, "k", h.claim("fp"))
	require.NotNil(t, found, "a duplicate finds the restored claim")
	require.Equal(t, cache.Pending, found.State)

	resp := cache.Response{Status: 201, Body: []byte("ok")}
	require.NoError(t, s.Complete(t.Context(), l, resp), "the restored lease is the caller's own")
	restored, err := s.Reassert(t.Context(), l)
	require.ErrorIs(t, err, cache.ErrLeaseLost, "a completed record is never made pending again")
	require.False(t, restored)
	got := lookup(t, s, "k")
	require.Equal(t, cache.Completed, got.State)
	requireResponse(t, resp, got.Response)
}

// testReassertRenewsOwn: on the caller's own live pending record, Reassert is a renewal.
func testReassertRenewsOwn(t *testing.T, h Harness) {
	s := h.Store
	c := h.claim("a")
	l := mustOwn(t, s, "k", c)
	for range 3 {
		h.Advance(h.lockTTL * 2 / 3)
		restored, err := s.Reassert(t.Context(), l)
		require.NoError(t, err)
		require.False(t, restored, "the record was there: renewed, not written back")
	}
	// 2×h.lockTTL has passed since Acquire: without the renewals the key would be free.
	require.Equal(t, cache.Pending, mustFind(t, s, "k").State)
	require.NoError(t, s.Complete(t.Context(), l, cache.Response{Status: 201}))
}

// testReassertNeverOverwrites: a key another owner took, pending or completed, is left alone.
func testReassertNeverOverwrites(t *testing.T, h Harness) {
	s := h.Store
	stale := mustOwn(t, s, "k", h.claim("a"))
	h.Advance(h.lockTTL * 3 / 2)
	owner := mustOwn(t, s, "k", h.claim("b"))
	restored, err := s.Reassert(t.Context(), stale)
	require.ErrorIs(t, err, cache.ErrLeaseLost)
	require.False(t, restored)
	require.Equal(t, []byte("b"), mustFind(t, s, "k").Fingerprint)
	require.ErrorIs(t, s.Complete(t.Context(), stale, cache.Response{Status: 200, Body: []byte("stale")}), cache.ErrLeaseLost)

	require.NoError(t, s.Complete(t.Context(), owner, cache.Response{Status: 200, Body: []byte("owner")}))
	_, err = s.Reassert(t.Context(), stale)
	require.ErrorIs(t, err, cache.ErrLeaseLost)
	rec := mustFind(t, s, "k")
	require.Equal(t, cache.Completed, rec.State)
	require.Equal(t, []byte("owner"), rec.Response.Body)

	var zero cache.Lease
	_, err = s.Reassert(t.Context(), zero)
	require.ErrorIs(t, err, cache.ErrLeaseLost)
}

// testLeaseCarriesItsClaim: a lease carries the claim it was acquired with, its route cut as the
// record's, so that Reassert needs nothing else.
func testLeaseCarriesItsClaim(t *testing.T, h Harness) {
	s := h.Store
	c := h.claim("fingerprint")
	c.Route = strings.Repeat("r", cache.MaxRouteBytes+10)
	want := c
	want.Route = c.Route[:cache.MaxRouteBytes]
	l := mustOwn(t, s, "k", c)
	require.Equal(t, want, l.Claim())
	require.Equal(t, want.Route, lookup(t, s, "k").Route)
	require.Equal(t, cache.Claim{}, cache.Lease{}.Claim(), "the zero lease carries no claim")

	h.Advance(h.lockTTL * 3 / 2)
	requireAbsent(t, s, "k")
	restored, err := s.Reassert(t.Context(), l)
	require.NoError(t, err)
	require.True(t, restored)
	rec := lookup(t, s, "k")
	require.Equal(t, want.Fingerprint, rec.Fingerprint, "the claim written back is the one acquired")
	require.Equal(t, want.Route, rec.Route)
}

// testReassertConcurrentAcquire: an expired holder reasserting while duplicates race to claim the
// key: exactly one of them holds it afterwards, and the record is that one's.
func testReassertConcurrentAcquire(t *testing.T, h Harness) {
	s := h.Store
	c := h.claim("holder")
	l := mustOwn(t, s, "k", c)
	h.Advance(h.lockTTL * 3 / 2)
	const racers = 16
	var wg sync.WaitGroup
	errs := make(chan error, racers+1)
	held := make(chan bool, racers)
	var restored bool
	start := make(chan struct{})
	for range racers {
		wg.Go(func() {
			<-start
			got, _, err := s.Acquire(t.Context(), "k", h.claim("racer"))
			errs <- err
			held <- got.Held()
		})
	}
	wg.Go(func() {
		<-start
		var err error
		restored, err = s.Reassert(t.Context(), l)
		if errors.Is(err, cache.ErrLeaseLost) {
			err = nil
		}
		errs <- err
	})
	close(start)
	wg.Wait()
	close(errs)
	close(held)
	for err := range errs {
		require.NoError(t, err)
	}
	winners := 0
	for ok := range held {
		if ok {
			winners++
		}
	}
	if restored {
		require.Zero(t, winners, "the restored claim was first: no duplicate may hold the key")
		require.Equal(t, []byte("holder"), mustFind(t, s, "k").Fingerprint)
		return
	}
	require.Equal(t, 1, winners, "a racer took the key first: it alone holds it")
	require.Equal(t, []byte("racer"), mustFind(t, s, "k").Fingerprint)
}
