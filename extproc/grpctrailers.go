package extproc

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// A covered gRPC call is stored at its response trailers, whose grpc-status is its outcome. A
// response that ends without them reaching the processor leaves the outcome unknown: the route
// lacks response_trailer_mode SEND (under Envoy Gateway, a FullDuplexStreamed response body), the
// upstream ended the response without trailers, or the call was cut short (the client cancelled,
// the upstream reset). The first is a misconfiguration `check` reports; at run time it shows as
// this counter growing with every covered call, where a cut-short call is a trickle.

// grpcTrailerMetrics count the covered gRPC responses whose trailers never reached the
// processor, and log the first of them once per process.
type grpcTrailerMetrics struct {
	missing *prometheus.CounterVec // by route
	logged  *sync.Once
}

func newGRPCTrailerMetrics() grpcTrailerMetrics {
	return grpcTrailerMetrics{
		missing: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idempotency_grpc_trailers_missing_total",
			Help: "Covered gRPC calls whose response ended without its trailers reaching the processor, so that its grpc-status, the call's outcome, was never seen (unknown_outcome decided), by route: every call, when the route lacks response_trailer_mode SEND; a few, when calls are cut short.",
		}, []string{"route"}),
		logged: new(sync.Once),
	}
}

func (m grpcTrailerMetrics) register(reg prometheus.Registerer) error {
	return reg.Register(m.missing)
}

// grpcTrailersMissing counts a covered gRPC call whose response ended (a body with end_of_stream,
// or the stream's end) while it was captured, before any trailers: its outcome is unknown. A
// proxyless call counts too: its client's processing_mode must send the response trailers as
// well.
func (st *stream) grpcTrailersMissing() {
	st.req.route.trailersMissing.Inc()
	st.s.metrics.grpcTrailers.logged.Do(func() {
		st.s.log.Warn().Str("route", st.req.route.Name).
			Msg("a covered gRPC call's response ended without trailers, so its grpc-status was not seen and its outcome is unknown; if every call does this, set response_trailer_mode: SEND on its Envoy route (Envoy Gateway: processingMode.response.body: FullDuplexStreamed); idempotency_grpc_trailers_missing_total counts them")
	})
}
