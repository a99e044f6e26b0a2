package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
)

type options struct {
	duration  time.Duration
	rounds    int // the duration is split in rounds that alternate the targets
	streams   int
	redisAddr string // "" skips the Redis target
	// memoryBytes bounds the memory stores (default: the binary's default).
	memoryBytes int64
	// load, when positive, adds a run of each workload at a fixed request rate: this fraction of
	// the slowest target's throughput in the saturated run, the same rate for every target.
	load float64
	// only, when set, runs just the workloads and targets it names.
	only map[string]bool
	// -mode costs: the body sizes (default 1 KiB, 64 KiB, 1 MiB) and stream counts (default
	// streams, 256, 1,024) it measures, and Redis' bound (its maxmemory, to which each section
	// fills it), which is also the bytes redis-benchmark's SETs write per size.
	sizes, streamCounts []int
	redisBytes          int64
	// replicatedAddr is a Redis master with one replica, for -mode costs' durability section;
	// "" skips it.
	replicatedAddr string
}

// memoryBound is the memory stores' bound for the option's value.
func memoryBound(b int64) int64 {
	if b == 0 {
		return cache.DefaultMemoryMaxBytes
	}
	return b
}

// runs tells whether the workload or target name, one of all, runs: -only may name workloads,
// targets or both, and a kind of which it names none runs whole (so "-only redis store" runs
// every workload against the Redis store and the null processor).
func (o options) runs(name string, all []string) bool {
	if o.only[name] {
		return true
	}
	for _, n := range all {
		if o.only[n] {
			return false
		}
	}
	return true
}

// Workloads, in the order they are printed.
const (
	workloadUncovered = "uncovered GET"
	workloadFirst     = "first execution"
	workloadReplay    = "replay"
	// The other body modes' first executions, each against a null processor that does
	// what the mode requires: a STREAMED request body of 4 chunks of 256 B (the response
	// BUFFERED), FULL_DUPLEX_STREAMED both ways with 4 chunks of 256 B each way, and BUFFERED on
	// a route whose fingerprint omits the body, claimed at request_headers. No name holds a
	// comma, so that -only can name it.
	workloadStreamed = "STREAMED first execution"
	workloadDuplex   = "FULL_DUPLEX_STREAMED first execution"
	workloadHeaders  = "claim-at-headers first execution"
)

var workloads = []string{workloadUncovered, workloadFirst, workloadReplay, workloadStreamed, workloadDuplex, workloadHeaders}

// headersOnlyPath is the claim-at-headers workload's path, under benchPolicy's route
// headers-only, whose fingerprint is [method, path].
const headersOnlyPath = "/v1/headers-only/payments"

// Targets.
const (
	targetNull        = "null processor"
	targetMemory      = "memory store"         // filled to its bound before the run: a replica's steady state
	targetMemoryEmpty = "memory store (empty)" // empty at the start, as after a restart
	targetRedis       = "redis store"
)

// cell is the result of one workload against one target, saturated or at a fixed rate.
type cell struct {
	workload, target string
	rate             float64 // offered requests/s at a fixed rate; 0 when saturated
	requests         int
	elapsed          time.Duration
	p50, p99         time.Duration
	latency          time.Duration   // the sum of every request's latency, for the mean
	roundP99         []time.Duration // each round's p99, for the paired comparison
	storeCalls       float64         // store operations per request
	acquires         float64         // store acquires (claims) per request
	slowCalls        int64           // store operations that took over slowCall
	redisCommands    float64         // commands sent to Redis per request
	redisTrips       float64         // round trips to Redis per request (pipelined calls share one)
	redisWaits       float64         // WAITs for replicas per request (durable round trips)
	unconfirmed      int64           // claims and completions the replicas did not confirm in time
	replicaCPU       time.Duration   // the Redis replica's CPU time, where the section has one
	logLines         float64         // lines the processor logged per request
	failures         int64           // requests settled otherwise than a clean run does (counters.Failures)
	leasesLost       int64           // of the failures, leases found gone (counters.LeasesLost)
	evicted          int64           // keys Redis evicted during the cell's rounds
	roundRPS         []float64       // each round's requests/s, for the paired ratios
	cpu              time.Duration   // the target process' CPU time
	clientCPU        time.Duration   // the benchmark's CPU time: the client, as Envoy's share
	redisCPU         time.Duration   // redis-server's CPU time
	memoryBytes      int64           // what a memory store held before the cell's first round
	peakRSS          int64           // the target process' peak resident memory by the cell's end
	roundCPU         []float64       // each round's processor CPU µs per request, for the paired differences
	roundClientCPU   []float64       // each round's client CPU µs per request
	waitCalls        float64         // store calls per request made by waiting duplicates beyond their first
	spans            int64           // spans the target ended, each exported to the benchmark's OTLP receiver
	records          int             // what a memory store held before the cell's first round
	sealOverhead     int64           // the bytes a record takes in the target's store beyond an unsealed one
	idle, held       memUsage        // the target's memory with no stream open and with the streams parked in flight (-mode costs)
}

