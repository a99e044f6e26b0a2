package jsonbody

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

// mcpCall is an MCP tools/call request of about n bytes: the members a route reads come first,
// a long argument last.
func mcpCall(n int) []byte {
	head := `{"jsonrpc":"2.0","id":17,"method":"tools/call","params":{"name":"send_mail","_meta":{"idempotencyKey":"0b6f2c1e-7d7a-4a53-9f5e-3c1d2b6f8a90"},"arguments":{"to":"a@example.com","amount":9007199254740993,"body":"`
	tail := `"}}}`
	return []byte(head + strings.Repeat("x", max(0, n-len(head)-len(tail))) + tail)
}

// BenchmarkValues reads a key, the method and a scope value from a tools/call body, three ways:
// this package (jsontext's decoder, token by token), encoding/json's token decoder, and
// encoding/json into a map, as a plain implementation would. It is how the package's machinery
// was chosen: the figures are in the benchmark's output.
func BenchmarkValues(b *testing.B) {
	ptrs := pointers(b, "/method", "/params/_meta/idempotencyKey", "/params/name")
	for _, n := range []int{1 << 10, 64 << 10} {
		body := mcpCall(n)
		b.Run(fmt.Sprintf("jsontext/%dKiB", n>>10), func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				v, err := Values(body, ptrs)
				if err != nil || v[1] == nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("encoding-json-tokens/%dKiB", n>>10), func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				d := json.NewDecoder(bytes.NewReader(body))
				d.UseNumber()
				for {
					if _, err := d.Token(); err != nil {
						break
					}
				}
			}
		})
		b.Run(fmt.Sprintf("encoding-json-map/%dKiB", n>>10), func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				var m map[string]any
				d := json.NewDecoder(bytes.NewReader(body))
				d.UseNumber()
				if err := d.Decode(&m); err != nil {
					b.Fatal(err)
				}
				_ = m["params"].(map[string]any)["_meta"]
			}
		})
	}
}

// BenchmarkCanonical is the fingerprint's canonical form of a tools/call body without its _meta.
func BenchmarkCanonical(b *testing.B) {
	ignore := pointers(b, "/id", "/params/_meta")
	for _, n := range []int{1 << 10, 64 << 10} {
		body := mcpCall(n)
		b.Run(fmt.Sprintf("%dKiB", n>>10), func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			var dst []byte
			for b.Loop() {
				var err error
				if dst, err = Canonical(dst[:0], body, ignore); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
