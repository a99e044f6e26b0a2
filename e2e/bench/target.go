package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/extproctest"
	"github.com/idempotency-extproc/idempotency-extproc/internal/logbatch"
)

// Each target runs in a process of its own, as a processor does beside Envoy: its CPU time is
// its own, and one target's heap (the memory store's records) never slows another's garbage
// collection. The benchmark starts its own executable with these variables set.
const (
	envServe   = "IDEMPOTENCY_BENCH_SERVE"        // the target to serve
	envRedis   = "IDEMPOTENCY_BENCH_REDIS"        // the Redis address of the Redis target
	envProfile = "IDEMPOTENCY_BENCH_CPUPROFILE"   // when set, the prefix of the target's CPU profile
	envTrace   = "IDEMPOTENCY_BENCH_TRACE"        // when set, the prefix of the target's execution trace
	envMemory  = "IDEMPOTENCY_BENCH_MEMORY_BYTES" // the memory stores' bound, when not the default
	// envUnbatched, set to 1, turns the Redis store's batching off (cache.RedisOptions.DisableBatching).
	envUnbatched = "IDEMPOTENCY_BENCH_REDIS_UNBATCHED"
	// envOTLP is the address of the OTLP/HTTP trace receiver the traced target exports to.
	envOTLP = "IDEMPOTENCY_BENCH_OTLP"
)

// profileSuffix names each target's CPU profile and execution trace.
var profileSuffix = map[string]string{
	targetNull: ".null", targetMemory: ".memory", targetMemoryEmpty: ".memory-empty", targetRedis: ".redis",
	targetMemoryTraced: ".memory-traced", targetMemorySealed: ".memory-sealed", targetMemoryWait: ".memory-wait",
	targetRedisUnbatched: ".redis-unbatched", targetRedisPlain: ".redis-plain",
	targetRedisReplicated: ".redis-replicated", targetRedisDurable: ".redis-durable",
}

// counters are what a target process reports: its CPU time and, for the processor, its store
// calls and the Redis commands and round trips they took.
type counters struct {
	CPU   time.Duration
	Calls int64
	// Acquires are the store calls that claim a key (op acquire): one per first execution, and a
	// replay's, which finds the record.
	Acquires int64
	// SlowCalls are the store calls that took over slowCall: a wait on the memory store's lock,
	// a Redis round trip held up.
	SlowCalls int64
	Commands  int64
	Trips     int64
	// Waits are the WAIT commands the Redis store sent (durable round trips), Unconfirmed the
	// claims and completions they did not confirm (idempotency_durability_unconfirmed_total).
	Waits, Unconfirmed int64
	// LogLines are the lines the processor logged.
	LogLines int64
	// Failures are the requests the processor settled otherwise than a clean run does: the
	// store_error outcome, and every lease released (a first execution that did not complete).
	Failures int64
	// LeasesLost are the leases the processor found gone at completion or renewal (their
	// requests are among the Failures, as store_error): a Redis that evicts, as the costs mode's
	// does, can evict a pending record.
	LeasesLost int64
	// MemoryBytes is what the memory store holds (cache.Memory.Bytes), 0 for other targets.
	MemoryBytes int64
	// PeakRSS is the most memory the process has held resident so far, in bytes.
	PeakRSS int64
	// WaitCalls are the store calls duplicates made waiting for a request in flight, beyond their
	// first (idempotency_wait_store_calls_total).
	WaitCalls int64
	// Records is what a memory store holds (cache.Memory.Len), 0 for other targets.
	Records int
	// SealOverhead is the bytes a record takes in this target's store beyond what the same
	// record takes in a store without a keyring: the seal's header and tag when it seals, 0
	// when it does not (memory targets only).
	SealOverhead int64
	// Spans are the spans the traced target ended (every one is exported).
	Spans int64
}

// serveFromEnv serves the target named by envServe, if set, until its standard input closes,
// and reports whether it did. It prints "<grpc address> <counters address>" on a first line.
func serveFromEnv() bool {
	name := os.Getenv(envServe)
	if name == "" {
		return false
	}
	if name == targetPlainNull || name == targetNaiveRedis {
		if prefix := os.Getenv(envProfile); prefix != "" {
			stop, err := startProfile(prefix + userProfileSuffix[name])
			if err != nil {
				fmt.Fprintln(os.Stderr, "bench target:", err)
				os.Exit(1)
			}
			// serveAfternoon returns when the bench closes stdin; the profile is written then.
			defer stop()
		}
		if err := serveAfternoon(name, os.Getenv(envRedis), os.Stdin, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "bench target:", err)
			os.Exit(1)
		}
		return true
	}
	for _, rec := range recorders {
		if prefix := os.Getenv(rec.env); prefix != "" {
			stop, err := rec.start(prefix + profileSuffix[name])
			if err != nil {
				fmt.Fprintln(os.Stderr, "bench target:", err)
				os.Exit(1)
			}
			defer stop()
		}
	}
	memoryBytes, _ := strconv.ParseInt(os.Getenv(envMemory), 10, 64)
	if err := serveTarget(name, os.Getenv(envRedis), memoryBytes, os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "bench target:", err)
		os.Exit(1)
	}
	return true
}

