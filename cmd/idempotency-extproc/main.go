// Command idempotency-extproc is an Envoy external processor that gives any HTTP upstream
// Idempotency-Key semantics. See the README for its flags and policy file.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Getenv, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "idempotency-extproc:", err)
		os.Exit(1)
	}
}
