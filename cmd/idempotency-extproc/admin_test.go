package main

import (
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// TestAdminPprofOnlyWhenAsked checks that the admin listener serves Go's profiles only with
// --admin-pprof, and that /metrics is served either way.
func TestAdminPprofOnlyWhenAsked(t *testing.T) {
	store, err := cache.NewMemory(cache.MemoryOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	rd, err := newReadiness(store, time.Second, policy.Default())
	require.NoError(t, err)
	for _, tc := range []struct {
		name  string
		pprof bool
		want  int
	}{
		{"default", false, http.StatusNotFound},
		{"admin-pprof", true, http.StatusOK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := adminHandler(prometheus.NewRegistry(), rd, new(atomic.Bool), nil, tc.pprof)
			for _, path := range []string{"/debug/pprof/", "/debug/pprof/cmdline", "/debug/pprof/heap"} {
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
				require.Equal(t, tc.want, rec.Code, path)
			}
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
			require.Equal(t, http.StatusOK, rec.Code)
		})
	}
}

// TestAdminPprofSetting checks that --admin-pprof is off by default and reads a bool.
func TestAdminPprofSetting(t *testing.T) {
	cfg, err := loadConfig(nil, func(string) string { return "" })
	require.NoError(t, err)
	require.False(t, cfg.adminPprof)
	cfg, err = loadConfig([]string{"--admin-pprof=true"}, func(string) string { return "" })
	require.NoError(t, err)
	require.True(t, cfg.adminPprof)
	_, err = loadConfig([]string{"--admin-pprof=maybe"}, func(string) string { return "" })
	require.ErrorContains(t, err, "must be true or false")
}
