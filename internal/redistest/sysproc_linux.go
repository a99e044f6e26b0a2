//go:build linux

package redistest

import "syscall"

// sysProcAttr asks the kernel to SIGKILL a redis-server when the test binary dies, as a backstop for
// cleanups that never ran.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