func (c cell) rps() float64 { return float64(c.requests) / c.elapsed.Seconds() }

func (c cell) mean() time.Duration { return c.latency / time.Duration(c.requests) }

// hasStore and hasRedis tell which counters mean something for c's target.
func (c cell) hasStore() bool { return c.target != targetNull }
func (c cell) hasRedis() bool {
	switch c.target {
	case targetRedis, targetRedisUnbatched, targetRedisPlain, targetRedisReplicated, targetRedisDurable:
		return true
	}
	return false
}

type result struct {
	opts         options
	cells        []cell // saturated
	paced        []cell // at a fixed rate
	alone        []aloneCell
	redisBenchRP float64 // redis-benchmark requests/s, 0 when not measured
}

func (r result) find(workload, target string) (cell, bool) {
	return findCell(r.cells, workload, target)
}

func (r result) findPaced(workload, target string) (cell, bool) {
	return findCell(r.paced, workload, target)
}

func findCell(cells []cell, workload, target string) (cell, bool) {
	for _, c := range cells {
		if c.workload == workload && c.target == target {
			return c, true
		}
	}
	return cell{}, false
}

func (r result) print(w io.Writer) {
	fmt.Fprintf(w, "%d concurrent streams, %v per cell in %d alternating rounds; each target in a process of its own, GOMAXPROCS %d.\n", r.opts.streams, r.opts.duration, r.opts.rounds, gomaxprocs())
	fmt.Fprintf(w, "p50 and p99 are over all rounds; p99 added is the median over rounds of the target's p99 minus the null processor's in the same round (in brackets: the range); processor CPU over null is, likewise, the median over rounds of the target process' CPU µs per request minus the null processor's.\n\n")
	fmt.Fprintf(w, "| workload | target | requests/s | p50 | p99 | × null | p99 added | store calls/req | store calls over 1 ms | Redis commands/req | Redis round trips/req | processor CPU µs/req | processor CPU over null µs/req | client CPU µs/req | Redis CPU µs/req | processor peak RSS so far |\n")
	fmt.Fprintf(w, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
	for _, c := range r.cells {
		null, _ := r.find(c.workload, targetNull)
		ratio, added, cpuOver := "1.00", "—", "—"
		if c.target != targetNull {
			ratio = fmtRatio(c, null)
			added = fmtAdded(c.roundP99, null.roundP99)
			cpuOver = fmtDiff(c.roundCPU, null.roundCPU)
		}
		store, slow, cmds, trips := "—", "—", "—", "—"
		if c.hasStore() {
			store, slow = fmt.Sprintf("%.2f", c.storeCalls), strconv.FormatInt(c.slowCalls, 10)
		}
		if c.hasRedis() {
			cmds = fmt.Sprintf("%.2f", c.redisCommands)
			trips = fmt.Sprintf("%.2f", c.redisTrips)
		}
		redisCPU := "—"
		if c.hasRedis() {
			redisCPU = fmt.Sprintf("%.1f", perRequest(c.redisCPU, c.requests))
		}
		fmt.Fprintf(w, "| %s | %s | %.0f | %s | %s | %s | %s | %s | %s | %s | %s | %.1f | %s | %.1f | %s | %d MiB |\n",
			c.workload, c.target, c.rps(), fmtDur(c.p50), fmtDur(c.p99), ratio, added, store, slow, cmds, trips,
			perRequest(c.cpu, c.requests), cpuOver, perRequest(c.clientCPU, c.requests), redisCPU, c.peakRSS>>20)
	}
	r.printSaturation(w)
	if len(r.paced) > 0 {
		fmt.Fprintf(w, "\nAt a fixed rate: %.0f%% of the slowest target's requests/s above, the same for every target, on %d streams; latency counts from each request's scheduled start\n\n", r.opts.load*100, r.opts.streams)
		fmt.Fprintf(w, "| workload | target | offered requests/s | achieved | p50 | p99 | p99 added | store calls over 1 ms |\n")
		fmt.Fprintf(w, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n")
		for _, c := range r.paced {
			added, slow := "—", "—"
			if null, ok := r.findPaced(c.workload, targetNull); ok && c.target != targetNull {
				added = fmtAdded(c.roundP99, null.roundP99)
			}
			if c.hasStore() {
				slow = strconv.FormatInt(c.slowCalls, 10)
			}
			fmt.Fprintf(w, "| %s | %s | %.0f | %.0f | %s | %s | %s | %s |\n", c.workload, c.target, c.rate,
				c.rps(), fmtDur(c.p50), fmtDur(c.p99), added, slow)
		}
	}
	r.printAlone(w)
	if r.redisBenchRP > 0 {
		fmt.Fprintf(w, "\nredis-benchmark, one round trip (HSET) at %d connections: %.0f requests/s — the ceiling of one Redis for a replay (1 round trip); a first execution needs 2.\n", r.opts.streams, r.redisBenchRP)
	}
	r.printFailures(w)
}

// printFailures says whether every request was settled as a clean run settles it: a failed
// store call is still a request timed, so its numbers would not be those of the path measured.
func (r result) printFailures(w io.Writer) {
	var failed []string
	for _, c := range append(slices.Clone(r.cells), r.paced...) {
		if c.failures > 0 {
			failed = append(failed, fmt.Sprintf("%s, %s%s: %d", c.workload, c.target, pacedSuffix(c), c.failures))
		}
	}
	if len(failed) == 0 {
		fmt.Fprintf(w, "\nEvery request of every cell was settled as a clean run settles it: no store_error outcome, no lease released.\n")
		return
	}
	fmt.Fprintf(w, "\nRequests settled otherwise than a clean run (store_error outcomes and released leases), whose cells measure something else: %s.\n", strings.Join(failed, "; "))
}

func pacedSuffix(c cell) string {
	if c.rate > 0 {
		return " at a fixed rate"
	}
	return ""
}

// latencyBudget is the p99 latency a target may add to the null processor's (issue 6); the
// saturation table asks at which throughput the mean alone would add that much.
const latencyBudget = time.Millisecond

// printSaturation shows what the saturated cells' latency owes to their throughput alone. A
// saturated stream always has one request in flight, so a cell's mean latency is at most
// streams ÷ requests/s, and about that (Little's law): a target that serves r times the null
// processor's requests/s adds about (1/r − 1) times the null processor's mean latency to the
// mean, whatever its code does, and it adds under latencyBudget only from ratioFor on.
func (r result) printSaturation(w io.Writer) {
	fmt.Fprintf(w, "\nSaturated, every stream always has a request in flight, so the mean latency is streams ÷ requests/s (Little's law): a target slower than the null processor adds that difference to the mean, whatever its code does. It adds under %s to the mean only from the ratio to the null processor given in the null processor's row.\n\n", fmtDur(latencyBudget))
	fmt.Fprintf(w, "| workload | target | × null | mean | streams ÷ requests/s | mean added | ratio for %s added |\n", fmtDur(latencyBudget))
	fmt.Fprintf(w, "| --- | --- | ---: | ---: | ---: | ---: | ---: |\n")
	for _, c := range r.cells {
		null, _ := r.find(c.workload, targetNull)
		ratio, added, needed := "1.00", "—", "—"
		if c.target == targetNull {
			needed = fmt.Sprintf("%.2f", ratioFor(r.opts.streams, null.rps(), latencyBudget))
		} else {
			ratio = fmt.Sprintf("%.2f", c.rps()/null.rps())
			added = fmtDur(c.mean() - null.mean())
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s |\n", c.workload, c.target, ratio, fmtDur(c.mean()),
			fmtDur(littleMean(r.opts.streams, c.rps())), added, needed)
	}
}

// littleMean is the mean latency of streams saturated streams serving rps requests/s in all.
func littleMean(streams int, rps float64) time.Duration {
	return time.Duration(float64(streams) / rps * float64(time.Second))
}

// ratioFor is the fraction of the null processor's nullRPS at which a saturated target's mean
// latency is budget above the null processor's: nullMean/r − nullMean = budget.
func ratioFor(streams int, nullRPS float64, budget time.Duration) float64 {
	nullMean := float64(streams) / nullRPS
	return nullMean / (nullMean + budget.Seconds())
}

func gomaxprocs() int { return runtime.GOMAXPROCS(0) }

func perRequest(d time.Duration, n int) float64 { return float64(d.Microseconds()) / float64(n) }

// processCPU is the CPU time this process has used.
func processCPU() time.Duration {
	cpu, _ := processUsage()
	return cpu
}

// processUsage is the CPU time this process has used and the most memory it has held resident,
// in bytes.
func processUsage() (time.Duration, int64) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, 0
	}
	cpu := time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	if rss, ok := ownPeakRSS(); ok {
		return cpu, rss
	}
	rss := int64(ru.Maxrss)
	if runtime.GOOS != "darwin" { // darwin counts bytes, Linux and the BSDs KiB
		rss <<= 10
	}
	return cpu, rss
}

