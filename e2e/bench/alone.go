package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/redis/go-redis/v9"
)

// roundTrips is how many Redis commands the processor sends per request of each workload, each
// a round trip of its own when made alone (the store's pipeline lets concurrent requests share
// round trips).
var roundTrips = map[string]int{workloadFirst: 2, workloadReplay: 1}

// aloneCell is what the Redis round trips of a workload's request take by themselves on this
// machine: made at the fixed rate by the benchmark's process with no processor code around
// them, while the null processor serves the same workload at the same rate, so that the machine
// is as busy as when the Redis store is measured (the client in Envoy's place and a processor's
// gRPC work on the same cores as redis-server). A Redis-backed processor's median should not
// be under the null processor's plus theirs; tails need not add, as slow moments of the
// machine slow both.
type aloneCell struct {
	workload   string
	perRequest int     // round trips per request
	rate       float64 // requests/s, the fixed rate of the workload's other cells
	requests   int
	commands   int64           // commands Redis was sent, counted by a go-redis hook
	trips      int64           // and the round trips they took
	p50, p99   time.Duration   // of one request's round trips, from the first one's start
	roundP99   []time.Duration // each round's p99
	nullP99    []time.Duration // the null processor's p99 in the same rounds
	// The same round trips with nothing else running on the machine, for as long in all.
	idleRequests     int
	idleP50, idleP99 time.Duration
}

// redisAlone measures workload w's Redis round trips beside the null processor, both at rate,
// in n rounds of d each, and then for n×d with nothing else running.
func redisAlone(ctx context.Context, addr string, null extprocv3.ExternalProcessorClient, w string, streams int, rate float64, n int, d time.Duration) (aloneCell, error) {
	c := aloneCell{workload: w, perRequest: roundTrips[w], rate: rate}
	var commands, trips atomic.Int64
	rdb := redis.NewClient(&redis.Options{Addr: addr, PoolSize: streams})
	defer rdb.Close()
	rdb.AddHook(commandCounter{commands: &commands, trips: &trips})
	// A replay's round trip finds its key completed, as the processor's does.
	record := string(responseBody)
	replayed := "alone:replayed:" + strconv.FormatInt(seq.Add(1), 10)
	if err := rdb.Set(ctx, replayed, record, 0).Err(); err != nil {
		return c, err
	}
	// Warm up the connections and load the completion's script (a first EVALSHA fails and Run
	// sends an EVAL: two commands), as the targets are warmed up.
	if _, err := paceRedis(ctx, rdb, w, replayed, record, streams, rate, d/10); err != nil {
		return c, err
	}
	commands.Store(0)
	trips.Store(0)
	var all []time.Duration
	for range n {
		var (
			wg       sync.WaitGroup
			nullLat  []time.Duration
			nullErr  error
			redisLat []time.Duration
			redisErr error
		)
		wg.Add(2)
		go func() {
			defer wg.Done()
			_, nullLat, nullErr = drivePaced(ctx, null, w, streams, rate, d)
		}()
		go func() {
			defer wg.Done()
			redisLat, redisErr = paceRedis(ctx, rdb, w, replayed, record, streams, rate, d)
		}()
		wg.Wait()
		if nullErr != nil {
			return c, fmt.Errorf("null processor: %w", nullErr)
		}
		if redisErr != nil {
			return c, redisErr
		}
		_, p99 := percentiles(nullLat)
		c.nullP99 = append(c.nullP99, p99)
		_, p99 = percentiles(redisLat)
		c.roundP99 = append(c.roundP99, p99)
		all = append(all, redisLat...)
	}
	c.requests = len(all)
	c.p50, c.p99 = percentiles(all)
	idle, err := paceRedis(ctx, rdb, w, replayed, record, streams, rate, time.Duration(n)*d)
	if err != nil {
		return c, err
	}
	c.idleRequests = len(idle)
	c.idleP50, c.idleP99 = percentiles(idle)
	c.commands, c.trips = commands.Load(), trips.Load()
	return c, nil
}

// completeScript stands for the store's completion: a script that reads the pending record
// and replaces it with the completed one, under a TTL.
var completeScript = redis.NewScript(`
if not redis.call('GET', KEYS[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1`)

// paceRedis makes the round trips of workload w's requests on streams connections at rate
// requests/s in all, for d, with the commands the Redis store sends. A first execution claims
// a fresh key (SET NX PX GET, as an acquire) and then writes its record with a script (as a
// completion); a replay claims a completed key and gets its record back. Each request's time
// counts from its first round trip's start, not from its schedule: what is measured is the
// round trips, and the schedule's lag is in both the targets' and the null processor's
// latency, where "added" cancels it.
func paceRedis(ctx context.Context, rdb *redis.Client, w, replayed, record string, streams int, rate float64, d time.Duration) ([]time.Duration, error) {
	_, lat, err := paced(streams, rate, d, func(time.Time) (time.Duration, error) {
		t0 := time.Now()
		switch w {
		case workloadFirst:
			key := "alone:first:" + strconv.FormatInt(seq.Add(1), 10)
			switch err := rdb.Do(ctx, "set", key, "pending", "nx", "px", 30000, "get").Err(); {
			case errors.Is(err, redis.Nil): // claimed
			case err == nil:
				return 0, fmt.Errorf("claiming %s: the key was taken", key)
			default:
				return 0, err
			}
			n, err := completeScript.Run(ctx, rdb, []string{key}, record, time.Minute.Milliseconds()).Int()
			if err != nil {
				return 0, err
			}
			if n != 1 {
				return 0, errors.New("completing: the pending record is gone")
			}
		case workloadReplay:
			got, err := rdb.Do(ctx, "set", replayed, "pending", "nx", "px", 30000, "get").Text()
			if err != nil {
				return 0, err
			}
			if len(got) != len(record) {
				return 0, fmt.Errorf("replayed key holds %d bytes, not %d", len(got), len(record))
			}
		default:
			return 0, fmt.Errorf("%s makes no Redis round trip", w)
		}
		return time.Since(t0), nil
	})
	return lat, err
}

func (r result) printAlone(w io.Writer) {
	if len(r.alone) == 0 {
		return
	}
	fmt.Fprintf(w, "\nThe Redis round trips alone: each request's round trips made by the benchmark's process at the fixed rate, with no processor code around them, while the null processor serves the same workload at the same rate (the machine as busy as when the Redis store is measured), then with nothing else running; latency from the first round trip's start to the last answer\n\n")
	fmt.Fprintf(w, "| workload | round trips/req | requests/s | p50 | p99 | p99 per round | null processor's p99 meanwhile | p50, machine idle | p99, machine idle |\n")
	fmt.Fprintf(w, "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: |\n")
	for _, c := range r.alone {
		fmt.Fprintf(w, "| %s | %d | %.0f | %s | %s | %s | %s | %s | %s |\n", c.workload, c.perRequest, c.rate,
			fmtDur(c.p50), fmtDur(c.p99), fmtDurs(c.roundP99), fmtDurs(c.nullP99), fmtDur(c.idleP50), fmtDur(c.idleP99))
	}
}

func fmtDurs(ds []time.Duration) string {
	s := make([]string, len(ds))
	for i, d := range ds {
		s[i] = fmtDur(d)
	}
	return strings.Join(s, ", ")
}
