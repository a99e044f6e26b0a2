// Package redistest starts real redis-server processes on loopback for tests: a standalone server
// (optionally with TLS, a password or an ACL user) and replicas of it, a Redis Cluster, and a
// Sentinel-managed master with one or more replicas. Any of them can be paused (SIGSTOP) and
// resumed, for a node that falls behind or stops answering.
//
// Every process runs in its own t.TempDir() with persistence off (save "", appendonly no), is bound
// to 127.0.0.1, logs to a file in its directory, and is killed and reaped by a t.Cleanup registered
// when it starts. When the test fails, the cleanup writes the tail of each process's log to the test
// log. On Linux each process also receives SIGKILL when the test binary dies, so no redis-server
// outlives the test binary even when cleanups never run.
//
// Functions and methods that take or remember a testing.TB report failures with t.Fatal, so they
// must be called from the goroutine running that test, like any other t.Fatal caller.
package redistest

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// RequireEnv is the environment variable that turns a missing redis-server into a test failure.
// CI sets it to "1" so that tests needing real Redis can never be skipped silently.
const RequireEnv = "IDEMPOTENCY_REQUIRE_REDIS"

const (
	startTimeout   = 10 * time.Second       // from launching a process to its first INFO reply
	stopTimeout    = 10 * time.Second       // from SIGTERM to exit, before SIGKILL
	pollInterval   = 25 * time.Millisecond  // between two checks of a waited-for condition
	probeTimeout   = 1 * time.Second        // for one administrative command
	portAttempts   = 10                     // free ports tried by one Start
	bindRetryFor   = 3 * time.Second        // how long a fixed port in use is retried
	bindRetryDelay = 100 * time.Millisecond // between two attempts on a fixed port
	logTailBytes   = 64 << 10               // of each log dumped on failure
)

// errAddrInUse reports that redis-server exited because a port it needed was already bound.
var errAddrInUse = errors.New("address already in use")

// Require returns the path of the redis-server binary found on PATH. When there is none, the test
// fails if the environment variable IDEMPOTENCY_REQUIRE_REDIS is "1", and is skipped otherwise, so
// Require never returns an empty path.
func Require(t testing.TB) string {
	t.Helper()
	path, err := exec.LookPath("redis-server")
	if err == nil {
		return path
	}
	if os.Getenv(RequireEnv) == "1" {
		t.Fatalf("redistest: real Redis is required (%s=1) but redis-server is not on PATH: %v", RequireEnv, err)
	}
	t.Skipf("redistest: real Redis not available (redis-server not on PATH); test skipped (set %s=1 to fail instead)", RequireEnv)
	return ""
}

// Options configures a standalone server started by Start. The zero value is a plain server on a
// free loopback port with no authentication.
type Options struct {
	// Port is the port to serve on; 0 picks a free loopback port. With TLS it is the TLS port and
	// the server accepts no plain-text connections.
	Port int

	// ACLUser and ACLPassword, when ACLUser is set, create an ACL user with full permissions
	// (~* &* +@all). The default user is then disabled, unless Password is also set, in which case
	// the default user keeps working with Password.
	ACLUser, ACLPassword string

	// Password is the password of the default user (requirepass).
	Password string

	// TLS makes the server accept TLS connections only, with a CA and a server certificate generated
	// for this server (ECDSA P-256, valid for 24 hours, for 127.0.0.1 and localhost). Clients are not
	// asked for certificates.
	TLS bool

	// Args are extra configuration directives, each a line "name value..." of redis.conf, written
	// after the directives redistest generates, so that a directive taking a single value
	// overrides the generated one.
	Args []string
}

// kind says what a Server process is beyond its Options.
type kind int

const (
	kindStandalone kind = iota
	kindClusterNode
	kindSentinel
)

// Server is a redis-server process started by Start, StartCluster or StartSentinel. Its address never
// changes, across Stop, Kill and Restart. Its methods are safe for concurrent use, but those that
// can fail (Stop, Kill, Restart, Client) report through the testing.TB that started the server and
// therefore belong on that test's goroutine.
type Server struct {
	t    testing.TB
	bin  string
	opts Options
	kind kind
	dir  string
	conf string // redis.conf; written once, then rewritten only by redis-server itself
	log  string // the logfile directive
	out  string // stdout and stderr, where configuration errors go
	port int
	tls  *tls.Config
	ca   string

	mu     sync.Mutex // serialises launching, stopping and reading proc
	proc   *process   // the running process, nil when stopped
	paused bool       // proc was sent SIGSTOP and not SIGCONT since
}

