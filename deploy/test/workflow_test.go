package deploytest

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"
)

// workflow is the part of a GitHub Actions workflow the test reads.
type workflow struct {
	Jobs map[string]struct {
		Strategy struct {
			Matrix map[string][]string `json:"matrix"`
		} `json:"strategy"`
		Steps []struct {
			Uses string `json:"uses"`
			Run  string `json:"run"`
		} `json:"steps"`
	} `json:"jobs"`
}

var pinned = regexp.MustCompile(`^[\w.-]+/[\w.-]+@[0-9a-f]{40}$`)

// The workflow parses, pins every action by commit, runs make test, runs the e2e suite on each
// Envoy version with a check that real Envoy ran, and builds both image platforms.
func TestWorkflow(t *testing.T) {
	path := filepath.Join(repoRoot, ".github", "workflows", "ci.yaml")
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	var w workflow
	require.NoError(t, yaml.Unmarshal(data, &w))
	var runs []string
	for name, j := range w.Jobs {
		require.NotEmpty(t, j.Steps, name)
		for _, s := range j.Steps {
			if s.Uses != "" {
				require.Regexp(t, pinned, s.Uses, "job %s: actions are pinned by commit SHA", name)
			}
			runs = append(runs, s.Run)
		}
	}
	all := strings.Join(runs, "\n")
	require.Contains(t, all, "make test")
	require.Contains(t, all, "./e2e/...")
	require.Contains(t, all, "running against real Envoy at")
	require.Contains(t, all, "--platform linux/amd64,linux/arm64")

	e2e, ok := w.Jobs["e2e-envoy"]
	require.True(t, ok)
	versions := e2e.Strategy.Matrix["envoy"]
	require.NotEmpty(t, versions)
	// The versions docs/deploying.md says are supported.
	docs, err := os.ReadFile(filepath.Join(repoRoot, "docs/deploying.md"))
	require.NoError(t, err)
	line := regexp.MustCompile(`(?m)^Supported Envoy releases: (.+)\.$`).FindSubmatch(docs)
	require.NotNil(t, line, `no "Supported Envoy releases: …." line in docs/deploying.md`)
	documented := regexp.MustCompile(`1\.\d+`).FindAllString(string(line[1]), -1)
	require.Equal(t, documented, versions, "the e2e matrix runs the documented Envoy releases")
}
