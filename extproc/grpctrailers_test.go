package extproc_test

import (
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
)

// A covered gRPC call whose response ends before its trailers reach the processor (the route
// lacks response_trailer_mode SEND, the upstream sent none, the call was cut short) is counted in
// idempotency_grpc_trailers_missing_total: at the stream's end, or at a response body that ends
// the response, through Envoy or grpc-go's own ext_proc client alike. A call settled by its
// trailers, or by the grpc-status of a trailers-only response, is not.
func TestGRPCTrailersMissingCounted(t *testing.T) {
	fds := filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
	const metric = "idempotency_grpc_trailers_missing_total"
	upstreamHeaders := func(extra ...string) *extprocv3.ProcessingRequest {
		rh := responseHeaders(upstream{status: 200, headers: append([]string{"content-type", "application/grpc"}, extra...)})
		rh.GetResponseHeaders().EndOfStream = len(extra) > 0 // a trailers-only response ends at its headers
		return rh
	}
	cases := []struct {
		name string
		run  func(t *testing.T, h *harness)
		want float64
	}{
		{"trailers arrive", func(t *testing.T, h *harness) {
			call := grpcCall{key: "k", body: grpcFrame("amount=10"), mode: fds}
			st := h.open()
			call.finish(t, st, call.begin(t, st), grpcFrame("tx_1"), "0")
			st.end()
		}, 0},
		{"a trailers-only response", func(t *testing.T, h *harness) {
			call := grpcCall{key: "k", body: grpcFrame("amount=10"), mode: fds}
			st := h.open()
			require.NotNil(t, call.begin(t, st).GetRequestHeaders())
			recv(t, st) // the message streamed back
			require.NotNil(t, st.send(upstreamHeaders("grpc-status", "5")).GetResponseHeaders())
			st.end()
		}, 0},
		{"the stream ends after the message, without trailers", func(t *testing.T, h *harness) {
			call := grpcCall{key: "k", body: grpcFrame("amount=10"), mode: fds}
			st := h.open()
			require.NotNil(t, call.begin(t, st).GetRequestHeaders())
			recv(t, st)
			require.NotNil(t, st.send(upstreamHeaders()).GetResponseHeaders())
			require.NotNil(t, st.send(responseBody(grpcFrame("tx_1"), false)).GetResponseBody())
			st.end()
		}, 1},
		{"a response body ends the response", func(t *testing.T, h *harness) {
			call := grpcCall{key: "k", body: grpcFrame("amount=10"), mode: fds}
			st := h.open()
			require.NotNil(t, call.begin(t, st).GetRequestHeaders())
			recv(t, st)
			require.NotNil(t, st.send(upstreamHeaders()).GetResponseHeaders())
			require.NotNil(t, st.send(responseBody(grpcFrame("tx_1"), true)).GetResponseBody())
			st.end()
		}, 1},
		{"a proxyless call's stream ends before the trailers", func(t *testing.T, h *harness) {
			call := proxylessCall{key: "k", mode: filterextproc.ProcessingMode_NONE, respMode: filterextproc.ProcessingMode_NONE}
			st := h.openNamed("charge")
			require.NotNil(t, st.send(call.headers()).GetRequestHeaders())
			rh := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
				Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: "x-up-header", RawValue: []byte("h")}}},
			}}}
			require.NotNil(t, st.send(rh).GetResponseHeaders())
			st.end()
		}, 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, harnessOptions{policy: "routes: [{name: charge, match: {path_prefix: /payments.v1.Payments/}, grpc: true}]"})
			families, err := h.registry.Gather()
			require.NoError(t, err)
			exposed := false
			for _, f := range families {
				exposed = exposed || f.GetName() == metric
			}
			require.True(t, exposed, "exposed from start-up")
			c.run(t, h)
			h.waitIdle(t)
			require.Equal(t, c.want, h.counter(metric, "route", "charge"))
		})
	}
}
