//go:build !linux

package e2e_test

import "syscall"

// childAttr returns nil: only Linux can kill children when their parent dies.
func childAttr() *syscall.SysProcAttr { return nil }