func serveTarget(name, redisAddr string, memoryBytes int64, stdin io.Reader, stdout io.Writer) error {
	// The processor logs as the binary does by default (JSON at info level, one line per covered
	// request, written in batches by logbatch), into /dev/null: the formatting and the writes are
	// paid, as in a deployment.
	devNull, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer devNull.Close()
	batched := logbatch.New(devNull, 50*time.Millisecond)
	defer batched.Close()
	lines := lineCounter{w: batched}
	log := zerolog.New(&lines).Level(zerolog.InfoLevel).With().Timestamp().Logger()
	// The processor's own metrics time every store call: they give the store calls and the slow
	// ones.
	reg := prometheus.NewRegistry()
	metrics, err := extproc.NewMetrics(reg)
	if err != nil {
		return err
	}
	var (
		p                      extprocv3.ExternalProcessorServer
		commands, trips, waits atomic.Int64
		spans                  atomic.Int64 // ended by the traced target
		memory                 *cache.Memory
		sealOverhead           int64
		// flush, for the traced target, exports the spans still buffered.
		flush = func(context.Context) error { return nil }
	)
	switch name {
	case targetNull:
		p = extproctest.NullProcessor{}
	case targetMemory, targetMemoryEmpty, targetMemoryTraced, targetMemorySealed, targetMemoryWait:
		if memoryBytes == 0 {
			memoryBytes = cache.DefaultMemoryMaxBytes
		}
		opts := cache.MemoryOptions{MaxBytes: memoryBytes}
		if name == targetMemorySealed {
			if opts.Keyring, err = benchKeyring(); err != nil {
				return err
			}
		}
		mem, err := cache.NewMemory(opts)
		if err != nil {
			return err
		}
		if sealOverhead, err = measureSealOverhead(mem); err != nil {
			return err
		}
		if name != targetMemoryEmpty {
			if err := fill(mem, memoryBytes); err != nil {
				return err
			}
		}
		memory = mem
		pol := benchPolicy()
		if name == targetMemoryWait {
			pol = waitPolicy()
		}
		xo := extproc.Options{Store: mem, Policy: pol, Logger: &log, Metrics: metrics}
		if name == targetMemoryTraced {
			tp, err := startTracing(os.Getenv(envOTLP), &spans)
			if err != nil {
				return err
			}
			defer func() { _ = tp.Shutdown(context.Background()) }()
			flush = tp.ForceFlush
			xo.Tracer = tp.Tracer("github.com/idempotency-extproc/idempotency-extproc/extproc")
		}
		srv, err := extproc.NewServer(xo)
		if err != nil {
			return err
		}
		p = srv
	case targetRedis, targetRedisUnbatched, targetRedisReplicated, targetRedisDurable:
		unbatched := name == targetRedisUnbatched || os.Getenv(envUnbatched) == "1"
		rs, err := cache.OpenRedis(cache.RedisOptions{URL: "redis://" + redisAddr + "/0", Timeout: time.Second, DisableBatching: unbatched})
		if err != nil {
			return err
		}
		defer rs.Close()
		rs.Client().AddHook(commandCounter{commands: &commands, trips: &trips, waits: &waits})
		pol := benchPolicy()
		if name == targetRedisDurable {
			pol = durablePolicy()
		}
		srv, err := extproc.NewServer(extproc.Options{Store: rs, Policy: pol, Logger: &log, Metrics: metrics})
		if err != nil {
			return err
		}
		p = srv
	case targetRedisPlain:
		ps, err := newPlainSets(redisAddr, os.Getenv(envPlainSizes))
		if err != nil {
			return err
		}
		defer ps.rdb.Close()
		ps.rdb.AddHook(commandCounter{commands: &commands, trips: &trips, waits: &waits})
		p = ps
	default:
		return fmt.Errorf("no target %q", name)
	}

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	// Every target, the null processor too, runs its streams on workers as the binary does
	// (cmd/idempotency-extproc/run.go): the comparison is of what the processor does, not of
	// how grpc-go schedules it.
	sopts := []grpc.ServerOption{grpc.MaxRecvMsgSize(64 << 20), grpc.NumStreamWorkers(extproc.StreamWorkers)}
	if processor, ok := p.(*extproc.Server); ok {
		// As the binary serves it (cmd/idempotency-extproc/run.go): a stream's panic ends that
		// stream, its first message has a deadline, and its answers go through the server's codec.
		sopts = append(sopts, grpc.ChainStreamInterceptor(processor.StreamInterceptor()), grpc.InTapHandle(processor.TapHandle()),
			grpc.ForceServerCodecV2(processor.Codec()))
	}
	gs := grpc.NewServer(sopts...)
	extprocv3.RegisterExternalProcessorServer(gs, p)
	go func() { _ = gs.Serve(lis) }()
	defer gs.Stop()

	statsLis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	stats := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if processor, ok := p.(*extproc.Server); ok {
			// A stream logs its line when it ends, after its last answer: the counters are read
			// once the round's streams have all ended. No stream starts meanwhile (the benchmark
			// reads counters between rounds), and a timeout ends the run rather than retrying.
			ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
			err := processor.Wait(ctx)
			if err == nil {
				// The spans of the requests counted so far are exported, and their export's
				// CPU time charged, before the CPU time is read.
				err = flush(ctx)
			}
			cancel()
			if err != nil {
				http.Error(w, "streams still open or spans not flushed: "+err.Error(), http.StatusServiceUnavailable)
				return
			}
		}
		cpu, rss := processUsage()
		c := counters{CPU: cpu, PeakRSS: rss, Commands: commands.Load(), Trips: trips.Load(), Waits: waits.Load(), LogLines: lines.n.Load(), SealOverhead: sealOverhead, Spans: spans.Load()}
		if err := storeCalls(reg, &c); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if memory != nil {
			c.MemoryBytes = memory.Bytes()
			c.Records = memory.Len()
		}
		_ = json.NewEncoder(w).Encode(c)
	})}
	// /mem answers at once, streams open or not: the process' memory while a round runs.
	mux := http.NewServeMux()
	mux.Handle("/", stats.Handler)
	mux.HandleFunc("/mem", serveMemory)
	stats.Handler = mux
	go func() { _ = stats.Serve(statsLis) }()
	defer stats.Close()

	if _, err := fmt.Fprintln(stdout, lis.Addr(), statsLis.Addr()); err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, stdin) // until the benchmark closes it, or exits
	return nil
}

