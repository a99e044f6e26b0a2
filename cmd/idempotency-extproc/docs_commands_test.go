package main

import (
	"os"
	"path/filepath"
	"regexp"
	"testing"

	"github.com/stretchr/testify/require"
)

// Every command the binary has is documented exactly once: the server (serve) in
// docs/configuration.md, which documents its flags, and each other command as one row of the
// commands table of docs/operating.md; help is help itself. No row names a command the binary
// lacks.
func TestDocsListEveryCommandOnce(t *testing.T) {
	pages, err := filepath.Glob("../../docs/*.md")
	require.NoError(t, err)
	rows := map[string][]string{} // command → the pages with a row for it
	row := regexp.MustCompile("(?m)^\\| `idempotency-extproc ([a-z-]+)")
	for _, p := range pages {
		data, err := os.ReadFile(p)
		require.NoError(t, err)
		for _, m := range row.FindAllStringSubmatch(string(data), -1) {
			rows[m[1]] = append(rows[m[1]], filepath.Base(p))
		}
	}
	known := map[string]bool{}
	for _, c := range commands {
		name := c[0]
		known[name] = true
		switch name {
		case "help":
		case "serve":
			conf, err := os.ReadFile("../../docs/configuration.md")
			require.NoError(t, err)
			require.Contains(t, string(conf), "`idempotency-extproc serve`", "docs/configuration.md documents the server command")
			require.Empty(t, rows[name], "serve has no row of its own")
		default:
			require.Equal(t, []string{"operating.md"}, rows[name], "command %s: one row of docs/operating.md's commands table", name)
		}
	}
	for name := range rows {
		require.True(t, known[name], "the docs list a command %q the binary does not have", name)
	}
}
