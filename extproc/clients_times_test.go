package extproc_test

import (
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A stored response carries its record's expiry; a replay carries it and the first request's
// time, as HTTP-dates.
func TestExpiryAndFirstSentHeaders(t *testing.T) {
	forEachStore(t, func(t *testing.T, newStore func(t *testing.T) testStore) {
		ts := newStore(t)
		h := newHarness(t, harnessOptions{store: ts.store, advance: ts.advance, policy: "defaults: {ttl: 1h}"})
		first := h.do(post("/v1/payments", "k", `{}`, "x-ttl", "600"), created)
		exp := first.header("x-idempotency-expires")
		require.Len(t, exp, 1)
		expires, err := http.ParseTime(exp[0])
		require.NoError(t, err)
		require.WithinDuration(t, h.clock.Now().Add(600*time.Second), expires, 2*time.Second, "the TTL the first request chose")
		require.Empty(t, first.header("x-idempotency-first-sent"), "only replays carry the first-sent time")

		replay := h.do(post("/v1/payments", "k", `{}`), created)
		require.Equal(t, []string{"true"}, replay.header(replayed))
		rec := h.record(t, "k")
		require.Equal(t, []string{rec.ExpiresAt.UTC().Format(http.TimeFormat)}, replay.header("x-idempotency-expires"), "the record's expiry")
		require.Equal(t, []string{rec.CreatedAt.UTC().Format(http.TimeFormat)}, replay.header("x-idempotency-first-sent"), "the first request's time")
		require.WithinDuration(t, rec.CreatedAt.Add(600*time.Second), rec.ExpiresAt, 2*time.Second)
		failed := h.do(post("/v1/payments", "e", `{}`), upstream{status: 500})
		require.Empty(t, failed.header("x-idempotency-expires"), "a response that is not stored has no expiry")
	})
	t.Run("turned off", func(t *testing.T) {
		h := newHarness(t, harnessOptions{policy: `defaults: {expires_header: "", first_sent_header: ""}`})
		require.Empty(t, h.do(post("/v1/payments", "k", `{}`), created).header("x-idempotency-expires"))
		replay := h.do(post("/v1/payments", "k", `{}`), created)
		require.Empty(t, replay.header("x-idempotency-expires"))
		require.Empty(t, replay.header("x-idempotency-first-sent"))
	})
}
