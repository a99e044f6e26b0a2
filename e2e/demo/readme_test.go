package main

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The repository's README shows the recipe's first four steps, command for command, under "Try
// it in five minutes": TestRecipe runs them as this directory's README writes them, so the front
// page's commands are run too, and cannot drift from the ones that are.
func TestFrontPageRunsTheRecipe(t *testing.T) {
	front, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	section, ok := strings.CutPrefix(string(front)[strings.Index(string(front), "\n## Try it in five minutes")+1:], "## ")
	require.True(t, ok, "README.md has a \"## Try it in five minutes\" section")
	section, _, _ = strings.Cut(section, "\n## ")
	_, block, ok := strings.Cut(section, "```sh\n")
	require.True(t, ok, "the section has a sh block")
	block, _, ok = strings.Cut(block, "\n```")
	require.True(t, ok, "the sh block is closed")
	var shown []string
	for _, line := range strings.Split(block, "\n") {
		if line = strings.TrimSpace(line); line != "" && !strings.HasPrefix(line, "#") {
			shown = append(shown, line)
		}
	}
	steps, err := recipe(readme)
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(steps), 4)
	var run []string
	for _, st := range steps[:4] {
		run = append(run, st.commands...)
	}
	require.Equal(t, run, shown, "README.md's commands are the first four steps of e2e/demo/README.md's recipe, which TestRecipe runs")
	require.Contains(t, section, "go run ./e2e/demo")
}
