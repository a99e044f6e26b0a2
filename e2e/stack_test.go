package e2e_test

import (
	"bytes"
	"cmp"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/envoyconf"
	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
	"github.com/idempotency-extproc/idempotency-extproc/e2e/upstream"
	"github.com/idempotency-extproc/idempotency-extproc/internal/extproctest"
)

// The end-to-end tests run the built binary behind Envoy's ext_proc filter, configured by the
// shipped envoy/envoy.yaml: a real envoy when one is on PATH, else the Envoy-compatible proxy of
// e2e/proxy. Clients are plain net/http.

var (
	binaryPath string
	envoyBin   = envoyconf.LookEnvoy()
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "e2e-bin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binaryPath = filepath.Join(dir, "idempotency-extproc")
	// As the Dockerfile builds it: with go-control-plane's generated encoders (extproc/codec.go).
	args := []string{"build", "-tags", "vtprotobuf", "-o", binaryPath}
	if raceEnabled {
		args = append(args, "-race")
	}
	build := exec.Command("go", append(args, "../cmd/idempotency-extproc")...)
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building the binary:", err)
		os.Exit(1)
	}
	if envoyBin == "" {
		fmt.Println("e2e: real Envoy was not available (no envoy on PATH); the tests run against the Envoy-compatible proxy in e2e/proxy")
	} else {
		fmt.Println("e2e: running against real Envoy at", envoyBin)
	}
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// processor is one running idempotency-extproc process.
type processor struct {
	t         *testing.T
	cmd       *exec.Cmd
	grpcAddr  string
	adminAddr string
	logs      *logBuffer
	exited    chan struct{}
	exitErr   error
}

// startProcessor runs the binary with args (listeners on free loopback ports unless args set
// them) and extra environment variables, and waits for its ready line: its store answered.
func startProcessor(t *testing.T, env []string, args ...string) *processor {
	t.Helper()
	p := startListening(t, env, args...)
	p.waitLog("ready", 30*time.Second)
	return p
}

// startListening is startProcessor without waiting for the store: it returns once the
// listeners are up, which they are whether the store answers or not.
func startListening(t *testing.T, env []string, args ...string) *processor {
	t.Helper()
	return startBinary(t, binaryPath, env, args...)
}

// ownEnviron is this process's environment without what configures the program (IDEMPOTENCY_*,
// OTEL_*): a processor a test starts runs as the test says, whatever the shell that runs it sets.
func ownEnviron() []string {
	return slices.DeleteFunc(os.Environ(), func(kv string) bool {
		name, _, _ := strings.Cut(kv, "=")
		return extproctest.ConfiguresProgram(name)
	})
}

// startBinary is startListening with another build of the program.
func startBinary(t *testing.T, bin string, env []string, args ...string) *processor {
	t.Helper()
	full := append([]string{"--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"}, args...)
	logs := &logBuffer{}
	cmd := exec.Command(bin, full...)
	cmd.Env = append(ownEnviron(), env...)
	cmd.SysProcAttr = childAttr()
	cmd.Stderr = logs
	cmd.Stdout = logs
	require.NoError(t, cmd.Start())
	p := &processor{t: t, cmd: cmd, logs: logs, exited: make(chan struct{})}
	go func() {
		p.exitErr = cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.exited
		if t.Failed() {
			t.Logf("processor %s log:\n%s", p.grpcAddr, logs.String())
		}
	})
	listening := p.waitLog("listening: waiting for the store to answer", 30*time.Second)
	p.grpcAddr = listening["grpc_addr"].(string)
	p.adminAddr = listening["admin_addr"].(string)
	return p
}

