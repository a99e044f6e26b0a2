package main

import (
	"fmt"
	"io"
	"os"

	"github.com/idempotency-extproc/idempotency-extproc/internal/check"
)

// stdinName is how check names standard input ("-") in its messages and findings.
const stdinName = "<stdin>"

// readCheckInput reads a FILE of check, "-" for standard input, through a bound of limit bytes:
// a regular file larger than the bound is refused before a byte is read, anything else (a pipe,
// standard input that never ends) once it has given one byte more. Its error is one line that
// names the file.
func readCheckInput(name string, stdin io.Reader, limit int64) (check.Input, error) {
	in := check.Input{Name: name}
	r := stdin
	if name == "-" {
		in.Name = stdinName
	} else {
		f, err := os.Open(name)
		if err != nil {
			return in, fmt.Errorf("%s: %w", name, unwrapPath(err))
		}
		defer func() { _ = f.Close() }()
		fi, err := f.Stat()
		if err != nil {
			return in, fmt.Errorf("%s: %w", name, unwrapPath(err))
		}
		if fi.IsDir() {
			return in, fmt.Errorf("%s: a directory, not a file", name)
		}
		if fi.Mode().IsRegular() && fi.Size() > limit {
			return in, tooLarge(name, fmt.Sprintf("%d bytes, more", fi.Size()), limit)
		}
		r = f
	}
	data, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return in, fmt.Errorf("%s: %w", in.Name, unwrapPath(err))
	}
	if int64(len(data)) > limit {
		return in, tooLarge(in.Name, "more", limit)
	}
	in.Data = data
	return in, nil
}

func tooLarge(name, size string, limit int64) error {
	return fmt.Errorf("%s: %s than the %s --max-input-bytes allows (%d bytes)", name, size, byteSize(limit), limit)
}
