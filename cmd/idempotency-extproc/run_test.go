package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"net"
	"net/http"
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
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/internal/slowlink"
)

// logLines collects the process log and reports the first line with a given message.
type logLines struct {
	mu    sync.Mutex
	lines []map[string]any
	raw   strings.Builder
	cond  *sync.Cond
}

func newLogLines() *logLines {
	l := &logLines{}
	l.cond = sync.NewCond(&l.mu)
	return l
}

func (l *logLines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.raw.Write(p)
	for _, line := range strings.Split(strings.TrimSpace(string(p)), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) == nil {
			l.lines = append(l.lines, m)
		}
	}
	l.cond.Broadcast()
	return len(p), nil
}

// all returns the lines parsed so far.
func (l *logLines) all() []map[string]any {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.lines)
}

func (l *logLines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.raw.String()
}

// wait returns the first line whose message is msg, waiting up to timeout.
func (l *logLines) wait(t *testing.T, msg string, timeout time.Duration) map[string]any {
	t.Helper()
	deadline := time.Now().Add(timeout)
	go func() {
		time.Sleep(timeout)
		l.cond.Broadcast()
	}()
	l.mu.Lock()
	defer l.mu.Unlock()
	for {
		for _, m := range l.lines {
			if m["message"] == msg {
				return m
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %q log line within %v; log:\n%s", msg, timeout, l.raw.String())
		}
		l.cond.Wait()
	}
}

func dial(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

func bodilessPost(key string) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
			{Key: ":method", RawValue: []byte("POST")},
			{Key: ":path", RawValue: []byte("/v1/payments")},
			{Key: "idempotency-key", RawValue: []byte(key)},
		}},
		EndOfStream: true,
	}}}
}

func created() *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
		Headers:     &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte("201")}}},
		EndOfStream: true,
	}}}
}

func TestRunServesUntilCancelled(t *testing.T) {
	logs := newLogLines()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	sock := filepath.Join(t.TempDir(), "extproc.sock")
	go func() {
		done <- run(ctx, []string{"--grpc-addr", "unix://" + sock, "--admin-addr", "127.0.0.1:0"}, env(nil), logs)
	}()
	ready := logs.wait(t, "ready", 10*time.Second)
	require.Equal(t, "unix://"+sock, ready["grpc_addr"])
	require.Equal(t, currentBuild().version, ready["version"])
	require.Equal(t, "(built-in defaults)", ready["config"])
	require.Equal(t, []any{"default"}, ready["routes"])
	admin := "http://" + ready["admin_addr"].(string)

	conn := dial(t, "unix://"+sock)
	require.Eventually(t, func() bool {
		resp, err := healthpb.NewHealthClient(conn).Check(t.Context(), &healthpb.HealthCheckRequest{})
		return err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING
	}, 5*time.Second, 20*time.Millisecond)

	client := extprocv3.NewExternalProcessorClient(conn)
	for i, want := range []string{"request_headers", "immediate_response"} {
		s, err := client.Process(t.Context())
		require.NoError(t, err)
		require.NoError(t, s.Send(bodilessPost("k")))
		resp, err := s.Recv()
		require.NoError(t, err)
		if i == 0 {
			require.NotNil(t, resp.GetRequestHeaders(), want)
			require.NoError(t, s.Send(created()))
			_, err = s.Recv()
			require.NoError(t, err)
		} else {
			require.Equal(t, 201, int(resp.GetImmediateResponse().GetStatus().GetCode()), want)
		}
		require.NoError(t, s.CloseSend())
	}
	// Streams run on the gRPC server's workers, whose grown stacks serve stream after stream.
	require.GreaterOrEqual(t, streamWorkers(), extproc.StreamWorkers)

	get := func(path string) (int, string) {
		resp, err := http.Get(admin + path)
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(body)
	}
	for path, status := range map[string]int{"/healthz": 200, "/readyz": 200, "/metrics": 200, "/nothing": 404} {
		code, _ := get(path)
		require.Equal(t, status, code, path)
	}
	// A request is counted when its stream ends, just after the client has its answer.
	require.Eventually(t, func() bool {
		_, body := get("/metrics")
		return strings.Contains(body, `idempotency_requests_total{outcome="executed",route="default"} 1`) &&
			strings.Contains(body, `idempotency_requests_total{outcome="replayed",route="default"} 1`)
	}, 5*time.Second, 10*time.Millisecond)
	_, body := get("/metrics")
	require.Contains(t, body, "go_goroutines")
	build := currentBuild()
	require.Contains(t, body, `idempotency_build_info{goversion="`+build.goVersion+`",revision="`+build.revision+`",version="`+build.version+`"} 1`)
	require.Contains(t, body, "process_cpu_seconds_total")
	// The memory store's record is in a segment: mapped outside the Go heap, or on it where
	// mapping is not supported.
	metric := func(name string) float64 {
		m := regexp.MustCompile(`(?m)^` + name + ` (\S+)$`).FindStringSubmatch(body)
		require.NotNil(t, m, "%s in /metrics", name)
		v, err := strconv.ParseFloat(m[1], 64)
		require.NoError(t, err)
		return v
	}
	mapped, onHeap := metric("idempotency_memory_mapped_bytes"), metric("idempotency_memory_heap_segments_total")
	require.True(t, mapped >= 256<<10 || onHeap >= 1, "the record's segment: %v bytes mapped, %v on the heap", mapped, onHeap)
	require.Zero(t, metric("idempotency_memory_unmap_failures_total"))

	// A health watcher sees NOT_SERVING as soon as shutdown begins.
	watchCtx, stopWatch := context.WithCancel(t.Context())
	watch, err := healthpb.NewHealthClient(conn).Watch(watchCtx, &healthpb.HealthCheckRequest{})
	require.NoError(t, err)
	st, err := watch.Recv()
	require.NoError(t, err)
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, st.GetStatus())

	cancel()
	st, err = watch.Recv()
	require.NoError(t, err)
	require.Equal(t, healthpb.HealthCheckResponse_NOT_SERVING, st.GetStatus(), "NOT_SERVING during shutdown")
	stopWatch() // an open watch is a stream like any other: the drain waits for it
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("run did not return after its context was cancelled")
	}
	logs.wait(t, "stopped", time.Second)
	require.Eventually(t, func() bool { return streamWorkers() == 0 }, 5*time.Second, 10*time.Millisecond, "the workers end with the server")
}

