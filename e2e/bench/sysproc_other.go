//go:build !linux

package main

import "os/exec"

// dieWithBench returns cmd: only Linux kills a child with its parent.
func dieWithBench(cmd *exec.Cmd) *exec.Cmd { return cmd }
