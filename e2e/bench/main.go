// Command bench measures idempotency-extproc's cost on loopback, two ways.
//
// -mode user (make bench-compare) measures it as a user would: the binary built as the
// Dockerfile builds it, started as a child process with the chart's default settings, against a
// null processor and a naive Redis processor a user could write in an afternoon (user.go), each
// a child process, with Envoy's header set, in interleaved rounds. It answers: what does
// deploying the product cost over not processing at all, and over the plain alternative.
//
// The other modes (make bench-inside, make bench-costs) answer where the processor's cost goes:
// they serve the processor from this executable, as a library, with logs to /dev/null, and count
// its store calls, Redis commands and round trips per request, its latency at a fixed rate, and
// what each feature, body mode and body size adds. They compare idempotency-extproc with a null
// ext_proc processor on loopback: the
// message sequences Envoy's ext_proc filter sends (source/extensions/filters/http/ext_proc/), 32
// concurrent streams, three workloads (uncovered GET, first executions, replays) and three
// targets (a null processor that answers CONTINUE to every phase, the processor with its memory
// store, and with a real redis-server).
// It prints requests/s, p50 and p99 latency, the ratio to the null processor, the store calls
// and Redis commands per request, redis-benchmark's requests/s at the same concurrency, and
// what a request's Redis round trips take by themselves at the fixed rate, beside the null
// processor.
//
// Each target runs in a process of its own (this executable, started again), as a processor
// runs beside Envoy; the benchmark's own process is the client. With -load, each workload also
// runs at a fixed request rate below saturation, to measure the latency a target adds.
//
//	go run ./e2e/bench -mode user -duration 9s -rounds 3
//	go run ./e2e/bench                    # 3 s per cell
//	go run ./e2e/bench -duration 10s -streams 64
//	go run ./e2e/bench -redis-batching=false -only "first execution,redis store"
//	go run ./e2e/bench -mode costs -duration 6s -rounds 3   # what features and dimensions cost
//	go run ./e2e/bench -mode costs -only durability          # durability.replicas: 1 against 0
//
// It needs redis-server (and redis-benchmark) on PATH for the Redis rows; without them those
// rows are skipped. Ratios, not absolute numbers, are the claims: the client, the processor and
// Redis share the machine's cores.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"runtime/trace"
	"strconv"
	"strings"
	"time"
)

func main() {
	if serveFromEnv() {
		return
	}
	os.Exit(run(os.Args[1:]))
}