// streamWorkers counts the goroutines waiting in, or running, a gRPC server's stream workers.
func streamWorkers() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return strings.Count(string(buf[:n]), "\ngoogle.golang.org/grpc.(*Server).serverWorker(")
		}
		buf = make([]byte, 2*len(buf))
	}
}

func TestRunRejectsBadConfigBeforeListening(t *testing.T) {
	logs := newLogLines()
	err := run(t.Context(), []string{"--store", "nope", "--admin-addr", "127.0.0.1:0"}, env(nil), logs)
	require.ErrorContains(t, err, "store")
	require.NotContains(t, logs.String(), "ready")
	require.ErrorIs(t, run(t.Context(), []string{"--help"}, env(nil), io.Discard), flag.ErrHelp, "for dispatch to print the usage")
}

func TestRunReportsListenerErrors(t *testing.T) {
	err := run(t.Context(), []string{"--grpc-addr", "256.0.0.1:1", "--admin-addr", "127.0.0.1:0"}, env(nil), io.Discard)
	require.ErrorContains(t, err, "grpc-addr")
}

// A store that takes connections and never answers turns the process unready within 2 s, even
// with a store_timeout far above that: readiness pings have a bound of their own.
func TestHangingStoreTurnsUnreadyQuickly(t *testing.T) {
	hole, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = hole.Close() })
	go func() {
		for {
			c, err := hole.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { _ = c.Close() })
		}
	}()
	logs := newLogLines()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--config", writeFile(t, "store_timeout: 1m\n"), "--store", "redis", "--redis-url", "redis://" + hole.Addr().String() + "/0",
			"--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"}, env(nil), logs)
	}()
	ready := logs.wait(t, "listening: waiting for the store to answer", 10*time.Second)
	start := time.Now()
	logs.wait(t, "store is unreachable: not serving", 10*time.Second)
	require.Less(t, time.Since(start), 3*time.Second, "a ping is bounded by 1 s, not by the 1 m store_timeout (within 2 s)")
	require.NotContains(t, logs.String(), `"message":"ready"`, "not ready before the store answers")

	client := http.Client{Timeout: 10 * time.Second}
	resp, err := client.Get("http://" + ready["admin_addr"].(string) + "/readyz")
	require.NoError(t, err, "/readyz answers without waiting for store_timeout")
	_ = resp.Body.Close()
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	cancel()
	require.NoError(t, <-done)
}

