// Command demo runs idempotency-extproc for a first try, in one process and without Docker or an
// envoy binary: the processor on the memory store with envoy/policy.yaml, the Envoy emulator of
// e2e/proxy configured from envoy/envoy.yaml, and the counting upstream of e2e/upstream. It binds
// loopback addresses only and prints the recipe of README.md, which its test runs.
//
// The emulator exists for trying the product and for its tests; in production the processor runs
// behind Envoy, Istio or Envoy Gateway (envoy/).
//
//	go run ./e2e/demo                 # from the repository root; -h lists the flags
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}
