package main

import (
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// TestMain lets the test binary serve as a target process, as the benchmark's does.
func TestMain(m *testing.M) {
	if serveFromEnv() {
		return
	}
	os.Exit(m.Run())
}

// TestCompare runs the comparison briefly, as CI does: it asserts what is counted, never what
// is timed. Store calls per request are exact: none for an uncovered request, two for a first
// execution (acquire, complete), one for a replay; the processor logs one line per covered
// request, as the binary does by default; Redis sees one command per store call, and
// pipelining makes the round trips no more than that. The run at a fixed rate measures every
// cell too, and the Redis round trips alone make as many commands per request as the store.
func TestCompare(t *testing.T) {
	srv := redistest.Start(t, redistest.Options{})
	res, err := compare(t.Context(), options{duration: 200 * time.Millisecond, rounds: 2, streams: 8, redisAddr: srv.Addr(), load: 0.5, memoryBytes: 8 << 20})
	require.NoError(t, err)
	var out bytes.Buffer
	res.print(&out)
	t.Log("\n" + out.String())

	want := map[string]float64{workloadUncovered: 0, workloadFirst: 2, workloadReplay: 1, workloadStreamed: 2, workloadDuplex: 2, workloadHeaders: 2}
	// The processor logs as the binary does: one line per covered request.
	wantLines := map[string]float64{workloadUncovered: 0, workloadFirst: 1, workloadReplay: 1, workloadStreamed: 1, workloadDuplex: 1, workloadHeaders: 1}
	// Every first execution, in every body mode, claimed its key once: an acquire per request (a
	// replay's one store call is the acquire that finds the record).
	wantAcquires := map[string]float64{workloadUncovered: 0, workloadFirst: 1, workloadReplay: 1, workloadStreamed: 1, workloadDuplex: 1, workloadHeaders: 1}
	require.Len(t, workloads, len(want))
	for _, w := range workloads {
		for _, target := range []string{targetNull, targetMemory, targetMemoryEmpty, targetRedis} {
			c, ok := res.find(w, target)
			require.True(t, ok, "%s, %s", w, target)
			require.Positive(t, c.requests)
			require.Len(t, c.roundP99, 2, "%s, %s: a p99 per round", w, target)
			require.Len(t, c.roundRPS, 2, "%s, %s: a rate per round", w, target)
			require.Zero(t, c.failures, "%s, %s: every request settled as a clean run settles it", w, target)
			// Each of the 8 streams has at most one request in flight: their latencies add up to
			// no more than 8 times the time the cell ran (Little's law's bound).
			require.Positive(t, c.latency)
			require.LessOrEqual(t, c.latency, 8*c.elapsed, "%s, %s: latencies of 8 streams", w, target)
			require.Positive(t, c.cpu, "%s, %s: the target process' CPU time", w, target)
			if target == targetMemory {
				// Its 8 MiB of records are resident, beside the process' own.
				require.Greater(t, c.peakRSS, int64(8<<20), "%s, %s: the target process' peak RSS", w, target)
			} else {
				require.Positive(t, c.peakRSS, "%s, %s: the target process' peak RSS", w, target)
			}
			p, ok := res.findPaced(w, target)
			require.True(t, ok, "%s, %s at a fixed rate", w, target)
			require.Positive(t, p.requests)
			require.Zero(t, p.failures, "%s, %s at a fixed rate: every request settled as a clean run settles it", w, target)
			if target == targetNull {
				continue
			}
			if w == workloadUncovered {
				// The memory targets' first cells: one starts at its bound, one empty.
				full := c.memoryBytes >= 8<<20*99/100
				require.Equal(t, target == targetMemory, full, "%s starts with %d bytes", target, c.memoryBytes)
			}
			require.Equal(t, want[w], c.storeCalls, "%s, %s: store calls per request", w, target)
			require.Equal(t, wantAcquires[w], c.acquires, "%s, %s: acquires per request", w, target)
			require.Equal(t, wantAcquires[w], p.acquires, "%s, %s at a fixed rate: acquires per request", w, target)
			require.Equal(t, wantLines[w], c.logLines, "%s, %s: log lines per request", w, target)
			require.LessOrEqual(t, float64(c.slowCalls), c.storeCalls*float64(c.requests), "%s, %s: slow store calls are store calls", w, target)
			require.LessOrEqual(t, float64(p.slowCalls), p.storeCalls*float64(p.requests), "%s, %s at a fixed rate: slow store calls are store calls", w, target)
			require.Equal(t, want[w], p.storeCalls, "%s, %s at a fixed rate: store calls per request", w, target)
			require.Equal(t, wantLines[w], p.logLines, "%s, %s at a fixed rate: log lines per request", w, target)
			if target == targetRedis {
				for _, rc := range []cell{c, p} {
					require.Equal(t, want[w], rc.redisCommands, "%s%s: Redis commands per request", w, pacedSuffix(rc))
					require.LessOrEqual(t, rc.redisTrips, want[w], "%s%s: pipelining never adds round trips", w, pacedSuffix(rc))
					if want[w] > 0 {
						require.Positive(t, rc.redisTrips, "%s%s: round trips are counted", w, pacedSuffix(rc))
					}
				}
			}
		}
	}
	require.True(t, strings.Contains(out.String(), "| replay | redis store |"))
	for _, w := range []string{workloadStreamed, workloadDuplex, workloadHeaders} {
		require.Regexp(t, `\| `+w+` \| redis store \| \d+ \| [^|]+ \| [^|]+ \| \d+\.\d\d \[\d+\.\d\d, \d+\.\d\d\] \|`, out.String(), "%s: a row with its ratio", w)
	}
	require.Regexp(t, `\| first execution \| memory store \|( [^|]+ \|){9} \d+\.\d \| [+-]\d+\.\d \[[+-]\d+\.\d, [+-]\d+\.\d\] \|`, out.String(),
		"the processor's CPU per request, and over the null processor's with the range of the rounds'")
	require.Contains(t, out.String(), "Little's law")
	require.Contains(t, out.String(), "Every request of every cell was settled as a clean run settles it")
	require.Regexp(t, `\| first execution \| memory store \| \d+ \| [^|]+ \| [^|]+ \| \d+\.\d\d \[\d+\.\d\d, \d+\.\d\d\] \|`, out.String(),
		"each ratio comes with the range of its rounds'")

	// The Redis round trips alone: as many per request as the Redis store makes, beside a null
	// processor that served the same workload meanwhile.
	require.Len(t, res.alone, 2, "first executions and replays; an uncovered request makes none")
	for _, a := range res.alone {
		require.Equal(t, want[a.workload], float64(a.perRequest), a.workload)
		require.Equal(t, int64(a.perRequest*(a.requests+a.idleRequests)), a.commands, "%s: Redis commands sent alone", a.workload)
		require.Equal(t, a.commands, a.trips, "%s: made alone, each command is a round trip of its own", a.workload)
	}
	require.Contains(t, out.String(), "The Redis round trips alone")
}

// TestClaimAtHeaders checks what the claim-at-headers workload measures: on benchPolicy's
// headers-only route the processor claims a first execution at request_headers, before Envoy
// sends the body (an acquire, whose lease is released when the stream ends there), where on the
// default route, whose fingerprint holds the body, it answers the headers at once and claims
// nothing until the body comes.
func TestClaimAtHeaders(t *testing.T) {
	tp, client := dialTarget(t, targetMemoryEmpty, 8<<20)
	for _, tc := range []struct {
		path     string
		acquires int64
	}{{headersOnlyPath, 1}, {"/v1/payments", 0}} {
		before, err := tp.counters(t.Context())
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(t.Context())
		s, err := client.Process(ctx)
		require.NoError(t, err)
		require.NoError(t, s.Send(&extprocv3.ProcessingRequest{
			Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
				Headers: &corev3.HeaderMap{Headers: requestHeaderValues("POST", tc.path, "k-"+tc.path, 1)},
			}},
			ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: filterextproc.ProcessingMode_BUFFERED, ResponseBodyMode: filterextproc.ProcessingMode_BUFFERED},
		}))
		resp, err := s.Recv()
		require.NoError(t, err)
		require.NotNil(t, resp.GetRequestHeaders(), "%s: the headers continue", tc.path)
		cancel() // the client went away before the body
		after, err := tp.counters(t.Context())
		require.NoError(t, err)
		require.Equal(t, tc.acquires, after.Acquires-before.Acquires, "%s: claimed at request_headers", tc.path)
		require.Equal(t, tc.acquires, after.Failures-before.Failures, "%s: the lease of a request that never ran is released", tc.path)
	}
}

