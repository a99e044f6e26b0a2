package extproc_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

// These tests hold the processor to what driving its gRPC side with hostile and faulty input
// found it did not do: a claim's JSON type is part of the caller's scope, a key is bound to the
// route it was first used on, a completion the store fails to write is retried rather than let
// the request run again, and what a caller sends cannot grow the process without bound.

// A JWT claim's JSON type is part of its scope value: "uid": 1 and "uid": "1" are two callers,
// and neither ever gets the other's stored response, on either store. (A custom claim: jwt_authn
// refuses a token whose sub is not a string.)
func TestTypedClaimsNeverShareARecord(t *testing.T) {
	pairs := []struct {
		name string
		a, b any
	}{
		{"number and string", float64(1), "1"},
		{"bool and string", true, "true"},
		{"list and its JSON text", []any{"a", "b"}, `["a","b"]`},
		{"object and its JSON text", map[string]any{"x": "y"}, `{"x":"y"}`},
		{"null and string", nil, "null"},
		{"number and bool", float64(1), true},
	}
	forEachStore(t, func(t *testing.T, newStore func(t *testing.T) testStore) {
		ts := newStore(t)
		h := newHarness(t, harnessOptions{store: ts.store, advance: ts.advance, policy: "defaults: {scope: [{jwt_claim: uid}]}"})
		for i, p := range pairs {
			key := fmt.Sprintf("typed-%d", i)
			a := map[string]map[string]any{"provider": {"uid": p.a}}
			b := map[string]map[string]any{"provider": {"uid": p.b}}
			forA := upstream{status: 201, headers: []string{"content-type", "application/json"}, body: []byte(`{"for":"a"}`)}
			forB := upstream{status: 201, headers: []string{"content-type", "application/json"}, body: []byte(`{"for":"b"}`)}
			require.True(t, h.do(withJWT(post("/v1/payments", key, `{}`), a), forA).executed, p.name)
			res := h.do(withJWT(post("/v1/payments", key, `{}`), b), forB)
			require.True(t, res.executed, "%s: uid %#v is another caller than uid %#v", p.name, p.b, p.a)
			require.Equal(t, forB.body, res.body)
			res = h.do(withJWT(post("/v1/payments", key, `{}`), a), forA)
			require.Equal(t, []string{"true"}, res.header(replayed), p.name)
			require.Equal(t, forA.body, res.body, "%s: each caller gets its own response", p.name)
			require.Equal(t, 2, h.executions(key))
		}
	})
}

// String claims (sub, iss: the usual ones) keep the record keys they had before claim types were
// hashed, so a retry across an upgrade still finds its record. The hashes below are what the
// release before typed claims computed for these requests; a number claim's key changed.
func TestStringClaimRecordsKeepTheirKeys(t *testing.T) {
	p, err := policy.Parse([]byte("defaults: {scope: [{jwt_claim: sub}, {jwt_claim: tenant}]}"))
	require.NoError(t, err)
	for _, c := range []struct {
		claims map[string]any
		want   string
	}{
		{map[string]any{"sub": "alice"}, "6e440d5ff8e17ae61c0854ec9fb7b3187e3505410d0d4aa0c26f508e50794e8e"},
		{map[string]any{"sub": "alice", "tenant": ""}, "4a45272315de691ea5d90478a2c773b1d2db5503298407e326649f79183b0a56"},
		{map[string]any{"sub": "1"}, "5c91f4bb2a203bcd4013a0f101ac73feb26bad29bb014b8e8a384469a1631bdb"},
	} {
		_, got, err := extproc.KeyHash(p, extproc.KeyRequest{Path: "/v1/payments", Key: "k", Claims: c.claims}, nil)
		require.NoError(t, err)
		require.Equal(t, c.want, got, "%v", c.claims)
	}
	_, number, err := extproc.KeyHash(p, extproc.KeyRequest{Path: "/v1/payments", Key: "k", Claims: map[string]any{"sub": float64(1)}}, nil)
	require.NoError(t, err)
	require.NotEqual(t, "5c91f4bb2a203bcd4013a0f101ac73feb26bad29bb014b8e8a384469a1631bdb", number, `"sub": 1 is not "sub": "1"`)
}

