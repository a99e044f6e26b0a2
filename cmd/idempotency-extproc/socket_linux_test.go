package main

import (
	"bytes"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// The socket appears at its path with its final mode, 0660, by a rename from a directory only
// the processor can enter: it is never there with the mode the umask gives, however briefly.
// inotify sees it arrive (IN_MOVED_TO), never created there (IN_CREATE) nor re-permissioned
// (IN_ATTRIB).
func TestRunUnixSocketHasNoPermissionWindow(t *testing.T) {
	dir := t.TempDir()
	fd, err := syscall.InotifyInit1(syscall.IN_CLOEXEC | syscall.IN_NONBLOCK)
	require.NoError(t, err)
	defer syscall.Close(fd)
	_, err = syscall.InotifyAddWatch(fd, dir, syscall.IN_CREATE|syscall.IN_ATTRIB|syscall.IN_MOVED_TO)
	require.NoError(t, err)

	l, err := listen("unix://" + filepath.Join(dir, "extproc.sock"))
	require.NoError(t, err)
	require.Equal(t, "unix://"+filepath.Join(dir, "extproc.sock"), addrString(l))
	fi, err := os.Stat(filepath.Join(dir, "extproc.sock"))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o660), fi.Mode().Perm())

	// The events are queued by the time listen returns: inotify records them synchronously.
	buf := make([]byte, 64<<10)
	n, err := syscall.Read(fd, buf)
	require.NoError(t, err)
	events := map[string]uint32{}
	for off := 0; off+syscall.SizeofInotifyEvent <= n; {
		ev := (*syscall.InotifyEvent)(unsafe.Pointer(&buf[off]))
		name := string(bytes.TrimRight(buf[off+syscall.SizeofInotifyEvent:off+syscall.SizeofInotifyEvent+int(ev.Len)], "\x00"))
		events[name] |= ev.Mask
		off += syscall.SizeofInotifyEvent + int(ev.Len)
	}
	got := events["extproc.sock"]
	require.NotZero(t, got&syscall.IN_MOVED_TO, "the socket did not arrive by a rename: %v", events)
	require.Zero(t, got&(syscall.IN_CREATE|syscall.IN_ATTRIB), "the socket was created or re-permissioned at its path: %v", events)

	require.NoError(t, l.Close())
	_, err = os.Lstat(filepath.Join(dir, "extproc.sock"))
	require.ErrorIs(t, err, os.ErrNotExist, "Close removes the socket")
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Empty(t, entries, "the private directory is left behind")
}
