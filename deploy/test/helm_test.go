package deploytest

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	"helm.sh/helm/v3/pkg/releaseutil"
	"sigs.k8s.io/yaml"
)

// Where the tested files are, relative to this directory.
const (
	chartDir    = "../helm/idempotency-extproc"
	repoRoot    = "../.."
	releaseName = "idem"
	releaseNS   = "idempotency"
)

// kubeVersion is the oldest Kubernetes the chart supports (Chart.yaml kubeVersion allows it);
// rendering against it proves the chart uses no newer API.
var kubeVersion = chartutil.KubeVersion{Version: "v1.29.0", Major: "1", Minor: "29"}

// valueSets are the files of testdata/ that every chart test renders, by name.
var valueSets = []string{"memory", "redis", "redis-full", "meshes"}

// readValues reads testdata/<name>.yaml.
func readValues(t testing.TB, name string) map[string]any {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("testdata", name+".yaml"))
	require.NoError(t, err)
	return parseValues(t, string(data))
}

func parseValues(t testing.TB, text string) map[string]any {
	t.Helper()
	vals := map[string]any{}
	require.NoError(t, yaml.Unmarshal([]byte(text), &vals))
	return vals
}

func loadChart(t testing.TB) *chart.Chart {
	t.Helper()
	ch, err := loader.Load(chartDir)
	require.NoError(t, err)
	return ch
}

// manifest is one rendered document: the template it came from and its YAML.
type manifest struct {
	template string
	yaml     string
}

// render renders the chart as `helm template` would for an install of release "idem" in
// namespace "idempotency": values checked against values.schema.json, templates in strict mode
// (a missing value is an error), NOTES.txt and empty documents left out. It returns the error of
// the first step that fails.
func render(ch *chart.Chart, vals map[string]any) ([]manifest, error) {
	caps := chartutil.DefaultCapabilities.Copy()
	caps.KubeVersion = kubeVersion
	if !chartutil.IsCompatibleRange(ch.Metadata.KubeVersion, caps.KubeVersion.String()) {
		return nil, fmt.Errorf("chart kubeVersion %q excludes %s", ch.Metadata.KubeVersion, caps.KubeVersion.String())
	}
	rv, err := chartutil.ToRenderValues(ch, vals, chartutil.ReleaseOptions{
		Name: releaseName, Namespace: releaseNS, Revision: 1, IsInstall: true,
	}, caps)
	if err != nil {
		return nil, err
	}
	out, err := engine.Engine{Strict: true}.Render(ch, rv)
	if err != nil {
		return nil, err
	}
	names := make([]string, 0, len(out))
	for name := range out {
		names = append(names, name)
	}
	sort.Strings(names)
	var ms []manifest
	for _, name := range names {
		if strings.HasSuffix(name, "NOTES.txt") || strings.HasPrefix(filepath.Base(name), "_") {
			continue
		}
		docs := releaseutil.SplitManifests(out[name])
		keys := make([]string, 0, len(docs))
		for k := range docs {
			keys = append(keys, k)
		}
		sort.Sort(releaseutil.BySplitManifestsOrder(keys))
		for _, k := range keys {
			if strings.TrimSpace(stripComments(docs[k])) == "" {
				continue
			}
			ms = append(ms, manifest{template: name, yaml: docs[k]})
		}
	}
	return ms, nil
}

// stripComments drops whole-line YAML comments, to tell an empty document from a real one.
func stripComments(doc string) string {
	var b strings.Builder
	for _, line := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			b.WriteString(line)
			b.WriteByte('\n')
		}
	}
	return b.String()
}

// mustRender renders the value set and fails t on any error.
func mustRender(t testing.TB, vals map[string]any) []manifest {
	t.Helper()
	ms, err := render(loadChart(t), vals)
	require.NoError(t, err)
	require.NotEmpty(t, ms)
	return ms
}

// lintChart runs Helm's linter (Chart.yaml, values, every template rendered and parsed) with
// the value set. Warnings fail as errors do: `helm lint --strict`.
func lintChart(vals map[string]any) []support.Message {
	kv := kubeVersion
	l := lint.AllWithKubeVersion(chartDir, vals, releaseNS, &kv)
	var bad []support.Message
	for _, m := range l.Messages {
		if m.Severity >= support.WarningSev {
			bad = append(bad, m)
		}
	}
	return bad
}