// runOnMiniredis runs the program with opts on mr's Redis with args added, on free loopback
// ports, until cancel; done has run's result.
func runOnMiniredis(t *testing.T, mr *miniredis.Miniredis, opts runOptions, args ...string) (logs *logLines, ready map[string]any, cancel func(), done chan error) {
	t.Helper()
	logs = newLogLines()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	done = make(chan error, 1)
	args = append([]string{"--store", "redis", "--redis-url", "redis://" + mr.Addr() + "/0",
		"--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"}, args...)
	go func() { done <- runWith(ctx, args, env(nil), logs, opts) }()
	return logs, logs.wait(t, "ready", 10*time.Second), cancel, done
}

// Streams still open when the drain ends are cut, and the leases they hold are released
// (unknown_outcome: release, the default), so that a retry on another replica runs.
func TestRunCutStreamsReleaseTheirLeases(t *testing.T) {
	mr := miniredis.RunT(t)
	logs, ready, cancel, done := runOnMiniredis(t, mr, runOptions{drainTimeout: 4 * time.Second})
	openClaim(t, ready["grpc_addr"].(string), "k")
	require.Len(t, mr.Keys(), 1, "the lease")

	readyz := "http://" + ready["admin_addr"].(string) + "/readyz"
	require.Equal(t, http.StatusOK, get(t, readyz))
	cancel() // as SIGTERM does; the stream never ends by itself
	require.Eventually(t, func() bool { return get(t, readyz) == http.StatusServiceUnavailable }, 3*time.Second, 10*time.Millisecond,
		"/readyz says unready during the drain, as gRPC health does")
	require.NoError(t, <-done)
	logs.wait(t, "drain timeout: cutting the streams still open", time.Second)
	require.Empty(t, mr.Keys(), "the cut stream's lease was released before the process exited")
}

// failingListener is a listener whose Accept fails for good once fail is closed.
type failingListener struct {
	net.Listener
	fail chan struct{}
}

func (l failingListener) Accept() (net.Conn, error) {
	accepted := make(chan struct{})
	var c net.Conn
	var err error
	go func() { c, err = l.Listener.Accept(); close(accepted) }()
	select {
	case <-accepted:
		return c, err
	case <-l.fail:
		return nil, errors.New("accept: the listener broke")
	}
}

// A listener that fails after start ends the process through the drain, as SIGTERM does: a
// stream still open is cut and its lease released, and run returns the listener's error.
func TestRunDrainsWhenAListenerFails(t *testing.T) {
	// The admin listener is the one that breaks, told apart by its address.
	fail := make(chan struct{})
	adminAddr := freeLoopbackAddr(t)
	opts := runOptions{drainTimeout: 200 * time.Millisecond, listen: func(addr string) (net.Listener, error) {
		l, err := listen(addr)
		if err != nil || addr != adminAddr {
			return l, err
		}
		return failingListener{Listener: l, fail: fail}, nil
	}}
	mr := miniredis.RunT(t)
	_, ready, _, done := runOnMiniredis(t, mr, opts, "--admin-addr", adminAddr)
	openClaim(t, ready["grpc_addr"].(string), "k")
	require.Len(t, mr.Keys(), 1, "the lease")

	close(fail)
	select {
	case err := <-done:
		require.ErrorContains(t, err, "the listener broke")
	case <-time.After(10 * time.Second):
		t.Fatal("run did not end after its listener failed")
	}
	require.Empty(t, mr.Keys(), "the open stream was cut and its lease released")
}

// freeLoopbackAddr returns a loopback address whose port was free a moment ago.
func freeLoopbackAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return addr
}

// get returns the status of a GET to url, or 0 if it got no answer.
func get(t *testing.T, url string) int {
	client := http.Client{Timeout: 5 * time.Second}
	resp, err := client.Get(url)
	if err != nil {
		return 0
	}
	_ = resp.Body.Close()
	return resp.StatusCode
}