// ownPeakRSS is Linux's VmHWM: the peak of this process's own memory. getrusage's maxrss is not:
// a process the Go runtime starts shares its parent's memory until it execs, and Linux counts
// the parent's peak into the child's at exec, so a processor started by a larger bench would
// read the bench's peak.
func ownPeakRSS() (int64, bool) {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0, false
	}
	_, rest, ok := bytes.Cut(b, []byte("\nVmHWM:"))
	if !ok {
		return 0, false
	}
	line, _, _ := bytes.Cut(rest, []byte("\n"))
	kb, err := strconv.ParseInt(string(bytes.TrimSpace(bytes.TrimSuffix(bytes.TrimSpace(line), []byte("kB")))), 10, 64)
	if err != nil {
		return 0, false
	}
	return kb << 10, true
}

var redisCPURE = regexp.MustCompile(`used_cpu_(?:user|sys):([0-9.]+)`)

// redisServerCPU is the CPU time redis-server reports having used.
func redisServerCPU(ctx context.Context, c *redis.Client) time.Duration {
	info, err := c.Info(ctx, "cpu").Result()
	if err != nil {
		return 0
	}
	var total float64
	for _, m := range redisCPURE.FindAllStringSubmatch(info, -1) {
		v, _ := strconv.ParseFloat(m[1], 64)
		total += v
	}
	return time.Duration(total * float64(time.Second))
}

