package main

import (
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync"
)

// gcHeadroom is how far the server lets its Go heap grow beyond its live data before it
// collects, at the least. The server's live heap is small (the memory store keeps its records
// outside the Go heap), so with GOGC's default of 100 the collector runs often, and each cycle
// also shrinks the idle stream workers' stacks, which the next streams grow again: what that
// cost per request, and the command that measures it, is in docs/performance.md (the
// collector's pace at GOGC=100, in the reconciliation of the user bench). 64 MiB of
// headroom makes the cycles several times rarer for that much more heap at most; once the live
// heap exceeds 64 MiB, the collector runs as with GOGC=100.
const gcHeadroom = 64 << 20

// gcMinBase is the least base gcPercent assumes: the Go runtime's minimum heap target at
// GOGC=100 (heapminimum in runtime/mgcpacer.go), which it scales by GOGC/100. Without it, a
// live heap of a few bytes (before the first collection) would ask for a GOGC so large that its
// scaled minimum never triggers a collection.
const gcMinBase = 4 << 20

// gcPercent is the GOGC that lets the heap grow by headroom, and by no less than GOGC's default
// of 100%, before the next collection. base is what the runtime scales GOGC by: the live heap,
// the goroutines' stacks and the globals it scanned (the heap goal is the live heap plus base
// times GOGC/100, runtime/mgcpacer.go); counting the stacks keeps 10,000 streams' stacks from
// multiplying the headroom.
func gcPercent(base, headroom uint64) int {
	p := headroom * 100 / max(base, gcMinBase)
	if p < 100 {
		return 100
	}
	return int(p)
}

// gcSentinel is garbage whose cleanup marks the end of a collection cycle. It is larger than
// the runtime's tiny allocations, whose cleanups may never run.
type gcSentinel struct{ _ [64]byte }

// gcTuner sets GOGC after each collection to let the heap grow by at least its headroom (see
// gcHeadroom). It runs only where GOGC is not set in the environment: an operator's setting
// wins.
type gcTuner struct {
	headroom uint64
	mu       sync.Mutex // serialises the cycles' reads and settings with stop
	stopped  bool       // guarded by mu
	sample   []metrics.Sample
	percent  int // what the tuner last set
	restore  int // GOGC before the tuner started
}

// tuning is the process' one tuner, shared by the servers that run at once (tests run several).
var tuning struct {
	sync.Mutex
	users int
	tuner *gcTuner
}

// startGCTuner starts tuning GOGC with headroom, and returns what stops it and restores GOGC's
// setting once no other server uses it; it does nothing and returns a no-op when getenv has
// GOGC.
func startGCTuner(headroom uint64, getenv func(string) string) (stop func()) {
	if getenv("GOGC") != "" {
		return func() {}
	}
	tuning.Lock()
	defer tuning.Unlock()
	if tuning.users == 0 {
		t := &gcTuner{headroom: headroom, sample: gcBaseSample()}
		t.restore = debug.SetGCPercent(100)
		t.percent = 100
		t.cycle()
		tuning.tuner = t
	}
	tuning.users++
	var once sync.Once
	return func() {
		once.Do(func() {
			tuning.Lock()
			defer tuning.Unlock()
			if tuning.users--; tuning.users == 0 {
				tuning.tuner.stop()
				tuning.tuner = nil
			}
		})
	}
}

// gcBaseSample reads what the runtime scales GOGC by (gcPercent).
func gcBaseSample() []metrics.Sample {
	return []metrics.Sample{{Name: "/gc/heap/live:bytes"}, {Name: "/gc/scan/stack:bytes"}, {Name: "/gc/scan/globals:bytes"}}
}

// cycle sets GOGC from what the last collection marked and scanned, then waits for the next one.
func (t *gcTuner) cycle() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stopped {
		return
	}
	metrics.Read(t.sample)
	var base uint64
	for _, s := range t.sample {
		if s.Value.Kind() == metrics.KindUint64 {
			base += s.Value.Uint64()
		}
	}
	if p := gcPercent(base, t.headroom); p != t.percent {
		debug.SetGCPercent(p)
		t.percent = p
	}
	runtime.AddCleanup(new(gcSentinel), func(t *gcTuner) { t.cycle() }, t)
}

func (t *gcTuner) stop() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.stopped {
		t.stopped = true
		debug.SetGCPercent(t.restore)
	}
}
