package extproc_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
)

// testStore is a store for the server under test, and the means to move the store's time
// beyond the harness clock (nil when the store runs on the harness clock).
type testStore struct {
	store   cache.Store
	advance func(time.Duration)
}

// stores lists the stores every outcome test runs against: the memory store on the harness clock
// (the harness default), and the real Redis of stores_redis_test.go.
var stores = map[string]func(t *testing.T) testStore{
	"memory": func(*testing.T) testStore { return testStore{} },
}

func forEachStore(t *testing.T, f func(t *testing.T, newStore func(t *testing.T) testStore)) {
	for name, newStore := range stores {
		t.Run(name, func(t *testing.T) { f(t, newStore) })
	}
}

// requireProblem decodes a problem+json body and checks its shape.
func requireProblem(t *testing.T, res result, status int, code string) {
	t.Helper()
	require.Equal(t, status, res.status)
	require.Equal(t, []string{"application/problem+json"}, res.header("content-type"))
	var p map[string]any
	require.NoError(t, json.Unmarshal(res.body, &p), "body %q", res.body)
	require.Equal(t, "about:blank", p["type"])
	require.Equal(t, float64(status), p["status"])
	require.Equal(t, code, p["code"])
	require.Equal(t, rfc9110Titles[status], p["title"], "RFC 9110's reason phrase")
	require.NotEmpty(t, p["detail"])
	require.Len(t, p, 5)
	require.False(t, res.executed, "the upstream must not run")
}

const replayed = "x-idempotency-replayed"

// requireUntouched checks that the client got the headers the upstream u sent, each name with
// its values in order, and no other header but Envoy's own (content-length, date, server,
// x-envoy-*) and the names in also.
func requireUntouched(t *testing.T, u upstream, res result, also ...string) {
	t.Helper()
	envoys := func(name string) bool {
		return strings.HasPrefix(name, "x-envoy-") || slices.Contains([]string{"content-length", "date", "server", "connection", "keep-alive", "transfer-encoding"}, name)
	}
	want := map[string][]string{}
	for i := 0; i+1 < len(u.headers); i += 2 {
		if !envoys(u.headers[i]) {
			want[u.headers[i]] = append(want[u.headers[i]], u.headers[i+1])
		}
	}
	for name, values := range want {
		require.Equal(t, values, res.header(name), "%s untouched", name)
	}
	for i := 0; i < len(res.headers); i += 2 {
		name := res.headers[i]
		_, sent := want[name]
		require.True(t, sent || envoys(name) || slices.Contains(also, name), "%s: neither the upstream's nor Envoy's", name)
	}
}

// rfc9110Titles are the reason phrases of RFC 9110 §15 for the statuses the server answers.
var rfc9110Titles = map[int]string{
	400: "Bad Request",
	401: "Unauthorized",
	409: "Conflict",
	413: "Content Too Large",
	422: "Unprocessable Content",
	500: "Internal Server Error",
	503: "Service Unavailable",
}

