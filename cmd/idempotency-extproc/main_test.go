package main

import (
	"os"
	"strings"
	"testing"

	"github.com/idempotency-extproc/idempotency-extproc/internal/extproctest"
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// binDir holds the commands the tests build (buildOnce), and goes when they end.
var binDir string

// TestMain runs the tests without the shell's IDEMPOTENCY_* and OTEL_* variables, but the one the
// tests read (redistest.RequireEnv): the program reads them, in this process and in the ones the
// tests start, which run as each test says, whatever the shell sets.
func TestMain(m *testing.M) {
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if extproctest.ConfiguresProgram(name) && name != redistest.RequireEnv {
			_ = os.Unsetenv(name)
		}
	}
	var err error
	if binDir, err = os.MkdirTemp("", "idempotency-extproc-test"); err != nil {
		panic(err)
	}
	code := m.Run()
	_ = os.RemoveAll(binDir)
	os.Exit(code)
}