// fill brings a memory store to its bound, where each new record evicts the least recently used
// one, and then replaces every record once more, so that the Go heap has grown to its
// steady-state size (about twice the live heap): the state of a replica that has run for a
// while. Without it, the measurement would include the heap's growth (fresh pages from the
// kernel, each faulted in and zeroed), which a replica pays once after it starts.
func fill(m *cache.Memory, bound int64) error {
	ctx := context.Background()
	claim := cache.Claim{Fingerprint: make([]byte, 32), LockTTL: time.Minute, TTL: 24 * time.Hour}
	resp := cache.Response{Status: 201, Headers: []cache.Header{{Name: "content-type", Value: []byte("application/json")}}, Body: responseBody}
	add := func(i int) error {
		l, _, err := m.Acquire(ctx, "fill-"+strconv.Itoa(i), claim)
		if err != nil {
			return err
		}
		return m.Complete(ctx, l, resp)
	}
	n := 0
	for ; m.Bytes() < bound-bound/100; n++ {
		if err := add(n); err != nil {
			return err
		}
	}
	for i := range n {
		if err := add(n + i); err != nil {
			return err
		}
	}
	return nil
}

// benchPolicy is the default policy with a store_timeout that tolerates a saturated machine, and
// a route whose fingerprint omits the body, claimed at request_headers in every body mode: the
// claim-at-headers workload's. Every other workload's path takes the defaults.
func benchPolicy() *policy.Policy {
	return mustPolicy("store_timeout: 2s\n" + benchRoutes)
}

// benchRoutes is benchPolicy's route, which the other policies that serve the claim-at-headers
// workload carry too.
const benchRoutes = `routes:
  - name: headers-only
    match: {path_prefix: /v1/headers-only/}
    fingerprint: [method, path]
`

// waitPolicy is benchPolicy with in_flight_wait: a duplicate of a request in flight waits for its
// replay, polling the store, rather than being answered 409 at once.
func waitPolicy() *policy.Policy {
	return mustPolicy("store_timeout: 2s\ndefaults:\n  in_flight_wait: 2s\n")
}

// mustPolicy parses a policy of the benchmark's own, which is never wrong.
func mustPolicy(text string) *policy.Policy {
	p, err := policy.Parse([]byte(text))
	if err != nil {
		panic(err)
	}
	return p
}

// targetProcess is a running target process.
type targetProcess struct {
	name  string
	addr  string // its ext_proc gRPC address
	stats string // its counters' address
	cmd   *exec.Cmd
	stdin io.Closer
}