// A stream whose Envoy vanished without a reset ends once the processor's keepalive ping goes
// unanswered, and its lease is released: it is not renewed for as long as TCP takes to notice.
//
// miniredis lets no TTL pass by itself, so the key's absence is the release, never an expiry.
// It also means that a release the store fails stays failed: the lease is left to expire at
// lock_ttl, which never comes. At the default store_timeout (100 ms) a loaded machine fails it
// now and then (the release, or the renewals, answered late), so the store calls here get a bound
// no loaded machine reaches; what the test proves, that the keepalive ends the stream and its end
// releases the lease, is unchanged.
func TestRunEndsStreamsOfAVanishedEnvoy(t *testing.T) {
	mr := miniredis.RunT(t)
	opts := runOptions{keepaliveTime: time.Second, keepaliveTimeout: 500 * time.Millisecond} // grpc-go's least Time is 1 s
	const storeTimeout = 5 * time.Second
	logs, ready, cancel, done := runOnMiniredis(t, mr, opts,
		"--config", writeFile(t, "store_timeout: "+storeTimeout.String()+"\ndefaults: {lock_ttl: 3s}\n"))
	var delay atomic.Int64
	openClaim(t, slowlink.Start(t, ready["grpc_addr"].(string), &delay), "k")
	require.Len(t, mr.Keys(), 1, "the lease")

	// From now on nothing the processor sends gets through, its keepalive pings included: an
	// Envoy that vanished without closing anything.
	delay.Store(int64(time.Hour))
	// Renewed every second (lock_ttl/3) while the stream lives; released once the ping fails.
	// The processor pings a connection silent for keepaliveTime and closes it keepaliveTimeout
	// later; a ping that got through before the delay was stored is answered, which costs one
	// more round. Three times that bounds the stream's end and the release that follows it,
	// with the margin a loaded machine needs; a keepaliveTime of 10 s, where 1 s is asked for,
	// misses it.
	ends := 2 * (opts.keepaliveTime + opts.keepaliveTimeout)
	require.Eventually(t, func() bool { return len(mr.Keys()) == 0 }, 3*ends, 50*time.Millisecond,
		"the vanished stream's lease is released; log:\n%s", logs)
	cancel()
	require.NoError(t, <-done)
}

// A mistyped Unix socket path must not delete the file it names; a stale socket is replaced.
func TestRunNeverRemovesAFileThatIsNotASocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policy.yaml")
	require.NoError(t, os.WriteFile(path, []byte("keep me"), 0o600))
	err := run(t.Context(), []string{"--grpc-addr", "unix://" + path, "--admin-addr", "127.0.0.1:0"}, env(nil), io.Discard)
	require.ErrorContains(t, err, "grpc-addr")
	require.ErrorContains(t, err, "not a socket")
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Equal(t, "keep me", string(data))

	sock := filepath.Join(t.TempDir(), "stale.sock")
	l, err := net.Listen("unix", sock)
	require.NoError(t, err)
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	require.NoError(t, l.Close())
	l, err = listen("unix://" + sock)
	require.NoError(t, err, "a stale socket is replaced")
	require.NoError(t, l.Close())
}

// Envoy in another container of the pod, as another user in the pod's group, can connect to the
// Unix socket (connecting needs write permission); other users cannot.
func TestRunUnixSocketIsTheGroups(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "extproc.sock")
	l, err := listen("unix://" + sock)
	require.NoError(t, err)
	defer l.Close()
	fi, err := os.Stat(sock)
	require.NoError(t, err)
	require.Equal(t, os.ModeSocket, fi.Mode().Type())
	require.Equal(t, os.FileMode(0o660), fi.Mode().Perm())
}

// binaryVersion and binaryRevision are linked into binary, as the Dockerfile links its own.
const binaryVersion, binaryRevision = "v0.0.0-linked", "f00d"

// binary is built once for the tests that run the real process.
var binary = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "idempotency-extproc-bin")
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, "idempotency-extproc")
	out, err := exec.Command("go", "build", "-race", "-ldflags", "-X main.version="+binaryVersion+" -X main.revision="+binaryRevision,
		"-o", path, ".").CombinedOutput()
	if err != nil {
		return "", &buildError{out: string(out), err: err}
	}
	return path, nil
})

type buildError struct {
	out string
	err error
}

func (e *buildError) Error() string { return e.err.Error() + "\n" + e.out }