// TestNullProcessorStreamsBack checks the null processor's answers in FULL_DUPLEX_STREAMED: each
// chunk streamed back as it came, both ways, and the trailers answered; in the buffered modes a
// plain CONTINUE, as extproctest.NullProcessor answers them (the benchmark runs it).
func TestNullProcessorStreamsBack(t *testing.T) {
	_, client := dialTarget(t, targetNull, 0)
	for _, mode := range []filterextproc.ProcessingMode_BodySendMode{filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED, filterextproc.ProcessingMode_BUFFERED} {
		s, err := client.Process(t.Context())
		require.NoError(t, err)
		duplex := mode == filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
		send := func(m *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
			require.NoError(t, s.Send(m))
			resp, err := s.Recv()
			require.NoError(t, err)
			return resp
		}
		require.NotNil(t, send(&extprocv3.ProcessingRequest{
			Request:        &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{}},
			ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: mode, ResponseBodyMode: mode},
		}).GetRequestHeaders())
		for i, chunk := range []string{"ab", "cd"} {
			sr := send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
				RequestBody: &extprocv3.HttpBody{Body: []byte(chunk), EndOfStream: i == 1},
			}}).GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
			if !duplex {
				require.Nil(t, sr, "%v: the body continues unchanged", mode)
				continue
			}
			require.Equal(t, chunk, string(sr.GetBody()), "%v: chunk %d streamed back", mode, i)
			require.Equal(t, i == 1, sr.GetEndOfStream())
		}
		require.NotNil(t, send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}}).GetRequestTrailers())
		require.NotNil(t, send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{}}}).GetResponseHeaders())
		sr := send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
			ResponseBody: &extprocv3.HttpBody{Body: []byte("xyz"), EndOfStream: true},
		}}).GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if duplex {
			require.Equal(t, "xyz", string(sr.GetBody()))
			require.True(t, sr.GetEndOfStream())
		} else {
			require.Nil(t, sr)
		}
		require.NotNil(t, send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}}).GetResponseTrailers())
		require.NoError(t, s.CloseSend())
	}
}

