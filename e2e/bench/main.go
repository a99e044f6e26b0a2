// Command bench compares idempotency-extproc with a null ext_proc processor on loopback: the
// message sequences Envoy sends (reference §3), 32 concurrent streams, three workloads
// (uncovered GET, first executions, replays) and three targets (a null processor that answers
// CONTINUE to every phase, the processor with its memory store, and with a real redis-server).
// It prints requests/s, p50 and p99 latency, the ratio to the null processor, the store calls
// and Redis commands per request, and redis-benchmark's requests/s at the same concurrency.
//
//	go run ./e2e/bench                    # 3 s per cell
//	go run ./e2e/bench -duration 10s -streams 64
//
// It needs redis-server (and redis-benchmark) on PATH for the Redis rows; without them those
// rows are skipped. Ratios, not absolute numbers, are the claims: the client, the processor and
// Redis share the machine's cores.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"runtime/pprof"
	"strings"
	"time"
)

func main() {
	duration := flag.Duration("duration", 3*time.Second, "how long each workload runs against each target")
	streams := flag.Int("streams", 32, "concurrent ext_proc streams")
	rounds := flag.Int("rounds", 5, "alternating rounds each cell's duration is split into")
	only := flag.String("only", "", "comma-separated workloads and targets to run (default all), e.g. \"first execution,memory store\"")
	cpuprofile := flag.String("cpuprofile", "", "write a CPU profile of the whole run to this file")
	flag.Parse()
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
		defer pprof.StopCPUProfile()
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
	res, err := compare(ctx, options{duration: *duration, rounds: max(*rounds, 1), streams: *streams, redisAddr: redisAddr, only: filter})
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1) //nolint:gocritic // the profile is not needed on failure
	}
	res.print(os.Stdout)
}