// waitLog returns the first log line whose message is msg.
func (p *processor) waitLog(msg string, timeout time.Duration) map[string]any {
	p.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		for _, l := range p.logs.lines() {
			if l["message"] == msg {
				return l
			}
		}
		select {
		case <-p.exited:
			p.t.Fatalf("processor exited (%v) before logging %q:\n%s", p.exitErr, msg, p.logs.String())
		default:
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("processor did not log %q within %v:\n%s", msg, timeout, p.logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// signal sends sig and returns a channel closed once the process has exited.
func (p *processor) signal(sig syscall.Signal) <-chan struct{} {
	_ = p.cmd.Process.Signal(sig)
	return p.exited
}

// admin GETs a path of the admin listener.
func (p *processor) admin(path string) (int, string) {
	p.t.Helper()
	resp, err := http.Get("http://" + p.adminAddr + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// logBuffer collects a process's output.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func (b *logBuffer) lines() []map[string]any {
	var out []map[string]any
	for _, line := range strings.Split(b.String(), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) == nil {
			out = append(out, m)
		}
	}
	return out
}

// stackOptions describe one deployment: processors, their store and policy, and envoy.yaml
// with optional changes.
type stackOptions struct {
	replicas int      // processors, default 1
	args     []string // extra processor flags, e.g. the store
	env      []string // extra processor environment, NAME=value
	policy   string   // policy file content
	// bootstrap is the shipped bootstrap to run, relative to the repository (default
	// envoy/envoy.yaml).
	bootstrap string
	// envoy changes the shipped bootstrap for this test, on the emulator and a real Envoy alike.
	envoy func(b *bootstrapv3.Bootstrap) error
	// upstream overrides the upstream URL (default: a counting test upstream).
	upstream string
	// localReplies makes the emulator send router-generated replies to the processor, as some
	// Envoy versions do (the emulator's Behaviour.SkipExtProcOnLocalReply). A real Envoy does
	// what its version does.
	localReplies bool
	// before137 makes the emulator an Envoy before 1.37, which does not know the
	// streamed_immediate_response (the emulator's Behaviour.NoStreamedImmediateResponse).
	before137 bool
	// shapes pins how the emulator cuts bodies into messages, for tests that need one shape
	// reproduced; a real Envoy cuts them as its timing says.
	shapes func(*http.Request) proxy.Shapes
	// accessLog receives the emulator's access-log records (a real Envoy writes its own log).
	accessLog func(proxy.Record)
	// binary runs another build of the processor (default: the one TestMain built).
	binary string
	// tls serves the emulator's listener over TLS with it (mTLS with ClientAuth set); the stack
	// then runs on the emulator, and client is the client to use.
	tls    *tls.Config
	client *http.Client
}

type stack struct {
	t      *testing.T
	url    string
	up     *upstream.Upstream
	procs  []*processor
	proxy  *proxy.Proxy // nil with a real Envoy
	client *http.Client
}

func newStack(t *testing.T, o stackOptions) *stack {
	t.Helper()
	s := &stack{t: t, client: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256}}}
	t.Cleanup(s.client.CloseIdleConnections)
	upURL := o.upstream
	if upURL == "" {
		s.up = upstream.Start(t)
		upURL = s.up.URL()
	}
	args := o.args
	if o.policy != "" {
		path := filepath.Join(t.TempDir(), "policy.yaml")
		require.NoError(t, os.WriteFile(path, []byte(o.policy), 0o600))
		args = append(args, "--config", path)
	}
	var addrs []string
	for range max(o.replicas, 1) {
		bin := binaryPath
		if o.binary != "" {
			bin = o.binary
		}
		p := startBinary(t, bin, o.env, args...)
		p.waitLog("ready", 30*time.Second)
		s.procs = append(s.procs, p)
		addrs = append(addrs, p.grpcAddr)
	}
	b, err := envoyconf.Load(repoFile(t, cmp.Or(o.bootstrap, "envoy/envoy.yaml")))
	require.NoError(t, err)
	// The shipped message_timeout (0.5 s) is for a processor with cores of its own. Here the
	// race-enabled processors, Redis, the proxy and hundreds of streams share two cores, and a
	// message may wait longer than that without anything being wrong: the tests run the shipped
	// file with only this timer raised (a test may still set its own).
	require.NoError(t, envoyconf.MutateExtProc(b, func(f *filterextproc.ExternalProcessor) {
		f.MessageTimeout = durationpb.New(5 * time.Second)
	}))
	if o.envoy != nil {
		require.NoError(t, o.envoy(b))
	}
	if envoyBin != "" && o.tls == nil {
		listener, admin := freePort(t), freePort(t)
		js, err := envoyconf.Rewrite(b, envoyconf.Ports{Listener: listener, Admin: admin, Processors: addrs, Upstream: strings.TrimPrefix(upURL, "http://")})
		require.NoError(t, err)
		envoyconf.StartEnvoy(t, envoyBin, js, admin)
		s.url = "http://127.0.0.1:" + strconv.Itoa(listener)
		return s
	}
	settings, err := envoyconf.ProxySettings(b)
	require.NoError(t, err)
	// The bootstrap's routes, per-route ext_proc configuration, local_reply_config, jwt_authn
	// and tracing reach the emulator as they reach a real Envoy.
	cfg := settings.ProxyConfig(addrs, upURL)
	cfg.Envoy = proxy.Behaviour{SkipExtProcOnLocalReply: !o.localReplies, NoStreamedImmediateResponse: o.before137}
	cfg.Shapes, cfg.AccessLog = o.shapes, o.accessLog
	cfg.TLS = o.tls
	if o.client != nil {
		s.client = o.client
	}
	s.proxy = proxy.Start(t, cfg)
	s.url = s.proxy.URL()
	return s
}

func repoFile(t *testing.T, rel string) string {
	t.Helper()
	p, err := filepath.Abs(filepath.Join("..", rel))
	require.NoError(t, err)
	return p
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// call is one HTTP request through the front proxy.
type call struct {
	method  string
	path    string
	key     string
	headers map[string]string
	body    string
}

// reply is what the client got.
type reply struct {
	status int
	header http.Header
	body   []byte
}

func (r reply) problemCode() string {
	var p struct {
		Code string `json:"code"`
	}
	_ = json.Unmarshal(r.body, &p)
	return p.Code
}

func (s *stack) do(c call) reply {
	s.t.Helper()
	r, err := s.try(c)
	require.NoError(s.t, err)
	return r
}

func (s *stack) try(c call) (reply, error) {
	if c.method == "" {
		c.method = "POST"
	}
	if c.path == "" {
		c.path = "/v1/payments"
	}
	req, err := http.NewRequest(c.method, s.url+c.path, strings.NewReader(c.body))
	if err != nil {
		return reply{}, err
	}
	if c.key != "" {
		req.Header.Set("Idempotency-Key", c.key)
	}
	for k, v := range c.headers {
		req.Header.Set(k, v)
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return reply{}, err
	}
	return reply{status: resp.StatusCode, header: resp.Header, body: b}, nil
}

// burst sends n requests at once, built by mk, and returns their statuses (0 for a request
// that got no answer).
func (s *stack) burst(n int, mk func(i int) call) []int {
	statuses := make([]int, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			if r, err := s.try(mk(i)); err == nil {
				statuses[i] = r.status
			}
		}()
	}
	close(start)
	wg.Wait()
	return statuses
}

// requireProblem checks a problem+json answer from the processor.
func requireProblem(t *testing.T, r reply, status int, code string) {
	t.Helper()
	require.Equal(t, status, r.status, "body: %s", r.body)
	require.Equal(t, "application/problem+json", r.header.Get("Content-Type"))
	require.Equal(t, code, r.problemCode())
	require.Equal(t, strconv.Itoa(len(r.body)), r.header.Get("Content-Length"), "Envoy computes content-length")
}