// run runs the bench with the command line args and returns the exit code. Every child it
// starts (redis-server, the processors) is stopped before it returns, on every path: main calls
// os.Exit, which runs no deferred call, only once run is done.
func run(args []string) int {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	duration := fs.Duration("duration", 3*time.Second, "how long each workload runs against each target")
	streams := fs.Int("streams", 32, "concurrent ext_proc streams")
	rounds := fs.Int("rounds", 5, "alternating rounds each cell's duration is split into")
	load := fs.Float64("load", 0.5, "also run each workload at this fraction of the slowest target's requests/s, to measure latency below saturation (0: skip)")
	only := fs.String("only", "", "comma-separated workloads and targets to run (default all), e.g. \"first execution,memory store\"; with -mode costs, the sections whose title holds one of them, e.g. durability")
	memoryBytes := fs.Int64("memory-bytes", 0, "the memory stores' bound (default the binary's, 256 MiB)")
	cpuprofile := fs.String("cpuprofile", "", "write CPU profiles of the whole run: this prefix plus .client, .null, .memory, .memory-empty and .redis")
	traceOut := fs.String("trace", "", "write execution traces (go tool trace) of the whole run, named as -cpuprofile's")
	mode := fs.String("mode", "compare", "user: the shipped binary with the chart's defaults against a null and a naive Redis processor, each a child process (docs/performance.md); compare: the processor's own tables; costs: CPU per request over the null processor of each feature (tracing, sealing, a waiting duplicate, the Redis batcher on and off, against plain SETs of the records under the same load, durability.replicas: 1 on a Redis master with a replica), of 1 KiB, 64 KiB and 1 MiB bodies and of -streams, 256 and 1,024 streams, in one run")
	redisBatching := fs.Bool("redis-batching", true, "let the Redis store share round trips among concurrent calls in pipelined batches (false: a round trip per call)")
	sizes := fs.String("sizes", "1024,65536,1048576", "-mode costs: the body sizes in bytes, comma-separated; the first is the features' size")
	streamCounts := fs.String("stream-counts", "", "-mode costs: the stream counts, comma-separated (default -streams, 256, 1024); the first is the other sections'")
	userSizes := fs.String("user-sizes", "33,4096", "-mode user: the body sizes of the first-execution and replay loads")
	userGrowth := fs.String("user-growth", "33,4096,65536,1048576", "-mode user: the body sizes of how cost grows (memory store; \"\" skips it)")
	userLogs := fs.String("user-logs", "file", "-mode user: where the binary's logs go: file (the chart's: the container's output) or discard")
	userRoutes := fs.String("user-routes", "chart", "-mode user: the binary's policy: chart (the measured path matched by a third route, after a prefix and a path_regex route) or one (a single route)")
	userHeaders := fs.String("user-headers", "envoy", "-mode user: the request headers: envoy (the set Envoy sends) or short (method, path and key)")
	userLoads := fs.String("user-loads", loadFirst+","+loadReplay, "-mode user: the loads to run, comma-separated (first execution, replay)")
	userVariant := fs.String("user-variant", "", "-mode user: also run this binary on each store, in the same rounds, printed against the null processor (the naive one on Redis) and the shipped binary")
	userVariantEnv := fs.String("user-variant-env", "", "-mode user: also run a variant of the shipped binary (or -user-variant's) with these variables added to its environment, space-separated K=V")
	userRedis := fs.Bool("user-redis", true, "-mode user: run the Redis rows too (false: the memory store and the null processor only)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *mode == "user" && *rounds < 3 {
		fmt.Fprintln(os.Stderr, "bench: -mode user takes medians of at least 3 interleaved rounds; -rounds", *rounds)
		return 2
	}
	if *mode != "user" && *mode != "costs" && *mode != "compare" {
		fmt.Fprintln(os.Stderr, "bench: -mode is user, compare or costs, not", *mode)
		return 2
	}
	if !*redisBatching {
		// The target processes read it.
		_ = os.Setenv(envUnbatched, "1")
	}
	prefixes := map[string]string{envProfile: *cpuprofile, envTrace: *traceOut}
	for _, rec := range recorders {
		prefix := prefixes[rec.env]
		if prefix == "" {
			continue
		}
		stop, err := rec.start(prefix + ".client")
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			return 1
		}
		defer stop()
		// The target processes write theirs.
		_ = os.Setenv(rec.env, prefix)
	}
	filter := map[string]bool{}
	for _, s := range strings.Split(*only, ",") {
		if s = strings.TrimSpace(s); s != "" {
			filter[s] = true
		}
	}

	ctx := context.Background()
	redisAddr, stop, err := startRedis()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench: no redis-server, Redis rows skipped:", err)
	} else {
		defer stop()
	}
	if *mode == "user" {
		o := userOptions{duration: *duration, rounds: max(*rounds, 1), streams: *streams, logs: *userLogs, routes: *userRoutes, headers: *userHeaders, redis: redisAddr != "" && *userRedis, cpuprofile: *cpuprofile, variantBin: *userVariant, variantEnv: strings.Fields(*userVariantEnv)}
		var err error
		if o.loads, err = userLoadList(*userLoads); err == nil {
			o.sizes, err = ints(*userSizes)
		}
		if err == nil {
			o.growth, err = ints(*userGrowth)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			return 2
		}
		if err := userBench(ctx, o, redisAddr, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			return 1
		}
		return 0
	}
	if *mode == "costs" {
		o := options{duration: *duration, rounds: max(*rounds, 1), streams: *streams, redisAddr: redisAddr, memoryBytes: *memoryBytes, redisBytes: 1 << 30, only: filter}
		if redisAddr != "" {
			replicated, stop, err := startReplicatedRedis()
			if err != nil {
				fmt.Fprintln(os.Stderr, "bench: no Redis master with a replica, durability section skipped:", err)
			} else {
				defer stop()
				o.replicatedAddr = replicated
			}
		}
		var err error
		if o.sizes, err = ints(*sizes); err == nil {
			o.streamCounts, err = ints(*streamCounts)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			return 2
		}
		res, err := costs(ctx, o)
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			return 1
		}
		res.print(os.Stdout)
		return 0
	}
	res, err := compare(ctx, options{duration: *duration, rounds: max(*rounds, 1), streams: *streams, redisAddr: redisAddr, load: *load, memoryBytes: *memoryBytes, only: filter})
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		return 1
	}
	if !*redisBatching {
		fmt.Println("Redis store with batching off (-redis-batching=false): a round trip per store call.")
	}
	res.print(os.Stdout)
	return 0
}

// recorders are what -cpuprofile and -trace record, each process under the prefix in its
// variable.
var recorders = []struct {
	env   string
	start func(path string) (stop func(), err error)
}{{envProfile, startProfile}, {envTrace, startTrace}}

// startTrace starts an execution trace into path and returns what stops it.
func startTrace(path string) (func(), error) { return record(path, trace.Start, trace.Stop) }

// startProfile starts a CPU profile into path and returns what stops it.
func startProfile(path string) (func(), error) {
	return record(path, pprof.StartCPUProfile, pprof.StopCPUProfile)
}

// record runs start on a new file at path and returns what stops it and closes the file.
func record(path string, start func(io.Writer) error, stop func()) (func(), error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := start(f); err != nil {
		_ = f.Close()
		return nil, err
	}
	return func() {
		stop()
		_ = f.Close()
	}, nil
}

// ints parses a comma-separated list of positive integers ("" is none).
func ints(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("%q is not a positive integer", f)
		}
		out = append(out, n)
	}
	return out, nil
}
