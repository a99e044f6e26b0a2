package extproc_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

// These tests hold the processor to what a store outage longer than lock_ttl must not do: run a
// request a second time while its first stream lives. A replica answers a key it holds without
// the store; a holder whose renewals could not reach the store re-asserts its claim once the
// store answers again; a record removed while the store answered stays removed, and every lost
// lease is counted.

// unreachable is a store that cannot be reached while down is set: its claims, renewals,
// re-assertions and completions time out. Lookup and Purge, the operator's calls, still work.
type unreachable struct {
	cache.Store
	down     atomic.Bool
	acquires atomic.Int32
}

func (u *unreachable) err(op string) error {
	return fmt.Errorf("cache: redis %s: %w", op, context.DeadlineExceeded)
}

func (u *unreachable) Acquire(ctx context.Context, key string, c cache.Claim) (cache.Lease, *cache.Record, error) {
	u.acquires.Add(1)
	if u.down.Load() {
		return cache.Lease{}, nil, u.err("acquire")
	}
	return u.Store.Acquire(ctx, key, c)
}

func (u *unreachable) Renew(ctx context.Context, l cache.Lease, d time.Duration) error {
	if u.down.Load() {
		return u.err("renew")
	}
	return u.Store.Renew(ctx, l, d)
}

func (u *unreachable) Reassert(ctx context.Context, l cache.Lease) (bool, error) {
	if u.down.Load() {
		return false, u.err("reassert")
	}
	return u.Store.Reassert(ctx, l)
}

func (u *unreachable) Complete(ctx context.Context, l cache.Lease, r cache.Response) error {
	if u.down.Load() {
		return u.err("complete")
	}
	return u.Store.Complete(ctx, l, r)
}

// twoReplicas returns two harnesses, two replicas of the processor, on one memory store that runs
// on their shared fake clock; the first reaches it through an unreachable wrapper.
func twoReplicas(t *testing.T, policy string) (first, other *harness, store *unreachable) {
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	m, err := cache.NewMemory(cache.MemoryOptions{Clock: clk})
	require.NoError(t, err)
	store = &unreachable{Store: m}
	first = newHarness(t, harnessOptions{store: store, clock: clk, policy: policy})
	other = newHarness(t, harnessOptions{store: m, clock: clk, policy: policy})
	return first, other, store
}

// claimRunning opens a stream on h whose request for key is claimed and running upstream.
func claimRunning(t *testing.T, h *harness, key string) *stream {
	t.Helper()
	s := h.open()
	s.send(requestHeaders(post("/v1/payments", key, `{}`)))
	require.NotNil(t, s.send(requestBody([]byte(`{}`))).GetRequestBody(), "claimed: the request goes upstream")
	h.mu.Lock()
	h.executed[key]++
	h.mu.Unlock()
	return s
}

// finishRunning sends the upstream's response on a running stream and ends it.
func finishRunning(t *testing.T, h *harness, s *stream) {
	t.Helper()
	s.send(responseHeaders(created))
	require.NotNil(t, s.send(responseBody(created.body, true)).GetResponseBody(), "the client gets the upstream's response")
	s.end()
	h.waitIdle(t)
}

// A replica never starts a request for a key it is itself running: a duplicate gets 409 (or 422
// with another payload) without a store call, whether the store is unreachable or has lost the
// record (a purge), for as long as the first stream lives.
func TestHeldKeyIsAnsweredWithoutTheStore(t *testing.T) {
	h, _, store := twoReplicas(t, "defaults: {lock_ttl: 3s}")
	const key = "held"
	first := claimRunning(t, h, key)
	calls := store.acquires.Load()

	store.down.Store(true)
	requireProblem(t, h.do(post("/v1/payments", key, `{}`), created), 409, "request-in-progress")
	requireProblem(t, h.do(post("/v1/payments", key, `{"other":1}`), created), 422, "idempotency-key-reused")
	require.Equal(t, calls, store.acquires.Load(), "the duplicates were answered without the store")
	store.down.Store(false)

	// However long the outage, and even with the record gone, this replica does not run it again.
	stored := extproc.StoredKey(h.policy, "/v1/payments", key)
	h.advance(10 * time.Second)
	require.NoError(t, store.Purge(t.Context(), stored))
	requireProblem(t, h.do(post("/v1/payments", key, `{}`), created), 409, "request-in-progress")
	require.Equal(t, calls, store.acquires.Load())
	require.Equal(t, 1, h.executions(key))

	// The hold ends with the stream: the key is the store's to judge again.
	finishRunning(t, h, first)
	require.Equal(t, 0, extproc.HeldKeys(h.server))
	require.Equal(t, 1.0, h.counter("idempotency_completions_abandoned_total", "reason", "lease_lost"), "the purge lost the first's lease")
	require.True(t, h.do(post("/v1/payments", key, `{}`), created).executed, "the purge freed the key")
	require.Greater(t, store.acquires.Load(), calls)
}

