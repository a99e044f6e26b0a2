package extproc_test

import (
	"testing"

	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"github.com/stretchr/testify/require"
)

// A gRPC call whose grpc-status the route does not store is released at its trailers for its
// status: the trailers are judged with where the response headers said it came from (the
// upstream, via_upstream), not as a response that may be Envoy's (an unknown outcome). A retry
// runs again.
func TestGRPCStatusNotStoredIsReleasedForItsStatus(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: "routes: [{name: charge, match: {path_prefix: /payments.v1.Payments/}, grpc: true}]"})
	call := grpcCall{key: "k1", body: grpcFrame("amount=10"), mode: filterextproc.ProcessingMode_BUFFERED}
	for range 2 {
		st := h.open()
		call.finish(t, st, call.begin(t, st), grpcFrame("no such account"), "5") // NOT_FOUND
		st.end()
		h.waitIdle(t)
	}
	require.Equal(t, 2.0, h.counter("idempotency_releases_total", "route", "charge", "reason", "status"))
	require.Zero(t, h.counter("idempotency_releases_total", "route", "charge", "reason", "unknown_outcome"))
	require.Equal(t, 2.0, h.counter("idempotency_requests_total", "route", "charge", "outcome", "executed"))
}
