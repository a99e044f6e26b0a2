package extproc_test

import (
	"bytes"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
)

// What clients and operators see: shadow rollout, waiting instead of 409, expiry headers, the
// API's own error format, and routes that keep no body.

// Shadow mode claims and records as enforcement does, but every request reaches the upstream and
// every response reaches the client untouched; the counters say what enforcement would have done.
func TestShadowMode(t *testing.T) {
	forEachStore(t, func(t *testing.T, newStore func(t *testing.T) testStore) {
		ts := newStore(t)
		h := newHarness(t, harnessOptions{store: ts.store, advance: ts.advance, policy: `
routes: [{name: pay, match: {path_prefix: /v1/payments}, mode: shadow, missing_key: required}]`})
		up := upstream{status: 201, headers: []string{"content-type", "application/json", "set-cookie", "a=1"}, body: []byte(`{"id":1}`)}

		// Racing duplicates: every one reaches the upstream.
		const racers = 8
		first := h.open()
		first.send(requestHeaders(post("/v1/payments", "k", `{}`)))
		first.send(requestBody([]byte(`{}`)))
		h.count(post("/v1/payments", "k", `{}`))
		var wg sync.WaitGroup
		results := make([]result, racers)
		for i := range racers {
			wg.Go(func() { results[i] = h.do(post("/v1/payments", "k", `{}`), up) })
		}
		wg.Wait()
		for _, res := range results {
			require.True(t, res.executed, "in shadow mode nothing is held back")
			requireUntouched(t, up, res) // the response is the upstream's
			require.Empty(t, res.header(replayed), "no replay header")
			require.Equal(t, up.body, res.body)
		}
		resp := first.send(responseHeaders(up))
		require.Nil(t, resp.GetResponseHeaders().GetResponse().GetHeaderMutation(), "untouched")
		first.send(responseBody(up.body, true))
		first.end()
		h.waitIdle(t)
		require.Equal(t, cache.Completed, h.record(t, "k").State, "recorded as under enforce")

		dup := h.do(post("/v1/payments", "k", `{}`), up)
		require.True(t, dup.executed)
		requireUntouched(t, up, dup)
		other := h.do(post("/v1/payments", "k", `{"different":1}`), up)
		require.True(t, other.executed)
		noKey := h.do(post("/v1/payments", "", `{}`), up)
		require.True(t, noKey.executed)
		requireUntouched(t, up, noKey)
		h.waitIdle(t)

		require.Equal(t, 1.0, h.counter("idempotency_shadow_total", "route", "pay", "would", "executed"))
		require.Equal(t, float64(racers), h.counter("idempotency_shadow_total", "route", "pay", "would", "in_progress"))
		require.Equal(t, 1.0, h.counter("idempotency_shadow_total", "route", "pay", "would", "replayed"))
		require.Equal(t, 1.0, h.counter("idempotency_shadow_total", "route", "pay", "would", "mismatch"))
		require.Equal(t, 1.0, h.counter("idempotency_shadow_total", "route", "pay", "would", "missing_key"))
		require.Equal(t, racers+3+1, h.executions("k")+h.executions(""))
		require.Contains(t, h.logs.String(), `"would":"in_progress"`)
	})
}

