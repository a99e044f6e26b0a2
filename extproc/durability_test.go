package extproc_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
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

// countingStore counts Acquire calls.
type countingStore struct {
	cache.Store
	acquires atomic.Int64
}

func (c *countingStore) Acquire(ctx context.Context, key string, cl cache.Claim) (cache.Lease, *cache.Record, error) {
	c.acquires.Add(1)
	return c.Store.Acquire(ctx, key, cl)
}

// Once the server knows the store has fewer replicas than a route's durability.replicas, that
// route's covered requests get 503 durability-unmet without a store call (or pass unprotected
// under fail_mode: open), and the cause is logged at most once per interval; other routes go on.
// With enough replicas they reach the store again.
func TestDurabilityUnmet(t *testing.T) {
	const routes = `
routes:
  - name: durable
    match: {path_prefix: /v1/payments}
    durability: {replicas: 2}
  - name: plain
    match: {path_prefix: /v1/orders}
`
	for _, mode := range []string{"closed", "open"} {
		t.Run(mode, func(t *testing.T) {
			clk := clock.NewFake(time.Unix(1_700_000_000, 0))
			m, err := cache.NewMemory(cache.MemoryOptions{Clock: clk})
			require.NoError(t, err)
			store := &countingStore{Store: m}
			h := newHarness(t, harnessOptions{store: store, clock: clk, policy: "fail_mode: " + mode + "\n" + routes})
			h.server.SetReplicas(1)
			for i := range 3 {
				res := h.do(post("/v1/payments", fmt.Sprintf("a%d", i), `{}`), created)
				if mode == "closed" {
					require.False(t, res.executed)
					requireProblem(t, res, 503, "durability-unmet")
					require.Equal(t, []string{"1"}, res.header("retry-after"))
				} else {
					require.True(t, res.executed, "unprotected under fail_mode: open")
				}
			}
			require.Zero(t, store.acquires.Load(), "no store call: a claim could only be withdrawn")
			require.True(t, h.do(post("/v1/orders", "o", `{}`), created).executed, "a route without durability runs")
			h.waitIdle(t)
			require.Equal(t, 3.0, h.counter("idempotency_requests_total", "route", "durable", "outcome", "durability_unmet"))
			require.Equal(t, 1, strings.Count(h.logs.String(), "durability.replicas asks for more replicas than the store has"), "logged once per interval:\n%s", h.logs.String())
			h.clock.Advance(10 * time.Second)
			h.do(post("/v1/payments", "later", `{}`), created)
			require.Equal(t, 2, strings.Count(h.logs.String(), "durability.replicas asks for more replicas than the store has"), "and again after it")
			var line map[string]any
			for l := range strings.Lines(h.logs.String()) {
				if strings.Contains(l, "durability.replicas asks") {
					require.NoError(t, json.Unmarshal([]byte(l), &line))
				}
			}
			require.Equal(t, 2.0, line["durability_replicas"])
			require.Equal(t, 1.0, line["replicas_seen"])
			require.Equal(t, "warn", line["level"])

			// The memory store has no replicas and refuses every durable claim itself: the claim
			// reached it.
			h.server.SetReplicas(2)
			before := store.acquires.Load()
			res := h.do(post("/v1/payments", "b", `{}`), created)
			require.Equal(t, before+1, store.acquires.Load(), "with enough replicas the claim goes to the store")
			if mode == "closed" {
				requireProblem(t, res, 503, "store-unavailable")
			}
			// Replicas unknown (the store did not answer the count): the store judges the claim.
			h.server.SetReplicas(0)
			h.server.SetReplicas(-1)
			h.do(post("/v1/payments", "c", `{}`), created)
			require.Equal(t, before+2, store.acquires.Load(), "with the replicas unknown the claim goes to the store")
		})
	}
}
