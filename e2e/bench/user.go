package main

// -mode user measures the processor as a user deploying it would: the binary built as the
// Dockerfile builds it, started as a child process with the chart's default settings, against
// two processors a user could write in an afternoon, each a child process too: a null processor
// (an empty answer to every message) and a naive Redis processor (SET NX at the request body,
// GET on a taken key, SET of the status and body at the response's end; nothing else). Both are
// written plainly, on a grpc.NewServer() without options, as such a user would.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idempotency-extproc/idempotency-extproc/internal/extproctest"
)

// The afternoon processors, served by this executable in a child process (serveFromEnv).
const (
	targetPlainNull  = "null"
	targetNaiveRedis = "naive redis"
	// The shipped binary, on each store.
	targetShippedMemory = "memory"
	targetShippedRedis  = "redis"
	// A variant of the shipped binary (-user-variant, -user-variant-env) on each store, to
	// compare a change with the binary as built in the same rounds.
	targetVariantMemory = "memory variant"
	targetVariantRedis  = "redis variant"
)

// Loads of -mode user.
const (
	loadFirst  = "first execution"
	loadReplay = "replay"
)

// userOptions are -mode user's settings.
type userOptions struct {
	duration time.Duration // each cell's time, split over the rounds
	rounds   int
	streams  int
	sizes    []int // request and response body sizes of the first-execution and replay loads
	growth   []int // body sizes of the growth section (memory store, first executions)
	// The variants the reconciliation table measures one at a time; each default is the chart's.
	logs    string   // "file" (the chart's: the container's output, which the node writes to a file) or "discard"
	routes  string   // "chart" (three routes, the measured path matched by the last) or "one"
	headers string   // "envoy" (the header set Envoy sends) or "short" (method, path, key)
	redis   bool     // whether the Redis rows run
	loads   []string // the loads of the first-execution and replay rows (default both)
	// cpuprofile, when set, is the prefix of each process' CPU profile over the whole run:
	// .null and .naive-redis from the afternoon processors, .shipped-memory and .shipped-redis
	// from the shipped binary's /debug/pprof/profile (--admin-pprof=true).
	cpuprofile string
	// variantBin and variantEnv, when either is set, add a variant of the shipped binary on the
	// memory store, and on Redis when the Redis rows run: variantBin's binary (default the one
	// built), with variantEnv added to its environment.
	variantBin string
	variantEnv []string
}

// userLoadList parses -user-loads.
func userLoadList(s string) ([]string, error) {
	var out []string
	for _, f := range strings.Split(s, ",") {
		switch f = strings.TrimSpace(f); f {
		case "":
		case loadFirst, loadReplay:
			out = append(out, f)
		default:
			return nil, fmt.Errorf("-user-loads: %q is neither %q nor %q", f, loadFirst, loadReplay)
		}
	}
	if len(out) == 0 {
		return nil, errors.New("-user-loads: no load")
	}
	return out, nil
}

// userProfileSuffix names each -mode user process' CPU profile.
var userProfileSuffix = map[string]string{
	targetPlainNull: ".null", targetNaiveRedis: ".naive-redis",
	targetShippedMemory: ".shipped-memory", targetShippedRedis: ".shipped-redis",
	targetVariantMemory: ".variant-memory", targetVariantRedis: ".variant-redis",
}

// userPolicy is the policy the shipped binary runs: the measured path (/v1/payments) is matched
// by a later route, after a disabled prefix route and a path_regex route, as in a real policy.
func userPolicy(routes string) string {
	if routes == "one" {
		return "routes:\n  - name: payments\n    match: { path_prefix: /v1/payments }\n"
	}
	return `routes:
  - name: health
    match: { path_prefix: /healthz }
    enabled: false
  - name: ledger-transactions
    match: { path_regex: '^/v1/organizations/(?P<org>[^/]+)/ledgers/(?P<ledger>[^/]+)/transactions' }
    scope_path_params: [org, ledger]
  - name: payments
    match: { path_prefix: /v1/payments }
`
}

// userProcess is one child process under measurement.
type userProcess struct {
	name   string
	admin  string // the shipped binary's admin address
	cmd    *exec.Cmd
	conn   *grpc.ClientConn
	client extprocv3.ExternalProcessorClient
	stop   func()
}

