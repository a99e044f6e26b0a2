package main

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"syscall"
)

// The most each kind of file the program reads may hold. A policy is a few hundred lines; a
// token, a key-hash secret or a keyring of record keys (one line of about 50 bytes per key) is
// far smaller. A bound keeps a wrong path (a log file, a disk image) from filling the memory.
const (
	maxPolicyFileBytes = 4 << 20
	maxSecretFileBytes = 64 << 10
	// maxPEMFileBytes bounds a file of certificates: a system CA bundle is a few hundred KiB.
	maxPEMFileBytes = 4 << 20
)

// checkLibraryFiles checks, as readBoundedFile does, the files that environment variables name
// for the libraries to read without a bound, or to block on: Go's crypto/x509 reads the CA
// bundle of SSL_CERT_FILE at the first TLS connection (to Redis or to an OTLP collector), the
// OTLP exporters read their certificates and key when tracing starts. Its error holds every bad
// one, each with its variable. With look (check) the files are only looked at (lookAtFile), and
// one that is not there is one of notes instead of an error.
func checkLibraryFiles(getenv func(string) string, look bool) (notes []string, err error) {
	var errs []error
	for _, name := range []string{
		"SSL_CERT_FILE",
		"OTEL_EXPORTER_OTLP_CERTIFICATE", "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
		"OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
		"OTEL_EXPORTER_OTLP_CLIENT_KEY", "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY",
	} {
		path := getenv(name)
		if path == "" {
			continue
		}
		var err error
		if look {
			err = lookAtFile(path, maxPEMFileBytes)
			if errors.Is(err, fs.ErrNotExist) {
				notes = append(notes, fmt.Sprintf("environment variable %s: %s is not there to look at; the server reads it at start-up", name, path))
				continue
			}
		} else {
			_, err = readBoundedFile(path, maxPEMFileBytes)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("environment variable %s: %w", name, err))
		}
	}
	return notes, errors.Join(errs...)
}

// lookAtFile refuses, as readBoundedFile does, what is not a regular file of at most limit bytes,
// or is empty, without reading it. Its error for a path that is not there is fs.ErrNotExist.
func lookAtFile(path string, limit int64) error {
	fi, err := os.Stat(path) // follows a symbolic link, as opening the file does
	switch {
	case err != nil:
		return err // an *fs.PathError: it names the path
	case !fi.Mode().IsRegular():
		return fmt.Errorf("%s: not a regular file (%s)", path, fileKind(fi.Mode()))
	case fi.Size() > limit:
		return fmt.Errorf("%s: %d bytes, more than the %s this file may hold", path, fi.Size(), byteSize(limit))
	case fi.Size() == 0:
		return fmt.Errorf("%s is empty", path)
	}
	return nil
}

// readBoundedFile reads the regular file at path, which may hold at most limit bytes. Anything
// else is refused with an error that names path and what it is, and never blocks: a named pipe
// is opened without waiting for a writer, and a device or a directory is refused before a byte
// is read. A symbolic link is followed (a Kubernetes Secret's files are links). The error never
// holds the file's content.
func readBoundedFile(path string, limit int64) ([]byte, error) {
	// O_NONBLOCK: opening a named pipe for reading otherwise waits for a writer, for ever. It
	// changes nothing for a regular file.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err // an *fs.PathError: it names the path
	}
	defer func() { _ = f.Close() }()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s: not a regular file (%s)", path, fileKind(fi.Mode()))
	}
	if fi.Size() > limit {
		return nil, fmt.Errorf("%s: %d bytes, more than the %s this file may hold", path, fi.Size(), byteSize(limit))
	}
	// The file may grow between Stat and the read: read one byte past the bound to see it.
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%s: more than the %s this file may hold", path, byteSize(limit))
	}
	return b, nil
}

// fileKind names the type of a file that is not a regular one.
func fileKind(m fs.FileMode) string {
	switch {
	case m.IsDir():
		return "a directory"
	case m&fs.ModeNamedPipe != 0:
		return "a named pipe"
	case m&fs.ModeCharDevice != 0:
		return "a character device"
	case m&fs.ModeDevice != 0:
		return "a block device"
	case m&fs.ModeSocket != 0:
		return "a socket"
	default:
		return "mode " + m.Type().String()
	}
}

// byteSize writes a bound in KiB or MiB.
func byteSize(n int64) string {
	if n >= 1<<20 && n%(1<<20) == 0 {
		return fmt.Sprintf("%d MiB", n>>20)
	}
	if n >= 1<<10 && n%(1<<10) == 0 {
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d bytes", n)
}
