package envoyconf

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// fakeEnvoyEnv makes the test binary act as envoy, so StartEnvoy can be tested where no envoy
// binary exists. Its value selects the behaviour: "serve" or "exit".
const fakeEnvoyEnv = "ENVOYCONF_FAKE_ENVOY"

func TestMain(m *testing.M) {
	if mode := os.Getenv(fakeEnvoyEnv); mode != "" {
		os.Exit(fakeEnvoy(mode, os.Args[1:]))
	}
	os.Exit(m.Run())
}

// fakeEnvoy accepts the command line StartEnvoy builds, loads the bootstrap the way this package
// does, and serves the admin /ready endpoint on the bootstrap's admin port until SIGTERM.
func fakeEnvoy(mode string, args []string) int {
	fs := flag.NewFlagSet("envoy", flag.ContinueOnError)
	cfg := fs.String("c", "", "bootstrap file")
	baseID := fs.Uint("base-id", 0, "shared memory base id")
	level := fs.String("log-level", "info", "log level")
	if err := fs.Parse(args); err != nil || fs.NArg() != 0 {
		return 2
	}
	if *baseID == 0 || *level != "warn" {
		fmt.Fprintf(os.Stderr, "fake envoy: want --base-id and --log-level warn, got %q\n", args)
		return 2
	}
	if mode == "exit" {
		fmt.Fprintln(os.Stderr, "fake envoy: exiting on purpose")
		return 3
	}
	b, err := Load(*cfg)
	if err == nil {
		err = Validate(b)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "fake envoy:", err)
		return 1
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM)
	addr := b.GetAdmin().GetAddress().GetSocketAddress()
	ln, err := net.Listen("tcp", net.JoinHostPort(addr.GetAddress(), fmt.Sprint(addr.GetPortValue())))
	if err != nil {
		fmt.Fprintln(os.Stderr, "fake envoy:", err)
		return 1
	}
	srv := &http.Server{
		ReadHeaderTimeout: time.Second,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/ready" {
				http.NotFound(w, r)
				return
			}
			fmt.Fprintln(w, "LIVE")
		}),
	}
	go func() { _ = srv.Serve(ln) }()
	<-stop
	_ = srv.Shutdown(context.Background())
	return 0
}

func freePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func fakeBootstrap(t testing.TB) ([]byte, int) {
	t.Helper()
	b := loadForProxy(t)
	admin := freePort(t)
	js, err := Rewrite(b, Ports{Listener: freePort(t), Admin: admin, Processors: []string{"127.0.0.1:1"}, Upstream: "127.0.0.1:2"})
	require.NoError(t, err)
	return js, admin
}

func TestLookEnvoy(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	require.Empty(t, LookEnvoy())

	dir := t.TempDir()
	require.NoError(t, os.WriteFile(dir+"/envoy", []byte("#!/bin/sh\n"), 0o755))
	t.Setenv("PATH", dir)
	require.Equal(t, dir+"/envoy", LookEnvoy())
}

func TestStartEnvoyWaitsForLiveAndStops(t *testing.T) {
	t.Setenv(fakeEnvoyEnv, "serve")
	self, err := os.Executable()
	require.NoError(t, err)
	js, admin := fakeBootstrap(t)

	var cmd *exec.Cmd
	t.Cleanup(func() { // runs after StartEnvoy's own cleanup, which waited for the exit
		require.NotNil(t, cmd.ProcessState, "envoy still running after cleanup")
		require.Equal(t, 0, cmd.ProcessState.ExitCode(), "envoy did not stop cleanly on SIGTERM")
	})
	cmd = StartEnvoy(t, self, js, admin)
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/ready", admin))
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
}

// recordingTB turns Fatal into a recorded failure that ends only the calling goroutine.
type recordingTB struct {
	testing.TB
	mu     sync.Mutex
	failed string
}

func (r *recordingTB) Fatalf(format string, args ...any) {
	r.mu.Lock()
	r.failed = fmt.Sprintf(format, args...)
	r.mu.Unlock()
	runtime.Goexit()
}

func (r *recordingTB) Fatal(args ...any) { r.Fatalf("%s", fmt.Sprint(args...)) }

func TestStartEnvoyReportsEarlyExit(t *testing.T) {
	t.Setenv(fakeEnvoyEnv, "exit")
	self, err := os.Executable()
	require.NoError(t, err)
	js, admin := fakeBootstrap(t)

	rec := &recordingTB{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		StartEnvoy(rec, self, js, admin)
	}()
	select {
	case <-done:
	case <-time.After(envoyReadyTimeout + 5*time.Second):
		t.Fatal(errors.New("StartEnvoy did not return"))
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	require.Contains(t, rec.failed, "envoy exited before it was ready")
	require.Contains(t, rec.failed, "exit status 3")
}