// cpu is the CPU time the process has used, every thread, from /proc/PID/stat.
func (p *userProcess) cpu() (time.Duration, error) {
	return procCPU(p.cmd.Process.Pid)
}

// procCPU reads utime and stime (clock ticks of 1/100 s on Linux) of pid.
func procCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, errors.New("bench: /proc stat without a command name")
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, errors.New("bench: /proc stat too short")
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return 0, err
	}
	return time.Duration(ut+st) * 10 * time.Millisecond, nil
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// buildShipped builds the binary as the Dockerfile does and returns its path.
func buildShipped(dir string) (string, error) {
	root, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("bench: go env GOMOD: %w", err)
	}
	bin := filepath.Join(dir, "idempotency-extproc")
	cmd := exec.Command("go", "build", "-trimpath", "-tags", "vtprotobuf", "-ldflags=-s -w", "-o", bin, "./cmd/idempotency-extproc")
	cmd.Dir = filepath.Dir(strings.TrimSpace(string(root)))
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	cmd.Stderr = os.Stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("bench: building the binary: %w", err)
	}
	return bin, nil
}

// startShipped starts the shipped binary with the chart's default settings (json logs at info on
// its output, written to a file; the admin listener with its metrics on) on the given store.
func startShipped(bin, dir, store, redisAddr string, env []string, o userOptions) (*userProcess, error) {
	grpcAddr, err := freeAddr()
	if err != nil {
		return nil, err
	}
	adminAddr, err := freeAddr()
	if err != nil {
		return nil, err
	}
	policyFile := filepath.Join(dir, "policy-"+o.routes+".yaml")
	if err := os.WriteFile(policyFile, []byte(userPolicy(o.routes)), 0o644); err != nil {
		return nil, err
	}
	args := []string{"--config=" + policyFile, "--grpc-addr=" + grpcAddr, "--admin-addr=" + adminAddr,
		"--store=" + store, "--log-level=info", "--log-format=json"}
	if store == "redis" {
		args = append(args, "--redis-url=redis://"+redisAddr+"/0")
	}
	if o.cpuprofile != "" {
		args = append(args, "--admin-pprof=true")
	}
	cmd := dieWithBench(exec.Command(bin, args...))
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, env...)
	var logFile *os.File
	if o.logs == "discard" {
		logFile, err = os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	} else {
		logFile, err = os.CreateTemp(dir, "processor-"+store+"-*.log")
	}
	if err != nil {
		return nil, err
	}
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		_ = logFile.Close()
		return nil, err
	}
	stop := func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = logFile.Close()
	}
	// Ready: /readyz answers 200 once the store does.
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get("http://" + adminAddr + "/readyz")
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(deadline) {
			stop()
			return nil, fmt.Errorf("bench: the %s processor was not ready within 30 s", store)
		}
		time.Sleep(50 * time.Millisecond)
	}
	p, err := dialUser("shipped "+store, cmd, grpcAddr, stop)
	if err == nil {
		p.admin = adminAddr
	}
	return p, err
}

// gcLine is what the shipped binary's /metrics says of its collector and heap, for -cpuprofile's
// summary; "" for another process.
func (p *userProcess) gcLine() string {
	if p.admin == "" {
		return ""
	}
	resp, err := http.Get("http://" + p.admin + "/metrics")
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	var out []string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		for _, name := range []string{"go_gc_duration_seconds_count ", "go_memstats_heap_inuse_bytes ", "go_memstats_next_gc_bytes ", "process_resident_memory_bytes "} {
			if v, ok := strings.CutPrefix(sc.Text(), name); ok {
				out = append(out, strings.TrimSpace(name)+"="+v)
			}
		}
	}
	return "; " + strings.Join(out, " ")
}

// profileShipped takes a CPU profile of the shipped binary p for d from its admin listener
// and writes it to path; the returned function waits for it.
func profileShipped(p *userProcess, d time.Duration, path string) func() error {
	done := make(chan error, 1)
	go func() {
		done <- func() error {
			resp, err := http.Get("http://" + p.admin + "/debug/pprof/profile?seconds=" + strconv.Itoa(int(d.Seconds()+0.5)))
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				b, _ := io.ReadAll(resp.Body)
				return fmt.Errorf("bench: profiling %s: %s: %s", p.name, resp.Status, bytes.TrimSpace(b))
			}
			f, err := os.Create(path)
			if err != nil {
				return err
			}
			_, err = io.Copy(f, resp.Body)
			return errors.Join(err, f.Close())
		}()
	}()
	return func() error { return <-done }
}

