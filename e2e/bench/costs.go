package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// -mode costs measures, in one invocation and against the null processor in the same
// alternating rounds, what each feature and each dimension costs: tracing on and sealing on
// (memory store, 1 KiB bodies), a duplicate that waits for a request in flight, the Redis store
// with its batcher on and off, bodies of 1 KiB, 64 KiB and 1 MiB, and 32, 256 and 1,024
// concurrent streams, and, on a Redis master with one replica, durability.replicas: 1 against
// the same store waiting for no replica. CPU per request (the target process' own) leads;
// throughput ratios follow.
// Redis is filled to its bound before each section (fillRedis), and redis-server's CPU per first
// execution is set against plain SETs of the records' bytes in the same rounds (plainset.go).

// The in-flight workloads: the upstream takes upstreamDelay, and in the second, waitDups
// duplicates of each first execution arrive once it is on its way upstream.
const (
	upstreamDelay     = 100 * time.Millisecond
	waitDups          = 3
	workloadFirstSlow = "first execution, upstream 100 ms"
	workloadWaiting   = "first + 3 waiting duplicates, upstream 100 ms"
)

// costSection is one table of -mode costs: workloads of one shape on one number of streams,
// against the targets it names (the null processor first).
type costSection struct {
	name      string
	streams   int
	shape     shape
	workloads []string
	targets   []string
	// replicated runs its Redis targets on the master with a replica (options.replicatedAddr).
	replicated bool
}

// sized is the shape of request and response bodies of n bytes each.
func sized(n int) shape {
	return shape{name: "-" + strconv.Itoa(n), req: bytes.Repeat([]byte("q"), n), resp: bytes.Repeat([]byte("r"), n)}
}

func fmtBytes(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}

// costSections are the sections of -mode costs for the given body sizes (the first the
// features' size) and stream counts (the first the other sections'), the durability section
// last when there is a Redis master with a replica.
func costSections(sizes, streams []int, redis, replicated bool) []costSection {
	var secs []costSection
	both := []string{workloadFirst, workloadReplay}
	keep := func(names ...string) []string {
		return slices.DeleteFunc(names, func(n string) bool {
			return !redis && (n == targetRedis || n == targetRedisUnbatched || n == targetRedisPlain)
		})
	}
	s0 := streams[0]
	for i, size := range sizes {
		sec := costSection{name: fmt.Sprintf("%s bodies, %d streams", fmtBytes(size), s0), streams: s0, shape: sized(size), workloads: both,
			targets: keep(targetNull, targetMemory, targetMemorySealed, targetRedis, targetRedisUnbatched, targetRedisPlain)}
		if i == 0 {
			sec.name += ": features"
			sec.targets = keep(targetNull, targetMemory, targetMemoryTraced, targetMemorySealed, targetRedis, targetRedisUnbatched, targetRedisPlain)
			secs = append(secs, sec)
			slow := sized(size)
			slow.upstream = upstreamDelay
			secs = append(secs, costSection{name: fmt.Sprintf("in-flight duplicates, %s bodies, %d streams", fmtBytes(size), s0), streams: s0, shape: slow,
				workloads: []string{workloadFirstSlow, workloadWaiting}, targets: []string{targetNull, targetMemoryWait}})
			continue
		}
		secs = append(secs, sec)
	}
	for _, n := range streams[1:] {
		secs = append(secs, costSection{name: fmt.Sprintf("%s bodies, %d streams", fmtBytes(sizes[0]), n), streams: n, shape: sized(sizes[0]),
			workloads: []string{workloadFirst}, targets: keep(targetNull, targetMemory, targetRedis)})
	}
	if replicated {
		secs = append(secs, costSection{name: fmt.Sprintf("durability: %s bodies, %d streams, a Redis master with one replica", fmtBytes(sizes[0]), s0),
			streams: s0, shape: sized(sizes[0]), workloads: both, targets: []string{targetNull, targetRedisReplicated, targetRedisDurable}, replicated: true})
	}
	return secs
}

