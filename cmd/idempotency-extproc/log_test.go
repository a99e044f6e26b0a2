package main

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/internal/logbatch"
)

// In both log formats a line at info waits for the batch, and a warning is written at once,
// after the lines that waited before it. The console format once let warnings wait too.
func TestWarningsAreWrittenAtOnce(t *testing.T) {
	for _, format := range []string{"json", "console"} {
		t.Run(format, func(t *testing.T) {
			// Every write to out comes from this goroutine: the batch writer's own flushes
			// come every hour, and Close runs in the test's cleanup.
			var out bytes.Buffer
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
