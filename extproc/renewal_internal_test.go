package extproc

import (
	"runtime"
	"testing"
	"time"
	"weak"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

// A renewal stopped while it was out of the queue (its store call in flight) is not queued again
// when that call returns, and a renewal's stop gives its place back and stops the shared timer
// once no renewal waits.
func TestStoppedRenewalIsNotQueued(t *testing.T) {
	store, err := cache.NewMemory(cache.MemoryOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	s, err := NewServer(Options{Store: store, Clock: clk})
	require.NoError(t, err)
	l, _, err := store.Acquire(t.Context(), "k", cache.Claim{LockTTL: 30 * time.Second, TTL: time.Hour})
	require.NoError(t, err)
	h := &hold{lease: l}
	o := &leaseCall{s: s}

	var queued renewal
	o.renewAfter(10*time.Second, &queued, h)
	require.Equal(t, 1, len(s.renewals.heap))
	require.Equal(t, 1, clk.Pending(), "the queue's one timer is armed")
	queued.stop()
	require.Empty(t, s.renewals.heap)
	require.Zero(t, clk.Pending(), "no renewal waits: the timer is stopped")

	var stopped renewal
	stopped.stop()
	o.renewAfter(10*time.Second, &stopped, h)
	require.Empty(t, s.renewals.heap, "a stopped renewal is not queued again")
	require.Zero(t, clk.Pending())
}

// A stopped renewal lets go of the call it renewed for: the hold that the completions' retries
// keep after the stream ended must not keep the stream's call, and with it the request, in
// memory.
func TestStoppedRenewalLetsGoOfItsCall(t *testing.T) {
	store, err := cache.NewMemory(cache.MemoryOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	s, err := NewServer(Options{Store: store, Clock: clock.NewFake(time.Unix(1_700_000_000, 0))})
	require.NoError(t, err)
	l, _, err := store.Acquire(t.Context(), "k", cache.Claim{LockTTL: 30 * time.Second, TTL: time.Hour})
	require.NoError(t, err)
	h := &hold{lease: l}
	o := &leaseCall{s: s, hold: h}
	o.renewAfter(10*time.Second, &h.renewal, h)
	call := weak.Make(o)
	h.renewal.stop()
	o = nil
	runtime.GC()
	runtime.GC()
	require.Nil(t, call.Value(), "the stopped renewal of a hold still kept keeps its call")
	runtime.KeepAlive(h)
}
