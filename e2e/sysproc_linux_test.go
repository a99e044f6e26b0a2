//go:build linux

package e2e_test

import "syscall"

// childAttr asks the kernel to SIGKILL a processor when the test binary dies (a test timeout's
// panic skips every cleanup), so that no race-built processor outlives the suite.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
