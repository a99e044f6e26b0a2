package cache_test

import (
	"bytes"
	"fmt"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/cache/storetest"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

func newMemory(t testing.TB, maxBytes int64) (*cache.Memory, *clock.Fake) {
	t.Helper()
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	m, err := cache.NewMemory(cache.MemoryOptions{MaxBytes: maxBytes, Clock: clk})
	require.NoError(t, err)
	return m, clk
}

func TestMemoryConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		m, clk := newMemory(t, 0)
		return storetest.Harness{Store: m, Advance: clk.Advance, Now: clk.Now}
	})
}

var testClaim = cache.Claim{LockTTL: 30 * time.Second, TTL: time.Hour}

func complete(t *testing.T, m *cache.Memory, key string, body []byte) {
	t.Helper()
	l, rec, err := m.Acquire(t.Context(), key, testClaim)
	require.NoError(t, err)
	require.Nil(t, rec, "key %s", key)
	require.NoError(t, m.Complete(t.Context(), l, cache.Response{Status: 200, Body: body}))
}

func held(t *testing.T, m *cache.Memory, key string) *cache.Record {
	t.Helper()
	l, rec, err := m.Acquire(t.Context(), key, testClaim)
	require.NoError(t, err)
	if l.Held() {
		require.NoError(t, m.Release(t.Context(), l))
		return nil
	}
	return rec
}

func TestMemoryBoundUnderManyKeys(t *testing.T) {
	const maxBytes = 1 << 20
	m, _ := newMemory(t, maxBytes)
	body := bytes.Repeat([]byte("x"), 1024)
	const n = 20_000
	for i := range n {
		complete(t, m, fmt.Sprintf("key-%d", i), body)
		require.LessOrEqual(t, m.Bytes(), int64(maxBytes), "after %d records", i+1)
	}
	// Roughly maxBytes / record size records remain, the most recent ones.
	require.Greater(t, m.Len(), 500)
	require.Less(t, m.Len(), 1024)
	require.NotNil(t, held(t, m, fmt.Sprintf("key-%d", n-1)), "the newest record must survive")
	require.Nil(t, held(t, m, "key-0"), "the oldest record must be evicted")
}

func TestMemoryEvictsLeastRecentlyUsed(t *testing.T) {
	body := bytes.Repeat([]byte("y"), 4096)
	m, _ := newMemory(t, 4*(4096+512))
	for _, k := range []string{"a", "b", "c", "d"} {
		complete(t, m, k, body)
	}
	require.Equal(t, 4, m.Len())
	// A replay of "a" makes it the most recently used; "b" is now the least.
	require.NotNil(t, held(t, m, "a"))
	complete(t, m, "e", body)
	require.NotNil(t, held(t, m, "a"), "a was used after b and must survive")
	require.Nil(t, held(t, m, "b"), "b was the least recently used")
	for _, k := range []string{"c", "d", "e"} {
		require.NotNil(t, held(t, m, k), k)
	}
}

func TestMemoryNeverEvictsPending(t *testing.T) {
	m, clk := newMemory(t, 16<<10)
	complete(t, m, "done", bytes.Repeat([]byte("z"), 8<<10))
	var leases []cache.Lease
	for i := range 200 {
		l, rec, err := m.Acquire(t.Context(), fmt.Sprintf("pending-%d", i), cache.Claim{Fingerprint: bytes.Repeat([]byte{1}, 32), LockTTL: time.Second, TTL: time.Hour})
		require.NoError(t, err)
		require.Nil(t, rec)
		leases = append(leases, l)
	}
	// The completed record made room; every lease is still held although the bound is exceeded.
	require.Nil(t, held(t, m, "done"))
	for _, l := range leases {
		require.NoError(t, m.Renew(t.Context(), l, time.Second))
	}
	// Leases bound pending records: once they expire the store is back under its bound.
	clk.Advance(2 * time.Second)
	_ = held(t, m, "trigger-expiry")
	require.LessOrEqual(t, m.Bytes(), int64(16<<10))
	for _, l := range leases {
		require.ErrorIs(t, m.Renew(t.Context(), l, time.Second), cache.ErrLeaseLost)
	}
}

func TestMemoryRecordLargerThanBoundStaysClaimed(t *testing.T) {
	m, _ := newMemory(t, 4<<10)
	l, _, err := m.Acquire(t.Context(), "big", testClaim)
	require.NoError(t, err)
	require.NoError(t, m.Complete(t.Context(), l, cache.Response{Status: 201, Body: bytes.Repeat([]byte("b"), 8<<10)}))
	rec := held(t, m, "big")
	require.NotNil(t, rec, "the key must stay claimed so that a duplicate does not run again")
	require.Equal(t, cache.Completed, rec.State)
	require.True(t, rec.Response.BodyOmitted)
	require.Equal(t, 201, rec.Response.Status)
	require.LessOrEqual(t, m.Bytes(), int64(4<<10))
}

func TestMemoryExpiredRecordsAreDropped(t *testing.T) {
	m, clk := newMemory(t, 0)
	for i := range 100 {
		complete(t, m, fmt.Sprintf("k%d", i), []byte("body"))
	}
	require.Equal(t, 100, m.Len())
	clk.Advance(testClaim.TTL)
	_ = held(t, m, "other")
	require.Equal(t, 0, m.Len())
	require.Equal(t, int64(0), m.Bytes())
}

func TestMemoryReturnedRecordIsACopy(t *testing.T) {
	m, _ := newMemory(t, 0)
	complete(t, m, "k", []byte("original"))
	rec := held(t, m, "k")
	copy(rec.Response.Body, "XXXXXXXX")
	require.Equal(t, []byte("original"), held(t, m, "k").Response.Body)
}

func TestMemoryClosed(t *testing.T) {
	m, _ := newMemory(t, 0)
	require.NoError(t, m.Close())
	_, _, err := m.Acquire(t.Context(), "k", testClaim)
	require.ErrorIs(t, err, cache.ErrClosed)
	require.ErrorIs(t, m.Ping(t.Context()), cache.ErrClosed)
}

func TestNewMemoryRejectsNegativeBound(t *testing.T) {
	_, err := cache.NewMemory(cache.MemoryOptions{MaxBytes: -1})
	require.Error(t, err)
}

// TestMemoryMillionKeys runs a million distinct keys through a small memory store: it stays
// within its byte bound all along, by its own accounting and on the Go heap.
func TestMemoryMillionKeys(t *testing.T) {
	const maxBytes = 4 << 20
	m, _ := newMemory(t, maxBytes)
	body := make([]byte, 200)
	var before runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for i := range 1_000_000 {
		complete(t, m, "idempotency:"+strconv.Itoa(i), body)
		if i%100_000 == 0 && m.Bytes() > maxBytes {
			t.Fatalf("%d bytes held after %d keys, above the %d bound", m.Bytes(), i, maxBytes)
		}
	}
	require.LessOrEqual(t, m.Bytes(), int64(maxBytes))
	var after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&after)
	grown := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("%d records held, %d bytes accounted, heap grew %d bytes", m.Len(), m.Bytes(), grown)
	require.Less(t, grown, int64(2*maxBytes), "the heap holds what the bound allows, not a million records")
	runtime.KeepAlive(m)
}