// A key reused on another route that shares the key_prefix is another endpoint's: 422, whatever
// the routes' fingerprints say, whether the first request completed or is still in flight.
func TestKeyReusedOnAnotherRoute(t *testing.T) {
	const twoRoutes = `
routes:
  - {name: charges, match: {path_prefix: /v1/charges}, fingerprint: [method, body]}
  - {name: refunds, match: {path_prefix: /v1/refunds}, fingerprint: [method, body]}
`
	forEachStore(t, func(t *testing.T, newStore func(t *testing.T) testStore) {
		ts := newStore(t)
		h := newHarness(t, harnessOptions{store: ts.store, advance: ts.advance, policy: twoRoutes})
		charged := upstream{status: 201, headers: []string{"content-type", "application/json"}, body: []byte(`{"charge":"ch_1"}`)}
		require.True(t, h.do(post("/v1/charges", "done", `{"amount":5}`), charged).executed)
		res := h.do(post("/v1/refunds", "done", `{"amount":5}`), created)
		requireProblem(t, res, 422, "idempotency-key-reused")
		require.Equal(t, []string{"true"}, h.do(post("/v1/charges", "done", `{"amount":5}`), charged).header(replayed), "its own route still replays")

		first := h.open()
		defer first.end()
		first.send(requestHeaders(post("/v1/charges", "running", `{"amount":5}`)))
		first.send(requestBody([]byte(`{"amount":5}`)))
		requireProblem(t, h.do(post("/v1/refunds", "running", `{"amount":5}`), created), 422, "idempotency-key-reused")
		requireProblem(t, h.do(post("/v1/charges", "running", `{"amount":5}`), created), 409, "request-in-progress")
	})
}

// failingCompletions is a store whose Complete fails (with err) while failing is set; every other
// call works. It keeps the responses it was given.
type failingCompletions struct {
	cache.Store
	failing atomic.Bool
	err     error
	calls   atomic.Int32

	mu        sync.Mutex
	responses []cache.Response
}

func (f *failingCompletions) Complete(ctx context.Context, l cache.Lease, r cache.Response) error {
	f.calls.Add(1)
	f.mu.Lock()
	f.responses = append(f.responses, r)
	f.mu.Unlock()
	if f.failing.Load() {
		return f.err
	}
	return f.Store.Complete(ctx, l, r)
}

// newFailingCompletions returns a harness on a memory store, on the harness's fake clock, whose
// completions fail with err.
func newFailingCompletions(t *testing.T, policy string, err error) (*harness, *failingCompletions) {
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	m, merr := cache.NewMemory(cache.MemoryOptions{Clock: clk})
	require.NoError(t, merr)
	store := &failingCompletions{Store: m, err: err}
	return newHarness(t, harnessOptions{store: store, clock: clk, policy: policy}), store
}

// runFailingCompletion runs one request whose completion the store refuses.
func runFailingCompletion(t *testing.T, h *harness, store *failingCompletions, key string) {
	t.Helper()
	s := h.open()
	s.send(requestHeaders(post("/v1/payments", key, `{}`)))
	s.send(requestBody([]byte(`{}`)))
	s.send(responseHeaders(created))
	store.failing.Store(true)
	require.NotNil(t, s.send(responseBody(created.body, true)).GetResponseBody(), "the client still gets the upstream response")
	s.end()
	h.waitIdle(t)
}

// requireRetrying waits until the one retried completion has armed its lease renewal and its
// first wait on the harness clock. Its goroutine starts after the stream's handler returns: a
// test that moves the clock before then lets the lease lapse unrenewed on the fake clock.
func requireRetrying(t *testing.T, h *harness) {
	t.Helper()
	require.Eventually(t, func() bool { return h.clock.Pending() == 2 }, 10*time.Second, time.Millisecond,
		"the retry's renewal and first wait are on the clock")
}

// A completion the store fails to write (a stall, a timeout, a full Redis) is retried in the
// background with its lease kept renewed: duplicates get 409 however long it takes, never a
// second execution, and then the replay.
func TestCompletionIsRetriedNotRunAgain(t *testing.T) {
	h, store := newFailingCompletions(t, "defaults: {lock_ttl: 3s}", fmt.Errorf("redis complete: %w", cache.ErrFull))
	runFailingCompletion(t, h, store, "k")
	requireRetrying(t, h)
	require.Equal(t, 1.0, h.counter("idempotency_completions_pending"))
	require.Equal(t, 1.0, h.counter("idempotency_store_errors_total", "op", "complete", "kind", "oom"), "a store refusing writes is visible in metrics")
	require.Equal(t, 1.0, h.counter("idempotency_requests_total", "route", "default", "outcome", "store_error"))

	// Well past lock_ttl the lease is still held: the retries renew it.
	for range 10 {
		h.advance(time.Second)
		requireProblem(t, h.do(post("/v1/payments", "k", `{}`), created), 409, "request-in-progress")
	}
	require.Greater(t, h.counter("idempotency_completion_retries_total", "result", "failed"), 1.0, "retried with backoff")

	store.failing.Store(false)
	require.Eventually(t, func() bool {
		h.advance(time.Second)
		return h.counter("idempotency_completions_pending") == 0
	}, 10*time.Second, 10*time.Millisecond, "the retry lands once the store takes writes again")
	require.Equal(t, 1.0, h.counter("idempotency_completion_retries_total", "result", "landed"))
	store.mu.Lock()
	first, last := store.responses[0], store.responses[len(store.responses)-1]
	store.mu.Unlock()
	require.Equal(t, "content-type", first.Headers[0].Name)
	require.Equal(t, "content-type", last.Headers[0].Name)
	require.NotSame(t, &first.Headers[0].Value[0], &last.Headers[0].Value[0],
		"the retries write copies of the headers, not the memory of Envoy's message")
	res := h.do(post("/v1/payments", "k", `{}`), created)
	require.Equal(t, []string{"true"}, res.header(replayed))
	require.Equal(t, created.body, res.body)
	require.False(t, res.executed, "the request ran once")
	require.Contains(t, h.logs.String(), "completion written after retrying")
}

