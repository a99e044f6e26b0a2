package extproc_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/extproc"
)

// TestMetricsCountEveryOutcome sends known traffic and checks exact increments per outcome and
// route, the release reasons, the in-flight gauge and the store histogram.
func TestMetricsCountEveryOutcome(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: `
defaults: {max_response_bytes: 8, lock_ttl: 3s}
routes:
  - {name: strict, match: {path_prefix: /v1/strict}, missing_key: required}
`})
	small := upstream{status: 201, body: []byte("ok")}
	big := upstream{status: 200, body: []byte("more than eight")}

	h.do(request{method: "GET", path: "/v1/payments"}, small)                     // default passthrough
	h.do(post("/v1/payments", "", `{}`), small)                                   // default passthrough (no key)
	h.do(post("/v1/payments", "a", `{}`), small)                                  // default executed
	h.do(post("/v1/payments", "a", `{}`), small)                                  // default replayed
	h.do(post("/v1/payments", "a", `{"x":1}`), small)                             // default mismatch
	h.do(post("/v1/payments", "", `{}`, "idempotency-key", "bad key"), small)     // default invalid
	h.do(post("/v1/payments", "t", `{}`, "x-ttl", "0"), small)                    // default invalid
	h.do(post("/v1/payments", "big", `{}`), big)                                  // default executed
	h.do(post("/v1/payments", "big", `{}`), big)                                  // default not_replayable
	h.do(post("/v1/payments", "fail", `{}`), upstream{status: 500})               // default executed, released: status
	h.run(post("/v1/payments", "gw", `{}`), envoyMade(0, false), small)           // default executed, released: envoy_response
	h.run(post("/v1/payments", "to", `{}`), envoyMade(1, true), small)            // default executed, released: unknown_outcome
	h.do(post("/v1/payments", "big", `{"y":1}`, "idempotency-key", "big"), small) // default mismatch
	h.do(post("/v1/strict", "", `{}`), small)                                     // strict missing_key
	h.do(post("/v1/strict", "s", `{}`), small)                                    // strict executed

	running := h.open()
	running.send(requestHeaders(post("/v1/strict", "r", `{}`)))
	running.send(requestBody([]byte(`{}`)))
	require.Equal(t, 1.0, h.counter("idempotency_inflight"))
	h.clock.Advance(time.Second)               // one renewal
	h.do(post("/v1/strict", "r", `{}`), small) // strict in_progress
	running.end()                              // strict executed, released: unknown_outcome
	h.waitIdle(t)

	want := map[string]map[string]float64{
		"default": {"passthrough": 2, "executed": 5, "replayed": 1, "mismatch": 2, "invalid": 2, "not_replayable": 1},
		"strict":  {"missing_key": 1, "executed": 2, "in_progress": 1},
	}
	for route, outcomes := range want {
		for _, o := range extproc.Outcomes {
			require.Equal(t, outcomes[string(o)], h.counter("idempotency_requests_total", "route", route, "outcome", string(o)), "%s %s", route, o)
		}
	}
	require.Equal(t, 1.0, h.counter("idempotency_releases_total", "route", "default", "reason", "status"))
	require.Equal(t, 1.0, h.counter("idempotency_releases_total", "route", "default", "reason", "envoy_response"))
	require.Equal(t, 1.0, h.counter("idempotency_releases_total", "route", "default", "reason", "unknown_outcome"))
	require.Equal(t, 1.0, h.counter("idempotency_releases_total", "route", "strict", "reason", "unknown_outcome"))
	require.Equal(t, 0.0, h.counter("idempotency_inflight"))

	// Every covered request with a valid key made exactly one acquire, but the duplicate of the
	// request this replica was running: it was answered without the store.
	ops := map[string]uint64{"acquire": 11, "complete": 3, "release": 4, "renew": 1}
	families, err := h.registry.Gather()
	require.NoError(t, err)
	seen := map[string]uint64{}
	for _, f := range families {
		if f.GetName() != "idempotency_store_duration_seconds" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				seen[l.GetValue()] = m.GetHistogram().GetSampleCount()
			}
		}
	}
	require.Equal(t, ops, seen)
}

// TestLogsNeverCarrySecrets runs requests with a distinctive key, authorization value, cookie
// and body at debug level and checks that none of them reaches the log.
func TestLogsNeverCarrySecrets(t *testing.T) {
	const (
		key    = "KEY-7f3a9c-distinctive"
		auth   = "Bearer SECRET-TOKEN-5521"
		cookie = "session=COOKIE-VALUE-8812"
		body   = `{"card":"BODY-4111111111111111"}`
	)
	store := newFailingStore(t, false)
	store.broken.Store(false)
	h := newHarness(t, harnessOptions{store: store})
	up := upstream{status: 201, headers: []string{"set-cookie", cookie}, body: []byte(body)}
	r := post("/v1/payments", key, body, "authorization", auth, "cookie", cookie)
	h.do(r, up)
	h.do(r, up)
	h.do(post("/v1/payments", key, `{"other":1}`, "authorization", auth), up)
	store.broken.Store(true)
	h.do(post("/v1/payments", key+"-2", body, "authorization", auth), up)
	h.waitIdle(t)

	logs := h.logs.String()
	require.Contains(t, logs, `"outcome":"replayed"`, "the log has request lines")
	require.Contains(t, logs, `"key_hash":`)
	require.Contains(t, logs, `"op":"acquire"`, "store errors are logged with their operation")
	for _, secret := range []string{"KEY-7f3a9c", "SECRET-TOKEN", "COOKIE-VALUE", "BODY-4111", "4111111111111111"} {
		require.NotContains(t, logs, secret)
	}
	for _, line := range strings.Split(strings.TrimSpace(logs), "\n") {
		require.True(t, strings.HasPrefix(line, "{"), "JSON lines only: %s", line)
	}
}
