//go:build linux

package main

import (
	"os/exec"
	"syscall"
)

// dieWithBench asks the kernel to SIGKILL cmd's process when the bench dies (a signal, a crash),
// as a backstop for the deferred stops, which then never run.
func dieWithBench(cmd *exec.Cmd) *exec.Cmd {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd
}