// TestCosts runs -mode costs briefly (two body sizes, two stream counts) and asserts what is
// counted: store calls and Redis commands per request, the traced target's spans and what the
// OTLP receiver was sent, the sealing target's records sealed (each takes the seal's header
// and tag more than in a store without a keyring), the waiting duplicates' store calls, the
// streams held in flight served by the stream workers, redis-benchmark's SETs measured for each
// size, and the plain SETs target's two SETs per first execution, of the records' sizes.
func TestCosts(t *testing.T) {
	srv := redistest.Start(t, redistest.Options{})
	replicated := redistest.Start(t, redistest.Options{})
	redistest.StartReplicas(t, replicated, 1)
	sizes, streams := []int{1 << 10, 64 << 10}, []int{8, 16}
	res, err := costs(t.Context(), options{duration: 300 * time.Millisecond, rounds: 2, streams: 8, redisAddr: srv.Addr(),
		memoryBytes: 8 << 20, sizes: sizes, streamCounts: streams, redisBytes: 16 << 20, replicatedAddr: replicated.Addr()})
	require.NoError(t, err)
	var out bytes.Buffer
	res.print(&out)
	t.Log("\n" + out.String())

	ring, err := benchKeyring()
	require.NoError(t, err)
	envelope := int64(ring.SealedLen(0))                    // the version, key id, nonce and tag
	require.Len(t, res.sections, len(sizes)+len(streams)+1) // a section per size, one of in-flight duplicates, one per further stream count, durability
	var spans int64
	for _, sec := range res.sections {
		for _, w := range sec.workloads {
			for _, target := range sec.targets {
				c, ok := res.find(sec.name, w, target)
				if target == targetRedisPlain && w != workloadFirst {
					require.False(t, ok, "%s, %s: the plain SETs target runs first executions only", sec.name, w)
					continue
				}
				require.True(t, ok, "%s, %s, %s", sec.name, w, target)
				where := sec.name + ", " + w + ", " + target
				require.Positive(t, c.requests, where)
				require.Len(t, c.roundCPU, 2, "%s: a CPU per request per round", where)
				require.Positive(t, c.cpu, where)
				// Redis here evicts beyond its bound (allkeys-lru), a pending record among them:
				// the only unclean settlements are the leases its evictions took.
				require.Equal(t, c.leasesLost, c.failures, "%s: every request settled as a clean run settles it, but those whose lease was evicted", where)
				require.LessOrEqual(t, c.leasesLost, c.evicted, "%s: a lease lost for each key evicted at most", where)
				switch target {
				case targetMemoryTraced:
					// A span per request and one per store call at least.
					require.GreaterOrEqual(t, float64(c.spans), 3*float64(c.requests)*c.storeCalls/2, where)
					spans += c.spans
				default:
					require.Zero(t, c.spans, where)
				}
				switch target {
				case targetMemorySealed:
					require.GreaterOrEqual(t, c.sealOverhead, envelope, "%s: records sealed", where)
					require.Less(t, c.sealOverhead, envelope+8, "%s: by one envelope", where)
				default:
					require.Zero(t, c.sealOverhead, "%s: records not sealed", where)
				}
				if target == targetNull || target == targetRedisPlain {
					require.Zero(t, c.storeCalls, where)
					require.Zero(t, c.waitCalls, where)
				}
				if target == targetRedisPlain {
					// Only first executions, each a SET at the claim and one of the completed
					// record, in round trips of their own.
					require.Equal(t, workloadFirst, w, where)
					require.Equal(t, 2.0, c.redisCommands, where)
					require.Equal(t, 2.0, c.redisTrips, where)
					require.Positive(t, c.redisCPU, where)
					continue
				}
				if w == workloadFirst {
					// Each stream held in flight runs on one of the target's stream workers, not on
					// a goroutine of its own as it would without them: the goroutines grow by less
					// than one per two streams, beyond those the workers cannot take. A count, as
					// scheduling cannot flip it; the stacks' growth is printed, not asserted: the
					// reading collects garbage, which shrinks a parked worker's stack too.
					beyond := int64(max(0, sec.streams-extproc.StreamWorkers))
					require.Less(t, c.held.Goroutines-c.idle.Goroutines, beyond+int64(sec.streams)/2, "%s: goroutines of the streams held", where)
				}
				if target == targetNull {
					continue
				}
				switch w {
				case workloadFirst, workloadFirstSlow:
					require.Equal(t, 2.0, c.storeCalls, where)
				case workloadReplay:
					require.Equal(t, 1.0, c.storeCalls, where)
				case workloadWaiting:
					// A group is a first execution (2 calls) and waitDups duplicates on the same
					// replica, each of which waited on the replica's hold of the key (no store
					// call while the first runs) and then found the replay (1 call); one that
					// reached the store before the first claimed made a wait call more.
					require.GreaterOrEqual(t, c.storeCalls*(1+waitDups), 2.0+waitDups, where)
					require.InDelta(t, c.storeCalls*(1+waitDups)-2-waitDups, c.waitCalls*(1+waitDups), 1e-9, "%s: store calls beyond the first are wait calls", where)
					require.GreaterOrEqual(t, c.p50, upstreamDelay, where)
				}
				if c.hasRedis() {
					// A command per store call, and one more per completion of a record of 4 KiB
					// or more, whose bytes are staged in a plain SET pipelined with the script.
					extra := 0.0
					if w == workloadFirst && len(sec.shape.resp) >= 4<<10 {
						extra = 1
					}
					require.Equal(t, c.storeCalls+extra, c.redisCommands, where)
					require.Positive(t, c.redisCPU, where)
					if target == targetRedisDurable {
						require.Equal(t, c.redisTrips, c.redisWaits, "%s: a WAIT ends every round trip", where)
						require.Positive(t, c.redisWaits, where)
					} else {
						require.Zero(t, c.redisWaits, where)
					}
					if sec.replicated {
						require.Positive(t, c.replicaCPU, "%s: the replica's CPU is measured", where)
					}
					if target == targetRedisUnbatched {
						require.Equal(t, c.storeCalls, c.redisTrips, "%s: a round trip per store call", where)
					} else {
						require.LessOrEqual(t, c.redisTrips, c.storeCalls, where)
					}
				}
			}
		}
	}
	require.Positive(t, spans, "the traced target ended spans")
	require.GreaterOrEqual(t, res.received, spans, "and exported every one to the receiver")
	require.Positive(t, res.exports)
	for _, size := range sizes {
		s, ok := res.sets[size]
		require.True(t, ok, "redis-benchmark's SET of a %d-byte body's record", size)
		require.Greater(t, res.recordBytes[size], size)
		require.Equal(t, res.recordBytes[size], s.bytes)
		require.Equal(t, res.recordBytes[size], res.plainBytes[size], "the plain SETs target writes values of the records' size")
		require.Positive(t, s.cpuPer)
		require.Positive(t, s.rps)
	}
	require.Positive(t, res.smallSet.cpuPer)
	require.Positive(t, res.pendingBytes)
	require.Contains(t, out.String(), fmt.Sprintf("the size of the pending record (%d B)", res.pendingBytes))
	for _, want := range []string{"### 1 KiB bodies, 8 streams: features", "### 64 KiB bodies, 8 streams", "### 1 KiB bodies, 16 streams",
		"### A duplicate waiting for a request in flight", "### What each feature costs", "### redis-server's CPU per first execution",
		"| first execution | null processor, plain SETs |",
		"| first execution | memory store, sealed |", "| replay | redis store, batching off |", "Every request of every cell was settled",
		"### durability: 1 KiB bodies, 8 streams, a Redis master with one replica", "| first execution | redis store, replicas: 1 |",
		"| durability: 1 KiB bodies, 8 streams, a Redis master with one replica | replay | redis store, replicas: 1 | redis store, master with a replica |"} {
		require.Contains(t, out.String(), want)
	}
}