// process is one launch of redis-server.
type process struct {
	cmd       *exec.Cmd
	done      chan struct{} // closed once the process has exited and been reaped
	logOffset int64         // size of the logfile when the process was launched
	outOffset int64         // size of the output file when the process was launched
}

// Start starts a standalone redis-server configured by opts and returns once it answers PING and
// INFO on its port (with TLS and credentials as configured), which takes at most about 10 seconds
// or fails the test. A port found in use is replaced by another free one, or, when opts.Port is
// set, retried for a few seconds. A cleanup registered on t kills the process and, if the test
// failed, logs the tail of the server's log.
func Start(t testing.TB, opts Options) *Server {
	t.Helper()
	return start(t, Require(t), opts, kindStandalone)
}

// start creates, configures and launches a server of the given kind.
func start(t testing.TB, bin string, opts Options, k kind) *Server {
	t.Helper()
	opts.Args = append([]string(nil), opts.Args...)
	dir := t.TempDir()
	s := &Server{
		t:    t,
		bin:  bin,
		opts: opts,
		kind: k,
		dir:  dir,
		conf: filepath.Join(dir, "redis.conf"),
		log:  filepath.Join(dir, "redis.log"),
		out:  filepath.Join(dir, "output.log"),
	}
	if opts.TLS {
		var err error
		s.tls, s.ca, err = writeCertificates(dir)
		if err != nil {
			t.Fatalf("redistest: generating TLS certificates: %v", err)
		}
	}
	t.Cleanup(s.cleanup)

	s.mu.Lock()
	defer s.mu.Unlock()
	if opts.Port != 0 {
		s.port = opts.Port
		s.writeConfig()
		s.launchRetrying("starting")
		return s
	}
	for attempt := 1; ; attempt++ {
		port, err := freePort(k == kindClusterNode)
		if err != nil {
			t.Fatalf("redistest: finding a free port: %v", err)
		}
		s.port = port
		s.writeConfig()
		err = s.launch()
		if errors.Is(err, errAddrInUse) && attempt < portAttempts {
			continue // taken by someone else since freePort saw it free
		}
		if err != nil {
			t.Fatalf("redistest: starting redis-server %s: %v", s.describe(), err)
		}
		return s
	}
}

// writeConfig writes the configuration file of the server.
func (s *Server) writeConfig() {
	s.t.Helper()
	if err := os.WriteFile(s.conf, []byte(s.config()), 0o600); err != nil {
		s.t.Fatalf("redistest: writing %s: %v", s.conf, err)
	}
}

// launchRetrying launches the server on its port, retrying for a few seconds while the port is in
// use, and fails the test with what it was doing when it cannot. s.mu must be held.
func (s *Server) launchRetrying(doing string) {
	s.t.Helper()
	deadline := time.Now().Add(bindRetryFor)
	for {
		err := s.launch()
		if errors.Is(err, errAddrInUse) && time.Now().Before(deadline) {
			time.Sleep(bindRetryDelay)
			continue
		}
		if errors.Is(err, errAddrInUse) {
			err = fmt.Errorf("port %d (or its cluster bus port) still in use after %s", s.port, bindRetryFor)
		}
		if err != nil {
			s.t.Fatalf("redistest: %s redis-server %s: %v", doing, s.describe(), err)
		}
		return
	}
}

// config renders the configuration file of the server.
func (s *Server) config() string {
	var b strings.Builder
	line := func(name string, values ...string) {
		b.WriteString(name)
		for _, v := range values {
			b.WriteByte(' ')
			b.WriteString(quote(v))
		}
		b.WriteByte('\n')
	}
	line("bind", "127.0.0.1")
	if s.opts.TLS {
		line("port", "0")
		line("tls-port", strconv.Itoa(s.port))
		line("tls-cert-file", filepath.Join(s.dir, serverCertFile))
		line("tls-key-file", filepath.Join(s.dir, serverKeyFile))
		line("tls-ca-cert-file", filepath.Join(s.dir, caCertFile))
		line("tls-auth-clients", "no")
	} else {
		line("port", strconv.Itoa(s.port))
	}
	auth := s.opts.Password != "" || s.opts.ACLUser != ""
	line("protected-mode", yesNo(auth))
	line("daemonize", "no")
	line("dir", s.dir)
	line("logfile", s.log)
	line("save", "")
	line("appendonly", "no")
	// Replicas would otherwise wait 5 s for a full sync, in case more replicas want one.
	line("repl-diskless-sync-delay", "0")
	if s.opts.Password != "" {
		line("requirepass", s.opts.Password)
	}
	if s.opts.ACLUser != "" {
		if s.opts.Password == "" {
			line("user", "default", "off")
		}
		line("user", s.opts.ACLUser, "on", ">"+s.opts.ACLPassword, "~*", "&*", "+@all")
	}
	for _, a := range s.opts.Args {
		b.WriteString(a)
		b.WriteByte('\n')
	}
	return b.String()
}

