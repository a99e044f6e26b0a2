package main

import (
	"bytes"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/internal/check"
)

var (
	// plainBinary is the binary built without the race detector, whose shadow memory would
	// multiply the heap: the tests that measure the process's memory run it.
	plainBinary = buildOnce(".", "idempotency-extproc")
	// peakRSS is a command that runs another and writes the most memory that one held resident
	// (testdata/peakrss): the test process's own peak would otherwise be read as the child's.
	peakRSS = buildOnce("./testdata/peakrss", "peakrss")
)

// buildOnce returns the path of pkg's command, named name, built without the race detector into
// the tests' binDir the first time it is called.
func buildOnce(pkg, name string) func() (string, error) {
	return sync.OnceValues(func() (string, error) {
		path := filepath.Join(binDir, name)
		if out, err := exec.Command("go", "build", "-o", path, pkg).CombinedOutput(); err != nil {
			return "", &buildError{out: string(out), err: err}
		}
		return path, nil
	})
}

// maxCheckRSS is the most memory check may hold, whatever it is fed: the default bounds and the
// heap's soft limit keep the worst input measured (flow pairs at the value bound) near 75 MB.
const maxCheckRSS = 100 << 20

// Input beyond check's bounds is refused with one line that names the input and the bound, exit
// status 2, in less than maxCheckRSS of memory: standard input that never ends, a file far
// larger than --max-input-bytes, a small file of 10,000 nested sequences, a file within the
// bound of short values only. Before the bounds the first grew until the runtime died, the
// second took 1.8 GB and the third 330 MB.
func TestCheckHostileInputIsBounded(t *testing.T) {
	bin, err := plainBinary()
	require.NoError(t, err)
	wrap, err := peakRSS()
	require.NoError(t, err)
	policy := shipped("policy.yaml")
	large := filepath.Join(t.TempDir(), "large.yaml")
	f, err := os.Create(large)
	require.NoError(t, err)
	line := bytes.Repeat([]byte("y\n"), 1<<19) // 1 MiB
	for range 48 {
		_, err := f.Write(line)
		require.NoError(t, err)
	}
	require.NoError(t, f.Close())
	limit := byteSize(check.DefaultMaxInputBytes)
	for _, tc := range []struct {
		name  string
		file  string          // a FILE, or "-" with stdin
		stdin func(io.Writer) // writes standard input until it fails
		want  string
	}{
		{name: "endless standard input", file: "-", stdin: func(w io.Writer) {
			for {
				if _, err := w.Write(line); err != nil {
					return
				}
			}
		}, want: "check: <stdin>: more than the " + limit + " --max-input-bytes allows"},
		{name: "a 48 MiB file", file: large, want: "check: " + large + ": 50331648 bytes, more than the " + limit + " --max-input-bytes allows"},
		{name: "10,000 nested sequences", file: writeNamed(t, "nested.yaml", strings.Repeat("[", 10000)+strings.Repeat("]", 10000)),
			want: "nested.yaml:1: mappings and sequences nested more than 100 deep, the most that is read"},
		{name: "short values up to the byte bound", file: writeNamed(t, "dense.yaml", "["+strings.Repeat("a,", int(check.DefaultMaxInputBytes)/2-2)+"a]"),
			want: "dense.yaml: more than the 131072 YAML values an input of " + limit + " may hold"},
		{name: "flow pairs within the value bound", file: writeNamed(t, "pairs.yaml", "["+strings.Repeat("a: b, ", 32700)+"a: b]"),
			want: "pairs.yaml:1:1: the document is a sequence"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			peak := filepath.Join(t.TempDir(), "peak")
			cmd := exec.Command(wrap, peak, bin, "check", "--config", policy, tc.file)
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			var fed sync.WaitGroup
			if tc.stdin != nil {
				w, err := cmd.StdinPipe()
				require.NoError(t, err)
				fed.Go(func() { tc.stdin(w); _ = w.Close() })
			}
			require.NoError(t, cmd.Start())
			err := cmd.Wait()
			fed.Wait() // the writer stops once the process has closed its end
			var exit *exec.ExitError
			require.ErrorAs(t, err, &exit, "stdout %q stderr %q", stdout.String(), stderr.String())
			require.Equal(t, checkBadFile, exit.ExitCode(), stderr.String())
			require.Empty(t, stdout.String())
			msg := stderr.String()
			require.Equal(t, 1, strings.Count(msg, "\n"), "one line: %q", msg)
			require.Contains(t, msg, tc.want)
			b, err := os.ReadFile(peak)
			require.NoError(t, err)
			rss, err := strconv.ParseInt(string(b), 10, 64)
			require.NoError(t, err)
			require.Less(t, rss, int64(maxCheckRSS), "peak RSS %d MiB", rss>>20)
		})
	}
}

