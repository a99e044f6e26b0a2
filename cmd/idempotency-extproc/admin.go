package main

import (
	"net/http"
	"net/http/pprof"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// adminHandler serves /metrics, /healthz (the process runs), /readyz (the process is not
// shutting down, and the readiness check passes: the store answers, with the replicas durability
// asks for; the body says why not) and, when records is not nil, the records API. Every body
// ends with a newline. With withPprof it also serves Go's runtime profiles at /debug/pprof/.
func adminHandler(reg *prometheus.Registry, rd *readiness, draining *atomic.Bool, records *recordsAPI, withPprof bool) http.Handler {
	mux := http.NewServeMux()
	if withPprof {
		// Nothing of it is mounted otherwise: the default costs no handler and exposes nothing.
		mux.HandleFunc("GET /debug/pprof/", pprof.Index)
		mux.HandleFunc("GET /debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("GET /debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("GET /debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("GET /debug/pprof/trace", pprof.Trace)
	}
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
		if _, err := rd.check(r.Context()); err != nil {
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	return mux
}