// TestOutcomeTable has one case per row of the outcome table (docs/outcomes.md).
func TestOutcomeTable(t *testing.T) {
	forEachStore(t, func(t *testing.T, newStore func(t *testing.T) testStore) {
		cases := []struct {
			name   string
			policy string
			run    func(t *testing.T, h *harness)
		}{
			{"not covered", "", func(t *testing.T, h *harness) {
				res := h.do(request{method: "GET", path: "/v1/things", headers: []string{"idempotency-key", "k1"}}, created)
				require.True(t, res.executed)
				requireUntouched(t, created, res)
				require.Equal(t, []string{"request_headers"}, res.received, "no response phase after the pass-through override")
				res = h.do(request{method: "GET", path: "/v1/things", headers: []string{"idempotency-key", "k1"}}, created)
				require.Equal(t, 2, h.executions("k1"))
				h.requireStoreEmpty(t, "k1")
			}},
			{"key missing, optional", "", func(t *testing.T, h *harness) {
				for range 2 {
					res := h.do(post("/v1/payments", "", `{"a":1}`), created)
					require.True(t, res.executed)
					requireUntouched(t, created, res)
				}
				require.Equal(t, 2, h.executions(""))
			}},
			{"key missing, required", "defaults: {missing_key: required}", func(t *testing.T, h *harness) {
				res := h.do(post("/v1/payments", "", `{"a":1}`), created)
				requireProblem(t, res, 400, "missing-idempotency-key")
				require.Equal(t, []string{"false"}, res.header(replayed))
				require.Empty(t, res.header("retry-after"))
				require.Equal(t, 0, h.executions(""))
			}},
			{"key missing, body-hash", "defaults: {missing_key: body-hash}", func(t *testing.T, h *harness) {
				first := h.do(post("/v1/payments", "", `{"a":1}`), created)
				require.True(t, first.executed)
				require.Equal(t, []string{"false"}, first.header(replayed))
				second := h.do(post("/v1/payments", "", `{"a":1}`), created)
				require.False(t, second.executed, "the same body is the same key")
				require.Equal(t, []string{"true"}, second.header(replayed))
				other := h.do(post("/v1/payments", "", `{"a":2}`), created)
				require.True(t, other.executed, "another body is another key")
				query := h.do(post("/v1/payments?x=1", "", `{"a":1}`), created)
				require.True(t, query.executed, "the path with its query is part of the key")
				require.Equal(t, 3, h.executions(""))
			}},
			{"key invalid", "", func(t *testing.T, h *harness) {
				for _, bad := range []string{"", " ", "has space", strings.Repeat("k", 256), "caf\xc3\xa9", `"unterminated`, `"bad\escape"`, `""`, "tab\tkey"} {
					res := h.do(post("/v1/payments", "", `{}`, "idempotency-key", bad), created)
					requireProblem(t, res, 400, "invalid-idempotency-key")
					require.Equal(t, []string{"false"}, res.header(replayed))
				}
				res := h.do(post("/v1/payments", "a", `{}`, "x-idempotency-key", "b"), created)
				requireProblem(t, res, 400, "invalid-idempotency-key")
				require.Equal(t, 0, h.executions("a"))
			}},
			{"ttl header invalid", "", func(t *testing.T, h *harness) {
				for _, bad := range []string{"0", "-5", "1.5", "ten", ""} {
					res := h.do(post("/v1/payments", "k", `{}`, "x-ttl", bad), created)
					requireProblem(t, res, 400, "invalid-ttl")
				}
				require.Equal(t, 0, h.executions("k"))
				h.requireStoreEmpty(t, "k")
			}},
			{"new key", "", func(t *testing.T, h *harness) {
				res := h.do(post("/v1/payments", "k", `{"amount":10}`), created)
				require.True(t, res.executed)
				require.Equal(t, 201, res.status)
				require.Equal(t, []string{"false"}, res.header(replayed))
				require.Equal(t, created.body, res.body)
				rec := h.record(t, "k")
				require.Equal(t, cache.Completed, rec.State)
				require.Equal(t, 1, h.executions("k"))
			}},
			{"same key, first in flight", "", func(t *testing.T, h *harness) {
				first := h.open()
				require.NotNil(t, first.send(requestHeaders(post("/v1/payments", "k", `{"a":1}`))).GetRequestHeaders())
				require.NotNil(t, first.send(requestBody([]byte(`{"a":1}`))).GetRequestBody())
				res := h.do(post("/v1/payments", "k", `{"a":1}`), created)
				requireProblem(t, res, 409, "request-in-progress")
				require.Equal(t, []string{"1"}, res.header("retry-after"))
				require.Equal(t, []string{"false"}, res.header(replayed))
				require.Equal(t, cache.Pending, h.record(t, "k").State, "unchanged")
			}},
			{"same key, first completed: replay byte for byte", "", func(t *testing.T, h *harness) {
				body := make([]byte, 4096)
				for i := range body {
					body[i] = byte(i * 7)
				}
				up := upstream{status: 201, body: body, headers: []string{
					"content-type", "application/octet-stream", "set-cookie", "a=1; Path=/", "x-trace", "t1",
					"set-cookie", "b=2", "content-length", "4096", "transfer-encoding", "chunked", "date", "x",
					"x-envoy-upstream-service-time", "5", "keep-alive", "timeout=5", "x-idempotency-replayed", "spoofed",
				}}
				first := h.do(post("/v1/payments", "k", `{"a":1}`), up)
				require.True(t, first.executed)
				res := h.do(post("/v1/payments", "k", `{"a":1}`), created)
				require.False(t, res.executed)
				require.Equal(t, 201, res.status)
				require.Equal(t, body, res.body)
				rec := h.record(t, "k")
				require.Equal(t, []string{"application/octet-stream"}, res.header("content-type"))
				require.Equal(t, []string{"a=1; Path=/", "b=2"}, res.header("set-cookie"))
				require.Equal(t, []string{"t1"}, res.header("x-trace"))
				require.Equal(t, []string{"true"}, res.header(replayed), "the upstream's own value is not replayed")
				require.Equal(t, []string{rec.ExpiresAt.UTC().Format(http.TimeFormat)}, res.header("x-idempotency-expires"))
				require.Equal(t, []string{rec.CreatedAt.UTC().Format(http.TimeFormat)}, res.header("x-idempotency-first-sent"))
				require.Equal(t, []string{"4096"}, res.header("content-length"), "Envoy's, for the replayed body")
				require.NotContains(t, res.header("x-envoy-upstream-service-time"), "5", "not the stored one")
				require.NotContains(t, res.header("date"), "x", "not the stored one")
				require.Empty(t, res.header("keep-alive"))
				require.Empty(t, res.header("transfer-encoding"))
				// The replay's exact answer, the first request and its duplicate written by hand:
				// the stored headers keep the upstream's order.
				hand := h.open()
				hand.send(requestHeaders(post("/v1/payments", "k2", `{"a":1}`)))
				hand.send(requestBody([]byte(`{"a":1}`)))
				hand.send(responseHeaders(up))
				hand.send(responseBody(up.body, true))
				hand.end()
				h.waitIdle(t)
				rec = h.record(t, "k2")
				s := h.open()
				s.send(requestHeaders(post("/v1/payments", "k2", `{"a":1}`)))
				ir := s.send(requestBody([]byte(`{"a":1}`))).GetImmediateResponse()
				require.Equal(t, []string{
					"content-type", "application/octet-stream", "set-cookie", "a=1; Path=/", "x-trace", "t1",
					"set-cookie", "b=2", "x-idempotency-replayed", "true",
					"x-idempotency-expires", rec.ExpiresAt.UTC().Format(http.TimeFormat),
					"x-idempotency-first-sent", rec.CreatedAt.UTC().Format(http.TimeFormat),
				}, setHeaders(ir.GetHeaders()), "every header in order, minus hop-by-hop, content-length, date and x-envoy-*; then the record's expiry and first-sent time")
				for _, o := range ir.GetHeaders().GetSetHeaders() {
					require.Empty(t, o.GetHeader().GetValue(), "values travel in raw_value only")
					require.NotEqual(t, "content-length", o.GetHeader().GetKey())
					require.False(t, strings.HasPrefix(o.GetHeader().GetKey(), ":"))
				}
				require.Equal(t, body, ir.GetBody())
				s.end()
				require.Equal(t, 1, h.executions("k"))
			}},
			{"same key, different fingerprint", "", func(t *testing.T, h *harness) {
				first := h.open()
				first.send(requestHeaders(post("/v1/payments", "k", `{"a":1}`)))
				first.send(requestBody([]byte(`{"a":1}`)))
				res := h.do(post("/v1/payments", "k", `{"a":2}`), created)
				requireProblem(t, res, 422, "idempotency-key-reused")
				require.Equal(t, []string{"false"}, res.header(replayed))
				first.end()
				h.waitIdle(t)

				h.do(post("/v1/payments", "k2", `{"a":1}`), created)
				for _, r := range []request{post("/v1/payments", "k2", `{"a":2}`), post("/v1/refunds", "k2", `{"a":1}`), {method: "PUT", path: "/v1/payments", headers: []string{"idempotency-key", "k2"}, body: []byte(`{"a":1}`)}} {
					res = h.do(r, created)
					requireProblem(t, res, 422, "idempotency-key-reused")
				}
				require.Equal(t, 1, h.executions("k2"))
				require.Equal(t, cache.Completed, h.record(t, "k2").State, "unchanged")
			}},
			{"status not stored", "", func(t *testing.T, h *harness) {
				failed := upstream{status: 500, headers: []string{"content-type", "text/plain"}, body: []byte("boom")}
				res := h.do(post("/v1/payments", "k", `{}`), failed)
				require.True(t, res.executed)
				require.Equal(t, 500, res.status)
				require.Equal(t, []string{"false"}, res.header(replayed))
				require.Equal(t, []string{"request_headers", "request_body", "response_headers"}, res.received, "no body phase for a response that is not stored")
				h.requireStoreEmpty(t, "k")
				res = h.do(post("/v1/payments", "k", `{}`), created)
				require.True(t, res.executed, "a retry runs again")
				require.Equal(t, 2, h.executions("k"))
				require.Equal(t, 1.0, h.counter("idempotency_releases_total", "route", "default", "reason", "status"))
			}},
			{"response generated by Envoy before any attempt upstream", "", func(t *testing.T, h *harness) {
				res := h.run(post("/v1/payments", "k", `{}`), envoyMade(0, false), created)
				require.Equal(t, 404, res.status, "the router's: no route")
				require.False(t, res.ran)
				h.requireStoreEmpty(t, "k")
				// Released even when its status would be stored: nothing reached the upstream.
				// The router's direct_response is written by hand: the proxy has no such route.
				s := h.open()
				s.send(requestHeaders(post("/v1/payments", "k", `{}`)))
				s.send(requestBody([]byte(`{}`)))
				require.NotNil(t, s.send(responseHeaders(upstream{status: 200, details: "direct_response"})).GetResponseHeaders())
				s.end()
				h.waitIdle(t)
				h.requireStoreEmpty(t, "k")
				require.Equal(t, 2.0, h.counter("idempotency_releases_total", "route", "default", "reason", "envoy_response"))
			}},
			{"response generated by Envoy after the request reached the upstream", "", func(t *testing.T, h *harness) {
				res := h.run(post("/v1/payments", "k", `{}`), envoyMade(1, true), created)
				require.Equal(t, 504, res.status, "the route timeout")
				require.True(t, res.ran)
				require.Equal(t, []string{"false"}, res.header(replayed))
				// unknown_outcome: release (the default): at-least-once for an ambiguous outcome,
				// counted.
				h.requireStoreEmpty(t, "k")
				require.Equal(t, 1.0, h.counter("idempotency_releases_total", "route", "default", "reason", "unknown_outcome"))
				require.Equal(t, 1.0, h.counter("idempotency_unknown_outcomes_total", "route", "default", "action", "release"))
				require.Zero(t, h.counter("idempotency_releases_total", "route", "default", "reason", "envoy_response"))
			}},
			{"response generated by Envoy after the attempt, recorded", "defaults: {unknown_outcome: record}", func(t *testing.T, h *harness) {
				require.Equal(t, 504, h.run(post("/v1/payments", "k", `{}`), envoyMade(2, true), created).status)
				rec := h.record(t, "k")
				require.NotNil(t, rec)
				require.True(t, rec.Response.OutcomeUnknown)
				require.Equal(t, 504, rec.Response.Status)
				res := h.do(post("/v1/payments", "k", `{}`), created)
				require.False(t, res.executed, "a duplicate of an unknown outcome never runs")
				requireProblem(t, res, 409, "outcome-unknown")
				require.Empty(t, res.header("retry-after"), "retrying will not help")
				require.Equal(t, 1, h.executions("k"))
				h.waitIdle(t) // outcomes are counted as streams end
				require.Equal(t, 1.0, h.counter("idempotency_requests_total", "route", "default", "outcome", "outcome_unknown"))
				require.Equal(t, 1.0, h.counter("idempotency_unknown_outcomes_total", "route", "default", "action", "record"))
			}},
			{"response generated by Envoy without the attempt count", "", func(t *testing.T, h *harness) {
				gw := envoyMade(1, false) // the upstream resets before answering: the router's 503
				gw.noAttempts = true
				require.Equal(t, 503, h.run(post("/v1/payments", "k", `{}`), gw, created).status)
				require.Equal(t, 503, h.run(post("/v1/payments", "k2", `{}`), gw, created).status)
				h.requireStoreEmpty(t, "k")
				require.Equal(t, 2.0, h.counter("idempotency_releases_total", "route", "default", "reason", "unknown_outcome"), "ambiguous without the attribute")
				require.Equal(t, 2.0, h.counter("idempotency_envoy_misconfig_total", "kind", "attempt_count_missing"))
				require.Equal(t, 1, strings.Count(h.logs.String(), "upstream.request_attempt_count"), "said once, naming the attribute")
			}},
			{"the upstream answered a retried attempt", "", func(t *testing.T, h *harness) {
				// Envoy's router re-sent the claimed request (retry_policy): stored as usual,
				// and counted apart from misconfigurations, since a retry after a connect
				// failure is harmless (the config checks refuse the harmful conditions).
				retried := buffered
				retried.attempts = 2
				require.True(t, h.run(post("/v1/payments", "k", `{}`), retried, created).executed)
				require.True(t, h.run(post("/v1/payments", "k2", `{}`), retried, created).executed)
				require.False(t, h.do(post("/v1/payments", "k", `{}`), created).executed, "replayed")
				// An Envoy-made answer after several attempts (timeouts, resets) counts too: those
				// retries are the ones that may have run it twice.
				require.Equal(t, 504, h.run(post("/v1/payments", "k3", `{}`), envoyMade(3, true), created).status)
				require.Equal(t, 3.0, h.counter("idempotency_upstream_retries_total", "route", "default"))
				require.Equal(t, 1, strings.Count(h.logs.String(), "retry_policy"), "said once, naming the setting")
				for _, kind := range []string{extproc.MisconfigCodeDetailsMissing, extproc.MisconfigUnclaimedRequest, extproc.MisconfigAttemptCountMissing} {
					require.Zero(t, h.counter("idempotency_envoy_misconfig_total", "kind", kind), kind)
				}
				require.Zero(t, h.counter("idempotency_envoy_misconfig_total", "kind", "code_details_missing"))
			}},
			{"response without code_details", "defaults: {unknown_outcome: keep, lock_ttl: 30s}", func(t *testing.T, h *harness) {
				// A 504 may be Envoy's upstream timeout after the upstream ran: without the
				// attribute a response that would release the key is an unknown outcome.
				noDetails := buffered
				noDetails.noDetails = true
				res := h.run(post("/v1/payments", "k", `{}`), noDetails, upstream{status: 504})
				require.Equal(t, 504, res.status)
				dup := h.do(post("/v1/payments", "k", `{}`), created)
				requireProblem(t, dup, 409, "request-in-progress")
				require.Equal(t, 1.0, h.counter("idempotency_unknown_outcomes_total", "route", "default", "action", "keep"))
				// Never attempted upstream (no route): released.
				notTried := envoyMade(0, false)
				notTried.noDetails = true
				require.Equal(t, 404, h.run(post("/v1/payments", "k2", `{}`), notTried, created).status)
				h.requireStoreEmpty(t, "k2")
				require.Equal(t, 1.0, h.counter("idempotency_releases_total", "route", "default", "reason", "envoy_response"))
				// A storable status is stored.
				require.True(t, h.run(post("/v1/payments", "k3", `{}`), noDetails, upstream{status: 201, body: []byte("ok")}).executed)
				require.False(t, h.do(post("/v1/payments", "k3", `{}`), created).executed, "replayed")
				require.Equal(t, 3.0, h.counter("idempotency_envoy_misconfig_total", "kind", "code_details_missing"))
				require.Equal(t, 1, strings.Count(h.logs.String(), "without response.code_details"), "said once, naming the attribute")
			}},
			{"stream ends while Envoy holds a buffered upload claimed at its headers", "defaults: {unknown_outcome: record, fingerprint: [method, path]}", func(t *testing.T, h *harness) {
				// Under BUFFERED Envoy forwards nothing until the body's answer
				// (ProcessorState::handleHeadersResponse): a client gone mid-upload never reached
				// the upstream, so no outcome-unknown record blocks its retry. Known only when the
				// request announces body bytes (content-length).
				s := h.open()
				resp := s.send(requestHeaders(post("/v1/payments", "k", `{"big":1}`, "content-length", "9")))
				require.NotNil(t, resp.GetRequestHeaders(), "claimed at the headers")
				s.end()
				h.waitIdle(t)
				h.requireStoreEmpty(t, "k")
				require.Equal(t, 1.0, h.counter("idempotency_releases_total", "route", "default", "reason", "not_sent"))
				require.Zero(t, h.counter("idempotency_unknown_outcomes_total", "route", "default", "action", "record"))
				// Without content-length the request may have trailers and no data, which under
				// request_trailer_mode SKIP goes upstream with no further message: an unknown
				// outcome, kept.
				s = h.open()
				s.send(requestHeaders(post("/v1/payments", "k3", `{"big":1}`)))
				s.end()
				h.waitIdle(t)
				require.True(t, h.record(t, "k3").Response.OutcomeUnknown)
				require.Equal(t, 1.0, h.counter("idempotency_releases_total", "route", "default", "reason", "not_sent"))
				// Once the body was answered, the upstream may have it: an unknown outcome.
				s = h.open()
				s.send(requestHeaders(post("/v1/payments", "k2", `{"big":1}`)))
				s.send(requestBody([]byte(`{"big":1}`)))
				s.end()
				h.waitIdle(t)
				require.True(t, h.record(t, "k2").Response.OutcomeUnknown)
			}},
			{"stream ends before the response, release", "", func(t *testing.T, h *harness) {
				s := h.open()
				s.send(requestHeaders(post("/v1/payments", "k", `{}`)))
				s.send(requestBody([]byte(`{}`)))
				s.end()
				h.waitIdle(t)
				h.requireStoreEmpty(t, "k")
				require.True(t, h.do(post("/v1/payments", "k", `{}`), created).executed)
			}},
			{"stream ends before the response, keep", "defaults: {unknown_outcome: keep, lock_ttl: 600ms}", func(t *testing.T, h *harness) {
				s := h.open()
				s.send(requestHeaders(post("/v1/payments", "k", `{}`)))
				s.send(requestBody([]byte(`{}`)))
				s.end()
				h.waitIdle(t)
				requireProblem(t, h.do(post("/v1/payments", "k", `{}`), created), 409, "request-in-progress")
				h.advance(700 * time.Millisecond)
				require.True(t, h.do(post("/v1/payments", "k", `{}`), created).executed, "the lease expires after lock_ttl")
			}},
			{"body larger than max_response_bytes", "defaults: {max_response_bytes: 10}", func(t *testing.T, h *harness) {
				big := upstream{status: 200, headers: []string{"content-type", "text/plain"}, body: []byte("more than ten bytes")}
				res := h.do(post("/v1/payments", "k", `{}`), big)
				require.True(t, res.executed)
				require.Equal(t, big.body, res.body, "the first request gets its response")
				require.Equal(t, []string{"false"}, res.header(replayed))
				rec := h.record(t, "k")
				require.Equal(t, cache.Completed, rec.State)
				require.True(t, rec.Response.BodyOmitted)
				res = h.do(post("/v1/payments", "k", `{}`), big)
				requireProblem(t, res, 409, "response-not-replayable")
				require.Empty(t, res.header("retry-after"))
				require.Equal(t, 1, h.executions("k"))
			}},
		}
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				ts := newStore(t)
				h := newHarness(t, harnessOptions{policy: c.policy, store: ts.store, advance: ts.advance})
				c.run(t, h)
			})
		}
	})
}