// targetsFor are the section's targets that run workload w: the plain SETs target only runs
// first executions, of which it is the baseline.
func (sec costSection) targetsFor(w string) []string {
	if w == workloadFirst {
		return sec.targets
	}
	return slices.DeleteFunc(slices.Clone(sec.targets), func(n string) bool { return n == targetRedisPlain })
}

// costCell is a section's cell.
type costCell struct {
	section string
	cell
}

// setCost is what redis-benchmark's plain SET of a value of some size costs redis-server.
type setCost struct {
	bytes   int
	ops     int
	rps     float64
	cpuPer  float64 // redis-server CPU µs per SET
	clients int
}

type costResult struct {
	opts     options
	sections []costSection
	cells    []costCell
	// recordBytes is, by body size, the length of a first execution's record in Redis.
	recordBytes map[int]int
	// plainBytes is, by body size, the length of the plain SETs target's completed values;
	// pendingBytes the length of a pending record, the plain SETs target's claim's value.
	plainBytes   map[int]int
	pendingBytes int
	sets         map[int]setCost // by value size
	smallSet     setCost         // a small SET, as the acquire's
	exports      int64           // OTLP export requests the receiver answered
	received     int64           // and the spans they carried
}

func (r costResult) find(section, workload, target string) (cell, bool) {
	for _, c := range r.cells {
		if c.section == section && c.workload == workload && c.target == target {
			return c.cell, true
		}
	}
	return cell{}, false
}

