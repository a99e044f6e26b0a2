// Package checktest holds what the tests of the configuration checks (internal/check) and of the
// Envoy emulator's configuration (e2e/envoyconf) share: the shipped files, a minimal bootstrap,
// a checked text edit, and the walks and edits of a parsed bootstrap of the shipped shape.
package checktest

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// StoreTimeout is the processor's default store_timeout, against which CheckSpec judges the
// filter's message_timeout.
const StoreTimeout = policy.DefaultStoreTimeout

// Minimal is a bootstrap that leaves everything it can at Envoy's defaults.
const Minimal = `
static_resources:
  listeners:
  - name: l
    address: { socket_address: { address: 0.0.0.0, port_value: 10000 } }
    filter_chains:
    - filters:
      - name: hcm
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: s
          route_config:
            virtual_hosts:
            - name: v
              domains: ["*"]
              routes:
              - match: { prefix: "/" }
                route: { cluster: app }
          http_filters:
          - name: my_ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: { envoy_grpc: { cluster_name: proc } }
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: proc
  - name: app
`

// RepoRoot walks up from the test's package directory to the directory holding go.mod.
func RepoRoot(t testing.TB) string {
	t.Helper()
	dir, err := os.Getwd()
	require.NoError(t, err)
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		require.NotEqual(t, dir, parent, "no go.mod above the package directory")
		dir = parent
	}
}

// EnvoyFile is the path of the shipped file name in envoy/.
func EnvoyFile(t testing.TB, name string) string {
	return filepath.Join(RepoRoot(t), "envoy", name)
}

// ReadEnvoyFile reads the shipped file name in envoy/.
func ReadEnvoyFile(t testing.TB, name string) string {
	t.Helper()
	data, err := os.ReadFile(EnvoyFile(t, name))
	require.NoError(t, err)
	return string(data)
}

// ShippedPolicy is envoy/policy.yaml, the policy the shipped configurations are checked against.
func ShippedPolicy(t testing.TB) *policy.Policy {
	t.Helper()
	p, err := policy.Parse([]byte(ReadEnvoyFile(t, "policy.yaml")))
	require.NoError(t, err)
	return p
}

// Mutate replaces old by new in text (the n-th occurrence, 1-based; 0 = every occurrence) and
// fails the test when old is absent, so a stale mutation cannot pass silently.
func Mutate(t testing.TB, text, old, new string, n int) string {
	t.Helper()
	require.Contains(t, text, old, "mutation target is gone from the file")
	if n == 0 {
		return strings.ReplaceAll(text, old, new)
	}
	idx := -1
	for i := 0; i < n; i++ {
		next := strings.Index(text[idx+1:], old)
		require.GreaterOrEqual(t, next, 0, "fewer than %d occurrences of %q", n, old)
		idx += 1 + next
	}
	return text[:idx] + new + text[idx+len(old):]
}