// failingStore fails every call while broken is set; with slow set, calls block until their
// deadline instead: the end of their context or, as a store bounds its own calls (cache.Store),
// the store's timeout.
type failingStore struct {
	cache.Store
	broken  atomic.Bool
	slow    bool
	timeout time.Duration
	calls   atomic.Int32
}

var errDown = errors.New("store is down")

func (f *failingStore) fail(ctx context.Context) error {
	f.calls.Add(1)
	if !f.broken.Load() {
		return nil
	}
	if f.slow {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(f.timeout):
			return context.DeadlineExceeded
		}
	}
	return errDown
}

func (f *failingStore) Acquire(ctx context.Context, key string, c cache.Claim) (cache.Lease, *cache.Record, error) {
	if err := f.fail(ctx); err != nil {
		return cache.Lease{}, nil, err
	}
	return f.Store.Acquire(ctx, key, c)
}

func (f *failingStore) Complete(ctx context.Context, l cache.Lease, r cache.Response) error {
	if err := f.fail(ctx); err != nil {
		return err
	}
	return f.Store.Complete(ctx, l, r)
}

func (f *failingStore) Release(ctx context.Context, l cache.Lease) error {
	if err := f.fail(ctx); err != nil {
		return err
	}
	return f.Store.Release(ctx, l)
}

