package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
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
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/extproctest"
)

type options struct {
	duration  time.Duration
	rounds    int // the duration is split in rounds that alternate the targets
	streams   int
	redisAddr string // "" skips the Redis target
	// only, when set, runs just the workloads and targets it names.
	only map[string]bool
}

func (o options) runs(name string) bool { return len(o.only) == 0 || o.only[name] }

// Workloads, in the order they are printed.
const (
	workloadUncovered = "uncovered GET"
	workloadFirst     = "first execution"
	workloadReplay    = "replay"
)

var workloads = []string{workloadUncovered, workloadFirst, workloadReplay}

// Targets.
const (
	targetNull   = "null processor"
	targetMemory = "memory store"
	targetRedis  = "redis store"
)

// cell is the result of one workload against one target.
type cell struct {
	workload, target string
	requests         int
	elapsed          time.Duration
	p50, p99         time.Duration
	storeCalls       float64       // store operations per request
	redisCommands    float64       // commands sent to Redis per request
	redisTrips       float64       // round trips to Redis per request (pipelined calls share one)
	cpu              time.Duration // this process' CPU time (client and processor)
	redisCPU         time.Duration // redis-server's CPU time
	hasStore         bool
	hasRedis         bool
}

func (c cell) rps() float64 { return float64(c.requests) / c.elapsed.Seconds() }

type result struct {
	opts         options
	cells        []cell
	redisBenchRP float64 // redis-benchmark requests/s, 0 when not measured
}

func (r result) find(workload, target string) (cell, bool) {
	for _, c := range r.cells {
		if c.workload == workload && c.target == target {
			return c, true
		}
	}
	return cell{}, false
}