// redisEvicted is the keys Redis has evicted since it started (INFO stats' evicted_keys).
func redisEvicted(ctx context.Context, c *redis.Client) (int64, error) {
	return strconv.ParseInt(c.InfoMap(ctx, "stats").Item("Stats", "evicted_keys"), 10, 64)
}

func fmtDur(d time.Duration) string {
	return fmt.Sprintf("%.2fms", float64(d)/float64(time.Millisecond))
}

// compare runs every workload against every target, each target in a process of its own.
func compare(ctx context.Context, o options) (result, error) {
	res := result{opts: o}
	names := []string{targetNull, targetMemory, targetMemoryEmpty}
	if o.redisAddr != "" {
		names = append(names, targetRedis)
	}
	var targets []*targetProcess
	defer func() {
		for _, t := range targets {
			t.stop()
		}
	}()
	for _, name := range names {
		if name != targetNull && !o.runs(name, names) {
			continue
		}
		t, err := startTarget(name, o.redisAddr, o.memoryBytes)
		if err != nil {
			return res, err
		}
		targets = append(targets, t)
	}
	var admin *redis.Client // for redis-server's CPU time
	if o.redisAddr != "" {
		admin = redis.NewClient(&redis.Options{Addr: o.redisAddr})
		defer admin.Close()
	}

	for _, w := range workloads {
		if !o.runs(w, workloads) {
			continue
		}
		clients := make([]extprocv3.ExternalProcessorClient, len(targets))
		for i, t := range targets {
			conn, err := grpc.NewClient("passthrough:///"+t.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				return res, err
			}
			defer conn.Close()
			clients[i] = extprocv3.NewExternalProcessorClient(conn)
			if w == workloadReplay {
				// The first request with the replayed key runs; every later one replays.
				if err := request(ctx, clients[i], w, 0); err != nil {
					return res, fmt.Errorf("%s, %s: %w", w, t.name, err)
				}
			}
			// Warm up: connections, Redis' script cache.
			if _, err := drive(ctx, clients[i], w, o.streams, o.duration/10); err != nil {
				return res, fmt.Errorf("%s, %s: %w", w, t.name, err)
			}
		}
		each := o.duration / time.Duration(o.rounds)
		cells, err := rounds(ctx, o.rounds, w, targets, admin, func(i int) (cell, []time.Duration, error) {
			return driveLatencies(ctx, clients[i], w, o.streams, each)
		})
		if err != nil {
			return res, err
		}
		res.cells = append(res.cells, cells...)
		if o.load <= 0 {
			continue
		}
		slowest := math.Inf(1)
		for _, c := range cells {
			slowest = min(slowest, c.rps())
		}
		rate := o.load * slowest
		cells, err = rounds(ctx, o.rounds, w, targets, admin, func(i int) (cell, []time.Duration, error) {
			return drivePaced(ctx, clients[i], w, o.streams, rate, each)
		})
		if err != nil {
			return res, fmt.Errorf("at %.0f/s: %w", rate, err)
		}
		for i := range cells {
			cells[i].rate = rate
		}
		res.paced = append(res.paced, cells...)
		if o.redisAddr != "" && o.runs(targetRedis, names) && roundTrips[w] > 0 {
			null := slices.IndexFunc(targets, func(t *targetProcess) bool { return t.name == targetNull })
			a, err := redisAlone(ctx, o.redisAddr, clients[null], w, o.streams, rate, o.rounds, each)
			if err != nil {
				return res, fmt.Errorf("%s, Redis round trips alone: %w", w, err)
			}
			res.alone = append(res.alone, a)
		}
	}
	if o.redisAddr != "" {
		res.redisBenchRP = redisBenchmark(o.redisAddr, o.streams)
	}
	return res, nil
}

