// Command peakrss runs a command and writes the most memory it held resident, in bytes, to a
// file: peakrss OUT COMMAND [ARG...]. It passes the command its standard streams and exits with
// its status; a command a signal ended is said so on standard error, with status 125, as are
// peakrss's own failures.
//
// A process the Go runtime starts shares its parent's memory until it execs (CLONE_VM), and
// Linux counts the parent's peak into the child's on exec, so a test process that starts the
// command itself reads its own peak whenever that is the larger. This small process stands
// between them: its few MiB are the floor of what it reports.
package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"syscall"
)

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: peakrss OUT COMMAND [ARG...]")
		os.Exit(125)
	}
	cmd := exec.Command(os.Args[2], os.Args[3:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		fmt.Fprintln(os.Stderr, "peakrss:", err)
		os.Exit(125)
	}
	rss := cmd.ProcessState.SysUsage().(*syscall.Rusage).Maxrss << 10 // Linux counts KiB
	if err := os.WriteFile(os.Args[1], []byte(strconv.FormatInt(rss, 10)), 0o600); err != nil {
		fmt.Fprintln(os.Stderr, "peakrss:", err)
		os.Exit(125)
	}
	if ws := cmd.ProcessState.Sys().(syscall.WaitStatus); ws.Signaled() {
		fmt.Fprintf(os.Stderr, "peakrss: %s: %v\n", os.Args[2], ws.Signal())
		os.Exit(125)
	}
	os.Exit(cmd.ProcessState.ExitCode())
}
