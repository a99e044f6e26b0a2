// Command idempotency-extproc is an Envoy external processor that gives any HTTP upstream
// Idempotency-Key semantics. docs/configuration.md documents its flags and policy file; help
// lists them too. Its commands check, key-hash and records help operators check a deployment and
// find and purge one record. Any error exits 1, a usage mistake included, with its message on
// stderr.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signalled, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	// The first signal starts the drain; a second one ends the process at once, as the default
	// action does: the drain begins only once the signals are no longer caught.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		<-signalled.Done()
		stop()
		cancel()
	}()
	if err := dispatch(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "idempotency-extproc:", err)
		code := 1
		var ec interface{ ExitCode() int } // check's: 1 findings, 2 a file it cannot read
		if errors.As(err, &ec) {
			code = ec.ExitCode()
		}
		os.Exit(code)
	}
}