// rounds runs workload w against every target n times with run, alternating the targets so
// that a drift of the machine's speed affects all alike, and returns a cell per target with
// what it counted: requests, latencies, store calls, Redis commands and round trips, and the
// CPU time of the target, the client and redis-server (admin, when there is one).
func rounds(ctx context.Context, n int, w string, targets []*targetProcess, admin *redis.Client, run func(i int) (cell, []time.Duration, error)) ([]cell, error) {
	cells := make([]cell, len(targets))
	lats := make([][]time.Duration, len(targets))
	for i, t := range targets {
		cells[i].workload, cells[i].target = w, t.name
	}
	order := make([]int, len(targets))
	for round := range n {
		// Every other round runs the targets in the reverse order, so that none always follows
		// the same one (and inherits what it left behind: a collection, a busy redis-server).
		for k := range order {
			order[k] = k
			if round%2 == 1 {
				order[k] = len(order) - 1 - k
			}
		}
		for _, i := range order {
			t := targets[i]
			c := &cells[i]
			before, err := t.counters(ctx)
			if err != nil {
				return nil, fmt.Errorf("%s, %s: %w", w, t.name, err)
			}
			if c.requests == 0 {
				c.memoryBytes, c.records, c.sealOverhead = before.MemoryBytes, before.Records, before.SealOverhead
			}
			var redis0 time.Duration
			var evicted0 int64
			if c.hasRedis() {
				// INFO stats first: its own CPU is then outside the cell's Redis CPU.
				if evicted0, err = redisEvicted(ctx, admin); err != nil {
					return nil, fmt.Errorf("%s, %s: redis INFO stats: %w", w, t.name, err)
				}
				redis0 = redisServerCPU(ctx, admin)
			}
			cpu0 := processCPU()
			got, lat, err := run(i)
			if err != nil {
				return nil, fmt.Errorf("%s, %s: %w", w, t.name, err)
			}
			c.clientCPU += processCPU() - cpu0
			after, err := t.counters(ctx)
			if err != nil {
				return nil, fmt.Errorf("%s, %s: %w", w, t.name, err)
			}
			c.cpu += after.CPU - before.CPU
			c.roundCPU = append(c.roundCPU, perRequest(after.CPU-before.CPU, got.requests))
			c.roundClientCPU = append(c.roundClientCPU, perRequest(processCPU()-cpu0, got.requests))
			c.spans += after.Spans - before.Spans
			c.waitCalls += float64(after.WaitCalls - before.WaitCalls)
			c.peakRSS = after.PeakRSS
			if c.hasRedis() {
				c.redisCPU += redisServerCPU(ctx, admin) - redis0
				evicted, err := redisEvicted(ctx, admin)
				if err != nil {
					return nil, fmt.Errorf("%s, %s: redis INFO stats: %w", w, t.name, err)
				}
				c.evicted += evicted - evicted0
			}
			c.requests += got.requests
			c.elapsed += got.elapsed
			c.roundRPS = append(c.roundRPS, got.rps())
			lats[i] = append(lats[i], lat...)
			for _, l := range lat {
				c.latency += l
			}
			_, p99 := percentiles(lat)
			c.roundP99 = append(c.roundP99, p99)
			c.storeCalls += float64(after.Calls - before.Calls)
			c.acquires += float64(after.Acquires - before.Acquires)
			c.slowCalls += after.SlowCalls - before.SlowCalls
			c.redisCommands += float64(after.Commands - before.Commands)
			c.redisTrips += float64(after.Trips - before.Trips)
			c.redisWaits += float64(after.Waits - before.Waits)
			c.unconfirmed += after.Unconfirmed - before.Unconfirmed
			c.logLines += float64(after.LogLines - before.LogLines)
			c.failures += after.Failures - before.Failures
			c.leasesLost += after.LeasesLost - before.LeasesLost
		}
	}
	for i := range cells {
		c := &cells[i]
		c.storeCalls /= float64(c.requests)
		c.acquires /= float64(c.requests)
		c.waitCalls /= float64(c.requests)
		c.redisCommands /= float64(c.requests)
		c.redisTrips /= float64(c.requests)
		c.redisWaits /= float64(c.requests)
		c.logLines /= float64(c.requests)
		c.p50, c.p99 = percentiles(lats[i])
	}
	return cells, nil
}

