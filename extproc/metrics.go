package extproc

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Release reasons, the reason label of idempotency_releases_total.
const (
	// ReleaseStatus: the response's status is not in store_statuses.
	ReleaseStatus = "status"
	// ReleaseEnvoyResponse: Envoy generated the response (response.code_details is not via_upstream).
	ReleaseEnvoyResponse = "envoy_response"
	// ReleaseUnknownOutcome: the stream ended before the whole response was seen.
	ReleaseUnknownOutcome = "unknown_outcome"
)

// Metrics are the Prometheus metrics of SPEC §7. Create them once per registry.
type Metrics struct {
	requests      *prometheus.CounterVec
	releases      *prometheus.CounterVec
	storeDuration *prometheus.HistogramVec
	inflight      prometheus.Gauge
}

// NewMetrics creates the metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idempotency_requests_total",
			Help: "Requests seen, by route and outcome.",
		}, []string{"route", "outcome"}),
		releases: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idempotency_releases_total",
			Help: "Leases released so that a retry with the same key runs again, by route and reason.",
		}, []string{"route", "reason"}),
		storeDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idempotency_store_duration_seconds",
			Help:    "Duration of store operations, by operation, including failed ones.",
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1},
		}, []string{"op"}),
		inflight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "idempotency_inflight",
			Help: "Requests running upstream under a lease held by this process.",
		}),
	}
	for _, c := range []prometheus.Collector{m.requests, m.releases, m.storeDuration, m.inflight} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}