// costs runs -mode costs.
func costs(ctx context.Context, o options) (costResult, error) {
	if len(o.sizes) == 0 {
		o.sizes = []int{1 << 10, 64 << 10, 1 << 20}
	}
	if len(o.streamCounts) == 0 {
		o.streamCounts = []int{o.streams, 256, 1024}
	}
	res := costResult{opts: o, recordBytes: map[int]int{}, plainBytes: map[int]int{}, sets: map[int]setCost{}}
	res.sections = slices.DeleteFunc(costSections(o.sizes, o.streamCounts, o.redisAddr != "", o.replicatedAddr != ""), func(sec costSection) bool {
		if len(o.only) == 0 {
			return false
		}
		for term := range o.only {
			if strings.Contains(sec.name, term) {
				return false
			}
		}
		return true
	})
	recv, err := startSpanReceiver()
	if err != nil {
		return res, err
	}
	defer recv.close()

	var admin, replicatedAdmin, replicaAdmin *redis.Client
	// bound gives a Redis its bound and the eviction of the least recently used keys beyond it.
	bound := func(c *redis.Client, bytes int64) error {
		for _, kv := range [][2]string{{"maxmemory", strconv.FormatInt(bytes, 10)}, {"maxmemory-policy", "allkeys-lru"}} {
			if err := c.ConfigSet(ctx, kv[0], kv[1]).Err(); err != nil {
				return err
			}
		}
		return nil
	}
	if o.redisAddr != "" {
		admin = redis.NewClient(&redis.Options{Addr: o.redisAddr})
		defer admin.Close()
		// 1 MiB records at hundreds a second would fill the machine's memory: Redis evicts the
		// least recently used keys beyond its bound (1 GiB), as a Redis sized for its replay
		// window does. redis-benchmark's SETs run under the same bound.
		if err := bound(admin, o.redisBytes); err != nil {
			return res, err
		}
	}
	if o.replicatedAddr != "" {
		replicatedAdmin = redis.NewClient(&redis.Options{Addr: o.replicatedAddr})
		defer replicatedAdmin.Close()
		if replicaAdmin, err = replicaOf(ctx, replicatedAdmin); err != nil {
			return res, err
		}
		defer replicaAdmin.Close()
		// A quarter of the other's bound: its replica holds as much again. The durability
		// section's 1 KiB records fill it many times over.
		if err := bound(replicatedAdmin, o.redisBytes/4); err != nil {
			return res, err
		}
	}
	procs := map[string]*targetProcess{}
	var closers []io.Closer
	defer func() {
		for _, c := range closers {
			_ = c.Close()
		}
		for _, t := range procs {
			t.stop()
		}
	}()
	clients := map[string]extprocv3.ExternalProcessorClient{}
	start := func(name string, env ...string) error {
		addr := o.redisAddr
		if name == targetRedisReplicated || name == targetRedisDurable {
			addr = o.replicatedAddr
		}
		t, err := startTarget(name, addr, o.memoryBytes, env...)
		if err != nil {
			return err
		}
		procs[name] = t
		conn, err := grpc.NewClient("passthrough:///"+t.addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20)))
		if err != nil {
			return err
		}
		closers = append(closers, conn)
		clients[name] = extprocv3.NewExternalProcessorClient(conn)
		return nil
	}
	plain := false
	for _, sec := range res.sections {
		for _, name := range sec.targets {
			plain = plain || name == targetRedisPlain
			if procs[name] != nil || name == targetRedisPlain {
				continue
			}
			if err := start(name, envOTLP+"="+recv.addr); err != nil {
				return res, err
			}
		}
	}
	// overhead is a completed record's bytes in Redis beyond its response body.
	var overhead int
	if procs[targetRedis] != nil {
		if res.pendingBytes, overhead, err = recordSizes(ctx, clients[targetRedis], admin); err != nil {
			return res, err
		}
		if plain {
			// The plain SETs target writes values of the Redis target's record sizes.
			if err := start(targetRedisPlain, fmt.Sprintf("%s=%d,%d", envPlainSizes, res.pendingBytes, overhead)); err != nil {
				return res, err
			}
		}
	}
	each := o.duration / time.Duration(o.rounds)
	for _, sec := range res.sections {
		secAdmin := admin
		if sec.replicated {
			secAdmin = replicatedAdmin
		}
		if secAdmin != nil && (sec.replicated || slices.Contains(sec.targets, targetRedis)) {
			// Each section starts with Redis at its bound, full of values of the size of the
			// section's records: the steady state of a Redis that has run for a while.
			if err := fillRedis(ctx, secAdmin, len(sec.shape.resp)+overhead); err != nil {
				return res, err
			}
		}
		for _, w := range sec.workloads {
			var targets []*targetProcess
			for _, name := range sec.targetsFor(w) {
				targets = append(targets, procs[name])
			}
			for _, t := range targets {
				if w == workloadReplay {
					// The first request with the replayed key runs; every later one replays.
					if err := requestShaped(ctx, clients[t.name], w, 0, sec.shape, "", nil); err != nil {
						return res, fmt.Errorf("%s, %s, %s: %w", sec.name, w, t.name, err)
					}
				}
				if _, _, err := driveShaped(ctx, clients[t.name], w, sec.streams, o.duration/10, sec.shape); err != nil {
					return res, fmt.Errorf("%s, %s, %s, warming up: %w", sec.name, w, t.name, err)
				}
			}
			replicaCPU := make([]time.Duration, len(targets))
			cells, err := rounds(ctx, o.rounds, w, targets, secAdmin, func(i int) (cell, []time.Duration, error) {
				var cpu0 time.Duration
				if sec.replicated {
					cpu0 = redisServerCPU(ctx, replicaAdmin)
				}
				c, lat, err := driveShaped(ctx, clients[targets[i].name], w, sec.streams, each, sec.shape)
				if sec.replicated {
					replicaCPU[i] += redisServerCPU(ctx, replicaAdmin) - cpu0
				}
				return c, lat, err
			})
			if err != nil {
				return res, fmt.Errorf("%s: %w", sec.name, err)
			}
			for i, c := range cells {
				c.replicaCPU = replicaCPU[i]
				if w == workloadFirst {
					// After the rounds, outside their CPU time: what the target holds per stream
					// in flight.
					if c.idle, c.held, err = holdStreams(ctx, targets[i], clients[targets[i].name], sec.streams, sec.shape); err != nil {
						return res, fmt.Errorf("%s, %s, streams held: %w", sec.name, targets[i].name, err)
					}
				}
				res.cells = append(res.cells, costCell{section: sec.name, cell: c})
			}
			if w == workloadFirst && admin != nil && slices.Contains(sec.targets, targetRedis) && sec.streams == o.streamCounts[0] {
				size := len(sec.shape.resp)
				n, err := longestValue(ctx, admin, recordKeys)
				if err != nil {
					return res, err
				}
				res.recordBytes[size] = n
				if slices.Contains(sec.targets, targetRedisPlain) {
					if res.plainBytes[size], err = longestValue(ctx, admin, plainKeyPrefix+"*"); err != nil {
						return res, err
					}
				}
				if res.sets[size], err = redisSetCost(ctx, admin, o.redisAddr, n, sec.streams, o.redisBytes); err != nil {
					return res, err
				}
				if res.smallSet.ops == 0 {
					if res.smallSet, err = redisSetCost(ctx, admin, o.redisAddr, 128, sec.streams, o.redisBytes); err != nil {
						return res, err
					}
				}
			}
		}
	}
	// The traced target flushes its spans as its counters are read: it has exported all once the
	// last read is done.
	res.exports, res.received = recv.exports.Load(), recv.spans.Load()
	return res, nil
}

