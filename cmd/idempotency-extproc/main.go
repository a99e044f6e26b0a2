// Command idempotency-extproc is an Envoy external processor that gives any HTTP upstream
// Idempotency-Key semantics. docs/configuration.md documents its flags and policy file; help
// lists them too. Its commands check, key-hash and records help operators check a deployment and
// find and purge one record. Any error exits 1, a usage mistake included, with its message on
// stderr; check exits 2 on input it cannot read. Only the server (serve) catches SIGTERM and
// SIGINT, to drain; every other command ends on the first one, as its default action does (a
// shell reports 143 or 130).
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"
)

// checkMemoryLimit is the soft limit of check's Go heap. Its bounds keep what it holds at
// once to some 40 MiB; the limit keeps the garbage it leaves behind from doubling that.
const checkMemoryLimit = 48 << 20

func main() {
	if len(os.Args) > 1 && os.Args[1] == "check" && os.Getenv("GOMEMLIMIT") == "" {
		debug.SetMemoryLimit(checkMemoryLimit)
	}
	if err := dispatch(context.Background(), os.Args[1:], os.Getenv, os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "idempotency-extproc:", err)
		code := 1
		var ec interface{ ExitCode() int } // check's: 1 findings, 2 a file it cannot read
		if errors.As(err, &ec) {
			code = ec.ExitCode()
		}
		os.Exit(code)
	}
}

// drainOnSignal returns a context that the first SIGTERM or SIGINT cancels, for the server to
// drain, and the function that stops catching them. A second signal ends the process at once,
// as the default action does: the drain begins only once the signals are no longer caught.
// Only serve calls it: a command that catches no signal ends on the first one, even while it
// waits for a silent standard input.
func drainOnSignal(parent context.Context) (context.Context, func()) {
	signalled, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	ctx, cancel := context.WithCancel(parent)
	go func() {
		select {
		case <-signalled.Done():
		case <-ctx.Done():
		}
		stop()
		cancel()
	}()
	return ctx, func() { stop(); cancel() }
}