// The outcome-unknown record (unknown_outcome: record) is retried as a completion is.
func TestOutcomeUnknownRecordIsRetried(t *testing.T) {
	h, store := newFailingCompletions(t, "defaults: {lock_ttl: 3s, unknown_outcome: record}", context.DeadlineExceeded)
	store.failing.Store(true)
	s := h.open()
	s.send(requestHeaders(post("/v1/payments", "k", `{}`)))
	s.send(requestBody([]byte(`{}`)))
	s.end()
	h.waitIdle(t)
	requireRetrying(t, h)
	require.Equal(t, 1.0, h.counter("idempotency_completions_pending"))
	require.Equal(t, 1.0, h.counter("idempotency_store_errors_total", "op", "complete", "kind", "timeout"))
	h.advance(5 * time.Second)
	requireProblem(t, h.do(post("/v1/payments", "k", `{}`), created), 409, "request-in-progress")
	store.failing.Store(false)
	require.Eventually(t, func() bool {
		h.advance(time.Second)
		return h.counter("idempotency_completions_pending") == 0
	}, 10*time.Second, 10*time.Millisecond)
	requireProblem(t, h.do(post("/v1/payments", "k", `{}`), created), 409, "outcome-unknown")
}

// A retried completion is given up, and counted, when its record would have expired, and when
// the process shuts down first; a lost lease ends its retries.
func TestCompletionRetriesEnd(t *testing.T) {
	t.Run("the record's TTL passes", func(t *testing.T) {
		h, store := newFailingCompletions(t, "defaults: {lock_ttl: 1s, ttl: 4s, max_ttl: 4s}", errors.New("store is down"))
		runFailingCompletion(t, h, store, "k")
		require.Eventually(t, func() bool {
			h.advance(time.Second)
			// The gauge comes down once the retries' goroutine has returned, after the count.
			return h.counter("idempotency_completions_abandoned_total", "reason", "expired") == 1 &&
				h.counter("idempotency_completions_pending") == 0
		}, 10*time.Second, 10*time.Millisecond)
	})
	t.Run("shutdown", func(t *testing.T) {
		h, store := newFailingCompletions(t, "", errors.New("store is down"))
		runFailingCompletion(t, h, store, "k")
		ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
		defer cancel()
		require.ErrorIs(t, h.server.Shutdown(ctx), context.DeadlineExceeded)
		require.Equal(t, 1.0, h.counter("idempotency_completions_abandoned_total", "reason", "shutdown"))
		require.Zero(t, h.counter("idempotency_completions_pending"))
	})
	t.Run("shutdown waits for a retry that lands", func(t *testing.T) {
		h, store := newFailingCompletions(t, "", errors.New("store is down"))
		runFailingCompletion(t, h, store, "k")
		store.failing.Store(false)
		done := make(chan error, 1)
		go func() { done <- h.server.Shutdown(t.Context()) }()
		require.Eventually(t, func() bool {
			h.advance(100 * time.Millisecond)
			select {
			case err := <-done:
				require.NoError(t, err)
				return true
			default:
				return false
			}
		}, 10*time.Second, 10*time.Millisecond)
		require.Equal(t, 1.0, h.counter("idempotency_completion_retries_total", "result", "landed"))
	})
	t.Run("the lease is purged", func(t *testing.T) {
		h, store := newFailingCompletions(t, "", errors.New("store is down"))
		runFailingCompletion(t, h, store, "k")
		require.NoError(t, store.Purge(t.Context(), extproc.StoredKey(h.policy, "/v1/payments", "k")))
		store.failing.Store(false)
		require.Eventually(t, func() bool {
			h.advance(time.Second)
			return h.counter("idempotency_completion_retries_total", "result", "lease_lost") == 1
		}, 10*time.Second, 10*time.Millisecond)
	})
}

