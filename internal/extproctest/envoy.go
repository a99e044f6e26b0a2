package extproctest

import (
	"strconv"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
)

// EnvoyRequestHeaders is the header set Envoy sends an ext_proc server for a POST of a JSON body
// of contentLength bytes to /v1/payments under key, with requestID as its x-request-id: what the
// benchmarks that play Envoy send.
func EnvoyRequestHeaders(key, requestID string, contentLength int) []*corev3.HeaderValue {
	return []*corev3.HeaderValue{
		{Key: ":authority", RawValue: []byte("api.example.com")},
		{Key: ":path", RawValue: []byte("/v1/payments")},
		{Key: ":method", RawValue: []byte("POST")},
		{Key: ":scheme", RawValue: []byte("https")},
		{Key: "user-agent", RawValue: []byte("okhttp/4.12.0")},
		{Key: "content-type", RawValue: []byte("application/json")},
		{Key: "content-length", RawValue: []byte(strconv.Itoa(contentLength))},
		{Key: "idempotency-key", RawValue: []byte(key)},
		{Key: "x-forwarded-proto", RawValue: []byte("https")},
		{Key: "x-request-id", RawValue: []byte(requestID)},
	}
}
