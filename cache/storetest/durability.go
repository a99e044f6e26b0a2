package storetest

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
)

// The cases of durable claims (cache.Claim.Replicas): every store runs the first two, and a
// store with replicas it can pause the others.
var durabilityCases = []suiteCase{
	{"DurableClaim", testDurableClaim},
	{"DurableClaimsBatched", testDurableClaimsBatched},
	{"DurableClaimPaused", testDurableClaimPaused},
	{"DurableCompletePaused", testDurableCompletePaused},
}

// Each wait for replicas of the cases below. A confirmed write is acknowledged long before
// confirmWait, and a batch of claims of which some cannot be confirmed before batchWait; a paused
// replica makes a wait run out pausedWait. A store with replicas needs a timeout above
// confirmWait (Harness.Replicas); one without, above twice batchWait, as a durable claim that
// cannot be confirmed may queue behind another that holds its connection for the whole wait.
const (
	confirmWait = 2 * time.Second
	batchWait   = 300 * time.Millisecond
	pausedWait  = 200 * time.Millisecond
)

// durable is a claim of fp waiting for replicas replicas for at most wait, with a lease that
// outlasts the case.
func (h Harness) durable(fp string, replicas int, wait time.Duration) cache.Claim {
	c := h.claim(fp)
	c.LockTTL, c.Replicas, c.ReplicaTimeout = time.Minute, replicas, wait
	return c
}

// requireUnconfirmedClaim checks that a durable claim of key was refused and left nothing.
func requireUnconfirmedClaim(t *testing.T, s cache.Store, key string, c cache.Claim) {
	t.Helper()
	l, rec, err := s.Acquire(t.Context(), key, c)
	require.ErrorIs(t, err, cache.ErrUnconfirmed, "a claim of %d replicas", c.Replicas)
	require.False(t, l.Held(), "an unconfirmed claim holds nothing")
	require.Nil(t, rec)
	requireAbsent(t, s, key)
}

// A claim that more replicas must confirm than the store has is withdrawn and leaves the key
// free; one that the store's replicas confirm holds the key and completes; a durable claim that
// finds a record returns it, whatever the replicas.
func testDurableClaim(t *testing.T, h Harness) {
	s := h.Store
	requireUnconfirmedClaim(t, s, "k", h.durable("a", h.Replicas+1, pausedWait))

	l := mustOwn(t, s, "k", h.durable("b", h.Replicas, confirmWait))
	rec := lookup(t, s, "k")
	require.Equal(t, cache.Pending, rec.State)
	require.Equal(t, []byte("b"), rec.Fingerprint)
	require.NoError(t, s.Complete(t.Context(), l, cache.Response{Status: 201, Body: []byte("confirmed")}))
	require.NoError(t, s.Complete(t.Context(), l, cache.Response{Status: 201, Body: []byte("confirmed")}), "completing again waits again")

	_, rec, err := s.Acquire(t.Context(), "k", h.durable("c", h.Replicas+1, pausedWait))
	require.NoError(t, err, "a claim that writes nothing has nothing to confirm")
	require.Equal(t, cache.Completed, rec.State)
	require.Equal(t, []byte("confirmed"), rec.Response.Body)

	_, _, err = s.Acquire(t.Context(), "bad", h.durable("d", -1, pausedWait))
	require.Error(t, err, "negative replicas")
	_, _, err = s.Acquire(t.Context(), "bad", h.durable("d", 1, 0))
	require.Error(t, err, "a wait of 0 would wait for ever")
	requireAbsent(t, s, "bad")
}

// Concurrent durable claims, which a store may send together, are each judged against the
// replicas they ask for.
func testDurableClaimsBatched(t *testing.T, h Harness) {
	s := h.Store
	const n = 32
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs = map[string]error{}
		held = map[string]cache.Lease{}
	)
	start := make(chan struct{})
	for i := range n {
		key := fmt.Sprintf("k%d", i)
		// The odd ones ask for more replicas than there are.
		replicas := h.Replicas + i%2
		wg.Go(func() {
			<-start
			l, _, err := s.Acquire(context.Background(), key, h.durable(key, replicas, batchWait))
			mu.Lock()
			defer mu.Unlock()
			errs[key] = err
			held[key] = l
		})
	}
	close(start)
	wg.Wait()
	for i := range n {
		key := fmt.Sprintf("k%d", i)
		if i%2 == 1 {
			require.ErrorIs(t, errs[key], cache.ErrUnconfirmed, key)
			requireAbsent(t, s, key)
			continue
		}
		require.NoError(t, errs[key], key)
		require.True(t, held[key].Held(), key)
		require.NoError(t, s.Complete(t.Context(), held[key], cache.Response{Status: 200}), key)
		require.Equal(t, cache.Completed, lookup(t, s, key).State, key)
	}
}

// A claim whose replicas are paused is withdrawn and leaves the key free; once they are back, a
// retry with the same key claims it, completes, and the key is taken for good.
func testDurableClaimPaused(t *testing.T, h Harness) {
	if h.PauseReplicas == nil {
		t.Skip("this store has no replicas to pause")
	}
	s := h.Store
	resume := h.PauseReplicas()
	requireUnconfirmedClaim(t, s, "k", h.durable("a", h.Replicas, pausedWait))
	resume()

	l := mustOwn(t, s, "k", h.durable("a", h.Replicas, confirmWait))
	require.NoError(t, s.Complete(t.Context(), l, cache.Response{Status: 200, Body: []byte("once")}))
	_, rec, err := s.Acquire(t.Context(), "k", h.durable("a", h.Replicas, confirmWait))
	require.NoError(t, err)
	require.Equal(t, cache.Completed, rec.State, "the retry ran once: the next one finds its record")
	require.Equal(t, []byte("once"), rec.Response.Body)
}

// A completion whose replicas are paused is written and stays; its lease is spent; completing
// again once the replicas are back confirms it. Small records and large (staged) ones alike.
func testDurableCompletePaused(t *testing.T, h Harness) {
	if h.PauseReplicas == nil {
		t.Skip("this store has no replicas to pause")
	}
	s := h.Store
	for _, size := range []int{16, 64 << 10} {
		key := fmt.Sprintf("k%d", size)
		resp := cache.Response{Status: 201, Body: bytes.Repeat([]byte("c"), size)}
		l := mustOwn(t, s, key, h.durable("a", h.Replicas, pausedWait))
		resume := h.PauseReplicas()
		require.ErrorIs(t, s.Complete(t.Context(), l, resp), cache.ErrUnconfirmed, key)
		rec := lookup(t, s, key)
		require.Equal(t, cache.Completed, rec.State, "%s: an unconfirmed completion is written and stays", key)
		requireResponse(t, resp, rec.Response)
		require.ErrorIs(t, s.Release(t.Context(), l), cache.ErrLeaseLost, "%s: the lease is spent", key)
		require.ErrorIs(t, s.Complete(t.Context(), l, resp), cache.ErrUnconfirmed, "%s: still paused", key)
		resume()

		require.NoError(t, completeConfirmed(t, s, l, resp), key)
		requireResponse(t, resp, lookup(t, s, key).Response)
	}
}

// completeConfirmed completes l again until the replicas, just resumed, confirm it: its wait is
// the claim's, pausedWait, which a replica catching up on a loaded machine may outlast once.
func completeConfirmed(t *testing.T, s cache.Store, l cache.Lease, resp cache.Response) error {
	t.Helper()
	var err error
	for range 10 {
		if err = s.Complete(t.Context(), l, resp); err == nil {
			return nil
		}
		require.ErrorIs(t, err, cache.ErrUnconfirmed)
	}
	return err
}