// startAfternoon starts this executable as the null or the naive Redis processor.
func startAfternoon(name, redisAddr, cpuprofile string) (*userProcess, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := dieWithBench(exec.Command(exe))
	// The same environment as the shipped binary's: no GOGC, GOMAXPROCS or GODEBUG of the
	// caller's moves one process and not another.
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), envServe + "=" + name, envRedis + "=" + redisAddr}
	if cpuprofile != "" {
		cmd.Env = append(cmd.Env, envProfile+"="+cpuprofile)
	}
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
	stop := func() {
		// Closing stdin ends it, and writes its CPU profile; a process that does not end is
		// killed.
		_ = stdin.Close()
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		select {
		case <-exited:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		stop()
		return nil, fmt.Errorf("bench: %s did not start: %w", name, err)
	}
	return dialUser(name, cmd, strings.TrimSpace(line), stop)
}

func dialUser(name string, cmd *exec.Cmd, addr string, stop func()) (*userProcess, error) {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		stop()
		return nil, err
	}
	return &userProcess{name: name, cmd: cmd, conn: conn, client: extprocv3.NewExternalProcessorClient(conn),
		stop: func() { _ = conn.Close(); stop() }}, nil
}

// serveAfternoon serves the null or the naive Redis processor on a plain gRPC server until stdin
// closes. It prints the address on its first line.
func serveAfternoon(name, redisAddr string, stdin io.Reader, stdout io.Writer) error {
	var p extprocv3.ExternalProcessorServer
	switch name {
	case targetPlainNull:
		p = plainNull{}
	case targetNaiveRedis:
		rdb := redis.NewClient(&redis.Options{Addr: redisAddr})
		defer rdb.Close()
		p = &naiveRedis{rdb: rdb}
	default:
		return fmt.Errorf("no afternoon processor %q", name)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	gs := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(gs, p)
	go func() { _ = gs.Serve(lis) }()
	defer gs.Stop()
	if _, err := fmt.Fprintln(stdout, lis.Addr()); err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, stdin)
	return nil
}

// plainNull answers every message with an empty answer of its phase.
type plainNull struct {
	extprocv3.UnimplementedExternalProcessorServer
}

func (plainNull) Process(s extprocv3.ExternalProcessor_ProcessServer) error {
	for {
		req, err := s.Recv()
		if err != nil {
			return nil
		}
		if err := s.Send(emptyAnswer(req)); err != nil {
			return nil
		}
	}
}

func emptyAnswer(req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
	switch req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{}}}
	case *extprocv3.ProcessingRequest_RequestBody:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{}}}
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}}
	case *extprocv3.ProcessingRequest_ResponseBody:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{}}}
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}}
	default:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}}
	}
}

// naiveRedis is the idempotency processor a user could write in an afternoon on go-redis: SET NX
// of the key at the request body, GET on a taken key answered with the stored status and body or
// 409, SET of the status and body at the response's end. No scope, no fingerprint, no lease
// renewal, no owner check, no metrics, no logs.
type naiveRedis struct {
	extprocv3.UnimplementedExternalProcessorServer
	rdb *redis.Client
}

func (n *naiveRedis) Process(s extprocv3.ExternalProcessor_ProcessServer) error {
	ctx := s.Context()
	var key string
	var status string
	for {
		req, err := s.Recv()
		if err != nil {
			return nil
		}
		resp := emptyAnswer(req)
		switch m := req.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			for _, h := range m.RequestHeaders.GetHeaders().GetHeaders() {
				if h.GetKey() == "idempotency-key" {
					key = "naive:" + string(h.GetRawValue())
				}
			}
		case *extprocv3.ProcessingRequest_RequestBody:
			if key == "" {
				break
			}
			ok, err := n.rdb.SetNX(ctx, key, "", 30*time.Second).Result()
			if err != nil {
				return err
			}
			if !ok {
				stored, err := n.rdb.Get(ctx, key).Result()
				if err != nil && err != redis.Nil {
					return err
				}
				resp = naiveAnswer(stored)
				key = ""
			}
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			for _, h := range m.ResponseHeaders.GetHeaders().GetHeaders() {
				if h.GetKey() == ":status" {
					status = string(h.GetRawValue())
				}
			}
		case *extprocv3.ProcessingRequest_ResponseBody:
			if key != "" && m.ResponseBody.GetEndOfStream() {
				if err := n.rdb.Set(ctx, key, status+" "+string(m.ResponseBody.GetBody()), 24*time.Hour).Err(); err != nil {
					return err
				}
			}
		}
		if err := s.Send(resp); err != nil {
			return nil
		}
	}
}

