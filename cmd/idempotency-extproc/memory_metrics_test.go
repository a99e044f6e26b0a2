package main

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
)

// The memory store's gauges follow the store they were made for: its accounted bytes and records,
// and the segments its records' bytes are in.
func TestMemoryMetricsFollowTheStore(t *testing.T) {
	m, err := cache.NewMemory(cache.MemoryOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(memoryMetrics(m)...)
	gauge := func(name string) float64 {
		t.Helper()
		mfs, err := reg.Gather()
		require.NoError(t, err)
		for _, mf := range mfs {
			if mf.GetName() == name {
				require.Len(t, mf.GetMetric(), 1)
				if g := mf.GetMetric()[0].GetGauge(); g != nil {
					return g.GetValue()
				}
				return mf.GetMetric()[0].GetCounter().GetValue()
			}
		}
		t.Fatalf("%s not gathered", name)
		return 0
	}
	require.Zero(t, gauge("idempotency_memory_bytes"))
	require.Zero(t, gauge("idempotency_memory_records"))
	claim := cache.Claim{LockTTL: time.Minute, TTL: time.Hour}
	for _, key := range []string{"a", "b"} {
		l, _, err := m.Acquire(t.Context(), key, claim)
		require.NoError(t, err)
		require.NoError(t, m.Complete(t.Context(), l, cache.Response{Status: 200, Body: make([]byte, 1000)}))
	}
	_, _, err = m.Acquire(t.Context(), "pending", claim)
	require.NoError(t, err)
	st := m.Stats()
	require.Equal(t, 3, st.Records)
	require.Equal(t, float64(3), gauge("idempotency_memory_records"))
	require.Equal(t, float64(st.Bytes), gauge("idempotency_memory_bytes"))
	require.Greater(t, gauge("idempotency_memory_bytes"), float64(2000))
	require.Equal(t, float64(st.Arena.MappedBytes), gauge("idempotency_memory_mapped_bytes"))
	require.True(t, st.Arena.MappedBytes > 0 || gauge("idempotency_memory_heap_segments_total") > 0, "the records' segment is counted")
	require.Zero(t, gauge("idempotency_memory_unmap_failures_total"))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	require.Len(t, mfs, 5)
}
