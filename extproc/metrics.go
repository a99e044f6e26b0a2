package extproc

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the Prometheus metrics of SPEC §7 and §8. Create them once per registry.
type Metrics struct {
	requests        *prometheus.CounterVec
	releases        *prometheus.CounterVec
	unknownOutcomes *prometheus.CounterVec
	misconfig       *prometheus.CounterVec
	storeDuration   *prometheus.HistogramVec
	inflight        prometheus.Gauge
	shadow          *prometheus.CounterVec
	waitCalls       *prometheus.CounterVec
	unreadable      *prometheus.CounterVec
	upstreamRetries *prometheus.CounterVec
	unconfirmed     *prometheus.CounterVec
}

// The op labels of idempotency_durability_unconfirmed_total.
const (
	unconfirmedClaim    = "claim"
	unconfirmedComplete = "complete"
)

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
		unknownOutcomes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idempotency_unknown_outcomes_total",
			Help: "Requests that may or may not have run upstream (the stream ended before any response headers, or Envoy made the response after sending the request upstream), by route and what unknown_outcome did: release, keep or record.",
		}, []string{"route", "action"}),
		misconfig: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idempotency_envoy_misconfig_total",
			Help: "Requests that showed an Envoy setting which keeps the processor from protecting requests, by kind.",
		}, []string{"kind"}),
		storeDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idempotency_store_duration_seconds",
			Help:    "Duration of store operations, by operation, including failed ones.",
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1},
		}, []string{"op"}),
		inflight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "idempotency_inflight",
			Help: "Requests running upstream under a lease held by this process.",
		}),
		shadow: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idempotency_shadow_total",
			Help: "Requests on shadow-mode routes, by route and the outcome enforcement would have given them; every one reached the upstream untouched.",
		}, []string{"route", "would"}),
		waitCalls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idempotency_wait_store_calls_total",
			Help: "Store calls made by duplicates waiting for a request in flight (in_flight_wait), beyond their first, by route.",
		}, []string{"route"}),
		unreadable: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idempotency_unreadable_records_total",
			Help: "Covered requests whose stored record this process could not open (sealed under a key it does not hold, tampered with, or of a layout it does not know), by route; each got 409 response-not-replayable and did not run.",
		}, []string{"route"}),
		upstreamRetries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idempotency_upstream_retries_total",
			Help: "Covered requests whose response came from the upstream on an attempt after the first (upstream.request_attempt_count > 1: a route retry_policy or hedging re-sent them), by route. Harmless after connect-failure or refused-stream; after reset, 5xx or a per-try timeout the upstream may have run the request more than once.",
		}, []string{"route"}),
		unconfirmed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idempotency_durability_unconfirmed_total",
			Help: "Writes of routes with durability that too few Redis replicas acknowledged in time, by op: claim (withdrawn; the request was answered as a store failure and did not run under it) or complete (kept; the response went out, and a failover before the replicas catch up may lose the record).",
		}, []string{"op"}),
	}
	for _, kind := range misconfigKinds {
		m.misconfig.WithLabelValues(kind)
	}
	for _, op := range []string{unconfirmedClaim, unconfirmedComplete} {
		m.unconfirmed.WithLabelValues(op)
	}
	for _, c := range []prometheus.Collector{m.requests, m.releases, m.unknownOutcomes, m.misconfig, m.storeDuration, m.inflight, m.shadow, m.waitCalls, m.unreadable, m.upstreamRetries, m.unconfirmed} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}