// launch starts a process from the configuration file and waits until it answers INFO with its
// own process id. It returns errAddrInUse when the process exited because a port was in use, and
// leaves no process running when it returns an error. s.mu must be held.
func (s *Server) launch() error {
	out, err := os.OpenFile(s.out, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	p := &process{done: make(chan struct{}), logOffset: fileSize(s.log), outOffset: fileSize(s.out)}
	args := []string{s.conf}
	if s.kind == kindSentinel {
		args = append(args, "--sentinel")
	}
	// Not exec.CommandContext(t.Context()): that context is cancelled before cleanups run.
	p.cmd = exec.Command(s.bin, args...)
	p.cmd.Dir = s.dir
	p.cmd.Stdout = out
	p.cmd.Stderr = out
	p.cmd.SysProcAttr = sysProcAttr()
	if err := p.cmd.Start(); err != nil {
		_ = out.Close()
		return err
	}
	go func() {
		_ = p.cmd.Wait()
		_ = out.Close()
		close(p.done)
	}()

	deadline := time.Now().Add(startTimeout)
	var last error
	for {
		select {
		case <-p.done:
			output := s.tailSince(p)
			if bytes.Contains(output, []byte("Address already in use")) {
				return errAddrInUse
			}
			return fmt.Errorf("redis-server exited (%v) before answering PING; output:\n%s", p.cmd.ProcessState, output)
		default:
		}
		if last = s.probe(p.cmd.Process.Pid); last == nil {
			s.proc = p
			return nil
		}
		if time.Now().After(deadline) {
			_ = p.cmd.Process.Kill()
			<-p.done
			return fmt.Errorf("no PING reply within %s (last error: %v); output:\n%s", startTimeout, last, s.tailSince(p))
		}
		time.Sleep(pollInterval)
	}
}

// probe checks that the server answers PING and that the process answering is pid, not a process
// that took the port in the meantime.
func (s *Server) probe(pid int) error {
	if err := s.listening(); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
	defer cancel()
	c := redis.NewClient(s.adminOptions())
	defer func() { _ = c.Close() }()
	if err := c.Ping(ctx).Err(); err != nil {
		return err
	}
	info, err := c.Info(ctx, "server").Result()
	if err != nil {
		return err
	}
	if got := infoField(info, "process_id"); got != strconv.Itoa(pid) {
		return fmt.Errorf("port %d is served by process %s, not by the process started (%d)", s.port, got, pid)
	}
	return nil
}

// Addr returns the server's address, "127.0.0.1:port". It never changes.
func (s *Server) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) }

// Port returns the server's port (the TLS port with TLS). It never changes.
func (s *Server) Port() int { return s.port }

// URL returns a go-redis URL for the server with its credentials and database 0:
// redis://[user:password@]127.0.0.1:port/0, or rediss://… with TLS. redis.ParseURL on a rediss URL
// does not trust the generated CA: replace the TLSConfig of the parsed options with TLSConfig().
func (s *Server) URL() string {
	u := url.URL{Scheme: "redis", Host: s.Addr(), Path: "/0"}
	if s.opts.TLS {
		u.Scheme = "rediss"
	}
	switch {
	case s.opts.ACLUser != "":
		u.User = url.UserPassword(s.opts.ACLUser, s.opts.ACLPassword)
	case s.opts.Password != "":
		u.User = url.UserPassword("", s.opts.Password)
	}
	return u.String()
}

// TLSConfig returns a new client TLS configuration that trusts the server's generated CA and
// verifies the certificate for 127.0.0.1, or nil when the server does not use TLS. Callers may
// modify the returned value.
func (s *Server) TLSConfig() *tls.Config {
	if s.tls == nil {
		return nil
	}
	return s.tls.Clone()
}

// CAFile returns the path of the PEM file holding the generated CA certificate, or "" when the
// server does not use TLS.
func (s *Server) CAFile() string { return s.ca }

// Dir returns the server's working directory, which holds its configuration and log files.
func (s *Server) Dir() string { return s.dir }

