package extproc

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the processor's Prometheus metrics (docs/operating.md lists them). Create them once
// per registry.
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
	storeErrors     *prometheus.CounterVec
	internalErrors  *prometheus.CounterVec
	// The completions whose write is retried in the background (completions.go).
	completionRetries    *prometheus.CounterVec
	completionsPending   prometheus.Gauge
	completionsAbandoned *prometheus.CounterVec
	unconfirmed          *prometheus.CounterVec
	notCovered           *prometheus.CounterVec
	// The streams this process holds (limits.go).
	streams streamMetrics
	// The covered gRPC responses without trailers (grpctrailers.go).
	grpcTrailers grpcTrailerMetrics
}

// The op labels of idempotency_durability_unconfirmed_total.
const (
	unconfirmedClaim    = "claim"
	unconfirmedComplete = "complete"
)

// internalIllegalTransition is the kind of idempotency_internal_errors_total for a move not in the
// stream's transition table.
const internalIllegalTransition = "illegal_transition"

// The options of the metrics of Metrics, by the field that holds each: their names and help.
var (
	requestsOpts = prometheus.CounterOpts{
		Name: "idempotency_requests_total",
		Help: "Requests seen, by route and outcome.",
	}
	releasesOpts = prometheus.CounterOpts{
		Name: "idempotency_releases_total",
		Help: "Leases released so that a retry with the same key runs again, by route and reason.",
	}
	unknownOutcomesOpts = prometheus.CounterOpts{
		Name: "idempotency_unknown_outcomes_total",
		Help: "Requests that may or may not have run upstream (the stream ended before any response headers, or Envoy made the response after sending the request upstream), by route and what unknown_outcome did: release, keep or record.",
	}
	misconfigOpts = prometheus.CounterOpts{
		Name: "idempotency_envoy_misconfig_total",
		Help: "Requests that showed an Envoy setting which keeps the processor from protecting requests, by kind.",
	}
	storeDurationOpts = prometheus.HistogramOpts{
		Name:    "idempotency_store_duration_seconds",
		Help:    "Duration of store operations, by operation, including failed ones.",
		Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1},
	}
	inflightOpts = prometheus.GaugeOpts{
		Name: "idempotency_inflight",
		Help: "Requests running upstream under a lease held by this process.",
	}
	shadowOpts = prometheus.CounterOpts{
		Name: "idempotency_shadow_total",
		Help: "Requests on shadow-mode routes, by route and the outcome enforcement would have given them; every one reached the upstream untouched.",
	}
	waitCallsOpts = prometheus.CounterOpts{
		Name: "idempotency_wait_store_calls_total",
		Help: "Store calls made by duplicates waiting for a request in flight (in_flight_wait), beyond their first, by route.",
	}
	unreadableOpts = prometheus.CounterOpts{
		Name: "idempotency_unreadable_records_total",
		Help: "Covered requests whose stored record this process could not open (sealed under a key it does not hold, tampered with, or of a layout it does not know), by route; each got 409 response-not-replayable and did not run.",
	}
	upstreamRetriesOpts = prometheus.CounterOpts{
		Name: "idempotency_upstream_retries_total",
		Help: "Covered requests whose response came from the upstream on an attempt after the first (upstream.request_attempt_count > 1: a route retry_policy or hedging re-sent them), by route. Harmless after connect-failure or refused-stream; after reset, 5xx or a per-try timeout the upstream may have run the request more than once.",
	}
	storeErrorsOpts = prometheus.CounterOpts{
		Name: "idempotency_store_errors_total",
		Help: "Store calls that failed, by operation (acquire, complete, release, renew) and kind: oom (the store refuses writes: Redis at maxmemory under noeviction), timeout (no answer within store_timeout), corrupt (a record that cannot be read) or unavailable (anything else). A lost lease is not counted.",
	}
	internalErrorsOpts = prometheus.CounterOpts{
		Name: "idempotency_internal_errors_total",
		Help: "Bugs the processor caught in itself, by kind: illegal_transition (a stream's state machine was asked for a move not in its table; the request was settled as if it had ended). Any is a bug to report.",
	}
	completionRetriesOpts = prometheus.CounterOpts{
		Name: "idempotency_completion_retries_total",
		Help: "Background retries of completed records the store failed to write, by result: landed (written), failed (to be retried again) or lease_lost (given up: the lease was purged or expired).",
	}
	completionsPendingOpts = prometheus.GaugeOpts{
		Name: "idempotency_completions_pending",
		Help: "Completed records the store failed to write and this process is still retrying, their leases kept renewed: duplicates get 409 until each lands.",
	}
	completionsAbandonedOpts = prometheus.CounterOpts{
		Name: "idempotency_completions_abandoned_total",
		Help: "Completed records never written, by reason: capacity (too many pending), expired (the record's TTL passed), shutdown (the process ended first) or lease_lost (the lease was lost while the request ran or its completion was pending: the record was removed, or another request took the key). A retry of its request may run again.",
	}
	unconfirmedOpts = prometheus.CounterOpts{
		Name: "idempotency_durability_unconfirmed_total",
		Help: "Writes of routes with durability that too few Redis replicas acknowledged in time, by op: claim (withdrawn; the request was answered as a store failure and did not run under it) or complete (kept; the response went out, and a failover before the replicas catch up may lose the record).",
	}
	notCoveredOpts = prometheus.CounterOpts{
		Name: "idempotency_not_covered_total",
		Help: "Requests of a route passed through uncovered for a reason the route alone does not give, by reason: json-rpc-batch (a JSON-RPC batch on a json_rpc route, which the processor leaves alone).",
	}
)