// holdStreams measures the memory a target holds per stream in flight: streams first executions
// of sh's bodies, each parked once on its way upstream (its request's messages answered, its
// response not yet sent) until all are; the target's live heap after a collection and its
// goroutine stacks then, and before they started.
func holdStreams(ctx context.Context, t *targetProcess, client extprocv3.ExternalProcessorClient, streams int, sh shape) (idle, held memUsage, err error) {
	sh.upstream = 0
	if idle, err = t.memory(ctx, true); err != nil {
		return idle, held, err
	}
	var (
		wg      sync.WaitGroup
		parked  sync.WaitGroup
		release = make(chan struct{})
		mu      sync.Mutex
		errs    error
	)
	parked.Add(streams)
	for range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			once := sync.OnceFunc(parked.Done)
			defer once() // a request that failed before its upstream parks no more
			err := requestShaped(ctx, client, workloadFirst, seq.Add(1), sh, "", func() {
				once()
				<-release
			})
			mu.Lock()
			errs = errors.Join(errs, err)
			mu.Unlock()
		}()
	}
	parked.Wait()
	held, err = t.memory(ctx, true)
	close(release)
	wg.Wait()
	return idle, held, errors.Join(err, errs)
}

// driveShaped runs workload w on streams concurrent streams for d with sh's bodies and
// upstream. In workloadWaiting, each group of 1+waitDups streams sends a first execution and,
// once it is on its way upstream, waitDups duplicates of it at once.
func driveShaped(ctx context.Context, client extprocv3.ExternalProcessorClient, w string, streams int, d time.Duration, sh shape) (cell, []time.Duration, error) {
	deadline := time.Now().Add(d)
	if w != workloadWaiting {
		return runStreams(streams, func(int) ([]time.Duration, error) {
			var lat []time.Duration
			for first := true; first || time.Now().Before(deadline); first = false {
				t0 := time.Now()
				if err := requestShaped(ctx, client, w, seq.Add(1), sh, "", nil); err != nil {
					return nil, err
				}
				lat = append(lat, time.Since(t0))
			}
			return lat, nil
		})
	}
	return runStreams(max(streams/(1+waitDups), 1), func(int) ([]time.Duration, error) {
		var lat []time.Duration
		for first := true; first || time.Now().Before(deadline); first = false {
			n := seq.Add(1)
			key := "waited-" + strconv.FormatInt(n, 10)
			var (
				wg   sync.WaitGroup
				errs [1 + waitDups]error
				lats [1 + waitDups]time.Duration
			)
			ran, first := make(chan struct{}), make(chan struct{})
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer close(first)
				t0 := time.Now()
				errs[0] = requestShaped(ctx, client, w, n, sh, key, func() { close(ran) })
				lats[0] = time.Since(t0)
			}()
			select {
			case <-ran:
			case <-first:
				wg.Wait()
				return nil, fmt.Errorf("the first request with %s never went upstream: %v", key, errs[0])
			}
			for k := 1; k <= waitDups; k++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					t0 := time.Now()
					errs[k] = requestShaped(ctx, client, w, n, sh, key, nil)
					lats[k] = time.Since(t0)
				}()
			}
			wg.Wait()
			if err := errors.Join(errs[:]...); err != nil {
				return nil, err
			}
			lat = append(lat, lats[:]...)
		}
		return lat, nil
	})
}