// seq numbers requests across runs, so that first executions always use fresh keys.
var seq atomic.Int64

// drive runs one workload on streams concurrent streams for d.
func drive(ctx context.Context, client extprocv3.ExternalProcessorClient, workload string, streams int, d time.Duration) (cell, error) {
	c, _, err := driveLatencies(ctx, client, workload, streams, d)
	return c, err
}

// driveLatencies is drive that also returns every request's latency. Each stream sends one
// request at least, however late its goroutine runs: on a busy machine a short cell's deadline
// can pass before it does (driveShaped too).
func driveLatencies(ctx context.Context, client extprocv3.ExternalProcessorClient, workload string, streams int, d time.Duration) (cell, []time.Duration, error) {
	deadline := time.Now().Add(d)
	return runStreams(streams, func(int) ([]time.Duration, error) {
		var lat []time.Duration
		for first := true; first || time.Now().Before(deadline); first = false {
			t0 := time.Now()
			if err := request(ctx, client, workload, seq.Add(1)); err != nil {
				return nil, err
			}
			lat = append(lat, time.Since(t0))
		}
		return lat, nil
	})
}

// drivePaced runs one workload on streams concurrent streams for d at rate requests/s in all.
// A request's latency counts from its scheduled start, so that a slow answer also charges the
// requests it delayed (no coordinated omission).
func drivePaced(ctx context.Context, client extprocv3.ExternalProcessorClient, workload string, streams int, rate float64, d time.Duration) (cell, []time.Duration, error) {
	return paced(streams, rate, d, func(scheduled time.Time) (time.Duration, error) {
		err := request(ctx, client, workload, seq.Add(1))
		return time.Since(scheduled), err
	})
}

// paced runs req on streams goroutines for d at rate calls/s in all: each goroutine starts a
// call every streams/rate, or at once when the previous one ended late, and keeps the latency
// req returns, given the call's scheduled start.
func paced(streams int, rate float64, d time.Duration, req func(scheduled time.Time) (time.Duration, error)) (cell, []time.Duration, error) {
	interval := time.Duration(float64(streams) / rate * float64(time.Second))
	start := time.Now()
	end := start.Add(d)
	return runStreams(streams, func(i int) ([]time.Duration, error) {
		var lat []time.Duration
		next := start.Add(interval * time.Duration(i) / time.Duration(streams))
		for next.Before(end) {
			if wait := time.Until(next); wait > 0 {
				time.Sleep(wait)
			}
			l, err := req(next)
			if err != nil {
				return nil, err
			}
			lat = append(lat, l)
			next = next.Add(interval)
		}
		return lat, nil
	})
}

// runStreams runs stream on streams goroutines at once and gathers the latencies they return.
func runStreams(streams int, stream func(i int) ([]time.Duration, error)) (cell, []time.Duration, error) {
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		all      []time.Duration
		firstErr error
	)
	start := time.Now()
	for i := range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lat, err := stream(i)
			mu.Lock()
			defer mu.Unlock()
			firstErr = cmpErr(firstErr, err)
			all = append(all, lat...)
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	if firstErr != nil {
		return cell{}, nil, firstErr
	}
	if len(all) == 0 {
		return cell{}, nil, errors.New("no request completed")
	}
	return cell{requests: len(all), elapsed: elapsed}, all, nil
}