// naiveAnswer is the immediate response to a taken key: the stored "STATUS BODY", or 409.
func naiveAnswer(stored string) *extprocv3.ProcessingResponse {
	code, body := 409, "request in progress"
	if st, b, ok := strings.Cut(stored, " "); ok {
		if c, err := strconv.Atoi(st); err == nil {
			code, body = c, b
		}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{
		Status: &typev3.HttpStatus{Code: typev3.StatusCode(code)}, Body: []byte(body),
	}}}
}

// The attributes Envoy sends with the shipped configuration (envoy/envoy.yaml): with the request
// headers the request's id (the same one each time here, of the length Envoy's have) and the
// route's name (connection.uri_san_peer_certificate fails without mTLS, and Envoy omits a failing
// expression), and with the response headers the response's code, origin and flags and the
// attempts upstream. Envoy sends the code, the flags and the count as numbers. And the metadata
// Envoy sends with every message, empty when the filter forwards no namespace
// (Filter::addDynamicMetadata in source/extensions/filters/http/ext_proc/ext_proc.cc sets
// metadata_context unconditionally).
var (
	userRequestAttributes = mustStruct(map[string]any{"request.id": "6f1c2b1e-9a4d-4c1e-8b1a-4d3c2b1a0f9e", "xds.route_name": "default"})
	userResponseAttrs     = mustStruct(map[string]any{"response.code": 201, "response.code_details": "via_upstream", "response.flags": 0, "upstream.request_attempt_count": 1})
	userMetadata          = &corev3.Metadata{}
)

// userHeaders is the request header set Envoy sends for a POST with a body (short: the least a
// processor needs).
func userHeaders(headers, key string, n int64, size int) []*corev3.HeaderValue {
	if headers == "short" {
		return []*corev3.HeaderValue{
			{Key: ":method", RawValue: []byte("POST")},
			{Key: ":path", RawValue: []byte("/v1/payments")},
			{Key: "idempotency-key", RawValue: []byte(key)},
		}
	}
	return extproctest.EnvoyRequestHeaders(key, "6f1c2b1e-9a4d-4c1e-8b1a-"+fmt.Sprintf("%012d", n), size)
}

// userRequest plays one request's ext_proc exchange as Envoy does under BUFFERED both ways, and
// reports whether the processor answered it at once (a replay, or a 409).
func userRequest(ctx context.Context, client extprocv3.ExternalProcessorClient, headers, key string, n int64, body []byte) (bool, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s, err := client.Process(ctx)
	if err != nil {
		return false, err
	}
	defer func() { _ = s.CloseSend() }()
	exchange := func(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, error) {
		if err := s.Send(m); err != nil {
			return nil, err
		}
		return s.Recv()
	}
	resp, err := exchange(&extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: userHeaders(headers, key, n, len(body))},
		}},
		Attributes:      userRequestAttributes,
		MetadataContext: userMetadata,
		ProtocolConfig: &extprocv3.ProtocolConfiguration{
			RequestBodyMode: filterextproc.ProcessingMode_BUFFERED, ResponseBodyMode: filterextproc.ProcessingMode_BUFFERED,
		},
	})
	if err != nil {
		return false, err
	}
	if ir := resp.GetImmediateResponse(); ir != nil {
		if ir.GetStatus().GetCode() >= 400 {
			return true, fmt.Errorf("unexpected %d at the request headers: %.200s", ir.GetStatus().GetCode(), ir.GetBody())
		}
		return true, nil
	}
	if resp, err = exchange(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true},
	}, MetadataContext: userMetadata}); err != nil {
		return false, err
	}
	if ir := resp.GetImmediateResponse(); ir != nil {
		if ir.GetStatus().GetCode() >= 400 {
			return true, fmt.Errorf("unexpected %d: %.200s", ir.GetStatus().GetCode(), ir.GetBody())
		}
		return true, nil
	}
	if resp, err = exchange(&extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
				{Key: ":status", RawValue: []byte("201")},
				{Key: "content-type", RawValue: []byte("application/json")},
				{Key: "content-length", RawValue: []byte(strconv.Itoa(len(body)))},
				{Key: "date", RawValue: []byte("Mon, 07 Dec 2026 10:00:00 GMT")},
				{Key: "x-envoy-upstream-service-time", RawValue: []byte("3")},
			}},
		}},
		Attributes:      userResponseAttrs,
		MetadataContext: userMetadata,
	}); err != nil {
		return false, err
	}
	if mo := resp.GetModeOverride(); mo != nil && mo.GetResponseBodyMode() == filterextproc.ProcessingMode_NONE {
		return false, errors.New("the response was not captured")
	}
	_, err = exchange(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: body, EndOfStream: true},
	}, MetadataContext: userMetadata})
	return false, err
}