// fillRedis empties Redis and then fills it with values of n bytes until it evicts, so that each
// new record takes the place of one evicted, as in a Redis that has run for a while; the fill's
// keys are the first evicted (allkeys-lru). Without it, the cells that run while Redis grows
// would pay for its growth, fresh pages from the kernel each faulted in and zeroed (about 17 per
// 64 KiB record: 250–350 µs of redis-server CPU per first execution in the cells that ran while
// it grew, 120–130 µs in those after), and the cells after them would not: the first and last
// of a section's rounds would not measure the same thing.
func fillRedis(ctx context.Context, admin *redis.Client, n int) error {
	if cfg, err := admin.ConfigGet(ctx, "maxmemory").Result(); err != nil || cfg["maxmemory"] == "0" {
		return errors.Join(err, errors.New("filling redis: no maxmemory, it would never evict"))
	}
	if err := admin.FlushAll(ctx).Err(); err != nil {
		return err
	}
	evicted := func() (int64, error) { return redisEvicted(ctx, admin) }
	e0, err := evicted()
	if err != nil {
		return fmt.Errorf("redis INFO stats: %w", err)
	}
	v := make([]byte, n)
	for i := 0; ; {
		pipe := admin.Pipeline()
		for range 64 {
			pipe.Set(ctx, "fill:"+strconv.Itoa(i), v, 0)
			i++
		}
		if _, err := pipe.Exec(ctx); err != nil {
			return fmt.Errorf("filling redis: %w", err)
		}
		if e, err := evicted(); err != nil || e > e0 {
			return err
		}
	}
}

// longestValue is the length of the longest string value among up to 200 of Redis' keys that
// match pattern (a SCAN MATCH pattern). Under recordKeys, after a section's first executions,
// that is a record of the section's body size: Redis is emptied before each section, and the
// fill's keys have a prefix of their own.
func longestValue(ctx context.Context, c *redis.Client, pattern string) (int, error) {
	longest, seen := 0, 0
	for it := c.Scan(ctx, 0, pattern, 200).Iterator(); seen < 200 && it.Next(ctx); seen++ {
		if n, err := c.StrLen(ctx, it.Val()).Result(); err == nil {
			longest = max(longest, int(n))
		}
	}
	if longest == 0 {
		return 0, fmt.Errorf("no value in Redis under %q", pattern)
	}
	return longest, nil
}

// redisSetCost runs redis-benchmark's SET of values of n bytes at the given concurrency, as many
// as budget bytes in all (at least 200, at most 50,000 SETs), and returns redis-server's CPU per
// SET (INFO cpu before and after) and redis-benchmark's requests/s.
func redisSetCost(ctx context.Context, admin *redis.Client, addr string, n, clients int, budget int64) (setCost, error) {
	ops := int(min(max(budget/int64(n), 200), 50000))
	s := setCost{bytes: n, ops: ops, clients: clients}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return s, err
	}
	cpu0 := redisServerCPU(ctx, admin)
	out, err := exec.CommandContext(ctx, "redis-benchmark", "-h", host, "-p", port, "-c", strconv.Itoa(clients),
		"-n", strconv.Itoa(ops), "-r", "1000000", "-d", strconv.Itoa(n), "-q", "-t", "set").Output()
	if err != nil {
		return s, fmt.Errorf("redis-benchmark: %w", err)
	}
	s.cpuPer = perRequest(redisServerCPU(ctx, admin)-cpu0, ops)
	if m := redisBenchRE.FindSubmatch(out); m != nil {
		s.rps, _ = strconv.ParseFloat(string(m[1]), 64)
	}
	return s, nil
}

// pairedDiff is the median over rounds of a[i] − b[i], and the range.
func pairedDiff(a, b []float64) (median, lo, hi float64) {
	d := make([]float64, min(len(a), len(b)))
	for i := range d {
		d[i] = a[i] - b[i]
	}
	if len(d) == 0 {
		return 0, 0, 0
	}
	slices.Sort(d)
	return d[len(d)/2], d[0], d[len(d)-1]
}