// TestTargetWritesProfileAndTrace checks -cpuprofile's and -trace's plumbing: a target process
// started with their variables set writes a CPU profile and an execution trace under its own
// name, complete once it stops.
func TestTargetWritesProfileAndTrace(t *testing.T) {
	prefix := filepath.Join(t.TempDir(), "run")
	t.Setenv(envProfile, prefix+"-cpu")
	t.Setenv(envTrace, prefix+"-trace")
	tp, err := startTarget(targetNull, "", 0)
	require.NoError(t, err)
	tp.stop()
	require.True(t, tp.cmd.ProcessState.Success(), "the target exited cleanly: %v", tp.cmd.ProcessState)

	// A CPU profile is a gzipped protocol buffer: a complete one decompresses to its end.
	f, err := os.Open(prefix + "-cpu" + profileSuffix[targetNull])
	require.NoError(t, err)
	defer f.Close()
	zr, err := gzip.NewReader(f)
	require.NoError(t, err)
	n, err := io.Copy(io.Discard, zr)
	require.NoError(t, err, "a complete CPU profile")
	require.Positive(t, n)

	tr, err := os.ReadFile(prefix + "-trace" + profileSuffix[targetNull])
	require.NoError(t, err)
	require.True(t, bytes.HasPrefix(tr, []byte("go 1.")), "an execution trace starts with its header")
	require.Greater(t, len(tr), 1<<10, "and holds the process' events")
}

