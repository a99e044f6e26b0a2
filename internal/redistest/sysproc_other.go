//go:build !linux

package redistest

import "syscall"

// sysProcAttr returns nil: only Linux can kill children when their parent dies.
func sysProcAttr() *syscall.SysProcAttr { return nil }
