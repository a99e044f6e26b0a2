package main

import (
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestGCPercent(t *testing.T) {
	for _, tc := range []struct {
		name           string
		base, headroom uint64
		want           int
	}{
		{"a small heap grows by the headroom", 16 << 20, 64 << 20, 400},
		{"a base of 256 MiB (10,000 streams' stacks) is GOGC=100", 256 << 20, 64 << 20, 100},
		{"a heap as large as the headroom is GOGC=100", 64 << 20, 64 << 20, 100},
		{"a larger heap is GOGC=100, never less", 1 << 30, 64 << 20, 100},
		{"an empty heap counts as the runtime's minimum", 0, 64 << 20, 1600},
		{"a few bytes count as the runtime's minimum", 3, 64 << 20, 1600},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, gcPercent(tc.base, tc.headroom))
		})
	}
}

// currentGCPercent reads GOGC's setting without writing it (debug.SetGCPercent would, racing the
// tuner's own write after a collection).
func currentGCPercent() int {
	s := []metrics.Sample{{Name: "/gc/gogc:percent"}}
	metrics.Read(s)
	return int(s[0].Value.Uint64())
}

// TestGCTuner sets GOGC after each collection from the live heap, and stop restores the
// setting it found.
func TestGCTuner(t *testing.T) {
	before := debug.SetGCPercent(123)
	t.Cleanup(func() { debug.SetGCPercent(before) })
	// A live heap of at least 8 MiB: with 1 GiB of headroom, GOGC is far above 100 but at most
	// 12,800.
	live := make([]*[1 << 20]byte, 8)
	for i := range live {
		live[i] = new([1 << 20]byte)
	}
	stop := startGCTuner(1<<30, func(string) string { return "" })
	// The cleanup that tunes runs on its own goroutine after a collection: collect until it has.
	require.Eventually(t, func() bool {
		runtime.GC()
		p := currentGCPercent()
		return p > 100 && p <= 12800
	}, 10*time.Second, 10*time.Millisecond)
	runtime.KeepAlive(live)
	stop()
	require.Equal(t, 123, currentGCPercent())
	runtime.GC()
	runtime.GC()
	require.Equal(t, 123, currentGCPercent(), "a stopped tuner sets nothing")
}

// TestGCTunerLeavesGOGC: an operator's GOGC wins.
func TestGCTunerLeavesGOGC(t *testing.T) {
	before := debug.SetGCPercent(150)
	t.Cleanup(func() { debug.SetGCPercent(before) })
	stop := startGCTuner(1<<30, func(k string) string {
		if k == "GOGC" {
			return "150"
		}
		return ""
	})
	runtime.GC()
	runtime.GC()
	require.Equal(t, 150, currentGCPercent())
	stop()
	require.Equal(t, 150, currentGCPercent())
}

// TestGCTunerShared: servers running at once share one tuner, and the setting before the first
// is restored when the last stops.
func TestGCTunerShared(t *testing.T) {
	before := debug.SetGCPercent(117)
	t.Cleanup(func() { debug.SetGCPercent(before) })
	none := func(string) string { return "" }
	stopA := startGCTuner(1<<30, none)
	stopB := startGCTuner(1<<30, none)
	stopA()
	stopA()
	runtime.GC()
	require.Eventually(t, func() bool { runtime.GC(); return currentGCPercent() > 100 }, 10*time.Second, 10*time.Millisecond,
		"the tuner still runs while a server uses it")
	stopB()
	require.Equal(t, 117, currentGCPercent())
}

// TestGCBaseSample: every metric the tuner reads exists in this Go's runtime/metrics: one that
// did not would read as KindBad and count for nothing.
func TestGCBaseSample(t *testing.T) {
	s := gcBaseSample()
	metrics.Read(s)
	for _, m := range s {
		require.Equal(t, metrics.KindUint64, m.Value.Kind(), m.Name)
	}
}

// tunerPercent reads GOGC's setting and what the running tuner last set, under the tuner's lock
// so that no cycle sets GOGC between the two reads.
func tunerPercent(t *testing.T) (set, recorded int) {
	t.Helper()
	tuning.Lock()
	tu := tuning.tuner
	tuning.Unlock()
	require.NotNil(t, tu, "the tuner runs")
	tu.mu.Lock()
	defer tu.mu.Unlock()
	return currentGCPercent(), tu.percent
}

// TestGCTunerFollowsTheHeap: every collection re-arms the tuner, so GOGC follows a live heap
// that grows collection after collection, not only at the first one; stop restores the setting
// it found, and later collections change nothing.
func TestGCTunerFollowsTheHeap(t *testing.T) {
	before := debug.SetGCPercent(123)
	t.Cleanup(func() { debug.SetGCPercent(before) })
	// With 1 GiB of headroom, a live heap of 8 to 40 MiB asks for GOGC between 12,800 and some
	// 2,500: each 4 MiB step lowers it by at least 8%, far more than the rest of the test
	// binary's heap moves between collections.
	const step = 4 << 20
	live := []*[step]byte{new([step]byte), new([step]byte)}
	stop := startGCTuner(1<<30, func(string) string { return "" })
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			stop()
		}
	})
	var seen []int
	for range 8 {
		live = append(live, new([step]byte))
		last := 0
		if len(seen) > 0 {
			last = seen[len(seen)-1]
		}
		// The cleanup that tunes runs on its own goroutine after a collection: collect until the
		// tuner has set a new value for the grown heap.
		var set, recorded int
		require.Eventually(t, func() bool {
			runtime.GC()
			set, recorded = tunerPercent(t)
			return recorded != last && recorded != 100
		}, 10*time.Second, 10*time.Millisecond, "no cycle after GOGC=%d (seen %v)", last, seen)
		require.Equal(t, recorded, set, "GOGC is what the tuner recorded")
		require.Greater(t, set, 100)
		seen = append(seen, set)
	}
	runtime.KeepAlive(live)
	require.Len(t, seen, 8, "GOGC changed at each of 8 heap sizes: %v", seen)
	require.Less(t, seen[7], seen[0], "GOGC falls as the live heap grows: %v", seen)

	stop()
	stopped = true
	require.Equal(t, 123, currentGCPercent(), "stop restores GOGC")
	// live is dead by now, so the heap shrinks: a running tuner would raise GOGC.
	for range 20 {
		runtime.GC()
		require.Equal(t, 123, currentGCPercent(), "a stopped tuner sets nothing")
	}
}