// TestFailuresAreCounted checks that the counters a target reports count the store_error
// outcome and every released lease, from the metrics the processor keeps.
func TestFailuresAreCounted(t *testing.T) {
	reg := prometheus.NewRegistry()
	requests := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "idempotency_requests_total"}, []string{"route", "outcome"})
	releases := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "idempotency_releases_total"}, []string{"route", "reason"})
	reg.MustRegister(requests, releases)
	requests.WithLabelValues("default", "executed").Add(5)
	requests.WithLabelValues("default", "store_error").Add(2)
	releases.WithLabelValues("default", "unknown_outcome").Inc()
	var c counters
	require.NoError(t, storeCalls(reg, &c))
	require.Equal(t, int64(3), c.Failures)
}

// TestRatioFor checks the saturated latency arithmetic: 32 streams at 8,000 requests/s wait 4 ms
// on average, and a target adds 1 ms to that at 0.8 times the rate, 6,400 requests/s.
func TestRatioFor(t *testing.T) {
	require.Equal(t, 4*time.Millisecond, littleMean(32, 8000))
	r := ratioFor(32, 8000, time.Millisecond)
	require.InDelta(t, 0.8, r, 1e-9)
	require.Equal(t, time.Millisecond, littleMean(32, r*8000)-littleMean(32, 8000))
	// No budget: the target must be as fast as the null processor.
	require.InDelta(t, 1.0, ratioFor(32, 8000, 0), 1e-9)
}

