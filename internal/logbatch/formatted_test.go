package logbatch

import (
	"strings"
	"testing"

	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"
)

// A console-format warning is written at once, after the info line before it: the formatted
// writer hands the batching writer the line's level (WriteLevel(l, nil)) once the line is in.
func TestFormattedWarningIsWrittenAtOnce(t *testing.T) {
	out := &sink{}
	w := New(out, never)
	log := zerolog.New(w.Formatted(zerolog.ConsoleWriter{Out: w, NoColor: true}))
	log.Info().Msg("before")
	require.Empty(t, out.all(), "an info line waits")
	log.Warn().Msg("late")
	all := strings.Join(out.all(), "")
	require.Contains(t, all, "before")
	require.Contains(t, all, "late")
	require.Less(t, strings.Index(all, "before"), strings.Index(all, "late"))
	require.NoError(t, w.Close())
}