func fmtDiff(a, b []float64) string {
	m, lo, hi := pairedDiff(a, b)
	if len(a) < 2 {
		return fmt.Sprintf("%+.1f", m)
	}
	return fmt.Sprintf("%+.1f [%+.1f, %+.1f]", m, lo, hi)
}

// perStream is what the target held per stream with streams parked in flight beyond what it held
// with none: live heap after a collection, goroutine stacks, goroutines.
func (c cell) perStream(streams int) (heap, stacks, goroutines float64, ok bool) {
	if c.held.Goroutines == 0 {
		return 0, 0, 0, false
	}
	n := float64(streams)
	return float64(c.held.LiveHeap-c.idle.LiveHeap) / n, float64(c.held.Stacks-c.idle.Stacks) / n, float64(c.held.Goroutines-c.idle.Goroutines) / n, true
}

func fmtKiB(b float64) string { return fmt.Sprintf("%.1f KiB", b/1024) }

func (r costResult) print(w io.Writer) {
	fmt.Fprintf(w, "-mode costs: %v per cell in %d alternating rounds; each target in a process of its own, GOMAXPROCS %d. Memory targets filled to their bound (%s) before the run.\n",
		r.opts.duration, r.opts.rounds, gomaxprocs(), fmtBytes(int(memoryBound(r.opts.memoryBytes))))
	fmt.Fprintf(w, "CPU over null is the median over rounds of the target process' CPU µs per request minus the null processor's in the same round, in brackets the range; × null is requests/s over the null processor's, in brackets the rounds' range. Heap and stacks per stream (first executions): after the rounds, as many first executions as the section's streams are parked on their way upstream at once (every request message answered, no response yet); the target's live heap after a collection and its goroutine stacks then, minus both with no stream open, divided by the streams.\n")
	for _, sec := range r.sections {
		fmt.Fprintf(w, "\n### %s\n\n", sec.name)
		fmt.Fprintf(w, "| workload | target | processor CPU µs/req | CPU over null µs/req | × null | requests/s | p50 | p99 | store calls/req | client CPU µs/req | Redis CPU µs/req | Redis round trips/req | live heap per stream held | stacks per stream held | also |\n")
		fmt.Fprintf(w, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n")
		for _, wl := range sec.workloads {
			null, _ := r.find(sec.name, wl, targetNull)
			for _, name := range sec.targets {
				c, ok := r.find(sec.name, wl, name)
				if !ok {
					continue
				}
				var also []string
				over, ratio, store := "—", "1.00", "—"
				if name != targetNull {
					over, ratio = fmtDiff(c.roundCPU, null.roundCPU), fmtRatio(c, null)
					store = fmt.Sprintf("%.2f", c.storeCalls)
				}
				redisCPU, trips := "—", "—"
				if c.hasRedis() {
					redisCPU, trips = fmt.Sprintf("%.1f", perRequest(c.redisCPU, c.requests)), fmt.Sprintf("%.2f", c.redisTrips)
				}
				heap, rss := "—", "—"
				if h, s, g, ok := c.perStream(sec.streams); ok {
					heap, rss = fmtKiB(h), fmtKiB(s)
					also = append(also, fmt.Sprintf("%.1f goroutines per stream held", g))
				}
				if c.spans > 0 {
					also = append(also, fmt.Sprintf("%.2f spans/req", float64(c.spans)/float64(c.requests)))
				}
				if c.hasRedis() {
					also = append(also, fmt.Sprintf("%.2f Redis commands/req", c.redisCommands))
				}
				if c.waitCalls > 0 {
					also = append(also, fmt.Sprintf("%.2f wait store calls/req", c.waitCalls))
				}
				if c.redisWaits > 0 {
					also = append(also, fmt.Sprintf("%.2f WAITs/req", c.redisWaits))
				}
				if c.replicaCPU > 0 && name != targetNull {
					also = append(also, fmt.Sprintf("replica CPU %.1f µs/req", perRequest(c.replicaCPU, c.requests)))
				}
				if c.unconfirmed > 0 {
					also = append(also, fmt.Sprintf("%d claims or completions unconfirmed", c.unconfirmed))
				}
				if c.sealOverhead > 0 {
					also = append(also, fmt.Sprintf("sealed: +%d B/record", c.sealOverhead))
				}
				if c.leasesLost > 0 {
					also = append(also, fmt.Sprintf("%d leases lost, %d keys evicted", c.leasesLost, c.evicted))
				}
				if n := c.failures - c.leasesLost; n > 0 {
					also = append(also, fmt.Sprintf("%d requests not settled cleanly", n))
				}
				fmt.Fprintf(w, "| %s | %s | %.1f | %s | %s | %.0f | %s | %s | %s | %.1f | %s | %s | %s | %s | %s |\n",
					wl, name, perRequest(c.cpu, c.requests), over, ratio, c.rps(), fmtDur(c.p50), fmtDur(c.p99), store,
					perRequest(c.clientCPU, c.requests), redisCPU, trips, heap, rss, strings.Join(also, "; "))
			}
		}
	}
	fmt.Fprintf(w, "\nThe OTLP receiver in the benchmark's process was sent %d spans in %d export requests.\n", r.received, r.exports)
	r.printFeatureCosts(w)
	r.printWaiting(w)
	r.printRedisSets(w)
	var failed, lost int64
	for _, c := range r.cells {
		failed += c.failures - c.leasesLost
		lost += c.leasesLost
	}
	if lost > 0 {
		// Redis runs under allkeys-lru here, to stay at its bound: it can evict a pending record
		// as readily as an old one, and its request then finds its lease gone.
		fmt.Fprintf(w, "\n%d requests found their lease lost: Redis evicted their pending record, as its allkeys-lru bound lets it (its LRU clock counts whole seconds: a record claimed this second is as old to it as any other key written this second). Under noeviction it evicts none.\n", lost)
	}
	every, other := "Every", ""
	if lost > 0 {
		every, other = "Every other", "other "
	}
	if failed == 0 {
		fmt.Fprintf(w, "\n%s request of every cell was settled as a clean run settles it: no store_error outcome, no lease released.\n", every)
	} else {
		fmt.Fprintf(w, "\n%d %srequests were settled otherwise than a clean run settles them (store_error outcomes and released leases): see the cells' \"also\".\n", failed, other)
	}
}

// featurePairs are the comparisons of printFeatureCosts: a target with a feature on or off,
// against its baseline.
var featurePairs = [][2]string{
	{targetMemoryTraced, targetMemory},
	{targetMemorySealed, targetMemory},
	{targetRedisUnbatched, targetRedis},
	{targetRedisDurable, targetRedisReplicated},
}

func (r costResult) printFeatureCosts(w io.Writer) {
	fmt.Fprintf(w, "\n### What each feature costs, against its baseline in the same rounds\n\n")
	fmt.Fprintf(w, "| section | workload | feature target | baseline | CPU added µs/req | × baseline | × null, feature | × null, baseline |\n")
	fmt.Fprintf(w, "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |\n")
	for _, sec := range r.sections {
		for _, wl := range sec.workloads {
			null, _ := r.find(sec.name, wl, targetNull)
			for _, p := range featurePairs {
				f, ok1 := r.find(sec.name, wl, p[0])
				b, ok2 := r.find(sec.name, wl, p[1])
				if !ok1 || !ok2 {
					continue
				}
				fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s | %s |\n", sec.name, wl, p[0], p[1],
					fmtDiff(f.roundCPU, b.roundCPU), fmtRatio(f, b), fmtRatio(f, null), fmtRatio(b, null))
			}
		}
	}
}