// Stop stops the server gracefully with SIGTERM and returns once the process has exited, killing it
// if it has not exited within 10 seconds. Stopping a stopped server does nothing.
func (s *Server) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stop(syscall.SIGTERM)
}

// Kill kills the server with SIGKILL and returns once the process has exited. Killing a stopped
// server does nothing.
func (s *Server) Kill() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stop(syscall.SIGKILL)
}

// Pause stops the server process with SIGSTOP: it keeps its port, connections and data, and
// answers nothing, replicates nothing and acknowledges nothing until Resume. Pausing a paused or
// stopped server does nothing. Stop, Kill, Restart and the cleanup work on a paused server.
func (s *Server) Pause() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil || s.paused {
		return
	}
	if err := s.proc.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		s.t.Fatalf("redistest: SIGSTOP to redis-server %s: %v", s.describe(), err)
	}
	s.paused = true
}

// Resume continues a paused server with SIGCONT; it then works through what it was sent
// meanwhile. Resuming a server that is not paused does nothing.
func (s *Server) Resume() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.resume()
}

// resume sends SIGCONT to a paused process. s.mu must be held.
func (s *Server) resume() {
	if s.proc == nil || !s.paused {
		return
	}
	if err := s.proc.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		s.t.Fatalf("redistest: SIGCONT to redis-server %s: %v", s.describe(), err)
	}
	s.paused = false
}

// stop signals the running process, if any, and reaps it. s.mu must be held.
func (s *Server) stop(sig syscall.Signal) {
	p := s.proc
	if p == nil {
		return
	}
	_ = p.cmd.Process.Signal(sig)
	if s.paused && sig != syscall.SIGKILL {
		_ = p.cmd.Process.Signal(syscall.SIGCONT) // a stopped process acts on SIGTERM once continued
	}
	s.proc, s.paused = nil, false
	select {
	case <-p.done:
	case <-time.After(stopTimeout):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// Restart stops the server if it is running and starts it again on the same port with the same
// configuration file (including any changes redis-server made to it with CONFIG REWRITE, and the
// cluster or sentinel state it saved), retrying for a few seconds while the port is still bound.
// It returns once the server answers PING; data is not kept, since nothing is persisted.
func (s *Server) Restart() {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stop(syscall.SIGTERM)
	s.launchRetrying("restarting")
}

// Running reports whether the server process is running, that is, it was started or restarted and
// neither stopped nor killed since. A process that crashed on its own still counts as running.
func (s *Server) Running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proc != nil
}

// Client returns a go-redis client for the server, with TLS and credentials as configured, that is
// closed when t's cleanups run.
func (s *Server) Client(t testing.TB) *redis.Client {
	t.Helper()
	opt := s.clientOptions()
	c := redis.NewClient(opt)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// clientOptions returns the options of a client for the server: its credentials and TLS, and
// timeouts short enough for tests.
func (s *Server) clientOptions() *redis.Options {
	opt := &redis.Options{
		Addr:         s.Addr(),
		TLSConfig:    s.TLSConfig(),
		DialTimeout:  2 * time.Second,
		ReadTimeout:  2 * time.Second,
		WriteTimeout: 2 * time.Second,
		// One dial per attempt: on loopback, a refused connection means the server is down.
		DialerRetries: 1,
		// Redis 7.0 knows neither CLIENT SETINFO nor CLIENT MAINT_NOTIFICATIONS.
		DisableIdentity:          true,
		MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled},
	}
	switch {
	case s.opts.ACLUser != "":
		opt.Username, opt.Password = s.opts.ACLUser, s.opts.ACLPassword
	case s.opts.Password != "":
		opt.Password = s.opts.Password
	}
	return opt
}

// adminOptions returns the options of the one-connection, no-retry clients redistest uses to probe
// and configure the server.
func (s *Server) adminOptions() *redis.Options {
	opt := s.clientOptions()
	opt.Protocol = 2
	opt.PoolSize = 1
	opt.MaxRetries = -1
	opt.DialTimeout = probeTimeout
	opt.ReadTimeout = probeTimeout
	opt.WriteTimeout = probeTimeout
	return opt
}

// do runs one command on the server through a fresh connection, so that a restarted or
// unreachable server never leaves a client in a bad state.
func (s *Server) do(args ...any) *redis.Cmd {
	ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
	defer cancel()
	if err := s.listening(); err != nil {
		cmd := redis.NewCmd(ctx, args...)
		cmd.SetErr(err)
		return cmd
	}
	c := redis.NewClient(s.adminOptions())
	defer func() { _ = c.Close() }()
	return c.Do(ctx, args...)
}

// listening checks that the server's port accepts TCP connections, which keeps go-redis from
// logging the failed dials of every poll while a server starts or is down.
func (s *Server) listening() error {
	conn, err := net.DialTimeout("tcp", s.Addr(), probeTimeout)
	if err != nil {
		return err
	}
	return conn.Close()
}

// info returns one INFO section of the server.
func (s *Server) info(section string) (string, error) {
	return s.do("INFO", section).Text()
}

// cleanup kills the process and, when the test failed, logs the tail of the server's logs.
func (s *Server) cleanup() {
	s.Kill()
	if !s.t.Failed() {
		return
	}
	s.t.Logf("redistest: log of redis-server %s:\n%s", s.describe(), tail(s.log, logTailBytes))
	if out := tail(s.out, logTailBytes); len(bytes.TrimSpace(out)) > 0 {
		s.t.Logf("redistest: output of redis-server %s:\n%s", s.describe(), out)
	}
}

// describe names the server in messages.
func (s *Server) describe() string {
	what := ""
	switch s.kind {
	case kindClusterNode:
		what = "cluster node "
	case kindSentinel:
		what = "sentinel "
	}
	return fmt.Sprintf("%s%s (dir %s)", what, s.Addr(), s.dir)
}

// tailSince returns what the process p wrote to the logfile and its output since it was launched.
func (s *Server) tailSince(p *process) []byte {
	return append(readFrom(s.log, p.logOffset), readFrom(s.out, p.outOffset)...)
}

// freePort returns a loopback port that was free a moment ago. With bus, port+10000 (the cluster
// bus port) was free as well. The ports lie below the kernel's ephemeral range when it leaves
// room: a server stopped and restarted on its port (Restart) could otherwise find it taken as
// the local port of some outgoing connection meanwhile.
func freePort(bus bool) (int, error) {
	lo, hi := 10000, ephemeralLow()-1
	if bus {
		hi -= 10000
	}
	for range 100 {
		port := 0
		if hi > lo {
			port = lo + rand.IntN(hi-lo+1)
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			continue
		}
		port = l.Addr().(*net.TCPAddr).Port
		if !bus {
			_ = l.Close()
			return port, nil
		}
		if port+10000 > 65535 {
			_ = l.Close()
			continue
		}
		lb, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port+10000)))
		_ = l.Close()
		if err != nil {
			continue
		}
		_ = lb.Close()
		return port, nil
	}
	return 0, errors.New("no free port (with a free cluster bus port, port+10000, for a cluster node) after 100 attempts")
}

