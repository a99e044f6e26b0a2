package extproc_test

import (
	"strconv"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

// jsonBodies are the request bodies FuzzJSONStreamMessages sends to the MCP routes: tool calls
// under three keys, another method, a batch, and bodies no route can read.
var jsonBodies = []string{
	`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"send_mail","_meta":{"idempotencyKey":"k0"},"arguments":{}}}`,
	`{"jsonrpc":"2.0","id":"b","method":"tools/call","params":{"name":"send_mail","_meta":{"idempotencyKey":"k1"},"arguments":{"n":9007199254740993}}}`,
	`{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"charge","arguments":{"_idempotency_key":"k2"}}}`,
	`{"jsonrpc":"2.0","id":4,"method":"tools/list"}`,
	`[{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"x"}}]`,
	`{"jsonrpc":"2.0","id":6,"method":"tools/call","params":`,
	`{"method":"tools/call","x":` + strings.Repeat("[", 100) + strings.Repeat("]", 100) + `}`,
	`{"request_id":"k0","a":1}`,
}

// fuzzByte is the byte jsonFuzzMessages reads as a message of kind (0 to 6) with body (an index
// of jsonBodies; for a last body chunk, 1 ends the body).
func fuzzByte(kind, body int) byte {
	for c := 0; c < 256; c++ {
		if c%7 == kind && (c>>4)%len(jsonBodies) == body%len(jsonBodies) && (kind != 4 || (c&0x10 != 0) == (body == 1)) {
			return byte(c)
		}
	}
	panic("no such byte")
}

func jsonFuzzMessages(b []byte) []*extprocv3.ProcessingRequest {
	var msgs []*extprocv3.ProcessingRequest
	for i, c := range b {
		body := jsonBodies[int(c>>4)%len(jsonBodies)]
		switch c % 7 {
		case 0:
			msgs = append(msgs, requestHeaders(request{method: "POST", path: "/mcp", body: []byte(body)}))
		case 1:
			msgs = append(msgs, requestHeaders(post("/api/x", "k"+strconv.Itoa(i%3), body)))
		case 2:
			msgs = append(msgs, requestBody([]byte(body)))
		case 3:
			msgs = append(msgs, responseHeaders(upstream{status: 200, headers: []string{"content-type", "text/event-stream"}, body: []byte("x")}))
		case 4:
			msgs = append(msgs, responseBody([]byte("data: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n\n"), c&0x10 != 0))
		case 5:
			msgs = append(msgs, requestHeaders(request{method: "GET", path: "/mcp"}))
		case 6:
			msgs = append(msgs, &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}})
		}
	}
	return msgs
}

// FuzzJSONStreamMessages is FuzzStreamMessages on routes that read JSON bodies (match.json,
// key_json, json scope, fingerprint_ignore_json, json_rpc): whatever the order and the bodies,
// the server never panics, never makes a move outside its transition table, and leaves nothing
// pending once the stream is over.
func FuzzJSONStreamMessages(f *testing.F) {
	// Each body through the MCP route whole: headers, body, response headers, a last body chunk;
	// and a retry of the first tool call after it.
	for body := range jsonBodies {
		f.Add([]byte{fuzzByte(0, body), fuzzByte(2, body), fuzzByte(3, 0), fuzzByte(4, 1)})
	}
	f.Add([]byte{fuzzByte(0, 0), fuzzByte(2, 0), fuzzByte(3, 0), fuzzByte(4, 1), fuzzByte(0, 0), fuzzByte(2, 0)})
	f.Add([]byte{fuzzByte(1, 7), fuzzByte(2, 7), fuzzByte(3, 0), fuzzByte(4, 1), fuzzByte(5, 0)})
	p, err := policy.Parse([]byte(mcpRoutes + "defaults: {lock_ttl: 3s}\n"))
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
		require.NoError(t, srv.Process(&memStream{ctx: t.Context(), msgs: jsonFuzzMessages(b), script: true}))
		require.Equal(t, 0, clk.Pending(), "no renewal timer outlives its stream")
		require.Zero(t, metricValue(t, reg, "idempotency_inflight"), "nothing in flight once the stream is over")
		require.Zero(t, metricValue(t, reg, "idempotency_internal_errors_total", "kind", "illegal_transition"), "no move outside the transition table, whatever the order")
	})
}
