package main

import (
	"context"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
)

// adminHandler serves /metrics, /healthz (the process runs), /readyz (the process is not
// shutting down, and the store answers a ping within pingTimeout) and, when records is not nil,
// the records API.
func adminHandler(reg *prometheus.Registry, store cache.Store, pingTimeout time.Duration, draining *atomic.Bool, records *recordsAPI) http.Handler {
	mux := http.NewServeMux()
	if records != nil {
		records.register(mux)
	}
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		if draining.Load() {
			// As gRPC health says NOT_SERVING: the listener takes no new stream.
			http.Error(w, "shutting down", http.StatusServiceUnavailable)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), pingTimeout)
		defer cancel()
		if err := store.Ping(ctx); err != nil {
			http.Error(w, "store unavailable", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	return mux
}
