// Package leakcheck fails a test binary whose tests leave goroutines running.
package leakcheck

import (
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// settle is how long Main waits for goroutines to end. goleak's own wait, about 0.4 s, is short
// for a goroutine that has been told to end but not yet run, on a loaded machine under the race
// detector: a gRPC transport after Stop, a handler after its stream.
const settle = 10 * time.Second

// Main runs the tests and, when they pass, fails the binary if a goroutine they started still
// runs after settle. Call it from TestMain.
func Main(m *testing.M) {
	code := m.Run()
	if code == 0 {
		if err := wait(goleak.Find, settle, 100*time.Millisecond); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: Errors on successful test run: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// wait calls find every pause until it reports nothing or settle has passed, and returns what it
// last reported.
func wait(find func(...goleak.Option) error, settle, pause time.Duration) error {
	deadline := time.Now().Add(settle)
	err := find()
	for err != nil && time.Now().Before(deadline) {
		time.Sleep(pause)
		err = find()
	}
	return err
}