// NewMetrics creates the metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		requests:             prometheus.NewCounterVec(requestsOpts, []string{"route", "outcome"}),
		releases:             prometheus.NewCounterVec(releasesOpts, []string{"route", "reason"}),
		unknownOutcomes:      prometheus.NewCounterVec(unknownOutcomesOpts, []string{"route", "action"}),
		misconfig:            prometheus.NewCounterVec(misconfigOpts, []string{"kind"}),
		storeDuration:        prometheus.NewHistogramVec(storeDurationOpts, []string{"op"}),
		inflight:             prometheus.NewGauge(inflightOpts),
		shadow:               prometheus.NewCounterVec(shadowOpts, []string{"route", "would"}),
		waitCalls:            prometheus.NewCounterVec(waitCallsOpts, []string{"route"}),
		unreadable:           prometheus.NewCounterVec(unreadableOpts, []string{"route"}),
		upstreamRetries:      prometheus.NewCounterVec(upstreamRetriesOpts, []string{"route"}),
		storeErrors:          prometheus.NewCounterVec(storeErrorsOpts, []string{"op", "kind"}),
		internalErrors:       prometheus.NewCounterVec(internalErrorsOpts, []string{"kind"}),
		completionRetries:    prometheus.NewCounterVec(completionRetriesOpts, []string{"result"}),
		completionsPending:   prometheus.NewGauge(completionsPendingOpts),
		completionsAbandoned: prometheus.NewCounterVec(completionsAbandonedOpts, []string{"reason"}),
		unconfirmed:          prometheus.NewCounterVec(unconfirmedOpts, []string{"op"}),
		notCovered:           prometheus.NewCounterVec(notCoveredOpts, []string{"route", "reason"}),
		streams:              newStreamMetrics(),
		grpcTrailers:         newGRPCTrailerMetrics(),
	}
	for _, kind := range misconfigKinds {
		m.misconfig.WithLabelValues(kind)
	}
	for _, op := range []string{"acquire", "complete", "release", "renew"} {
		for _, kind := range storeErrorKinds {
			m.storeErrors.WithLabelValues(op, kind)
		}
	}
	m.internalErrors.WithLabelValues(internalIllegalTransition)
	for _, r := range []string{"landed", "failed", "lease_lost"} {
		m.completionRetries.WithLabelValues(r)
	}
	for _, r := range []string{abandonedCapacity, abandonedExpired, abandonedShutdown, abandonedLeaseLost} {
		m.completionsAbandoned.WithLabelValues(r)
	}
	for _, op := range []string{unconfirmedClaim, unconfirmedComplete} {
		m.unconfirmed.WithLabelValues(op)
	}
	for _, c := range []prometheus.Collector{m.requests, m.releases, m.unknownOutcomes, m.misconfig, m.storeDuration, m.inflight, m.shadow, m.waitCalls, m.unreadable, m.upstreamRetries, m.storeErrors, m.internalErrors, m.completionRetries, m.completionsPending, m.completionsAbandoned, m.unconfirmed, m.notCovered} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	if err := m.streams.register(reg); err != nil {
		return nil, err
	}
	if err := m.grpcTrailers.register(reg); err != nil {
		return nil, err
	}
	return m, nil
}