func (r result) print(w io.Writer) {
	fmt.Fprintf(w, "%d concurrent streams, %v per cell in %d alternating rounds, GOMAXPROCS %d\n\n", r.opts.streams, r.opts.duration, r.opts.rounds, gomaxprocs())
	fmt.Fprintf(w, "| workload | target | requests/s | p50 | p99 | × null | p99 added | store calls/req | Redis commands/req | Redis round trips/req | CPU µs/req (bench process) | Redis CPU µs/req |\n")
	fmt.Fprintf(w, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
	for _, c := range r.cells {
		null, _ := r.find(c.workload, targetNull)
		ratio, added := "1.00", "—"
		if c.target != targetNull {
			ratio = fmt.Sprintf("%.2f", c.rps()/null.rps())
			added = fmtDur(c.p99 - null.p99)
		}
		store, cmds, trips := "—", "—", "—"
		if c.hasStore {
			store = fmt.Sprintf("%.2f", c.storeCalls)
		}
		if c.hasRedis {
			cmds = fmt.Sprintf("%.2f", c.redisCommands)
			trips = fmt.Sprintf("%.2f", c.redisTrips)
		}
		redisCPU := "—"
		if c.hasRedis {
			redisCPU = fmt.Sprintf("%.1f", perRequest(c.redisCPU, c.requests))
		}
		fmt.Fprintf(w, "| %s | %s | %.0f | %s | %s | %s | %s | %s | %s | %s | %.1f | %s |\n",
			c.workload, c.target, c.rps(), fmtDur(c.p50), fmtDur(c.p99), ratio, added, store, cmds, trips,
			perRequest(c.cpu, c.requests), redisCPU)
	}
	if r.redisBenchRP > 0 {
		fmt.Fprintf(w, "\nredis-benchmark, one round trip (HSET) at %d connections: %.0f requests/s — the ceiling of one Redis for a replay (1 round trip); a first execution needs 2.\n", r.opts.streams, r.redisBenchRP)
	}
}

func gomaxprocs() int { return runtime.GOMAXPROCS(0) }

func perRequest(d time.Duration, n int) float64 { return float64(d.Microseconds()) / float64(n) }

// processCPU is the CPU time this process has used.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
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

func fmtDur(d time.Duration) string {
	return fmt.Sprintf("%.2fms", float64(d)/float64(time.Millisecond))
}

// compare runs every workload against every target.
func compare(ctx context.Context, o options) (result, error) {
	res := result{opts: o}
	type target struct {
		name  string
		addr  string
		calls *atomic.Int64 // store calls, nil for the null processor
		cmds  *atomic.Int64 // Redis commands, nil without Redis
		trips *atomic.Int64 // Redis round trips, nil without Redis
		redis *redis.Client // for redis-server's CPU time, nil without Redis
		stop  func()
	}
	var targets []target

	null, stop, err := serve(extproctest.NullProcessor{})
	if err != nil {
		return res, err
	}
	targets = append(targets, target{name: targetNull, addr: null, stop: stop})

	mem, err := cache.NewMemory(cache.MemoryOptions{})
	if err != nil {
		return res, err
	}
	memCalls := &atomic.Int64{}
	addr, stop, err := serveProcessor(&countingStore{Store: mem, calls: memCalls})
	if err != nil {
		return res, err
	}
	targets = append(targets, target{name: targetMemory, addr: addr, calls: memCalls, stop: stop})

	if o.redisAddr != "" {
		rs, err := cache.OpenRedis(cache.RedisOptions{URL: "redis://" + o.redisAddr + "/0", Timeout: time.Second, PoolSize: 4 * o.streams})
		if err != nil {
			return res, err
		}
		cmds, trips := &atomic.Int64{}, &atomic.Int64{}
		rs.Client().AddHook(commandCounter{commands: cmds, trips: trips})
		redisCalls := &atomic.Int64{}
		addr, stop, err := serveProcessor(&countingStore{Store: rs, calls: redisCalls})
		if err != nil {
			return res, err
		}
		admin := redis.NewClient(&redis.Options{Addr: o.redisAddr})
		defer admin.Close()
		targets = append(targets, target{name: targetRedis, addr: addr, calls: redisCalls, cmds: cmds, trips: trips, redis: admin, stop: stop})
	}
	defer func() {
		for _, t := range targets {
			t.stop()
		}
	}()

	for _, w := range workloads {
		if !o.runs(w) {
			continue
		}
		var ts []target
		for _, t := range targets {
			if t.name == targetNull || o.runs(t.name) {
				ts = append(ts, t)
			}
		}
		clients := make([]extprocv3.ExternalProcessorClient, len(ts))
		for i, t := range ts {
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
		// Rounds alternate the targets, so that a drift of the machine's speed affects all alike.
		cells := make([]cell, len(ts))
		var lats [][]time.Duration = make([][]time.Duration, len(ts))
		for range o.rounds {
			for i, t := range ts {
				var calls0, cmds0, trips0 int64
				if t.calls != nil {
					calls0 = t.calls.Load()
				}
				if t.cmds != nil {
					cmds0, trips0 = t.cmds.Load(), t.trips.Load()
				}
				var redis0 time.Duration
				if t.redis != nil {
					redis0 = redisServerCPU(ctx, t.redis)
				}
				cpu0 := processCPU()
				c, lat, err := driveLatencies(ctx, clients[i], w, o.streams, o.duration/time.Duration(o.rounds))
				if err != nil {
					return res, fmt.Errorf("%s, %s: %w", w, t.name, err)
				}
				cells[i].cpu += processCPU() - cpu0
				if t.redis != nil {
					cells[i].redisCPU += redisServerCPU(ctx, t.redis) - redis0
				}
				cells[i].requests += c.requests
				cells[i].elapsed += c.elapsed
				lats[i] = append(lats[i], lat...)
				if t.calls != nil {
					cells[i].hasStore = true
					cells[i].storeCalls += float64(t.calls.Load() - calls0)
				}
				if t.cmds != nil {
					cells[i].hasRedis = true
					cells[i].redisCommands += float64(t.cmds.Load() - cmds0)
					cells[i].redisTrips += float64(t.trips.Load() - trips0)
				}
			}
		}
		for i, t := range ts {
			c := cells[i]
			c.workload, c.target = w, t.name
			c.storeCalls /= float64(c.requests)
			c.redisCommands /= float64(c.requests)
			c.redisTrips /= float64(c.requests)
			slices.Sort(lats[i])
			c.p50, c.p99 = lats[i][len(lats[i])/2], lats[i][len(lats[i])*99/100]
			res.cells = append(res.cells, c)
		}
	}
	if o.redisAddr != "" {
		res.redisBenchRP = redisBenchmark(o.redisAddr, o.streams)
	}
	return res, nil
}

// seq numbers requests across runs, so that first executions always use fresh keys.
var seq atomic.Int64

// drive runs one workload on streams concurrent streams for d.
func drive(ctx context.Context, client extprocv3.ExternalProcessorClient, workload string, streams int, d time.Duration) (cell, error) {
	c, _, err := driveLatencies(ctx, client, workload, streams, d)
	return c, err
}

// driveLatencies is drive that also returns every request's latency.
func driveLatencies(ctx context.Context, client extprocv3.ExternalProcessorClient, workload string, streams int, d time.Duration) (cell, []time.Duration, error) {
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		all      []time.Duration
		firstErr error
	)
	deadline := time.Now().Add(d)
	start := time.Now()
	for range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var lat []time.Duration
			for time.Now().Before(deadline) {
				t0 := time.Now()
				if err := request(ctx, client, workload, seq.Add(1)); err != nil {
					mu.Lock()
					firstErr = cmpErr(firstErr, err)
					mu.Unlock()
					return
				}
				lat = append(lat, time.Since(t0))
			}
			mu.Lock()
			all = append(all, lat...)
			mu.Unlock()
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

// request plays one HTTP request's ext_proc exchange as Envoy does: lock-step messages,
// honouring mode_override and ImmediateResponse, then a half-close and a reset.
func request(ctx context.Context, client extprocv3.ExternalProcessorClient, workload string, n int64) error {
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

	method, key, hasBody := "POST", "", true
	switch workload {
	case workloadUncovered:
		method, hasBody = "GET", false
	case workloadFirst:
		key = "first-" + strconv.FormatInt(n, 10)
	case workloadReplay:
		key = "replayed-key"
	}
	hs := []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte(method)},
		{Key: ":path", RawValue: []byte("/v1/payments")},
		{Key: ":authority", RawValue: []byte("api.example.com")},
		{Key: ":scheme", RawValue: []byte("https")},
		{Key: "content-type", RawValue: []byte("application/json")},
		{Key: "authorization", RawValue: []byte("Bearer 0123456789abcdef")},
		{Key: "x-request-id", RawValue: []byte("6f1c2b1e-" + strconv.FormatInt(n, 10))},
	}
	if key != "" {
		hs = append(hs, &corev3.HeaderValue{Key: "idempotency-key", RawValue: []byte(key)})
	}
	resp, err := exchange(&extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: hs}, EndOfStream: !hasBody,
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
			RequestBody: &extprocv3.HttpBody{Body: requestBody, EndOfStream: true},
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
			ResponseBody: &extprocv3.HttpBody{Body: responseBody, EndOfStream: true},
		}}); err != nil {
			return err
		}
	}
	return nil
}

