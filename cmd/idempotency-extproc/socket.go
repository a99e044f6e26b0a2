package main

import (
	"errors"
	"net"
	"os"
	"path/filepath"
)

// listenUnix opens a Unix socket at path, readable and writable by its owner and group only,
// with no moment at which it is there with another mode: it is bound in a directory of its own
// that only the process may enter (os.MkdirTemp makes it 0700), made 0660 there, then renamed
// to path. Closing the listener removes path.
func listenUnix(path string) (net.Listener, error) {
	private, err := os.MkdirTemp(filepath.Dir(path), ".extproc-listen-")
	if err != nil {
		return nil, err
	}
	defer func() { _ = os.RemoveAll(private) }()
	bound := filepath.Join(private, "s")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: bound, Net: "unix"})
	if err != nil {
		return nil, err
	}
	// The bound name goes with the private directory: Close removes path instead.
	l.SetUnlinkOnClose(false)
	if err := os.Chmod(bound, 0o660); err != nil {
		_ = l.Close()
		return nil, err
	}
	if err := os.Rename(bound, path); err != nil {
		_ = l.Close()
		return nil, err
	}
	return &unixListener{UnixListener: l, addr: &net.UnixAddr{Name: path, Net: "unix"}}, nil
}

// unixListener is a socket renamed after it was bound: its address is its path, and Close
// removes that.
type unixListener struct {
	*net.UnixListener
	addr *net.UnixAddr
}

func (l *unixListener) Addr() net.Addr { return l.addr }

func (l *unixListener) Close() error {
	err := l.UnixListener.Close()
	if rerr := os.Remove(l.addr.Name); rerr != nil && !errors.Is(rerr, os.ErrNotExist) && err == nil {
		err = rerr
	}
	return err
}