// startTarget runs the target name in a new process of this executable.
func startTarget(name, redisAddr string, memoryBytes int64, env ...string) (*targetProcess, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := dieWithBench(exec.Command(exe))
	cmd.Env = append(os.Environ(), envServe+"="+name, envRedis+"="+redisAddr, envMemory+"="+strconv.FormatInt(memoryBytes, 10))
	cmd.Env = append(cmd.Env, env...)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	t := &targetProcess{name: name, cmd: cmd, stdin: stdin}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	addrs := strings.Fields(line)
	if err != nil || len(addrs) != 2 {
		t.stop()
		return nil, fmt.Errorf("target %s did not start: %q, %v", name, line, err)
	}
	t.addr, t.stats = addrs[0], addrs[1]
	return t, nil
}

// counters reads the target's counters.
func (t *targetProcess) counters(ctx context.Context) (counters, error) {
	var c counters
	return c, t.getJSON(ctx, "/", &c)
}

// getJSON decodes into v what the target's stats listener answers at path.
func (t *targetProcess) getJSON(ctx context.Context, path string, v any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+t.stats+path, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("%s: %s: %s", path, resp.Status, msg)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

// stop ends the target process: it exits when its standard input closes.
func (t *targetProcess) stop() {
	_ = t.stdin.Close()
	done := make(chan struct{})
	go func() {
		_ = t.cmd.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		_ = t.cmd.Process.Kill()
		<-done
	}
}

// lineCounter counts the lines written through it; zerolog writes one line per Write.
type lineCounter struct {
	w io.Writer
	n atomic.Int64
}

func (c *lineCounter) Write(p []byte) (int, error) {
	c.n.Add(1)
	return c.w.Write(p)
}

// storeCalls sets c's store calls and slow calls from the processor's store-duration histogram
// (every call it made, and those over its 1 ms bucket), and its failures from its outcome and
// release counters.
func storeCalls(g prometheus.Gatherer, c *counters) error {
	families, err := g.Gather()
	if err != nil {
		return err
	}
	for _, f := range families {
		switch f.GetName() {
		case "idempotency_requests_total":
			for _, m := range f.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "outcome" && l.GetValue() == string(extproc.StoreError) {
						c.Failures += int64(m.GetCounter().GetValue())
					}
				}
			}
			continue
		case "idempotency_releases_total":
			for _, m := range f.GetMetric() {
				c.Failures += int64(m.GetCounter().GetValue())
			}
			continue
		case "idempotency_completions_abandoned_total":
			for _, m := range f.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "reason" && l.GetValue() == "lease_lost" {
						c.LeasesLost += int64(m.GetCounter().GetValue())
					}
				}
			}
			continue
		case "idempotency_wait_store_calls_total":
			for _, m := range f.GetMetric() {
				c.WaitCalls += int64(m.GetCounter().GetValue())
			}
			continue
		case "idempotency_durability_unconfirmed_total":
			for _, m := range f.GetMetric() {
				c.Unconfirmed += int64(m.GetCounter().GetValue())
			}
			continue
		case "idempotency_store_duration_seconds":
		default:
			continue
		}
		for _, m := range f.GetMetric() {
			h := m.GetHistogram()
			c.Calls += int64(h.GetSampleCount())
			for _, l := range m.GetLabel() {
				if l.GetName() == "op" && l.GetValue() == "acquire" {
					c.Acquires += int64(h.GetSampleCount())
				}
			}
			c.SlowCalls += int64(h.GetSampleCount())
			for _, b := range h.GetBucket() {
				if b.GetUpperBound() == slowCall.Seconds() {
					c.SlowCalls -= int64(b.GetCumulativeCount())
				}
			}
		}
	}
	return nil
}

// slowCall is the time over which a store call counts as slow: a bucket of the histogram.
const slowCall = time.Millisecond

// commandCounter counts the store's commands (set, evalsha, eval), the round trips that carry
// them, and the WAITs that end durable round trips.
type commandCounter struct{ commands, trips, waits *atomic.Int64 }

func isStoreCommand(cmd redis.Cmder) bool {
	switch cmd.Name() {
	case "set", "evalsha", "eval":
		return true
	}
	return false
}

func (commandCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h commandCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if isStoreCommand(cmd) {
			h.commands.Add(1)
			h.trips.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (h commandCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		var n int64
		for _, c := range cmds {
			if isStoreCommand(c) {
				n++
			}
			if c.Name() == "wait" && h.waits != nil {
				h.waits.Add(1)
			}
		}
		if n > 0 { // not a connection's set-up, which go-redis pipelines too
			h.commands.Add(n)
			h.trips.Add(1)
		}
		return next(ctx, cmds)
	}
}
