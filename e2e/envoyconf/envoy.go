package envoyconf

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// LookEnvoy returns the path of the envoy binary on PATH, or "" when there is none.
func LookEnvoy() string {
	p, err := exec.LookPath("envoy")
	if err != nil {
		return ""
	}
	return p
}

// Envoy start-up and shut-down budgets.
const (
	envoyReadyTimeout = 30 * time.Second
	envoyStopTimeout  = 10 * time.Second
)

// StartEnvoy writes bootstrapJSON (for instance Rewrite's output) to a temporary file, runs
// `envoyBin -c <file> --base-id <random> --log-level warn`, and returns once the admin interface
// on 127.0.0.1:adminPort answers /ready with LIVE. It fails t when Envoy exits or is not ready
// within 30s. At cleanup Envoy gets SIGTERM, then SIGKILL after 10s; its output is kept in
// envoy.log in a temporary directory and logged when the test failed. The random base id lets
// several Envoys run at once on one machine.
func StartEnvoy(t testing.TB, envoyBin string, bootstrapJSON []byte, adminPort int) *exec.Cmd {
	t.Helper()
	dir := t.TempDir()
	cfg := filepath.Join(dir, "envoy.json") // the .json extension makes Envoy parse it as JSON
	if err := os.WriteFile(cfg, bootstrapJSON, 0o600); err != nil {
		t.Fatal(err)
	}
	logPath := filepath.Join(dir, "envoy.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(envoyBin, "-c", cfg,
		"--base-id", strconv.Itoa(1+rand.IntN(1<<20)),
		"--log-level", "warn")
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		logFile.Close()
		t.Fatalf("start envoy: %v", err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait() // the exit status is reported through the log
		logFile.Close()
		close(exited)
	}()
	t.Cleanup(func() {
		select {
		case <-exited:
		default:
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-exited:
			case <-time.After(envoyStopTimeout):
				_ = cmd.Process.Kill()
				<-exited
			}
		}
		if t.Failed() {
			logTail(t, logPath)
		}
	})

	ctx, cancel := context.WithTimeout(context.Background(), envoyReadyTimeout)
	defer cancel()
	url := fmt.Sprintf("http://127.0.0.1:%d/ready", adminPort)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		if live(ctx, url) {
			return cmd
		}
		select {
		case <-exited:
			t.Fatalf("envoy exited before it was ready: %v", cmd.ProcessState)
		case <-ctx.Done():
			t.Fatalf("envoy not ready at %s after %v", url, envoyReadyTimeout)
		case <-tick.C:
		}
	}
}

// live reports whether Envoy's admin /ready answers 200 LIVE.
func live(ctx context.Context, url string) bool {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return false
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 64))
	return resp.StatusCode == http.StatusOK && strings.TrimSpace(string(body)) == "LIVE"
}

func logTail(t testing.TB, path string) {
	data, err := os.ReadFile(path)
	if err != nil {
		return
	}
	const keep = 16 << 10
	if len(data) > keep {
		data = data[len(data)-keep:]
	}
	t.Logf("envoy log (%s):\n%s", path, data)
}
