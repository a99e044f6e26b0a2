package extproc_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// With durability, a claim the Redis replica does not confirm is answered as a store failure and
// does not run, and a completion it does not confirm still answers the client: each is counted,
// and the completion is logged with its key hash.
func TestDurabilityUnconfirmed(t *testing.T) {
	srv := redistest.Start(t, redistest.Options{})
	replica := redistest.StartReplicas(t, srv, 1)[0]
	t.Cleanup(replica.Resume)
	s, err := cache.OpenRedis(cache.RedisOptions{URL: srv.URL(), Timeout: 2 * time.Second})
	require.NoError(t, err)
	h := newHarness(t, harnessOptions{store: s, advance: time.Sleep, policy: "store_timeout: 2s\ndurability: {replicas: 1, timeout: 300ms}\n"})
	ok := upstream{status: 201, body: []byte("ok")}
	unconfirmed := func(op string) float64 { return h.counter("idempotency_durability_unconfirmed_total", "op", op) }

	first := h.do(post("/v1/payments", "a", `{}`), ok)
	require.True(t, first.executed, "a claim the replica confirms runs: %d %s\n%s", first.status, first.body, h.logs.String())
	require.False(t, h.do(post("/v1/payments", "a", `{}`), ok).executed, "and its duplicate replays")

	replica.Pause()
	res := h.do(post("/v1/payments", "b", `{}`), ok)
	require.False(t, res.executed, "a claim the replica does not confirm does not run")
	requireProblem(t, res, 503, "store-unavailable")
	require.Equal(t, 1.0, unconfirmed("claim"))
	require.Nil(t, h.record(t, "b"), "and leaves nothing pending")
	replica.Resume()
	require.True(t, h.do(post("/v1/payments", "b", `{}`), ok).executed, "its retry runs once the replica is back")

	st := h.open()
	st.send(requestHeaders(post("/v1/payments", "c", `{}`)))
	st.send(requestBody([]byte(`{}`)))
	replica.Pause()
	require.NotNil(t, st.send(responseHeaders(ok)).GetResponseHeaders())
	resp := st.send(responseBody(ok.body, true))
	require.NotNil(t, resp.GetResponseBody(), "the response goes out")
	require.Nil(t, resp.GetImmediateResponse())
	st.end()
	h.waitIdle(t)
	require.Equal(t, 1.0, unconfirmed("complete"))
	require.Equal(t, 1.0, unconfirmed("claim"), "the completion is not a claim")
	require.Equal(t, 3.0, h.counter("idempotency_requests_total", "route", "default", "outcome", "executed"), "a, the retry of b and c")
	require.Equal(t, 1.0, h.counter("idempotency_requests_total", "route", "default", "outcome", "store_error"), "b only")

	var warned map[string]any
	for line := range strings.Lines(h.logs.String()) {
		var l map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &l))
		if strings.HasPrefix(l["message"].(string), "completion not confirmed") {
			warned = l
		}
	}
	require.NotNil(t, warned, "the unconfirmed completion is logged:\n%s", h.logs.String())
	require.Equal(t, "warn", warned["level"])
	require.NotEmpty(t, warned["key_hash"])
	require.Equal(t, "default", warned["route"])
	replica.Resume()
	require.Equal(t, cache.Completed, h.record(t, "c").State, "the record stays")
	require.False(t, h.do(post("/v1/payments", "c", `{}`), ok).executed, "its duplicate replays")
}

// The memory store has no replicas: a route with durability gets store failures (the server's
// start-up refuses such a policy with the memory store; the store refuses it too).
func TestDurabilityOnTheMemoryStore(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: "durability: {replicas: 1}\n"})
	res := h.do(post("/v1/payments", "a", `{}`), created)
	require.False(t, res.executed)
	requireProblem(t, res, 503, "store-unavailable")
	require.Equal(t, 1.0, h.counter("idempotency_durability_unconfirmed_total", "op", "claim"))
	require.Zero(t, h.counter("idempotency_durability_unconfirmed_total", "op", "complete"))
}