// A holder whose renewals could not reach the store for longer than lock_ttl writes its claim
// back as soon as the store answers again: a duplicate on another replica then gets 409, not a
// second execution, and the first request's completion lands and replays everywhere.
func TestClaimReassertedAfterAnOutage(t *testing.T) {
	for _, c := range []struct {
		name string
		// completeDuring: the response ends while the store is still away, so the completion is
		// retried and re-asserts the claim itself.
		completeDuring bool
	}{
		{name: "while the request runs"},
		{name: "while its completion is retried", completeDuring: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			h, other, store := twoReplicas(t, "defaults: {lock_ttl: 3s}")
			const key = "outage"
			stored := extproc.StoredKey(h.policy, "/v1/payments", key)
			first := claimRunning(t, h, key)

			store.down.Store(true)
			if c.completeDuring {
				finishRunning(t, h, first)
				requireRetrying(t, h)
			}
			h.advance(4 * time.Second) // past lock_ttl: the store lets the lease expire
			_, err := store.Lookup(t.Context(), stored)
			require.ErrorIs(t, err, cache.ErrNotFound, "the store let the lease expire during the outage")
			require.Greater(t, h.counter("idempotency_store_errors_total", "op", "renew", "kind", "timeout"), 1.0,
				"renewals were retried while the store was away")

			store.down.Store(false)
			h.advance(50 * time.Millisecond) // the next try to reach the store
			rec, err := store.Lookup(t.Context(), stored)
			require.NoError(t, err, "the claim is written back within 50 ms of the store's return")
			if rec.State == cache.Pending {
				// The retried completion re-asserts the claim and then writes the record: a
				// duplicate between the two gets 409, one after them the replay; never a run.
				res := other.do(post("/v1/payments", key, `{}`), created)
				require.False(t, res.executed, "the other replica ran it while the claim was back")
				if res.status == 409 || !c.completeDuring {
					requireProblem(t, res, 409, "request-in-progress")
				} else {
					require.Equal(t, []string{"true"}, res.header(replayed), "the completion landed after the lookup: a replay")
				}
			}
			if !c.completeDuring {
				finishRunning(t, h, first)
			}
			require.Eventually(t, func() bool {
				h.advance(time.Second)
				r, err := store.Lookup(t.Context(), stored)
				return err == nil && r.State == cache.Completed
			}, 10*time.Second, 10*time.Millisecond)

			for _, r := range []*harness{h, other} {
				res := r.do(post("/v1/payments", key, `{}`), created)
				require.Equal(t, []string{"true"}, res.header(replayed))
				require.Equal(t, created.body, res.body)
			}
			require.Equal(t, 1, h.executions(key))
			require.Zero(t, other.executions(key), "the other replica never ran it")
			require.Zero(t, h.counter("idempotency_completions_abandoned_total", "reason", "lease_lost"))
			require.Contains(t, h.logs.String(), "claim re-asserted")
		})
	}
}

// A completion that reaches the store first after an outage longer than lock_ttl, before any
// renewal could write the claim back, finds its lease gone: it re-asserts the claim itself and
// then writes the record, which the client's retries replay, on this replica and another.
func TestCompletionReassertsALapsedClaim(t *testing.T) {
	h, other, store := twoReplicas(t, "defaults: {lock_ttl: 3s}")
	const key = "lapsed"
	stored := extproc.StoredKey(h.policy, "/v1/payments", key)
	first := claimRunning(t, h, key)

	store.down.Store(true)
	h.advance(4 * time.Second) // past lock_ttl: the store lets the lease expire
	_, err := store.Lookup(t.Context(), stored)
	require.ErrorIs(t, err, cache.ErrNotFound, "the store let the lease expire during the outage")
	// No renewal is under way: the next one waits on the clock, which stands still from here.
	require.Eventually(t, func() bool { return h.clock.Pending() == 1 }, 10*time.Second, time.Millisecond,
		"the renewal waits for its next try")

	store.down.Store(false)
	finishRunning(t, h, first)
	rec, err := store.Lookup(t.Context(), stored)
	require.NoError(t, err, "the completion wrote the record:\n%s", h.logs.String())
	require.Equal(t, cache.Completed, rec.State)
	require.Contains(t, h.logs.String(), "claim re-asserted")
	require.Zero(t, h.counter("idempotency_completions_abandoned_total", "reason", "lease_lost"))
	require.Equal(t, 1.0, h.counter("idempotency_requests_total", "route", "default", "outcome", "executed"))
	for _, r := range []*harness{h, other} {
		res := r.do(post("/v1/payments", key, `{}`), created)
		require.Equal(t, []string{"true"}, res.header(replayed))
		require.Equal(t, created.body, res.body)
	}
	require.Equal(t, 1, h.executions(key))
	require.Zero(t, other.executions(key))
}