// printWaiting gives a waiting duplicate's own cost: the cell of first executions with their
// duplicates, less the cell of first executions alone, per duplicate.
func (r costResult) printWaiting(w io.Writer) {
	var sec *costSection
	for i := range r.sections {
		if slices.Contains(r.sections[i].workloads, workloadWaiting) {
			sec = &r.sections[i]
		}
	}
	if sec == nil {
		return
	}
	fmt.Fprintf(w, "\n### A duplicate waiting for a request in flight\n\n")
	fmt.Fprintf(w, "Each first execution's upstream takes %v; %d duplicates arrive once it is on its way upstream. Per duplicate: (the cell with duplicates × %d − the cell of first executions alone) ÷ %d, per request of each. Through the null processor a duplicate is one more request upstream.\n\n", upstreamDelay, waitDups, 1+waitDups, waitDups)
	fmt.Fprintf(w, "| target | store calls per duplicate | wait store calls per duplicate | processor CPU µs per duplicate | processor CPU µs per first execution alone | p50 of the group's requests | p99 |\n")
	fmt.Fprintf(w, "| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n")
	for _, name := range sec.targets {
		g, ok1 := r.find(sec.name, workloadWaiting, name)
		f, ok2 := r.find(sec.name, workloadFirstSlow, name)
		if !ok1 || !ok2 {
			continue
		}
		k := float64(1 + waitDups)
		cpuG, cpuF := perRequest(g.cpu, g.requests), perRequest(f.cpu, f.requests)
		store := "—"
		if name != targetNull {
			store = fmt.Sprintf("%.2f", (g.storeCalls*k-f.storeCalls)/waitDups)
		}
		fmt.Fprintf(w, "| %s | %s | %.2f | %.1f | %.1f | %s | %s |\n", name, store, g.waitCalls*k/waitDups,
			(cpuG*k-cpuF)/waitDups, cpuF, fmtDur(g.p50), fmtDur(g.p99))
	}
}

