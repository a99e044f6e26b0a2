package main

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// mkfifo makes a named pipe. A reader that opened it and waits for a writer is let go when the
// test ends, so that a regression fails the test instead of hanging the binary.
func mkfifo(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "fifo")
	require.NoError(t, syscall.Mkfifo(path, 0o600))
	t.Cleanup(func() {
		if f, err := os.OpenFile(path, os.O_WRONLY|syscall.O_NONBLOCK, 0); err == nil {
			_ = f.Close()
		}
	})
	return path
}

// sparse makes a file of size bytes that takes no room on disk.
func sparse(t *testing.T, size int64) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "big")
	f, err := os.Create(path)
	require.NoError(t, err)
	require.NoError(t, f.Truncate(size))
	require.NoError(t, f.Close())
	return path
}

// within runs f and fails the test if it has not returned after a while: a file read that
// blocks would otherwise hang the test binary.
func within(t *testing.T, f func() error) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- f() }()
	select {
	case err := <-done:
		return err
	case <-time.After(5 * time.Second):
		t.Fatal("still reading after 5 s")
		return nil
	}
}

// Every file the program reads must be a regular file within its bound: a named pipe, a device,
// a directory or an oversized file is refused at once, with the setting, the path and what is
// wrong. Before, a named pipe blocked start-up for ever, /dev/zero filled the memory and a
// 300 MB token was accepted.
func TestFilesMustBeBoundedRegularFiles(t *testing.T) {
	fifo, dir := mkfifo(t), t.TempDir()
	// refusals lists, for a file's bound, each kind of file refused and the error's end.
	refusals := func(limit int64) [][2]string {
		return [][2]string{
			{fifo, "not a regular file (a named pipe)"},
			{"/dev/zero", "not a regular file (a character device)"},
			{dir, "not a regular file (a directory)"},
			{sparse(t, limit+1), strconv.FormatInt(limit+1, 10) + " bytes, more than the " + byteSize(limit) + " this file may hold"},
			{sparse(t, 300<<20), "314572800 bytes, more than the " + byteSize(limit) + " this file may hold"},
		}
	}
	for setting, limit := range map[string]int64{
		"config": maxPolicyFileBytes, "admin-token-file": maxSecretFileBytes,
		"record-keys-file": maxSecretFileBytes, "key-hash-secret-file": maxSecretFileBytes,
	} {
		for _, r := range refusals(limit) {
			t.Run(setting+" "+r[1], func(t *testing.T) {
				err := within(t, func() error {
					_, err := loadConfig([]string{"--" + setting, r[0]}, env(nil))
					return err
				})
				require.ErrorContains(t, err, setting+" (flag --"+setting+"): "+r[0]+": "+r[1])
			})
		}
	}

	t.Run("records --token-file", func(t *testing.T) {
		for _, r := range refusals(maxSecretFileBytes) {
			err := within(t, func() error {
				return dispatch(t.Context(), []string{"records", "get", strings.Repeat("a", 64), "--token-file", r[0]}, env(nil), io.Discard, io.Discard)
			})
			require.ErrorContains(t, err, "records get: --token-file: "+r[0]+": "+r[1])
		}
	})

	t.Run("the server's start-up", func(t *testing.T) {
		logs := newLogLines()
		err := within(t, func() error {
			return run(t.Context(), []string{"--admin-token-file", fifo, "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"}, env(nil), logs)
		})
		require.ErrorContains(t, err, "admin-token-file (flag --admin-token-file): "+fifo+": not a regular file (a named pipe)")
		require.NotContains(t, logs.String(), "ready")
	})
}

// A file at its bound is read, through a symbolic link as a Kubernetes Secret mounts it; one
// byte more is refused.
func TestReadBoundedFile(t *testing.T) {
	dir := t.TempDir()
	content := bytes.Repeat([]byte("k"), 100)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "token"), content, 0o600))
	link := filepath.Join(dir, "link")
	require.NoError(t, os.Symlink("token", link))

	for _, tc := range []struct {
		name  string
		path  string
		limit int64
		want  string // "" reads content
	}{
		{"at the bound", filepath.Join(dir, "token"), 100, ""},
		{"through a link", link, 100, ""},
		{"one byte over", link, 99, link + ": 100 bytes, more than the 99 bytes this file may hold"},
		{"missing", filepath.Join(dir, "absent"), 100, "open " + filepath.Join(dir, "absent") + ": no such file or directory"},
		{"a link to a device", mklink(t, "/dev/null"), 100, "not a regular file (a character device)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := readBoundedFile(tc.path, tc.limit)
			if tc.want != "" {
				require.ErrorContains(t, err, tc.want)
				return
			}
			require.NoError(t, err)
			require.Equal(t, content, b)
		})
	}
	require.Equal(t, "4 MiB", byteSize(maxPolicyFileBytes))
	require.Equal(t, "64 KiB", byteSize(maxSecretFileBytes))
	require.Equal(t, "1000 bytes", byteSize(1000))
}

func mklink(t *testing.T, target string) string {
	t.Helper()
	link := filepath.Join(t.TempDir(), "link")
	require.NoError(t, os.Symlink(target, link))
	return link
}

// The files the libraries read, named by environment variables, are held to the same rule
// before start-up goes on: the OTLP exporters would read a named pipe for ever when tracing
// starts, and crypto/x509 would at the first TLS connection.
func TestLibraryFilesMustBeBoundedRegularFiles(t *testing.T) {
	fifo, ca := mkfifo(t), writeNamed(t, "ca.pem", "-----BEGIN CERTIFICATE-----\n")
	for _, tc := range []struct {
		name string
		env  map[string]string
		want []string // nil: accepted
	}{
		{"none", nil, nil},
		{"regular files", map[string]string{"SSL_CERT_FILE": ca, "OTEL_EXPORTER_OTLP_CERTIFICATE": ca}, nil},
		{"a named pipe and a device", map[string]string{"SSL_CERT_FILE": fifo, "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": "/dev/zero"}, []string{
			"environment variable SSL_CERT_FILE: " + fifo + ": not a regular file (a named pipe)",
			"environment variable OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY: /dev/zero: not a regular file (a character device)",
		}},
		{"tracing on, an oversized certificate", map[string]string{
			"OTEL_EXPORTER_OTLP_ENDPOINT":           "http://127.0.0.1:1",
			"OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": sparse(t, maxPEMFileBytes+1),
		}, []string{"environment variable OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE: ", "more than the 4 MiB this file may hold"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// A context already done: start-up stops, without an error, once the files are read.
			ctx, cancel := context.WithCancel(t.Context())
			cancel()
			err := within(t, func() error {
				return run(ctx, []string{"--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"}, env(tc.env), io.Discard)
			})
			if tc.want == nil {
				require.NoError(t, err)
				return
			}
			for _, w := range tc.want {
				require.ErrorContains(t, err, w)
			}
		})
	}
}