// A record removed while the holder's renewals reached the store (a purge, a flush, a failover
// to a replica without it), or while the store was away for less than lock_ttl, was not let
// expire: it is never written back. A duplicate elsewhere may run it again; the lost lease is
// counted once and logged at error.
func TestRemovedRecordIsNotReasserted(t *testing.T) {
	for _, c := range []struct {
		name string
		away time.Duration // how long the store is away before the purge
	}{
		{name: "renewals reached the store"},
		{name: "the store was away for less than lock_ttl", away: 1500 * time.Millisecond},
	} {
		t.Run(c.name, func(t *testing.T) {
			h, other, store := twoReplicas(t, "defaults: {lock_ttl: 3s}")
			const key = "purged"
			stored := extproc.StoredKey(h.policy, "/v1/payments", key)
			first := claimRunning(t, h, key)
			h.advance(time.Second) // one renewal that reaches the store
			if c.away > 0 {
				store.down.Store(true)
				h.advance(c.away)
			}
			require.NoError(t, store.Purge(t.Context(), stored))
			store.down.Store(false)
			h.advance(time.Second) // the next renewal finds the record gone
			require.Equal(t, 1.0, h.counter("idempotency_completions_abandoned_total", "reason", "lease_lost"))
			_, err := store.Lookup(t.Context(), stored)
			require.ErrorIs(t, err, cache.ErrNotFound, "a purge stays a purge")

			require.True(t, other.do(post("/v1/payments", key, `{}`), created).executed, "the record was removed: another replica runs it")
			finishRunning(t, h, first)
			require.Equal(t, 1.0, h.counter("idempotency_completions_abandoned_total", "reason", "lease_lost"), "counted once")
			require.Contains(t, h.logs.String(), `"level":"error"`)
			require.Contains(t, h.logs.String(), `"reason":"lease_lost"`)
		})
	}
}

// A re-assertion that finds another owner's pending record tries again for up to lock_ttl: the
// record may be a claim whose caller gave up on it (a duplicate's Acquire that timed out while
// the store was away, applied when it came back), which its replica removes. One that is still
// there after lock_ttl is another request's: the lease is lost, and counted.
func TestReassertWaitsOutAnAbandonedClaim(t *testing.T) {
	for _, c := range []struct {
		name    string
		removed bool // the other claim is removed by its replica
	}{
		{name: "the other claim is removed", removed: true},
		{name: "the other claim stays"},
	} {
		t.Run(c.name, func(t *testing.T) {
			h, _, store := twoReplicas(t, "defaults: {lock_ttl: 3s}")
			const key = "contested"
			stored := extproc.StoredKey(h.policy, "/v1/payments", key)
			first := claimRunning(t, h, key)
			store.down.Store(true)
			h.advance(4 * time.Second)
			// A claim applied as the store comes back, by no request of this replica.
			orphan, rec, err := store.Store.Acquire(t.Context(), stored, cache.Claim{Fingerprint: []byte("x"), LockTTL: 10 * time.Second, TTL: time.Hour})
			require.NoError(t, err)
			require.Nil(t, rec)
			store.down.Store(false)
			h.advance(time.Second) // re-assertions meet the other claim
			require.Zero(t, h.counter("idempotency_completions_abandoned_total", "reason", "lease_lost"), "not lost yet")
			if c.removed {
				require.NoError(t, store.Store.Release(t.Context(), orphan))
				h.advance(50 * time.Millisecond)
				got, err := store.Lookup(t.Context(), stored)
				require.NoError(t, err)
				require.Equal(t, cache.Pending, got.State)
				require.NotEqual(t, []byte("x"), got.Fingerprint, "the holder's claim is back")
				finishRunning(t, h, first)
				require.Zero(t, h.counter("idempotency_completions_abandoned_total", "reason", "lease_lost"))
				return
			}
			h.advance(3 * time.Second)
			require.Equal(t, 1.0, h.counter("idempotency_completions_abandoned_total", "reason", "lease_lost"))
			got, err := store.Lookup(t.Context(), stored)
			require.NoError(t, err)
			require.Equal(t, []byte("x"), got.Fingerprint, "the other claim is never overwritten")
			finishRunning(t, h, first)
		})
	}
}

