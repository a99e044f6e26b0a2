package extproc_test

import (
	"fmt"
	"strconv"
	"strings"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// BenchmarkJSONRoute is what a route that reads its JSON bodies costs per request, next to a
// route on the same path that reads none, for an MCP tools/call of 1 KiB and 64 KiB: "plain"
// takes its key from a header and fingerprints the raw body; "json-rpc" is the MCP route
// (match.json, key_json, a json scope entry, fingerprint_ignore_json, json_rpc). Both run on
// the memory store without gRPC, first executions and replays.
func BenchmarkJSONRoute(b *testing.B) {
	routes := []struct{ name, policy string }{
		{"plain", "routes: [{name: mcp, match: {path_prefix: /mcp}}]"},
		{"json-rpc", mcpRoutes},
	}
	for _, size := range []int{1 << 10, 64 << 10} {
		for _, rt := range routes {
			for _, w := range []string{"first", "replay"} {
				b.Run(fmt.Sprintf("%dKiB/%s/%s", size>>10, rt.name, w), func(b *testing.B) {
					srv := benchServer(b, rt.policy)
					key := func() string {
						if w == "replay" {
							return "replayed"
						}
						return "k-" + strconv.FormatInt(benchSeq.Add(1), 10)
					}
					run := func(msgs []*extprocv3.ProcessingRequest) {
						if err := srv.Process(&memStream{ctx: b.Context(), msgs: msgs}); err != nil {
							b.Fatal(err)
						}
					}
					run(toolCallMessages("replayed", size))
					b.SetBytes(int64(size))
					b.ReportAllocs()
					batch := make([][]*extprocv3.ProcessingRequest, 0, 256)
					b.ResetTimer()
					for i := 0; i < b.N; i++ {
						if i%256 == 0 {
							b.StopTimer()
							batch = batch[:0]
							for range min(256, b.N-i) {
								batch = append(batch, toolCallMessages(key(), size))
							}
							b.StartTimer()
						}
						run(batch[i%256])
					}
				})
			}
		}
	}
}

func benchServer(b *testing.B, src string) *extproc.Server {
	p, err := policy.Parse([]byte(src))
	require.NoError(b, err)
	mem, err := cache.NewMemory(cache.MemoryOptions{})
	require.NoError(b, err)
	b.Cleanup(func() { _ = mem.Close() })
	srv, err := extproc.NewServer(extproc.Options{Store: mem, Policy: p})
	require.NoError(b, err)
	return srv
}

// toolCallMessages are Envoy's messages for an MCP tools/call of about size bytes whose key is
// in its _meta and in the idempotency-key header.
func toolCallMessages(key string, size int) []*extprocv3.ProcessingRequest {
	r := toolCall("17", key, "send_mail", `{"to":"a@example.com","body":"x"}`)
	pad := strings.Repeat("x", max(0, size-len(r.body)))
	r.body = []byte(strings.Replace(string(r.body), `"body":"x"`, `"body":"x`+pad+`"`, 1))
	r.headers = append(r.headers, "idempotency-key", key)
	return []*extprocv3.ProcessingRequest{requestHeaders(r), requestBody(r.body), responseHeaders(toolResult), responseBody(toolResult.body, true)}
}