func (r costResult) printRedisSets(w io.Writer) {
	if len(r.sets) == 0 {
		return
	}
	fmt.Fprintf(w, "\n### redis-server's CPU per first execution against plain SETs of the record's bytes\n\n")
	fmt.Fprintf(w, "Two baselines. Plain SETs in the same rounds: the target %q, the null processor making, where the processor's store calls are, a SET of a value the size of the pending record (%d B) and, once the response has ended, a SET of one the size of the completed record (its bytes in the table), each in a round trip of its own, under the same load. redis-benchmark: -t set -d <record bytes> at the same concurrency after the section, on a machine otherwise idle, and a small SET (%d B, the acquire's size) beside it: %.1f µs, %.0f requests/s. redis-server's CPU from INFO cpu before and after each.\n\n", targetRedisPlain, r.pendingBytes, r.smallSet.bytes, r.smallSet.cpuPer, r.smallSet.rps)
	fmt.Fprintf(w, "| body | record bytes in Redis | plain SET bytes | target | redis CPU µs per first execution | plain SETs, same rounds: redis CPU µs/req | ÷ plain SETs | redis-benchmark SET of the record: µs | its requests/s | ÷ (redis-benchmark SET + small SET) |\n")
	fmt.Fprintf(w, "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n")
	for _, size := range r.opts.sizes {
		s, ok := r.sets[size]
		if !ok {
			continue
		}
		for _, sec := range r.sections {
			if len(sec.shape.resp) != size || sec.streams != r.opts.streamCounts[0] || sec.shape.upstream > 0 {
				continue
			}
			plain, plainOK := r.find(sec.name, workloadFirst, targetRedisPlain)
			for _, name := range []string{targetRedis, targetRedisUnbatched} {
				c, ok := r.find(sec.name, workloadFirst, name)
				if !ok {
					continue
				}
				per := perRequest(c.redisCPU, c.requests)
				plainPer, ratio := "—", "—"
				if plainOK {
					p := perRequest(plain.redisCPU, plain.requests)
					plainPer, ratio = fmt.Sprintf("%.1f", p), fmt.Sprintf("%.2f", per/p)
				}
				fmt.Fprintf(w, "| %s | %d | %d | %s | %.1f | %s | %s | %.1f | %.0f | %.2f |\n", fmtBytes(size), r.recordBytes[size], r.plainBytes[size], name, per,
					plainPer, ratio, s.cpuPer, s.rps, per/(s.cpuPer+r.smallSet.cpuPer))
			}
		}
	}
}
