package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestRunLeavesNoRedisBehind runs the bench's command line to an early failure, before and after
// it starts its redis-server, and checks that no redis-server child of this process is left: the
// bench's exits once skipped the deferred stop (os.Exit), and -rounds 1 left one running.
func TestRunLeavesNoRedisBehind(t *testing.T) {
	_, err := exec.LookPath("redis-server")
	require.NoError(t, err, "the test needs redis-server on PATH")
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"too few rounds", []string{"-mode", "user", "-rounds", "1"}},
		{"a bad size, after redis-server started", []string{"-mode", "user", "-rounds", "3", "-user-sizes", "x"}},
		{"an unknown mode", []string{"-mode", "nope"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, 2, run(tc.args))
			require.Empty(t, redisChildren(t))
		})
	}
}

// redisChildren returns the pids of this process's redis-server children, from /proc.
func redisChildren(t *testing.T) []int {
	t.Helper()
	stats, err := filepath.Glob("/proc/[0-9]*/stat")
	require.NoError(t, err)
	var pids []int
	for _, p := range stats {
		b, err := os.ReadFile(p)
		if err != nil {
			continue // gone meanwhile
		}
		// pid (comm) state ppid ...
		s := string(b)
		open, end := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
		if open < 0 || end < open {
			continue
		}
		f := strings.Fields(s[end+1:])
		if len(f) < 2 || s[open+1:end] != "redis-server" || f[1] != strconv.Itoa(os.Getpid()) {
			continue
		}
		pid, _ := strconv.Atoi(strings.TrimSpace(s[:open]))
		pids = append(pids, pid)
	}
	return pids
}