// ephemeralLow is the first port of the kernel's ephemeral range (Linux), or 32768.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 32768
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return 32768
	}
	n, err := strconv.Atoi(f[0])
	if err != nil {
		return 32768
	}
	return n
}

// waitFor polls cond until it returns nil and fails the test, naming what was waited for and the
// last error, when timeout passes first.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("redistest: timed out after %s waiting for %s: %v", timeout, what, err)
		}
		time.Sleep(pollInterval)
	}
}

// infoField returns the value of a field of an INFO reply, or "" when it is absent.
func infoField(info, name string) string {
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimRight(line, "\r\n"), name+":"); ok {
			return v
		}
	}
	return ""
}

// quote quotes a configuration value the way redis.conf parses quoted strings.
func quote(v string) string {
	if v != "" && !strings.ContainsAny(v, " \t\r\n\"'\\") {
		return v
	}
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(v); i++ {
		switch c := v[i]; {
		case c == '"' || c == '\\':
			b.WriteByte('\\')
			b.WriteByte(c)
		case c < 0x20 || c >= 0x7f:
			fmt.Fprintf(&b, `\x%02x`, c)
		default:
			b.WriteByte(c)
		}
	}
	b.WriteByte('"')
	return b.String()
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func fileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// readFrom returns the content of path from offset on, or nothing when it cannot be read.
func readFrom(path string, offset int64) []byte {
	b, err := os.ReadFile(path)
	if err != nil || offset > int64(len(b)) {
		return nil
	}
	return b[offset:]
}

// tail returns at most the last n bytes of path.
func tail(path string, n int64) []byte {
	b, err := os.ReadFile(path)
	if err != nil {
		return []byte(err.Error())
	}
	if int64(len(b)) > n {
		return append([]byte("…"), b[int64(len(b))-n:]...)
	}
	return b
}