// --max-input-bytes bounds the size of each input and the values of its YAML.
func TestCheckMaxInputBytes(t *testing.T) {
	text, err := os.ReadFile(shipped("envoy.yaml"))
	require.NoError(t, err)
	_, msg, code := runCheck(t, string(text), "--config", shipped("policy.yaml"), "--max-input-bytes", "1024", "-")
	require.Equal(t, checkBadFile, code)
	require.Equal(t, "check: <stdin>: more than the 1 KiB --max-input-bytes allows (1024 bytes)", msg)
	_, msg, code = runCheck(t, "", "--config", shipped("policy.yaml"), "--max-input-bytes", "1024", shipped("envoy.yaml"))
	require.Equal(t, checkBadFile, code)
	require.Equal(t, "check: "+shipped("envoy.yaml")+": "+strconv.Itoa(len(text))+" bytes, more than the 1 KiB --max-input-bytes allows (1024 bytes)", msg)
	// Its size would do, but not its values: configuration holds one per 6 to 8 bytes.
	_, msg, code = runCheck(t, string(text), "--config", shipped("policy.yaml"), "--max-input-bytes", strconv.Itoa(len(text)), "-")
	require.Equal(t, checkBadFile, code)
	require.Contains(t, msg, "check: <stdin>: more than the "+strconv.Itoa(len(text)/32)+" YAML values an input of "+strconv.Itoa(len(text))+" bytes may hold")
	out, msg, code := runCheck(t, string(text), "--config", shipped("policy.yaml"), "--max-input-bytes", strconv.Itoa(4*len(text)), "-")
	require.Zero(t, code, msg)
	require.True(t, strings.HasPrefix(out, "ok: "), "a clean run says what it checked: %q", out)
	_, msg, code = runCheck(t, "", "--config", shipped("policy.yaml"), "--max-input-bytes", "0", "-")
	require.Equal(t, checkBadFile, code)
	require.Contains(t, msg, "--max-input-bytes must be positive")
	_, msg, code = runCheck(t, "", "--config", shipped("policy.yaml"), t.TempDir())
	require.Equal(t, checkBadFile, code)
	require.Contains(t, msg, ": a directory, not a file")
}

// blockedReading waits until a thread of process pid is blocked in read(2) on standard input,
// as /proc/PID/task/TID/syscall shows it: syscall 0, first argument 0.
func blockedReading(t *testing.T, pid int) {
	t.Helper()
	require.Eventually(t, func() bool {
		tasks, _ := filepath.Glob(filepath.Join("/proc", strconv.Itoa(pid), "task", "*", "syscall"))
		for _, task := range tasks {
			b, err := os.ReadFile(task)
			if err == nil && strings.HasPrefix(string(b), "0 0x0 ") {
				return true
			}
		}
		return false
	}, 30*time.Second, 10*time.Millisecond, "check never blocked reading standard input")
}

// signalEnds sends sig to cmd and requires that it ends promptly, killed by it: a shell reports
// 128+sig (143 for SIGTERM, 130 for SIGINT).
func signalEnds(t *testing.T, cmd *exec.Cmd, sig syscall.Signal) {
	t.Helper()
	waited := make(chan error, 1)
	go func() { waited <- cmd.Wait() }()
	require.NoError(t, cmd.Process.Signal(sig))
	select {
	case err := <-waited:
		var exit *exec.ExitError
		require.ErrorAs(t, err, &exit)
		ws := exit.Sys().(syscall.WaitStatus)
		require.True(t, ws.Signaled(), "ended by the signal, not by exit status %d", ws.ExitStatus())
		require.Equal(t, sig, ws.Signal())
		require.Equal(t, 128+int(sig), 128+int(ws.Signal()), "a shell's $?")
	case <-time.After(5 * time.Second): // the default action is immediate; the bound is margin
		_ = cmd.Process.Kill()
		t.Fatalf("%v did not end %v", sig, cmd.Args)
	}
}

// Only serve catches SIGTERM and SIGINT: check waiting on a silent standard input ends on the
// first one, and so does records waiting on a server that never answers. Before, both caught
// the signal for a drain they do not have and ran on.
func TestOneShotCommandsEndOnTheFirstSignal(t *testing.T) {
	bin, err := binary()
	require.NoError(t, err)
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		t.Run("check "+sig.String(), func(t *testing.T) {
			cmd := exec.Command(bin, "check", "--config", shipped("policy.yaml"), "-")
			stdin, err := cmd.StdinPipe() // held open, never written: a silent standard input
			require.NoError(t, err)
			defer func() { _ = stdin.Close() }()
			require.NoError(t, cmd.Start())
			blockedReading(t, cmd.Process.Pid)
			signalEnds(t, cmd, sig)
		})
		t.Run("records "+sig.String(), func(t *testing.T) {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			defer func() { _ = l.Close() }()
			cmd := exec.Command(bin, "records", "get", strings.Repeat("a", 64),
				"--admin-url", "http://"+l.Addr().String(), "--token-file", writeNamed(t, "token", "tok\n"))
			require.NoError(t, cmd.Start())
			conn, err := l.Accept() // the request is on its way; no answer comes
			require.NoError(t, err)
			defer func() { _ = conn.Close() }()
			signalEnds(t, cmd, sig)
		})
	}
}