// The retries keep a bounded number of completions and a bounded number of body bytes: past the
// bytes a completion is kept without its body (duplicates get 409 response-not-replayable, and
// the request still ran once); past the count it is abandoned and counted.
func TestCompletionRetriesAreBounded(t *testing.T) {
	h, store := newFailingCompletions(t, "", errors.New("store is down"))
	extproc.SetCompletionLimits(h.server, 2, len(created.body))
	for _, k := range []string{"a", "b", "c"} {
		runFailingCompletion(t, h, store, k)
	}
	require.Equal(t, 2.0, h.counter("idempotency_completions_pending"))
	require.Equal(t, 1.0, h.counter("idempotency_completions_abandoned_total", "reason", "capacity"))
	store.failing.Store(false)
	require.Eventually(t, func() bool {
		h.advance(time.Second)
		return h.counter("idempotency_completions_pending") == 0
	}, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, []string{"true"}, h.do(post("/v1/payments", "a", `{}`), created).header(replayed), "within the bytes, the body is kept")
	requireProblem(t, h.do(post("/v1/payments", "b", `{}`), created), 409, "response-not-replayable")
}

// Unknown x-idempotency-route names are remembered in a bounded set, logged once per name while
// remembered, and cut in logs: a caller sending endless distinct names, or one huge one, grows
// neither the process nor its log lines.
func TestUnknownRouteNamesAreBounded(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: meshPolicy})
	n := 3 * extproc.MaxUnknownRoutes
	for i := range n {
		res := h.do(named(post("/v1/payments", "k", `{}`), fmt.Sprintf("no-such-route-%d", i)), created)
		require.Equal(t, 500, res.status)
		require.LessOrEqual(t, extproc.UnknownRoutesRemembered(h.server), extproc.MaxUnknownRoutes)
	}
	require.Equal(t, float64(n), h.counter("idempotency_envoy_misconfig_total", "kind", "unknown_route"), "every one is counted")

	h.logs.Reset()
	long := strings.Repeat("r", 64<<10)
	requireProblem(t, h.do(named(post("/v1/payments", "k", `{}`), long), created), 500, "unknown-idempotency-route")
	logs := h.logs.String()
	require.Contains(t, logs, `"named_route":"`+strings.Repeat("r", 256)+`"`)
	require.Less(t, len(logs), 4<<10, "a 64 KiB name makes no 64 KiB log line: %d bytes", len(logs))
}

// A request id is logged cut to 128 bytes.
func TestRequestIDIsCutInLogs(t *testing.T) {
	h := newHarness(t, harnessOptions{})
	s := h.open()
	m := requestHeaders(post("/v1/payments", "k", ""))
	for _, hv := range m.GetRequestHeaders().GetHeaders().GetHeaders() {
		if hv.GetKey() == "x-request-id" {
			hv.RawValue = []byte(strings.Repeat("i", 1<<20))
		}
	}
	s.send(m)
	s.send(responseHeaders(upstream{status: 204}))
	s.end()
	h.waitIdle(t)
	logs := h.logs.String()
	require.Contains(t, logs, `"request_id":"`+strings.Repeat("i", 128)+`"`)
	require.Less(t, len(logs), 8<<10)
}

// A FULL_DUPLEX_STREAMED request's body is Envoy's again once the processor has streamed it
// back: the stream does not keep it for the whole upstream call.
func TestFullDuplexBodyReleasedOnceStreamedBack(t *testing.T) {
	h := newHarness(t, harnessOptions{})
	const streams, size = 32, 1 << 20
	body := bigBody(size)
	heap := func() uint64 {
		runtime.GC()
		runtime.GC() // the second empties sync.Pool's victim caches (gRPC's buffers)
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	before := heap()
	var open []*pipelined
	for i := range streams {
		s := h.openPipelined(5 * time.Second)
		open = append(open, s)
		s.put(withBodyModes(requestHeaders(post("/v1/payments", fmt.Sprint("fd-", i), body)), modeDuplex, modeDuplex))
		s.put(bodyMsg([]byte(body), true))
		require.NotNil(t, s.next().GetRequestHeaders())
		for {
			if s.next().GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetEndOfStream() {
				break
			}
		}
	}
	grown := int64(heap()) - int64(before)
	t.Logf("%d streams running after a %d-byte body each: heap grew %d bytes", streams, size, grown)
	// The bodies kept would add streams*size on top of what gRPC's own buffers hold here (up to
	// about 16 MiB on a loaded machine): the bound sits between the two.
	require.Less(t, grown, int64(streams*size*3/4), "the streamed-back bodies are not kept")
	for _, s := range open {
		s.end()
	}
}