// A second signal during the drain ends the process at once: an operator's second Ctrl-C.
func TestBinarySecondSignalEndsTheDrain(t *testing.T) {
	cmd, logs, _, _ := startBinaryWithClaim(t, "held")
	require.NoError(t, cmd.Process.Signal(syscall.SIGINT))
	logs.wait(t, "shutting down: draining open streams", 5*time.Second) // the stream holds the drain for 15 s
	require.NoError(t, cmd.Process.Signal(syscall.SIGINT))
	waitErr := make(chan error, 1)
	go func() { waitErr <- cmd.Wait() }()
	select {
	case err := <-waitErr:
		var exit *exec.ExitError
		require.ErrorAs(t, err, &exit)
		ws := exit.Sys().(syscall.WaitStatus)
		require.True(t, ws.Signaled() && ws.Signal() == syscall.SIGINT, "killed by the second signal: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatalf("the second signal did not end the drain; log:\n%s", logs.String())
	}
}

// startBinaryWithClaim starts the race-built binary with the memory store and opens a stream
// that claims key and stays open, its request running upstream.
func startBinaryWithClaim(t *testing.T, key string) (*exec.Cmd, *logLines, map[string]any, extprocv3.ExternalProcessor_ProcessClient) {
	t.Helper()
	bin, err := binary()
	require.NoError(t, err)
	logs := newLogLines()
	cmd := exec.Command(bin, "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0")
	cmd.Stderr = logs
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	ready := logs.wait(t, "ready", 30*time.Second)
	require.Equal(t, binaryVersion, ready["version"], "the linked version")
	return cmd, logs, ready, openClaim(t, ready["grpc_addr"].(string), key)
}

// openClaim opens a stream to addr whose bodiless POST claims key, and leaves it open: the
// request runs upstream under a lease.
func openClaim(t *testing.T, addr, key string) extprocv3.ExternalProcessor_ProcessClient {
	t.Helper()
	s, err := extprocv3.NewExternalProcessorClient(dial(t, addr)).Process(t.Context())
	require.NoError(t, err)
	require.NoError(t, s.Send(bodilessPost(key)))
	resp, err := s.Recv()
	require.NoError(t, err)
	require.NotNil(t, resp.GetRequestHeaders(), "claimed: the request runs upstream under a lease")
	return s
}

func TestBinaryDrainsOnSIGTERM(t *testing.T) {
	cmd, logs, ready, s := startBinaryWithClaim(t, "draining")
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	logs.wait(t, "shutting down: draining open streams", 5*time.Second)

	// New streams are refused while the open one finishes. The log line comes just before the
	// listener closes, so a stream opened in between may still be served: retry until refused.
	require.Eventually(t, func() bool { return status.Code(tryStream(t, ready["grpc_addr"].(string))) == codes.Unavailable },
		5*time.Second, 10*time.Millisecond, "a draining process takes no new stream")

	require.NoError(t, s.Send(created()))
	resp, err := s.Recv()
	require.NoError(t, err, "the open stream finishes")
	require.NotNil(t, resp.GetResponseHeaders())
	require.NoError(t, s.CloseSend())
	_, err = s.Recv()
	require.ErrorIs(t, err, io.EOF)

	waitErr := make(chan error, 1)
	go func() { waitErr <- cmd.Wait() }()
	select {
	case err := <-waitErr:
		require.NoError(t, err, "exit status 0; log:\n%s", logs.String())
	case <-time.After(20 * time.Second):
		t.Fatalf("process did not exit; log:\n%s", logs.String())
	}
	logs.wait(t, "stopped", time.Second)
	require.Contains(t, logs.String(), `"outcome":"executed"`)
}

// tryStream opens a stream on a new connection, sends one message and waits for its answer. It
// closes the stream and the connection before it returns, so that a stream that was served does
// not hold up the drain.
func tryStream(t *testing.T, addr string) error {
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	s, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		return err
	}
	if err := s.Send(bodilessPost("new")); err != nil {
		return err
	}
	_, err = s.Recv()
	return err
}

