package main

import (
	"bytes"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/internal/logbatch"
)

// lockedBuffer is a bytes.Buffer safe for the batch writer's goroutine and the test's.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// In both log formats a line at info waits for the batch, and a warning is written at once,
// after the lines that waited before it. The console format once let warnings wait too.
func TestWarningsAreWrittenAtOnce(t *testing.T) {
	for _, format := range []string{"json", "console"} {
		t.Run(format, func(t *testing.T) {
			var out lockedBuffer
			lines := logbatch.New(&out, time.Hour)
			t.Cleanup(func() { _ = lines.Close() })
			log := newLogger(&config{logFormat: format, logLevel: zerolog.InfoLevel}, lines)

			log.Info().Msg("first")
			require.Empty(t, out.String(), "an info line waits for the batch")
			log.Warn().Msg("second")
			got := out.String()
			require.Contains(t, got, "first")
			require.Contains(t, got, "second")
			require.Less(t, strings.Index(got, "first"), strings.Index(got, "second"), "in order")
			log.Info().Msg("third")
			require.NotContains(t, out.String(), "third")
		})
	}
}
