// Package logbatch writes log lines in batches. A covered request writes one log line, and a
// write(2) per line costs a system call each (about 2.3 µs, BenchmarkRequestLogLine), more than
// the rest of the line's cost and as much as a third of what the processor adds to a request.
// Writer gathers the lines of a few milliseconds and writes them with one call.
//
// zerolog's own diode writer batches too, but drops lines when its ring is full; a Writer never
// drops one: past its bound it writes at once, on the caller's goroutine.
package logbatch

import (
	"io"
	"sync"
	"time"

	"github.com/rs/zerolog"
)

// MaxBatch bounds the bytes a Writer holds: a write that reaches it writes the batch at once.
const MaxBatch = 256 << 10

// Writer gathers the lines written to it and writes them to its destination every interval, when
// MaxBatch bytes are waiting, before a line at warn level or above (so that a warning or an error
// is never held back, and nothing before it is written after it), and on Close. Lines keep their
// order. It is safe for concurrent use; each Write must be one whole line, as zerolog writes
// them.
type Writer struct {
	out io.Writer

	mu     sync.Mutex
	buf    []byte
	closed bool

	// flushMu serialises the writes to out, so that batches keep their order.
	flushMu sync.Mutex
	spare   []byte

	stop chan struct{}
	done chan struct{}
}

var _ zerolog.LevelWriter = (*Writer)(nil)

// New returns a Writer to out that writes every interval.
func New(out io.Writer, interval time.Duration) *Writer {
	w := &Writer{out: out, stop: make(chan struct{}), done: make(chan struct{})}
	go w.loop(interval)
	return w
}

func (w *Writer) loop(interval time.Duration) {
	defer close(w.done)
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-w.stop:
			return
		case <-t.C:
			w.Flush()
		}
	}
}

// Write implements [io.Writer]: p is a line without a level, which waits for the batch.
func (w *Writer) Write(p []byte) (int, error) { return w.WriteLevel(zerolog.NoLevel, p) }

// WriteLevel implements [zerolog.LevelWriter]: a line at warn level or above is written at once,
// after what came before it; the others wait for the batch. After Close it writes through.
func (w *Writer) WriteLevel(l zerolog.Level, p []byte) (int, error) {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		if len(p) == 0 {
			return 0, nil // nothing waits after Close
		}
		// After the last batch, in order.
		w.flushMu.Lock()
		defer w.flushMu.Unlock()
		return w.out.Write(p)
	}
	w.buf = append(w.buf, p...)
	now := len(w.buf) >= MaxBatch || l >= zerolog.WarnLevel && l != zerolog.NoLevel
	w.mu.Unlock()
	if now {
		w.Flush()
	}
	return len(p), nil
}

// Formatted returns a writer for a zerolog logger that formats each line with f, which writes
// the result to w (a zerolog.ConsoleWriter whose Out is w, say), and writes a line at warn or
// above at once, as w's own WriteLevel does. f alone would hand w its text without the level.
func (w *Writer) Formatted(f io.Writer) zerolog.LevelWriter { return formatted{f: f, w: w} }

type formatted struct {
	f io.Writer
	w *Writer
}

func (x formatted) Write(p []byte) (int, error) { return x.f.Write(p) }

// WriteLevel has f write the line to w, then hands w no more bytes at the line's level, so that w
// writes what it holds at once when the level asks for it.
func (x formatted) WriteLevel(l zerolog.Level, p []byte) (int, error) {
	n, err := x.f.Write(p)
	_, _ = x.w.WriteLevel(l, nil)
	return n, err
}

// Flush writes what is waiting.
func (w *Writer) Flush() {
	w.flushMu.Lock()
	defer w.flushMu.Unlock()
	w.mu.Lock()
	batch := w.buf
	w.buf = w.spare[:0]
	w.mu.Unlock()
	if len(batch) > 0 {
		// A log destination that fails has nowhere to report it: as with any unbuffered
		// writer, the lines are lost.
		_, _ = w.out.Write(batch)
	}
	w.spare = batch
}

// Close writes what is waiting and stops the background writes; later lines are written at once.
func (w *Writer) Close() error {
	w.flushMu.Lock()
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		w.flushMu.Unlock()
		return nil
	}
	w.closed = true
	batch := w.buf
	w.buf = nil
	w.mu.Unlock()
	if len(batch) > 0 {
		_, _ = w.out.Write(batch)
	}
	w.flushMu.Unlock()
	close(w.stop)
	<-w.done
	return nil
}
