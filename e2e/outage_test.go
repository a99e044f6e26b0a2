package e2e_test

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// A store outage longer than lock_ttl while a request runs: Redis stopped (SIGSTOP) 3 s with a
// lock_ttl of 1 s, so the first request's lease expires inside Redis. The replica that runs it
// answers a duplicate without the store, and re-asserts its claim as soon as Redis answers again,
// so a duplicate sent to the other replica 700 ms after Redis continued gets 409 too. The upstream
// runs once, and once the first request completes both replicas replay it.
//
// The two replicas are two processors behind two fronts, so that each duplicate goes to the
// replica it names. The figure logged is the window of the multi-replica case: from Redis'
// return to the claim being in Redis again (docs/guarantees.md#a-store-outage-longer-than-lock_ttl).
// In one case the other replica also got a duplicate during the outage, answered 503: its claim,
// sent to the stopped Redis, is applied when Redis continues, and the holder must wait it out.
func TestRedisOutageLongerThanLockTTL(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		// dupDuring: the other replica gets a duplicate while Redis is stopped.
		dupDuring bool
	}{
		{name: "a duplicate at each replica during the outage", dupDuring: true},
		{name: "nothing else during the outage"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			redisOutageLongerThanLockTTL(t, c.dupDuring)
		})
	}
}

func redisOutageLongerThanLockTTL(t *testing.T, dupDuring bool) {
	const (
		lockTTL = time.Second
		outage  = 3 * time.Second
		// The other replica's duplicate is sent this long after Redis continued.
		otherAfter = 700 * time.Millisecond
	)
	srv := redistest.Start(t, redistest.Options{})
	policy := "defaults: {lock_ttl: " + lockTTL.String() + "}"
	holder := newStack(t, stackOptions{args: redisArgs(srv), policy: policy})
	other := newStack(t, stackOptions{args: redisArgs(srv), policy: policy, upstream: holder.up.URL()})
	admin := srv.Client(t)
	ctx := context.Background()

	// The first request runs upstream for longer than the outage and the duplicates after it.
	const key = "outage-1"
	delay := outage + 5*time.Second
	first := make(chan reply, 1)
	go func() {
		r, _ := holder.try(call{key: key, headers: map[string]string{"X-Test-Delay": delay.String()}, body: `{}`})
		first <- r
	}()
	require.Eventually(t, func() bool { return holder.up.Count(key) == 1 }, 10*time.Second, 5*time.Millisecond)

	// The holder's claim, by its owner token: bytes 2 to 28 of a record (cache/redis_record.go).
	stored := mustOneKey(t, srv)
	claim, err := admin.Get(ctx, stored).Result()
	require.NoError(t, err)
	token := claim[2:28]

	srv.Pause()
	paused := time.Now()
	// While Redis is away, the replica that runs the key answers its duplicate without Redis; the
	// other can only say that the store is unavailable.
	requireProblem(t, holder.do(call{key: key, body: `{}`}), 409, "request-in-progress")
	if dupDuring {
		requireProblem(t, other.do(call{key: key, body: `{}`}), 503, "store-unavailable")
	}
	time.Sleep(outage - time.Since(paused)) // the outage itself: three lock_ttls
	srv.Resume()
	resumed := time.Now()

	// The same replica answers from what it holds, whatever Redis now says.
	requireProblem(t, holder.do(call{key: key, body: `{}`}), 409, "request-in-progress")

	// The holder's claim is back in Redis: re-asserted, since the key had expired there. (The
	// other replica's claim of the duplicate it answered 503, sent while Redis was stopped, may
	// be applied when Redis continues: its replica removes it, and the holder tries again.)
	var back time.Duration
	require.Eventually(t, func() bool {
		rec, err := admin.Get(ctx, stored).Result()
		if err == nil && len(rec) > 28 && rec[1] == 'p' && rec[2:28] == token {
			back = time.Since(resumed)
			return true
		}
		return false
	}, 10*lockTTL, time.Millisecond, "the holder re-asserts its claim once Redis answers")
	contested := strings.Contains(holder.procs[0].logs.String(), "found another owner's record")
	t.Logf("claim in Redis again %v after Redis continued (lock_ttl %v, outage %v); it first met the other replica's abandoned claim: %v",
		back.Round(time.Millisecond), lockTTL, outage, contested)
	ttl, err := admin.PTTL(ctx, stored).Result()
	require.NoError(t, err)
	require.Positive(t, ttl, "it is a lease, with an expiry")

	if wait := otherAfter - time.Since(resumed); wait > 0 {
		time.Sleep(wait)
	}
	requireProblem(t, other.do(call{key: key, body: `{}`}), 409, "request-in-progress")
	require.Equal(t, 1, holder.up.Count(key), "the upstream ran once")

	r := <-first
	require.Equal(t, 200, r.status)
	require.Equal(t, "false", r.header.Get(replayed))
	for _, s := range []*stack{holder, other} {
		r := s.do(call{key: key, body: `{}`})
		require.Equal(t, 200, r.status)
		require.Equal(t, "true", r.header.Get(replayed))
	}
	require.Equal(t, 1, holder.up.Count(key), "the upstream ran once")
	_, m := holder.procs[0].admin("/metrics")
	require.Zero(t, metric(m, `idempotency_completions_abandoned_total{reason="lease_lost"}`))
}