// idempotency_ready follows the store as /readyz does: 1 while it answers, 0 while it does not,
// and 1 again once it is back, without a restart.
func TestReadyGaugeFollowsTheStore(t *testing.T) {
	mr := miniredis.RunT(t)
	_, ready, _, _ := runOnMiniredis(t, mr, runOptions{})
	metrics := "http://" + ready["admin_addr"].(string) + "/metrics"
	gauge := func() string {
		resp, err := http.Get(metrics)
		if err != nil {
			return ""
		}
		defer func() { _ = resp.Body.Close() }()
		b, _ := io.ReadAll(resp.Body)
		m := regexp.MustCompile(`(?m)^idempotency_ready (\S+)$`).FindSubmatch(b)
		if m == nil {
			return ""
		}
		return string(m[1])
	}
	require.Eventually(t, func() bool { return gauge() == "1" }, 5*time.Second, 20*time.Millisecond)
	mr.Close()
	require.Eventually(t, func() bool { return gauge() == "0" }, 5*time.Second, 20*time.Millisecond)
	require.NoError(t, mr.Restart())
	require.Eventually(t, func() bool { return gauge() == "1" }, 10*time.Second, 20*time.Millisecond)
}

// closeCounter is a store that counts its Close calls.
type closeCounter struct {
	cache.Store
	closed atomic.Int32
}

func (c *closeCounter) Close() error {
	c.closed.Add(1)
	return c.Store.Close()
}

// SIGTERM during start-up ends run at once, without an error and without opening a listener:
// a store that takes its time opening does not keep the process from stopping, and is closed
// when it opens after all.
func TestRunStopsDuringStartUp(t *testing.T) {
	for _, tc := range []struct {
		name string
		// when is when the context is cancelled: "before" run starts, "opening" while the store
		// opens (it answers only after), "opened" just after the store opened.
		when string
	}{
		{"before anything", "before"},
		{"while the store opens", "opening"},
		{"just after the store opened", "opened"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			opening, release := make(chan struct{}), make(chan struct{})
			mem, err := cache.NewMemory(cache.MemoryOptions{})
			require.NoError(t, err)
			store := &closeCounter{Store: mem}
			var listened atomic.Int32
			opts := runOptions{
				// A store that ignores ctx.
				openStore: func(context.Context, *config) (cache.Store, error) {
					close(opening)
					switch tc.when {
					case "opening":
						<-release
					case "opened":
						cancel()
					}
					return store, nil
				},
				listen: func(addr string) (net.Listener, error) {
					listened.Add(1)
					return listen(addr)
				},
			}
			if tc.when == "before" {
				cancel()
			}
			logs := newLogLines()
			done := make(chan error, 1)
			go func() {
				done <- runWith(ctx, []string{"--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"}, env(nil), logs, opts)
			}()
			if tc.when == "opening" {
				<-opening
				cancel()
			}
			select {
			case err := <-done:
				require.NoError(t, err, "stopping is not a failure")
			case <-time.After(5 * time.Second):
				close(release)
				t.Fatalf("run still starting 5 s after its context was cancelled; log:\n%s", logs.String())
			}
			close(release)
			logs.wait(t, "stopped during start-up", time.Second)
			require.NotContains(t, logs.String(), `"ready"`)
			require.Zero(t, listened.Load(), "no listener opened")
			if tc.when != "before" {
				require.Eventually(t, func() bool { return store.closed.Load() == 1 }, 5*time.Second, time.Millisecond, "the store is closed")
			}
		})
	}
}

// The admin listener closes a keep-alive connection left idle for adminIdleTimeout: idle
// connections do not pile up for ever.
func TestAdminClosesIdleConnections(t *testing.T) {
	mr := miniredis.RunT(t)
	_, ready, _, _ := runOnMiniredis(t, mr, runOptions{adminIdleTimeout: 300 * time.Millisecond})
	conn, err := net.Dial("tcp", ready["admin_addr"].(string))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	_, err = io.WriteString(conn, "GET /healthz HTTP/1.1\r\nHost: admin\r\n\r\n")
	require.NoError(t, err)
	r := bufio.NewReader(conn)
	resp, err := http.ReadResponse(r, nil)
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.False(t, resp.Close, "a keep-alive connection")

	// Well before the read timeout, which would otherwise close it.
	start := time.Now()
	require.NoError(t, conn.SetReadDeadline(start.Add(adminReadTimeout/2)))
	_, err = r.ReadByte()
	require.ErrorIs(t, err, io.EOF, "the server closed the idle connection")
	require.Less(t, time.Since(start), adminReadTimeout/2)
}