// userCell is one load against one process in one round.
type userCell struct {
	requests int64
	failures int64
	elapsed  time.Duration
	cpu      time.Duration // the process's
	redisCPU time.Duration // redis-server's, 0 without Redis
}

func (c userCell) rps() float64 { return float64(c.requests) / c.elapsed.Seconds() }

// cpuPer is the process's CPU per request, in µs.
func (c userCell) cpuPer() float64 {
	return float64(c.cpu.Microseconds()) / float64(max(c.requests, 1))
}

// redisPer is redis-server's CPU per request, in µs.
func (c userCell) redisPer() float64 {
	return float64(c.redisCPU.Microseconds()) / float64(max(c.requests, 1))
}

var userKeys atomic.Int64

// driveUser runs load on p with streams concurrent streams for d. Each stream sends one request
// at least, however late its goroutine runs (as driveLatencies).
func driveUser(ctx context.Context, p *userProcess, admin *redis.Client, load, headers string, size, streams int, d time.Duration) (userCell, error) {
	body := bytes.Repeat([]byte("b"), size)
	replayKey := "replay-" + strconv.Itoa(size)
	if load == loadReplay {
		// The first request with the key records it; the cell replays it.
		if _, err := userRequest(ctx, p.client, headers, replayKey, 0, body); err != nil {
			return userCell{}, fmt.Errorf("%s: recording the replayed key: %w", p.name, err)
		}
	}
	var redisBefore time.Duration
	if admin != nil {
		redisBefore = redisServerCPU(ctx, admin)
	}
	cpuBefore, err := p.cpu()
	if err != nil {
		return userCell{}, err
	}
	var (
		requests, failures atomic.Int64
		firstErr           error
		errOnce            sync.Once
		wg                 sync.WaitGroup
	)
	start := time.Now()
	deadline := start.Add(d)
	for range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for first := true; first || time.Now().Before(deadline); first = false {
				n := userKeys.Add(1)
				key := replayKey
				if load == loadFirst {
					key = "first-" + strconv.FormatInt(n, 10)
				}
				answered, err := userRequest(ctx, p.client, headers, key, n, body)
				switch {
				case err != nil:
				case load == loadReplay && !answered && p.name != targetPlainNull:
					err = errors.New("a replay ran upstream")
				case load == loadFirst && answered:
					err = errors.New("a first execution was answered without running upstream")
				}
				if err != nil {
					failures.Add(1)
					errOnce.Do(func() { firstErr = err })
					continue
				}
				requests.Add(1)
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	// A stream's last work (the shipped binary's log line) follows its last answer, and the
	// binary writes its log lines in batches every 50 ms: the cell's last batch is its own.
	time.Sleep(150 * time.Millisecond)
	cpuAfter, err := p.cpu()
	if err != nil {
		return userCell{}, err
	}
	c := userCell{requests: requests.Load(), failures: failures.Load(), elapsed: elapsed, cpu: cpuAfter - cpuBefore}
	if admin != nil {
		c.redisCPU = redisServerCPU(ctx, admin) - redisBefore
	}
	if c.failures > c.requests/100 {
		return c, fmt.Errorf("%s, %s, %d B: %d of %d requests failed, the first: %w", p.name, load, size, c.failures, c.requests+c.failures, firstErr)
	}
	return c, nil
}

// userKey names a cell's results: load, size and process.
type userKey struct {
	load    string
	size    int
	process string
}

// userResult holds every round of every cell.
type userResult struct {
	o      userOptions
	rounds map[userKey][]userCell
	// shaCopy is the CPU of one SHA-256 and one copy of a body of each growth size, in µs.
	shaCopy map[int]float64
}

// userBench runs -mode user.
func userBench(ctx context.Context, o userOptions, redisAddr string, w io.Writer) error {
	dir, err := os.MkdirTemp("", "bench-user")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	bin, err := buildShipped(dir)
	if err != nil {
		return err
	}
	var admin *redis.Client
	if o.redis {
		admin = redis.NewClient(&redis.Options{Addr: redisAddr})
		defer admin.Close()
		if err := admin.FlushAll(ctx).Err(); err != nil {
			return err
		}
	}
	procs := map[string]*userProcess{}
	defer func() {
		for _, p := range procs {
			p.stop()
		}
	}()
	if procs[targetPlainNull], err = startAfternoon(targetPlainNull, redisAddr, o.cpuprofile); err != nil {
		return err
	}
	if procs[targetShippedMemory], err = startShipped(bin, dir, "memory", "", nil, o); err != nil {
		return err
	}
	names := []string{targetPlainNull, targetShippedMemory}
	vbin := bin
	if o.variantBin != "" {
		vbin = o.variantBin
	}
	if o.variantBin != "" || len(o.variantEnv) > 0 {
		if procs[targetVariantMemory], err = startShipped(vbin, dir, "memory", "", o.variantEnv, o); err != nil {
			return err
		}
		names = append(names, targetVariantMemory)
	}
	if o.redis {
		if procs[targetNaiveRedis], err = startAfternoon(targetNaiveRedis, redisAddr, o.cpuprofile); err != nil {
			return err
		}
		if procs[targetShippedRedis], err = startShipped(bin, dir, "redis", redisAddr, nil, o); err != nil {
			return err
		}
		names = append(names, targetNaiveRedis, targetShippedRedis)
		if procs[targetVariantMemory] != nil {
			if procs[targetVariantRedis], err = startShipped(vbin, dir, "redis", redisAddr, o.variantEnv, o); err != nil {
				return err
			}
			names = append(names, targetVariantRedis)
		}
	}
	res := userResult{o: o, rounds: map[userKey][]userCell{}, shaCopy: map[int]float64{}}
	per := o.duration / time.Duration(o.rounds)
	type job struct {
		load  string
		size  int
		names []string
	}
	var jobs []job
	for _, size := range o.sizes {
		for _, load := range o.loads {
			jobs = append(jobs, job{load, size, names})
		}
	}
	for _, size := range o.growth {
		if !slices.Contains(o.sizes, size) || !slices.Contains(o.loads, loadFirst) {
			jobs = append(jobs, job{loadFirst, size, []string{targetPlainNull, targetShippedMemory}})
		}
	}
	if o.cpuprofile != "" {
		// The shipped binaries' profiles span the whole run: every cell, on each process in turn.
		var whole time.Duration
		for _, j := range jobs {
			whole += per * time.Duration(len(j.names)*o.rounds)
		}
		for _, name := range []string{targetShippedMemory, targetVariantMemory, targetShippedRedis, targetVariantRedis} {
			if p := procs[name]; p != nil {
				wait := profileShipped(p, whole+time.Second, o.cpuprofile+userProfileSuffix[name])
				defer func() {
					if err := wait(); err != nil {
						fmt.Fprintln(os.Stderr, "bench:", err)
					}
				}()
			}
		}
	}
	for r := range o.rounds {
		for _, j := range jobs {
			// Each round starts the alternation at another process, and every other round takes
			// them in reverse, so that no process always runs right after another (the Redis
			// keyspace grows along a round).
			for i := range j.names {
				at := (i + r) % len(j.names)
				if r%2 == 1 {
					at = len(j.names) - 1 - at
				}
				name := j.names[at]
				var a *redis.Client
				if name == targetNaiveRedis || name == targetShippedRedis || name == targetVariantRedis {
					a = admin
				}
				c, err := driveUser(ctx, procs[name], a, j.load, o.headers, j.size, o.streams, per)
				if err != nil {
					return err
				}
				k := userKey{j.load, j.size, name}
				res.rounds[k] = append(res.rounds[k], c)
			}
		}
		fmt.Fprintf(os.Stderr, "bench: round %d of %d done\n", r+1, o.rounds)
	}
	for _, size := range o.growth {
		res.shaCopy[size] = shaCopyMicros(size)
	}
	if o.cpuprofile != "" {
		// A profile's samples over these are its CPU per request.
		for _, name := range names {
			var n int64
			var cpu time.Duration
			for k, cells := range res.rounds {
				if k.process == name {
					for _, c := range cells {
						n, cpu = n+c.requests, cpu+c.cpu
					}
				}
			}
			fmt.Fprintf(os.Stderr, "bench: %s%s: %d requests, %s of CPU in them%s\n", o.cpuprofile, userProfileSuffix[name], n, cpu, procs[name].gcLine())
		}
	}
	res.print(w)
	return nil
}

// shaCopyMicros is the CPU, in µs, of one SHA-256 and one copy of size bytes, in this process.
func shaCopyMicros(size int) float64 {
	src := bytes.Repeat([]byte("b"), size)
	dst := make([]byte, size)
	n := max(1, (256<<20)/max(size, 1))
	n = min(n, 200000)
	start := processCPU()
	for range n {
		copy(dst, src)
		_ = sha256.Sum256(dst)
	}
	return float64((processCPU() - start).Microseconds()) / float64(n)
}

// paired is the median and range of f over the rounds of a and b, taken round by round.
func paired(a, b []userCell, f func(a, b userCell) float64) (med, lo, hi float64) {
	var v []float64
	for i := range min(len(a), len(b)) {
		v = append(v, f(a[i], b[i]))
	}
	if len(v) == 0 {
		return 0, 0, 0
	}
	slices.Sort(v)
	return v[len(v)/2], v[0], v[len(v)-1]
}

func (r userResult) get(load string, size int, name string) []userCell {
	return r.rounds[userKey{load, size, name}]
}

func (r userResult) print(w io.Writer) {
	o := r.o
	fmt.Fprintf(w, "idempotency-extproc as shipped (go build -trimpath -tags vtprotobuf -ldflags='-s -w', CGO_ENABLED=0), chart defaults (info logs, json, to %s; admin and metrics on), policy routes %q, headers %q\n",
		map[string]string{"file": "a file", "discard": "/dev/null"}[o.logs], o.routes, o.headers)
	fmt.Fprintf(w, "%d CPUs, %s, %d streams, BUFFERED both ways, %d interleaved rounds of %s per cell; medians [min, max] of the rounds\n\n",
		runtime.NumCPU(), runtime.Version(), o.streams, o.rounds, (o.duration / time.Duration(o.rounds)).Round(time.Millisecond))
	ratio := func(a, b userCell) float64 { return a.rps() / b.rps() }
	cpuOver := func(a, b userCell) float64 { return a.cpuPer() - b.cpuPer() }
	redisRatio := func(a, b userCell) float64 { return a.redisPer() / max(b.redisPer(), 0.001) }
	for _, size := range o.sizes {
		for _, load := range o.loads {
			null := r.get(load, size, targetPlainNull)
			mem := r.get(load, size, targetShippedMemory)
			m, lo, hi := paired(mem, null, ratio)
			c, clo, chi := paired(mem, null, cpuOver)
			fmt.Fprintf(w, "memory, %s, %s: %.2f× null [%.2f, %.2f], %+.1f µs CPU over null [%+.1f, %+.1f]\n",
				load, fmtBytes(size), m, lo, hi, c, clo, chi)
			if v := r.get(load, size, targetVariantMemory); len(v) > 0 {
				m, lo, hi := paired(v, null, ratio)
				c, clo, chi := paired(v, null, cpuOver)
				vm, vlo, vhi := paired(v, mem, ratio)
				vc, vclo, vchi := paired(v, mem, cpuOver)
				fmt.Fprintf(w, "memory variant (%s %s), %s, %s: %.2f× null [%.2f, %.2f], %+.1f µs CPU over null [%+.1f, %+.1f]; %.2f× memory [%.2f, %.2f], %+.1f µs CPU over memory [%+.1f, %+.1f]\n",
					filepath.Base(o.variantBin), strings.Join(o.variantEnv, " "), load, fmtBytes(size), m, lo, hi, c, clo, chi, vm, vlo, vhi, vc, vclo, vchi)
			}
			if !o.redis {
				continue
			}
			naive := r.get(load, size, targetNaiveRedis)
			red := r.get(load, size, targetShippedRedis)
			nm, _, _ := paired(naive, null, ratio)
			rm, _, _ := paired(red, null, ratio)
			km, klo, khi := paired(red, naive, ratio)
			kc, kclo, kchi := paired(red, naive, cpuOver)
			rr, rrlo, rrhi := paired(red, naive, redisRatio)
			rc, rclo, rchi := paired(red, null, cpuOver)
			rs, _, _ := paired(red, red, func(a, _ userCell) float64 { return a.redisPer() })
			ns, _, _ := paired(naive, naive, func(a, _ userCell) float64 { return a.redisPer() })
			fmt.Fprintf(w, "redis, %s, %s: %.2f× null (naive %.2f×), %+.1f µs CPU over null [%+.1f, %+.1f]; %.2f× naive [%.2f, %.2f], %+.1f µs process CPU over naive [%+.1f, %+.1f]; redis-server %.1f µs/request, naive's %.1f µs: %.2f× [%.2f, %.2f]\n",
				load, fmtBytes(size), rm, nm, rc, rclo, rchi, km, klo, khi, kc, kclo, kchi, rs, ns, rr, rrlo, rrhi)
			if v := r.get(load, size, targetVariantRedis); len(v) > 0 {
				km, klo, khi := paired(v, naive, ratio)
				kc, kclo, kchi := paired(v, naive, cpuOver)
				rr, rrlo, rrhi := paired(v, naive, redisRatio)
				vm, vlo, vhi := paired(v, red, ratio)
				vc, vclo, vchi := paired(v, red, cpuOver)
				vr, vrlo, vrhi := paired(v, red, redisRatio)
				vs, _, _ := paired(v, v, func(a, _ userCell) float64 { return a.redisPer() })
				fmt.Fprintf(w, "redis variant (%s %s), %s, %s: %.2f× naive [%.2f, %.2f], %+.1f µs process CPU over naive [%+.1f, %+.1f], redis-server %.1f µs/request, %.2f× naive's [%.2f, %.2f]; %.2f× redis [%.2f, %.2f], %+.1f µs process CPU over redis [%+.1f, %+.1f], redis-server %.2f× redis' [%.2f, %.2f]\n",
					filepath.Base(o.variantBin), strings.Join(o.variantEnv, " "), load, fmtBytes(size), km, klo, khi, kc, kclo, kchi, vs, rr, rrlo, rrhi, vm, vlo, vhi, vc, vclo, vchi, vr, vrlo, vrhi)
			}
		}
	}
	if len(o.growth) == 0 {
		return
	}
	base := o.growth[0]
	baseNull, baseMem := r.get(loadFirst, base, targetPlainNull), r.get(loadFirst, base, targetShippedMemory)
	b, _, _ := paired(baseMem, baseNull, cpuOver)
	fmt.Fprintf(w, "\nhow cost grows, memory store, first executions (the body sent both ways): CPU over null, and per byte beyond %s against one SHA-256 and one copy of the same bytes here\n", fmtBytes(base))
	for _, size := range o.growth {
		null, mem := r.get(loadFirst, size, targetPlainNull), r.get(loadFirst, size, targetShippedMemory)
		c, lo, hi := paired(mem, null, cpuOver)
		line := fmt.Sprintf("  %8s: %+.1f µs over null [%+.1f, %+.1f]; SHA-256 + copy %.1f µs", fmtBytes(size), c, lo, hi, r.shaCopy[size])
		if size > base {
			extra := c - b
			ref := r.shaCopy[size] - r.shaCopy[base]
			line += fmt.Sprintf("; beyond %s: %.2f ns/B against %.2f ns/B, %.2f×", fmtBytes(base),
				extra*1000/float64(size-base), ref*1000/float64(size-base), extra/max(ref, 0.001))
		}
		fmt.Fprintln(w, line)
	}
}
