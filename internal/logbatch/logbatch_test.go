package logbatch

import (
	"bytes"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"
)

// sink records each write it gets.
type sink struct {
	mu     sync.Mutex
	writes []string
}

func (s *sink) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.writes = append(s.writes, string(p))
	return len(p), nil
}

func (s *sink) all() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.writes...)
}

// An hour-long interval: only what the test does writes.
const never = time.Hour

func TestLinesWaitForTheBatch(t *testing.T) {
	out := &sink{}
	w := New(out, never)
	log := zerolog.New(w)
	log.Info().Msg("one")
	log.Info().Msg("two")
	require.Empty(t, out.all(), "info lines wait")
	w.Flush()
	require.Equal(t, []string{`{"level":"info","message":"one"}` + "\n" + `{"level":"info","message":"two"}` + "\n"}, out.all(), "one write for the batch")
	require.NoError(t, w.Close())
}

func TestWarningsAreWrittenAtOnceAfterWhatCameBefore(t *testing.T) {
	out := &sink{}
	w := New(out, never)
	log := zerolog.New(w)
	log.Info().Msg("before")
	log.Error().Msg("bad")
	require.Equal(t, []string{`{"level":"info","message":"before"}` + "\n" + `{"level":"error","message":"bad"}` + "\n"}, out.all())
	require.NoError(t, w.Close())
}

func TestTheIntervalWrites(t *testing.T) {
	out := &sink{}
	w := New(out, 5*time.Millisecond)
	defer w.Close()
	log := zerolog.New(w)
	log.Info().Msg("later")
	require.Eventually(t, func() bool { return len(out.all()) == 1 }, 5*time.Second, time.Millisecond)
}

func TestABatchIsBounded(t *testing.T) {
	out := &sink{}
	w := New(out, never)
	line := strings.Repeat("x", 1023) + "\n"
	for range MaxBatch / len(line) {
		_, err := w.Write([]byte(line))
		require.NoError(t, err)
	}
	require.Len(t, out.all(), 1, "the write that reaches the bound writes the batch")
	require.Len(t, out.all()[0], MaxBatch)
	require.NoError(t, w.Close())
}

func TestCloseWritesTheRestAndThenWritesThrough(t *testing.T) {
	out := &sink{}
	w := New(out, never)
	_, _ = w.Write([]byte("a\n"))
	require.NoError(t, w.Close())
	require.NoError(t, w.Close(), "twice")
	_, _ = w.Write([]byte("b\n"))
	require.Equal(t, []string{"a\n", "b\n"}, out.all())
}

// A formatted warning after Close is written through once, with no write of nothing after it.
func TestFormattedWarningAfterCloseIsOneWrite(t *testing.T) {
	out := &sink{}
	w := New(out, never)
	require.NoError(t, w.Close())
	log := zerolog.New(w.Formatted(zerolog.ConsoleWriter{Out: w, NoColor: true}))
	log.Warn().Msg("late")
	require.Len(t, out.all(), 1)
	require.Contains(t, out.all()[0], "late")
}

// Lines written from many goroutines all arrive, whole and each once, every writer's in its own
// order.
func TestConcurrentLinesKeepTheirOrder(t *testing.T) {
	var out bytes.Buffer
	var mu sync.Mutex
	w := New(writerFunc(func(p []byte) (int, error) { mu.Lock(); defer mu.Unlock(); return out.Write(p) }), time.Millisecond)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 500 {
				_, _ = fmt.Fprintf(w, "g%d-%d\n", g, i)
				if i%100 == 0 {
					w.Flush()
				}
			}
		})
	}
	wg.Wait()
	require.NoError(t, w.Close())
	next := map[string]int{}
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	require.Len(t, lines, 8*500)
	for _, l := range lines {
		var g, i int
		_, err := fmt.Sscanf(l, "g%d-%d", &g, &i)
		require.NoError(t, err, l)
		key := fmt.Sprint(g)
		require.Equal(t, next[key], i, "goroutine %d's lines in order", g)
		next[key]++
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }
