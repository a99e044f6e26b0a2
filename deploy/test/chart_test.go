package deploytest

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Every value set lints clean (warnings included), renders, and decodes strictly.
func TestChartLintsRendersAndDecodes(t *testing.T) {
	for _, name := range valueSets {
		t.Run(name, func(t *testing.T) {
			vals := readValues(t, name)
			require.Empty(t, lintChart(vals), "helm lint --strict")
			objs, err := decodeAll(mustRender(t, vals))
			require.NoError(t, err)
			for _, o := range objs {
				t.Logf("%s %s/%s", o.gvk, o.meta.Namespace, o.meta.Name)
			}
		})
	}
}