// serve runs an ExternalProcessor on a loopback port with the binary's gRPC options.
func serve(p extprocv3.ExternalProcessorServer) (string, func(), error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	gs := grpc.NewServer(grpc.MaxRecvMsgSize(64 << 20))
	extprocv3.RegisterExternalProcessorServer(gs, p)
	go func() { _ = gs.Serve(lis) }()
	return lis.Addr().String(), gs.Stop, nil
}

func serveProcessor(store cache.Store) (string, func(), error) {
	srv, err := extproc.NewServer(extproc.Options{Store: store, Policy: benchPolicy()})
	if err != nil {
		return "", nil, err
	}
	return serve(srv)
}

// benchPolicy is the default policy with a store_timeout that tolerates a saturated machine.
func benchPolicy() *policy.Policy {
	p, err := policy.Parse([]byte("store_timeout: 2s"))
	if err != nil {
		panic(err)
	}
	return p
}

// countingStore counts store operations.
type countingStore struct {
	cache.Store
	calls *atomic.Int64
}

func (c *countingStore) Acquire(ctx context.Context, key string, cl cache.Claim) (cache.Lease, *cache.Record, error) {
	c.calls.Add(1)
	return c.Store.Acquire(ctx, key, cl)
}

func (c *countingStore) Renew(ctx context.Context, l cache.Lease, d time.Duration) error {
	c.calls.Add(1)
	return c.Store.Renew(ctx, l, d)
}

func (c *countingStore) Complete(ctx context.Context, l cache.Lease, r cache.Response) error {
	c.calls.Add(1)
	return c.Store.Complete(ctx, l, r)
}

func (c *countingStore) Release(ctx context.Context, l cache.Lease) error {
	c.calls.Add(1)
	return c.Store.Release(ctx, l)
}

// commandCounter counts the store's commands go-redis sends (SET for an acquire, scripts for
// the rest) and the round trips they take: one per command sent alone, one per pipelined batch.
// Connection set-up (HELLO) is not counted.
type commandCounter struct{ commands, trips *atomic.Int64 }

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
		for _, c := range cmds {
			if isStoreCommand(c) {
				h.commands.Add(1)
			}
		}
		h.trips.Add(1)
		return next(ctx, cmds)
	}
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
func startRedis() (string, func(), error) {
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
	cmd := exec.Command(bin, "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", dir, "--logfile", filepath.Join(dir, "redis.log"))
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