// A duplicate that finds the key in flight waits up to in_flight_wait for the first to complete
// and then gets its replay; a client may ask for less with Prefer: wait=N, and gets
// Preference-Applied. Time out: 409. Waiting on another replica polls the store no faster than
// every 50 ms; on the replica that runs the first, it polls that replica's hold, not the store.
func TestInFlightWait(t *testing.T) {
	const pol = "defaults: {in_flight_wait: 2s, lock_ttl: 30s}"
	h := newHarness(t, harnessOptions{policy: pol})
	other := newHarness(t, harnessOptions{policy: pol, store: h.store, clock: h.clock})
	first := h.open()
	first.send(requestHeaders(post("/v1/payments", "k", `{}`)))
	first.send(requestBody([]byte(`{}`)))

	base := h.clock.Pending() // the first request's renewal
	waiting := other.open()
	waiting.send(requestHeaders(post("/v1/payments", "k", `{}`, "prefer", "respond-async, wait=5")))
	require.NoError(t, waiting.s.Send(requestBody([]byte(`{}`))))
	// The duplicate polls on the harness clock: advance it in steps, each once it sleeps.
	for range 20 {
		h.advanceWhenSleeping(t, base, 50*time.Millisecond) // 1 s in all, within the wait
	}
	requireAsleep(t, h, base)
	first.send(responseHeaders(created))
	first.send(responseBody(created.body, true))
	h.advanceWhenSleeping(t, 0, 50*time.Millisecond)
	resp, err := waiting.s.Recv()
	require.NoError(t, err)
	res, ok := immediateAnswer(resp)
	require.True(t, ok)
	require.Equal(t, created.body, res.body, "the replay, once the first completed")
	require.Equal(t, []string{"true"}, res.header(replayed))
	require.Equal(t, []string{"wait=2"}, res.header("preference-applied"), "capped by in_flight_wait")
	calls := other.counter("idempotency_wait_store_calls_total", "route", "default")
	require.Equal(t, 21.0, calls, "one store call per 50 ms: 1.05 s of waiting")
	require.Zero(t, h.counter("idempotency_wait_store_calls_total", "route", "default"))
	first.end()
	waiting.end()

	// Time out: 409 as before.
	slow := h.open()
	slow.send(requestHeaders(post("/v1/payments", "slow", `{}`)))
	slow.send(requestBody([]byte(`{}`)))
	base = h.clock.Pending()
	late := h.open()
	late.send(requestHeaders(post("/v1/payments", "slow", `{}`, "prefer", "wait=1")))
	require.NoError(t, late.s.Send(requestBody([]byte(`{}`))))
	for range 10 {
		h.advanceWhenSleeping(t, base, 100*time.Millisecond)
	}
	resp, err = late.s.Recv()
	require.NoError(t, err)
	res, _ = immediateAnswer(resp)
	requireProblem(t, res, 409, "request-in-progress")
	slow.end()
	late.end()
	h.waitIdle(t)
}

// Preference-Applied counts whole seconds (RFC 7240): a sub-second in_flight_wait is reported
// rounded up, never above what the client asked.
func TestPreferenceAppliedRoundsUp(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: "defaults: {in_flight_wait: 500ms, lock_ttl: 30s}"})
	first := h.open()
	first.send(requestHeaders(post("/v1/payments", "k", `{}`)))
	first.send(requestBody([]byte(`{}`)))
	base := h.clock.Pending()
	waiting := h.open()
	waiting.send(requestHeaders(post("/v1/payments", "k", `{}`, "prefer", "wait=3")))
	require.NoError(t, waiting.s.Send(requestBody([]byte(`{}`))))
	h.advanceWhenSleeping(t, base, 50*time.Millisecond)
	requireAsleep(t, h, base)
	first.send(responseHeaders(created))
	first.send(responseBody(created.body, true))
	h.advanceWhenSleeping(t, 0, 50*time.Millisecond)
	resp, err := waiting.s.Recv()
	require.NoError(t, err)
	res, ok := immediateAnswer(resp)
	require.True(t, ok)
	require.Equal(t, []string{"true"}, res.header(replayed))
	require.Equal(t, []string{"wait=1"}, res.header("preference-applied"))
	first.end()
	waiting.end()
}

// advanceWhenSleeping advances the harness clock by d once more than base timers are pending: a
// waiting duplicate is asleep until its next poll.
func (h *harness) advanceWhenSleeping(t *testing.T, base int, d time.Duration) {
	t.Helper()
	requireAsleep(t, h, base)
	h.clock.Advance(d)
}

// requireAsleep waits until a waiting duplicate sleeps on the harness clock: more timers than
// base. Completing the first request before the duplicate's poll that follows an advance has
// gone back to sleep would let that poll find the replay at once, one poll early.
func requireAsleep(t *testing.T, h *harness, base int) {
	t.Helper()
	require.Eventually(t, func() bool { return h.clock.Pending() > base }, 5*time.Second, time.Millisecond)
}

// Without in_flight_wait a duplicate is answered at once, whatever it prefers.
func TestNoWaitByDefault(t *testing.T) {
	h := newHarness(t, harnessOptions{})
	first := h.open()
	first.send(requestHeaders(post("/v1/payments", "k", `{}`)))
	first.send(requestBody([]byte(`{}`)))
	res := h.do(post("/v1/payments", "k", `{}`, "prefer", "wait=10"), created)
	requireProblem(t, res, 409, "request-in-progress")
	require.Zero(t, h.counter("idempotency_wait_store_calls_total", "route", "default"))
}