// addedP99 compares a target's p99 with the null processor's round by round (the two ran one
// after the other, on the same machine state) and returns the median of the differences and
// their range.
func addedP99(target, null []time.Duration) (median, lo, hi time.Duration) {
	d := make([]time.Duration, min(len(target), len(null)))
	for i := range d {
		d[i] = target[i] - null[i]
	}
	slices.Sort(d)
	return d[len(d)/2], d[0], d[len(d)-1]
}

func fmtAdded(target, null []time.Duration) string {
	median, lo, hi := addedP99(target, null)
	if lo == hi {
		return fmtDur(median)
	}
	return fmt.Sprintf("%s [%s, %s]", fmtDur(median), fmtDur(lo), fmtDur(hi))
}

// fmtRatio formats a target's requests/s over the null processor's, over the whole cell, with
// the range of the ratios of the rounds (each paired with the null processor's in that round):
// how far one round's throughput claim could stray.
func fmtRatio(target, null cell) string {
	overall := fmt.Sprintf("%.2f", target.rps()/null.rps())
	lo, hi := math.Inf(1), math.Inf(-1)
	for i := range min(len(target.roundRPS), len(null.roundRPS)) {
		r := target.roundRPS[i] / null.roundRPS[i]
		lo, hi = min(lo, r), max(hi, r)
	}
	if len(target.roundRPS) < 2 {
		return overall
	}
	return fmt.Sprintf("%s [%.2f, %.2f]", overall, lo, hi)
}

// percentiles sorts lat and returns its median and 99th percentile.
func percentiles(lat []time.Duration) (p50, p99 time.Duration) {
	slices.Sort(lat)
	return lat[len(lat)/2], lat[len(lat)*99/100]
}

func cmpErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

var (
	requestBody  = bytes.Repeat([]byte(`{"amount":100,"currency":"EUR"}`), 8) // 256 bytes
	responseBody = bytes.Repeat([]byte("r"), 1024)
	viaUpstream  = mustStruct(map[string]any{"response.code_details": "via_upstream"})
)

func mustStruct(m map[string]any) map[string]*structpb.Struct {
	s, err := structpb.NewStruct(m)
	if err != nil {
		panic(err)
	}
	return map[string]*structpb.Struct{"envoy.filters.http.ext_proc": s}
}

// shape is what a workload's requests carry and what their upstream does: the request and
// response bodies, and how long the upstream takes between the request's end and its response
// headers.
type shape struct {
	name      string // tells the shape's replayed key from another's
	req, resp []byte
	upstream  time.Duration
}

// defaultShape is the default mode's: a 256-byte request, a 1 KiB response, an upstream that
// answers at once.
var defaultShape = shape{req: requestBody, resp: responseBody}

// request plays one HTTP request's ext_proc exchange as Envoy does: lock-step messages,
// honouring mode_override and ImmediateResponse, then a half-close and a reset.
func request(ctx context.Context, client extprocv3.ExternalProcessorClient, workload string, n int64) error {
	switch workload {
	case workloadStreamed, workloadDuplex:
		return requestStreaming(ctx, client, workload == workloadDuplex, n)
	}
	return requestShaped(ctx, client, workload, n, defaultShape, "", nil)
}