func newFailingStore(t *testing.T, slow bool) *failingStore {
	m, err := cache.NewMemory(cache.MemoryOptions{})
	require.NoError(t, err)
	f := &failingStore{Store: m, slow: slow, timeout: 50 * time.Millisecond}
	f.broken.Store(true)
	return f
}

func TestStoreUnavailable(t *testing.T) {
	for _, slow := range []bool{false, true} {
		t.Run(fmt.Sprintf("closed/slow=%v", slow), func(t *testing.T) {
			store := newFailingStore(t, slow)
			h := newHarness(t, harnessOptions{policy: "store_timeout: 50ms", store: store})
			start := time.Now()
			res := h.do(post("/v1/payments", "k", `{}`), created)
			requireProblem(t, res, 503, "store-unavailable")
			require.Equal(t, []string{"1"}, res.header("retry-after"))
			require.Equal(t, []string{"false"}, res.header(replayed))
			require.Less(t, time.Since(start), time.Second, "bounded by store_timeout")
			h.waitIdle(t)
			require.Equal(t, 1.0, h.counter("idempotency_requests_total", "route", "default", "outcome", "store_error"))

			store.broken.Store(false)
			require.True(t, h.do(post("/v1/payments", "k", `{}`), created).executed, "serves normally once the store is back")
		})
	}
	t.Run("open", func(t *testing.T) {
		store := newFailingStore(t, false)
		h := newHarness(t, harnessOptions{policy: "fail_mode: open", store: store})
		// Claimed at the body, then bodiless, claimed at the request headers.
		for _, body := range []string{`{}`, ""} {
			res := h.do(post("/v1/payments", "k", body), created)
			require.True(t, res.executed)
			requireUntouched(t, created, res, replayed)
			require.Equal(t, []string{"false"}, res.header(replayed), "untouched but for the replay header")
			require.NotContains(t, res.received, "response_body", "nothing to store: the body phase is off")
			require.Equal(t, created.body, res.body)
		}
		require.Equal(t, 2, h.executions("k"))
		h.waitIdle(t)
		require.Equal(t, 2.0, h.counter("idempotency_requests_total", "route", "default", "outcome", "store_error"))
		require.Contains(t, h.logs.String(), `"outcome":"store_error"`)
	})
	t.Run("completion fails", func(t *testing.T) {
		store := newFailingStore(t, false)
		store.broken.Store(false)
		h := newHarness(t, harnessOptions{store: store})
		s := h.open()
		s.send(requestHeaders(post("/v1/payments", "k", `{}`)))
		s.send(requestBody([]byte(`{}`)))
		resp := s.send(responseHeaders(created))
		require.Equal(t, "false", string(resp.GetResponseHeaders().GetResponse().GetHeaderMutation().GetSetHeaders()[0].GetHeader().GetRawValue()))
		store.broken.Store(true)
		require.NotNil(t, s.send(responseBody(created.body, true)).GetResponseBody(), "the client still gets the upstream response")
		s.end()
		h.waitIdle(t)
		require.Equal(t, 1.0, h.counter("idempotency_requests_total", "route", "default", "outcome", "store_error"))
	})
}