// replay_header_fresh: false writes the replay header on replays only (Lerian's Matcher, TED and
// Pix Indirect), on problems neither.
func TestReplayHeaderOnReplaysOnly(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: "defaults: {replay_header_fresh: false, missing_key: required}"})
	require.Empty(t, h.do(post("/v1/payments", "k", `{}`), created).header(replayed))
	require.Equal(t, []string{"true"}, h.do(post("/v1/payments", "k", `{}`), created).header(replayed))
	require.Empty(t, h.do(post("/v1/payments", "", `{}`), created).header(replayed))
	require.Empty(t, h.do(post("/v1/payments", "k", `{"x":1}`), created).header(replayed))
}

// problems answers in the format the API already speaks: Midaz's 0084 for an in-flight duplicate,
// and a Stripe-like error for a reused key.
func TestProblemTemplates(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: `
problems:
  request-in-progress:
    status: 409
    content_type: application/json
    body: '{"code":"0084","title":"Duplicate Idempotency Key","message":{{json .Detail}}}'
routes:
  - name: stripe
    match: {path_prefix: /v1/charges}
    problems:
      idempotency-key-reused:
        status: 400
        body: '{"error":{"type":"idempotency_error","code":"{{.Code}}","message":{{json .Detail}}}}'
`})
	running := h.open()
	running.send(requestHeaders(post("/v1/payments", "k", `{}`)))
	running.send(requestBody([]byte(`{}`)))
	res := h.do(post("/v1/payments", "k", `{}`), created)
	require.Equal(t, 409, res.status)
	require.Equal(t, []string{"application/json"}, res.header("content-type"))
	require.Equal(t, []string{"1"}, res.header("retry-after"))
	var midaz map[string]string
	require.NoError(t, json.Unmarshal(res.body, &midaz))
	require.Equal(t, "0084", midaz["code"])
	require.Equal(t, "Duplicate Idempotency Key", midaz["title"])
	require.NotEmpty(t, midaz["message"])
	running.end()

	h.do(post("/v1/charges", "c", `{}`), created)
	res = h.do(post("/v1/charges", "c", `{"amount":2}`), created)
	require.Equal(t, 400, res.status)
	require.Equal(t, []string{"application/problem+json"}, res.header("content-type"))
	require.True(t, bytes.HasPrefix(res.body, []byte(`{"error":{"type":"idempotency_error","code":"idempotency-key-reused"`)), "%s", res.body)
	// The stripe route keeps the top-level entries for the codes it does not set.
	running = h.open()
	running.send(requestHeaders(post("/v1/charges", "r", `{}`)))
	running.send(requestBody([]byte(`{}`)))
	res = h.do(post("/v1/charges", "r", `{}`), created)
	require.Equal(t, 409, res.status)
	require.Contains(t, string(res.body), `"code":"0084"`)
	running.end()
}

// store_body: false keeps status and headers only: the request still runs at most once, and a
// duplicate gets 409 response-not-replayable; the body phase is turned off.
func TestStoreBodyFalse(t *testing.T) {
	forEachStore(t, func(t *testing.T, newStore func(t *testing.T) testStore) {
		ts := newStore(t)
		h := newHarness(t, harnessOptions{store: ts.store, advance: ts.advance, policy: "routes: [{name: secrets, match: {path_prefix: /v1/keys}, store_body: false}]"})
		secret := upstream{status: 201, headers: []string{"content-type", "application/json"}, body: []byte(`{"api_key":"sk_live_1"}`)}
		first := h.do(post("/v1/keys", "k", `{}`), secret)
		require.Equal(t, secret.body, first.body)
		require.Equal(t, []string{"request_headers", "request_body", "response_headers"}, first.received, "the body never goes to the processor")
		rec := h.record(t, "k")
		require.True(t, rec.Response.BodyOmitted)
		require.Empty(t, rec.Response.Body)
		require.Equal(t, 201, rec.Response.Status)
		require.Equal(t, "content-type", rec.Response.Headers[0].Name)
		requireProblem(t, h.do(post("/v1/keys", "k", `{}`), secret), 409, "response-not-replayable")
		require.Equal(t, 1, h.executions("k"))
	})
}