// sentReassert is an unreachable store whose next re-assertion, once armed, is held up as a
// command already sent to the store: it waits for the test to let it go, and if its caller stops
// waiting first (its context ends), the caller gets the context's error at once and the command
// still lands, as late as it can, after the store's next release.
type sentReassert struct {
	*unreachable
	armed    atomic.Bool
	entered  chan struct{} // closed when the armed re-assertion reaches the store
	proceed  chan struct{} // closed by the test: the re-assertion lands and is answered
	cutShort chan struct{} // closed when its caller stopped waiting first
	returned chan struct{} // closed when it returned to its caller, either way
	mu       sync.Mutex
	late     func() // the command still on the wire, if any
}

func (s *sentReassert) Reassert(ctx context.Context, l cache.Lease) (bool, error) {
	if !s.armed.CompareAndSwap(true, false) {
		return s.unreachable.Reassert(ctx, l)
	}
	close(s.entered)
	defer close(s.returned)
	select {
	case <-s.proceed:
		return s.unreachable.Reassert(context.WithoutCancel(ctx), l)
	case <-ctx.Done():
		s.mu.Lock()
		s.late = func() { _, _ = s.unreachable.Reassert(context.Background(), l) }
		s.mu.Unlock()
		close(s.cutShort)
		return false, ctx.Err()
	}
}

func (s *sentReassert) Release(ctx context.Context, l cache.Lease) error {
	select {
	case <-s.entered:
		// A release that cut the re-assertion short finds its command on the wire, not one
		// still being sent.
		<-s.returned
	default:
	}
	err := s.unreachable.Release(ctx, l)
	s.mu.Lock()
	late := s.late
	s.late = nil
	s.mu.Unlock()
	if late != nil {
		late()
	}
	return err
}

// A lease released while a renewal's re-assertion of it is under way (the store came back after
// an outage longer than lock_ttl, and the stream ended before the response) stays released: the
// re-assertion lands before the release, never after it, so that a retry runs at once instead of
// getting 409 until lock_ttl passes. The release waits for the re-assertion's answer, which the
// stream's end does not cut short.
func TestReleaseOutlastsAReassertionUnderWay(t *testing.T) {
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	m, err := cache.NewMemory(cache.MemoryOptions{Clock: clk})
	require.NoError(t, err)
	store := &sentReassert{unreachable: &unreachable{Store: m},
		entered: make(chan struct{}), proceed: make(chan struct{}), cutShort: make(chan struct{}), returned: make(chan struct{})}
	const policy = "defaults: {lock_ttl: 3s}"
	h := newHarness(t, harnessOptions{store: store, clock: clk, policy: policy})
	other := newHarness(t, harnessOptions{store: m, clock: clk, policy: policy})
	const key = "released"
	stored := extproc.StoredKey(h.policy, "/v1/payments", key)
	first := claimRunning(t, h, key)

	store.down.Store(true)
	h.advance(4 * time.Second) // past lock_ttl: the store lets the lease expire
	require.Eventually(t, func() bool { return h.clock.Pending() == 1 }, 10*time.Second, time.Millisecond,
		"the renewal waits for its next try")
	store.armed.Store(true)
	store.down.Store(false)
	// The next try re-asserts the lapsed claim; the fake clock runs it on this goroutine.
	advanced := make(chan struct{})
	go func() {
		defer close(advanced)
		h.advance(50 * time.Millisecond)
	}()
	<-store.entered

	// The client goes away before the response: unknown_outcome release (the default).
	first.end()
	// A release that cuts the re-assertion short does so at once, and its command then lands
	// after the release. One that waits for the answer never cuts it short: the second is only
	// how long the test gives it to, before the re-assertion is answered.
	select {
	case <-store.cutShort:
	case <-time.After(time.Second):
	}
	close(store.proceed)
	<-advanced
	h.waitIdle(t)

	_, err = m.Lookup(t.Context(), stored)
	require.ErrorIs(t, err, cache.ErrNotFound, "the released key holds no record")
	require.True(t, other.do(post("/v1/payments", key, `{}`), created).executed, "a retry runs at once")
	require.Equal(t, 1.0, h.counter("idempotency_releases_total", "route", "default", "reason", "unknown_outcome"))
	require.Zero(t, extproc.HeldKeys(h.server))
}