// TestOnly: -only names workloads, targets or both; a kind it names none of runs whole. A
// filter naming only targets once ran nothing at all.
func TestOnly(t *testing.T) {
	targets := []string{targetNull, targetMemory, targetRedis}
	for _, c := range []struct {
		only                 string
		workload, redis, mem bool
	}{
		{"", true, true, true},
		{targetRedis, true, true, false},
		{workloadReplay, false, true, true},
		{workloadReplay + "," + targetRedis, false, true, false},
		{workloadFirst + "," + targetRedis, true, true, false},
	} {
		o := options{only: map[string]bool{}}
		for _, n := range strings.Split(c.only, ",") {
			if n != "" {
				o.only[n] = true
			}
		}
		assert.Equal(t, c.workload, o.runs(workloadFirst, workloads), "%q: first execution", c.only)
		assert.Equal(t, c.redis, o.runs(targetRedis, targets), "%q: redis store", c.only)
		assert.Equal(t, c.mem, o.runs(targetMemory, targets), "%q: memory store", c.only)
	}
}

// dialTarget starts a target process and returns it with a client of its ext_proc listener;
// both end with the test.
func dialTarget(t *testing.T, name string, memoryBytes int64) (*targetProcess, extprocv3.ExternalProcessorClient) {
	t.Helper()
	tp, err := startTarget(name, "", memoryBytes)
	require.NoError(t, err)
	t.Cleanup(tp.stop)
	conn, err := grpc.NewClient("passthrough:///"+tp.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return tp, extprocv3.NewExternalProcessorClient(conn)
}

// TestFillRedis: a filled Redis is at its bound, evicting, and holds the fill's values of the
// size asked; without a bound the fill refuses rather than filling the machine.
func TestFillRedis(t *testing.T) {
	srv := redistest.Start(t, redistest.Options{})
	admin := srv.Client(t)
	ctx := t.Context()
	require.ErrorContains(t, fillRedis(ctx, admin, 1<<10), "no maxmemory")
	require.NoError(t, admin.ConfigSet(ctx, "maxmemory", strconv.Itoa(8<<20)).Err())
	require.NoError(t, admin.ConfigSet(ctx, "maxmemory-policy", "allkeys-lru").Err())
	require.NoError(t, admin.Set(ctx, "idempotency:left-over", "x", 0).Err())
	require.NoError(t, fillRedis(ctx, admin, 64<<10))
	stats := admin.InfoMap(ctx, "stats", "memory")
	evicted, err := strconv.Atoi(stats.Item("Stats", "evicted_keys"))
	require.NoError(t, err)
	require.Positive(t, evicted)
	used, err := strconv.Atoi(stats.Item("Memory", "used_memory"))
	require.NoError(t, err)
	require.Greater(t, used, 7<<20, "at its bound")
	require.Zero(t, admin.Exists(ctx, "idempotency:left-over").Val(), "emptied first")
	n, err := longestValue(ctx, admin, "fill:*")
	require.NoError(t, err)
	require.Equal(t, 64<<10, n)
}

// TestUserBench runs -mode user briefly: the shipped binary built and started with the chart's
// defaults, the null and naive Redis processors as child processes. It asserts what is counted:
// every load ran without failures (a replay that ran upstream fails its cell, so the binary and
// the naive processor both replay), every line of the report is printed, and each process' CPU
// was read. A variant of the binary runs on each store and is printed against it.
func TestUserBench(t *testing.T) {
	srv := redistest.Start(t, redistest.Options{})
	o := userOptions{duration: 300 * time.Millisecond, rounds: 2, streams: 4, sizes: []int{33}, growth: []int{33, 4096},
		logs: "file", routes: "chart", headers: "envoy", redis: true, loads: []string{loadFirst, loadReplay},
		variantEnv: []string{"GOGC=100"}}
	var out bytes.Buffer
	require.NoError(t, userBench(t.Context(), o, srv.Addr(), &out))
	t.Log("\n" + out.String())
	for _, want := range []string{
		"memory, first execution, 33 B: ", "memory, replay, 33 B: ",
		"redis, first execution, 33 B: ", "redis, replay, 33 B: ",
		"memory variant (. GOGC=100), replay, 33 B: ",
		"redis variant (. GOGC=100), first execution, 33 B: ", "redis variant (. GOGC=100), replay, 33 B: ", "× redis [",
		"how cost grows", "4 KiB: ",
	} {
		require.Contains(t, out.String(), want)
	}
	require.NotContains(t, out.String(), "NaN")
}

// TestNaiveRedis checks the naive processor does what its comment says: the first request with a
// key runs and is stored, the same key again gets the stored status and body, and a key taken by
// a request still running gets 409.
func TestNaiveRedis(t *testing.T) {
	srv := redistest.Start(t, redistest.Options{})
	p, err := startAfternoon(targetNaiveRedis, srv.Addr(), "")
	require.NoError(t, err)
	defer p.stop()
	answered, err := userRequest(t.Context(), p.client, "envoy", "k1", 1, []byte("hello"))
	require.NoError(t, err)
	require.False(t, answered, "the first request runs")
	answered, err = userRequest(t.Context(), p.client, "envoy", "k1", 2, []byte("hello"))
	require.NoError(t, err)
	require.True(t, answered, "the second is answered from the store")
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer rdb.Close()
	require.NoError(t, rdb.Set(t.Context(), "naive:k2", "", time.Minute).Err())
	_, err = userRequest(t.Context(), p.client, "envoy", "k2", 3, []byte("hello"))
	require.ErrorContains(t, err, "unexpected 409")
	cpu, err := p.cpu()
	require.NoError(t, err)
	require.GreaterOrEqual(t, cpu, time.Duration(0))
}

// TestUserBenchVariantAndProfiles runs -mode user's first executions on the memory store only,
// with a variant of the shipped binary and CPU profiles: the variant's line is printed against
// the null processor and the shipped binary, no replay or Redis row runs, and every process
// wrote a complete CPU profile (the shipped binaries' from their admin listeners).
func TestUserBenchVariantAndProfiles(t *testing.T) {
	prefix := filepath.Join(t.TempDir(), "user")
	o := userOptions{duration: 300 * time.Millisecond, rounds: 3, streams: 4, sizes: []int{33},
		logs: "file", routes: "chart", headers: "envoy", loads: []string{loadFirst},
		cpuprofile: prefix, variantEnv: []string{"GOGC=100"}}
	var out bytes.Buffer
	require.NoError(t, userBench(t.Context(), o, "", &out))
	t.Log("\n" + out.String())
	require.Contains(t, out.String(), "memory, first execution, 33 B: ")
	require.Contains(t, out.String(), "memory variant (. GOGC=100), first execution, 33 B: ")
	require.Contains(t, out.String(), "× memory [")
	require.NotContains(t, out.String(), "replay")
	require.NotContains(t, out.String(), "redis")
	require.NotContains(t, out.String(), "NaN")
	for _, name := range []string{targetPlainNull, targetShippedMemory, targetVariantMemory} {
		f, err := os.Open(prefix + userProfileSuffix[name])
		require.NoError(t, err, name)
		zr, err := gzip.NewReader(f)
		require.NoError(t, err, name)
		n, err := io.Copy(io.Discard, zr)
		require.NoError(t, err, "a complete CPU profile of %s", name)
		require.Positive(t, n, name)
		require.NoError(t, f.Close())
	}
}

func TestUserLoadList(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []string
		err  string
	}{
		{in: "first execution,replay", want: []string{loadFirst, loadReplay}},
		{in: " replay ", want: []string{loadReplay}},
		{in: "first", err: `"first" is neither`},
		{in: " , ", err: "no load"},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := userLoadList(tc.in)
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

// TestLeaseLostCounted: a request whose pending record Redis drops while it runs upstream (as
// the costs mode's allkeys-lru bound may evict it) is counted among the failures and as a lease
// lost, which the costs mode reports apart; a clean request is neither.
func TestLeaseLostCounted(t *testing.T) {
	srv := redistest.Start(t, redistest.Options{})
	admin := srv.Client(t)
	ctx := t.Context()
	tp, err := startTarget(targetRedis, srv.Addr(), 0)
	require.NoError(t, err)
	t.Cleanup(tp.stop)
	conn, err := grpc.NewClient("passthrough:///"+tp.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	client := extprocv3.NewExternalProcessorClient(conn)

	before, err := tp.counters(ctx)
	require.NoError(t, err)
	require.NoError(t, requestShaped(ctx, client, workloadFirst, seq.Add(1), sized(1<<10), "", nil))
	clean, err := tp.counters(ctx)
	require.NoError(t, err)
	require.Zero(t, clean.Failures-before.Failures)
	require.Zero(t, clean.LeasesLost-before.LeasesLost)

	require.NoError(t, requestShaped(ctx, client, workloadFirst, seq.Add(1), sized(1<<10), "", func() {
		keys, err := admin.Keys(ctx, recordKeys).Result()
		require.NoError(t, err)
		require.Len(t, keys, 2, "the clean request's record and this one's pending record")
		for _, k := range keys {
			if v, _ := admin.Get(ctx, k).Result(); len(v) > 1 && v[1] == 'p' {
				require.NoError(t, admin.Del(ctx, k).Err(), "evicted")
			}
		}
	}))
	lost, err := tp.counters(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), lost.Failures-clean.Failures, "its outcome is store_error")
	require.Equal(t, int64(1), lost.LeasesLost-clean.LeasesLost)
}

// The processor's peak RSS is its own, not that of the larger process that started it: Linux
// counts the parent's peak into getrusage's maxrss of a child started as the Go runtime does.
func TestPeakRSSIsTheProcessOwn(t *testing.T) {
	const envChild = "IDEMPOTENCY_BENCH_TEST_PEAK"
	if os.Getenv(envChild) != "" {
		_, rss := processUsage()
		fmt.Printf("peak %d\n", rss)
		return
	}
	hog := make([]byte, 256<<20)
	for i := 0; i < len(hog); i += os.Getpagesize() {
		hog[i] = 1 // resident
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestPeakRSSIsTheProcessOwn$")
	cmd.Env = append(os.Environ(), envChild+"=1")
	out, err := cmd.Output()
	require.NoError(t, err)
	var rss int64
	_, err = fmt.Sscanf(string(out), "peak %d", &rss)
	require.NoError(t, err, "%s", out)
	require.Positive(t, rss)
	require.Less(t, rss, int64(len(hog)), "the child read its parent's peak")
	t.Logf("the child's own peak %d MiB; getrusage's maxrss says %d MiB", rss>>20, cmd.ProcessState.SysUsage().(*syscall.Rusage).Maxrss>>10)
}