// requestShaped is request with sh's bodies and upstream. key, when set, is the request's
// Idempotency-Key (otherwise the workload's); ran, when set, is called once the request is on
// its way upstream.
func requestShaped(ctx context.Context, client extprocv3.ExternalProcessorClient, workload string, n int64, sh shape, key string, ran func()) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s, err := client.Process(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = s.CloseSend() }()
	exchange := func(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, error) {
		if err := s.Send(m); err != nil {
			return nil, err
		}
		return s.Recv()
	}

	method, hasBody := "POST", true
	switch {
	case key != "":
	case workload == workloadUncovered:
		method, hasBody = "GET", false
	case workload == workloadReplay:
		key = "replayed-key" + sh.name
	default: // first executions
		key = "first-" + strconv.FormatInt(n, 10)
	}
	path := "/v1/payments"
	if workload == workloadHeaders {
		path = headersOnlyPath
	}
	resp, err := exchange(&extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: requestHeaderValues(method, path, key, n)}, EndOfStream: !hasBody,
		}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{
			RequestBodyMode: filterextproc.ProcessingMode_BUFFERED, ResponseBodyMode: filterextproc.ProcessingMode_BUFFERED,
		},
	})
	if err != nil {
		return err
	}
	if resp.GetImmediateResponse() != nil {
		return nil
	}
	mode := resp.GetModeOverride()
	if hasBody && (mode == nil || mode.GetRequestBodyMode() != filterextproc.ProcessingMode_NONE) {
		resp, err = exchange(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
			RequestBody: &extprocv3.HttpBody{Body: sh.req, EndOfStream: true},
		}})
		if err != nil {
			return err
		}
		if ir := resp.GetImmediateResponse(); ir != nil {
			if ir.GetStatus().GetCode() >= 400 {
				return fmt.Errorf("unexpected %d: %s", ir.GetStatus().GetCode(), ir.GetBody())
			}
			return nil
		}
	}
	if ran != nil {
		ran()
	}
	if sh.upstream > 0 {
		time.Sleep(sh.upstream)
	}
	if mode != nil && mode.GetResponseHeaderMode() == filterextproc.ProcessingMode_SKIP {
		return nil
	}
	respBody := hasBody
	resp, err = exchange(&extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
				{Key: ":status", RawValue: []byte("201")},
				{Key: "content-type", RawValue: []byte("application/json")},
				{Key: "x-envoy-upstream-service-time", RawValue: []byte("3")},
			}},
			EndOfStream: !respBody,
		}},
		Attributes: viaUpstream,
	})
	if err != nil {
		return err
	}
	if mo := resp.GetModeOverride(); mo != nil && mo.GetResponseBodyMode() == filterextproc.ProcessingMode_NONE {
		respBody = false
	}
	if respBody {
		if _, err := exchange(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
			ResponseBody: &extprocv3.HttpBody{Body: sh.resp, EndOfStream: true},
		}}); err != nil {
			return err
		}
	}
	return nil
}

// requestHeaderValues are request n's headers, with its Idempotency-Key when key is set.
func requestHeaderValues(method, path, key string, n int64) []*corev3.HeaderValue {
	hs := []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte(method)},
		{Key: ":path", RawValue: []byte(path)},
		{Key: ":authority", RawValue: []byte("api.example.com")},
		{Key: ":scheme", RawValue: []byte("https")},
		{Key: "content-type", RawValue: []byte("application/json")},
		{Key: "authorization", RawValue: []byte("Bearer 0123456789abcdef")},
		{Key: "x-request-id", RawValue: []byte("6f1c2b1e-" + strconv.FormatInt(n, 10))},
	}
	if key != "" {
		hs = append(hs, &corev3.HeaderValue{Key: "idempotency-key", RawValue: []byte(key)})
	}
	return hs
}

var redisBenchRE = regexp.MustCompile(`([0-9.]+) requests per second`)

// redisBenchmark runs redis-benchmark's one-round-trip write at the given concurrency and
// returns its requests/s, or 0 when it cannot.
func redisBenchmark(addr string, clients int) float64 {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return 0
	}
	out, err := exec.Command("redis-benchmark", "-h", host, "-p", port, "-c", strconv.Itoa(clients),
		"-n", "100000", "-r", "1000000", "-q", "HSET", "bench:__rand_int__", "v", "1").Output()
	if err != nil {
		return 0
	}
	m := redisBenchRE.FindSubmatch(out)
	if m == nil {
		return 0
	}
	v, _ := strconv.ParseFloat(string(m[1]), 64)
	return v
}

// startRedis runs a throwaway redis-server on a free loopback port.
func startRedis(args ...string) (string, func(), error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return "", nil, err
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	addr := l.Addr().String()
	_, port, _ := net.SplitHostPort(addr)
	_ = l.Close()
	dir, err := os.MkdirTemp("", "bench-redis")
	if err != nil {
		return "", nil, err
	}
	cmd := dieWithBench(exec.Command(bin, append([]string{"--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", dir, "--logfile", filepath.Join(dir, "redis.log")}, args...)...))
	if err := cmd.Start(); err != nil {
		return "", nil, err
	}
	stop := func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = os.RemoveAll(dir)
	}
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	for i := 0; ; i++ {
		if c.Ping(context.Background()).Err() == nil {
			return addr, stop, nil
		}
		if i == 100 {
			stop()
			return "", nil, errors.New("redis-server did not answer")
		}
		time.Sleep(50 * time.Millisecond)
	}
}
