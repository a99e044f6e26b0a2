package extproc_test

import (
	"strconv"
	"testing"
	"time"

	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

// fuzzMessages turns bytes into a sequence of ext_proc messages of any kind, in any order.
func fuzzMessages(b []byte) []*extprocv3.ProcessingRequest {
	var msgs []*extprocv3.ProcessingRequest
	for i, c := range b {
		key := "k" + strconv.Itoa(int(c>>4)%3)
		switch c % 9 {
		case 0:
			msgs = append(msgs, requestHeaders(post("/v1/payments", key, "")))
		case 1:
			msgs = append(msgs, requestHeaders(post("/v1/payments", key, "body")))
		case 2:
			msgs = append(msgs, requestHeaders(request{method: "GET", path: "/x"}))
		case 3:
			msgs = append(msgs, requestBody([]byte{c, byte(i)}))
		case 4:
			msgs = append(msgs, responseHeaders(upstream{status: 200 + int(c>>4)*20, body: []byte("x")}))
		case 5:
			msgs = append(msgs, responseHeaders(upstream{status: 201, details: "upstream_reset_before_response_started"}))
		case 6:
			msgs = append(msgs, responseBody([]byte{c}, c&0x10 != 0))
		case 7:
			m := requestHeaders(post("/v1/payments", key, "body"))
			m.ProtocolConfig.ResponseBodyMode = filterextproc.ProcessingMode_STREAMED
			msgs = append(msgs, m)
		case 8:
			msgs = append(msgs,
				&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}},
				&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}})
		}
	}
	return msgs
}

// FuzzStreamMessages sends sequences of ext_proc messages in random order and of random kinds
// down one stream: the server never panics, never asks its state machine for a move outside the
// table, and once the stream is over it holds nothing: no lease, no renewal timer, nothing in
// flight.
func FuzzStreamMessages(f *testing.F) {
	f.Add([]byte{1, 3, 4, 6 | 0x10})
	f.Add([]byte{0, 0, 3, 5})
	f.Add([]byte{3, 1, 4, 6, 6 | 0x10, 8})
	f.Add([]byte{7, 3, 4, 6, 6, 8})
	f.Add([]byte{2, 4, 6})
	p, err := policy.Parse([]byte("defaults: {lock_ttl: 3s}"))
	require.NoError(f, err)
	f.Fuzz(func(t *testing.T, b []byte) {
		clk := clock.NewFake(time.Unix(1_700_000_000, 0))
		mem, err := cache.NewMemory(cache.MemoryOptions{Clock: clk})
		require.NoError(t, err)
		reg := prometheus.NewRegistry()
		metrics, err := extproc.NewMetrics(reg)
		require.NoError(t, err)
		srv, err := extproc.NewServer(extproc.Options{Store: mem, Policy: p, Metrics: metrics, Clock: clk})
		require.NoError(t, err)

		msgs := fuzzMessages(b)
		require.NoError(t, srv.Process(&memStream{ctx: t.Context(), msgs: msgs, script: true}))
		require.Equal(t, 0, clk.Pending(), "no renewal timer outlives its stream")
		require.Zero(t, metricValue(t, reg, "idempotency_inflight"), "nothing in flight once the stream is over")
		require.Zero(t, metricValue(t, reg, "idempotency_internal_errors_total", "kind", "illegal_transition"), "no move outside the transition table, whatever the order")
		for _, k := range []string{"k0", "k1", "k2"} {
			if rec := storedRecord(t, mem, p, k); rec != nil {
				require.Equal(t, cache.Completed, rec.State, "a stream that ended leaves no pending lease for %s", k)
			}
		}
	})
}