// mustOneKey returns the one key srv's database holds.
func mustOneKey(t *testing.T, srv *redistest.Server) string {
	t.Helper()
	keys, err := srv.Client(t).Keys(context.Background(), "*").Result()
	require.NoError(t, err)
	require.Len(t, keys, 1)
	return keys[0]
}

// A FLUSHALL while a request runs removes its record while Redis answers all along: the holder
// does not write it back (a deliberate removal stays one), a duplicate on the other replica runs
// the request again, as expected, and the holder counts its lost lease where the
// IdempotencyCompletionsAbandoned alert sees it.
func TestFlushWhileARequestRuns(t *testing.T) {
	t.Parallel()
	const lockTTL = time.Second
	srv := redistest.Start(t, redistest.Options{})
	policy := "defaults: {lock_ttl: " + lockTTL.String() + "}"
	holder := newStack(t, stackOptions{args: redisArgs(srv), policy: policy})
	other := newStack(t, stackOptions{args: redisArgs(srv), policy: policy, upstream: holder.up.URL()})
	admin := srv.Client(t)
	ctx := context.Background()
	const series = `idempotency_completions_abandoned_total{reason="lease_lost"}`
	_, before := holder.procs[0].admin("/metrics")
	require.Contains(t, before, series+" 0", "the series exists at 0 before any loss, so that increase() sees the first")

	const key = "flushed-1"
	first := make(chan reply, 1)
	go func() {
		r, _ := holder.try(call{key: key, headers: map[string]string{"X-Test-Delay": (3 * lockTTL).String()}, body: `{}`})
		first <- r
	}()
	require.Eventually(t, func() bool { return holder.up.Count(key) == 1 }, 10*time.Second, 5*time.Millisecond)
	require.NoError(t, admin.FlushAll(ctx).Err())

	r := other.do(call{key: key, body: `{}`})
	require.Equal(t, 200, r.status, "the record was removed: the other replica runs the request")
	require.Equal(t, "false", r.header.Get(replayed))
	require.Equal(t, 2, holder.up.Count(key))

	require.Equal(t, 200, (<-first).status, "the first client still gets its response")
	_, after := holder.procs[0].admin("/metrics")
	require.Equal(t, 1.0, metric(after, series), "the holder's lost lease is counted once")
	rec, err := admin.Get(ctx, mustOneKey(t, srv)).Result()
	require.NoError(t, err)
	require.Equal(t, byte('c'), rec[1], "the record is the other replica's completion, not overwritten")

	// IdempotencyCompletionsAbandoned: sum by (namespace, job, reason)
	// (increase(idempotency_completions_abandoned_total[10m])) > 0, over the two scrapes.
	expr := abandonedAlertExpr(t)
	require.Equal(t, "sum by (namespace, job, reason) (increase(idempotency_completions_abandoned_total[10m])) > 0", expr,
		"the expression this test evaluates by hand; deploy/test evaluates the chart's with PromQL")
	require.Greater(t, metric(after, series)-metric(before, series), 0.0, "the alert's increase over the two scrapes is above 0: it fires")
}

// abandonedAlertExpr returns the expression of the chart's IdempotencyCompletionsAbandoned alert.
func abandonedAlertExpr(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(repoFile(t, "deploy/helm/idempotency-extproc/files/prometheus-alerts.yaml"))
	require.NoError(t, err)
	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert string `yaml:"alert"`
				Expr  string `yaml:"expr"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	require.NoError(t, yaml.Unmarshal(b, &rules))
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			if r.Alert == "IdempotencyCompletionsAbandoned" {
				return strings.TrimSpace(r.Expr)
			}
		}
	}
	t.Fatal("the chart has no IdempotencyCompletionsAbandoned alert")
	return ""
}
