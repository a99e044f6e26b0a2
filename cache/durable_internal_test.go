package cache

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// replicaHook answers each WAIT as a master would whose replicas acknowledged acked(n) of them,
// n counting the WAITs from 1, and records every round trip's commands. While hold is set it
// holds round trips until release is closed, so that calls queue behind them, and counts the
// claims (SET) it holds.
type replicaHook struct {
	passHook
	acked   func(n int) int64
	hold    atomic.Bool
	held    atomic.Int64
	release chan struct{}

	mu    sync.Mutex
	trips [][][]string // each round trip's commands, each as its arguments
	waits int
}

func (h *replicaHook) record(cmds []redis.Cmder) {
	var trip [][]string
	for _, c := range cmds {
		if c.Name() == "hello" || c.Name() == "client" {
			continue // a new connection's set-up
		}
		var args []string
		for _, a := range c.Args() {
			args = append(args, fmt.Sprint(a))
		}
		trip = append(trip, args)
	}
	h.mu.Lock()
	h.trips = append(h.trips, trip)
	h.mu.Unlock()
}

func (h *replicaHook) answer(cmds []redis.Cmder) {
	for _, c := range cmds {
		if cmd, ok := c.(*redis.Cmd); ok && c.Name() == "wait" && c.Err() == nil {
			h.mu.Lock()
			h.waits++
			n := h.waits
			h.mu.Unlock()
			cmd.SetVal(h.acked(n))
		}
	}
}

func (h *replicaHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.hold.Load() {
			h.held.Add(1)
			<-h.release
		}
		h.record([]redis.Cmder{cmd})
		return next(ctx, cmd)
	}
}

func (h *replicaHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if h.hold.Load() {
			for _, c := range cmds {
				if c.Name() == "set" {
					h.held.Add(1) // a claim
				}
			}
			<-h.release
		}
		h.record(cmds)
		err := next(ctx, cmds)
		h.answer(cmds)
		return err
	}
}

// roundTrips returns the round trips recorded so far and forgets them.
func (h *replicaHook) roundTrips() [][][]string {
	h.mu.Lock()
	defer h.mu.Unlock()
	trips := h.trips
	h.trips = nil
	return trips
}

// durableClaim waits for replicas replicas for at most wait.
func durableClaim(replicas int, wait time.Duration) Claim {
	return Claim{LockTTL: time.Hour, TTL: time.Hour, Replicas: replicas, ReplicaTimeout: wait}
}

// Concurrent durable claims share round trips, each ending with one WAIT for the most replicas
// any of its claims asks, within the shortest wait any allows, and each claim is judged by the
// count that WAIT returns. Claims that are not durable never share a round trip with a WAIT.
func TestDurableBatchesEndWithOneWait(t *testing.T) {
	hook := &replicaHook{acked: func(int) int64 { return 1 }, release: make(chan struct{})}
	s, mr := hookedRedis(t, hook, 10*time.Second)
	hook.hold.Store(true)
	const n = 60
	// Claim i is durable when i%3 > 0: of 1 replica (i%3 == 1) or 2, which the master's one
	// replica cannot confirm, within 100 ms to 400 ms.
	replicas := func(i int) int { return i % 3 }
	wait := func(i int) time.Duration { return time.Duration(100+100*(i%4)) * time.Millisecond }
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			_, _, errs[i] = s.Acquire(t.Context(), "k"+strconv.Itoa(i), durableClaim(replicas(i), wait(i)))
		})
	}
	require.Eventually(t, func() bool {
		queued := 0
		for _, p := range []*pipeline{s.send.(*pipeline), s.durable.(*pipeline)} {
			p.mu.Lock()
			queued += len(p.queue)
			p.mu.Unlock()
		}
		return int(hook.held.Load())+queued == n
	}, 10*time.Second, time.Millisecond)
	hook.hold.Store(false)
	close(hook.release)
	wg.Wait()

	for i := range n {
		key := "k" + strconv.Itoa(i)
		if replicas(i) == 2 {
			require.ErrorIs(t, errs[i], ErrUnconfirmed, key)
			require.False(t, mr.Exists(key), "%s: withdrawn", key)
			continue
		}
		require.NoError(t, errs[i], key)
		require.True(t, mr.Exists(key), key)
	}

	shared := 0
	for _, trip := range hook.roundTrips() {
		var claims []int
		for _, args := range trip {
			if args[0] == "set" {
				i, err := strconv.Atoi(strings.TrimPrefix(args[1], "k"))
				require.NoError(t, err)
				claims = append(claims, i)
			}
		}
		if len(claims) == 0 {
			continue // a withdrawal
		}
		last := trip[len(trip)-1]
		if replicas(claims[0]) == 0 {
			for _, args := range trip {
				require.NotEqual(t, "wait", args[0], "a round trip of claims that are not durable waits for nothing: %v", trip)
			}
			continue
		}
		most, shortest := 0, time.Hour
		for _, i := range claims {
			require.Positive(t, replicas(i), "a claim that is not durable shares no round trip with durable ones: %v", trip)
			most, shortest = max(most, replicas(i)), min(shortest, wait(i))
		}
		require.Equal(t, []string{"wait", strconv.Itoa(most), strconv.FormatInt(shortest.Milliseconds(), 10)}, last, "one WAIT, last: %v", trip)
		require.Len(t, slices.DeleteFunc(slices.Clone(trip), func(a []string) bool { return a[0] != "wait" }), 1, "one WAIT: %v", trip)
		if len(claims) > 1 {
			shared++
		}
	}
	require.Positive(t, shared, "durable claims shared round trips")
}

// A script a node refuses (NOSCRIPT) is sent again in a second round trip, which ends with a
// WAIT of its own: that WAIT, on the connection that carried it again, judges it.
func TestDurableScriptSentAgainIsJudgedByItsOwnWait(t *testing.T) {
	// Once flushed is set, the first WAIT finds no replica and any later one finds it.
	var flushed atomic.Bool
	hook := &replicaHook{acked: func(n int) int64 {
		if !flushed.Load() {
			return 1
		}
		return min(int64(n-1), 1)
	}}
	s, _ := hookedRedis(t, hook, 10*time.Second)
	ctx := t.Context()
	l, _, err := s.Acquire(ctx, "k", durableClaim(1, time.Second))
	require.NoError(t, err)
	require.NoError(t, s.client.ScriptFlush(ctx).Err())
	hook.mu.Lock()
	hook.waits = 0
	hook.mu.Unlock()
	hook.roundTrips()
	flushed.Store(true)
	require.NoError(t, s.Complete(ctx, l, Response{Status: 200}))
	var ends []string
	for _, trip := range hook.roundTrips() {
		if trip[0][0] == "evalsha" || trip[0][0] == "eval" {
			ends = append(ends, trip[len(trip)-1][0])
		}
	}
	require.Equal(t, []string{"wait", "wait"}, ends, "the completion, refused, then sent again: each with its WAIT")
}

// retryHook, while on, runs each round trip twice, as go-redis does when the first reply is lost
// after the server ran it: the caller sees the second reply.
type retryHook struct {
	passHook
	on atomic.Bool
}

func (h *retryHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if h.on.Load() {
			_ = next(ctx, cmds)
		}
		return next(ctx, cmds)
	}
}

// A durable claim whose round trip was sent again finds its own record, written by an attempt
// whose WAIT it never saw: the WAIT it does see, after a SET that wrote nothing, says nothing
// of that write. The claim is withdrawn. A completion sent again writes again (the completed
// record's expiry, unchanged), so that its WAIT does confirm the record.
func TestDurableCallsSentAgain(t *testing.T) {
	retry := &retryHook{}
	mr := miniredis.RunT(t)
	client := redis.NewClient(&redis.Options{Addr: mr.Addr(), Protocol: 2})
	client.AddHook(retry)
	client.AddHook(&replicaHook{acked: func(int) int64 { return 1 }})
	s := NewRedis(client, RedisOptions{Timeout: 10 * time.Second})
	t.Cleanup(func() { _ = s.Close() })
	ctx := t.Context()

	retry.on.Store(true)
	_, _, err := s.Acquire(ctx, "retried", durableClaim(1, time.Second))
	require.ErrorIs(t, err, ErrUnconfirmed)
	require.False(t, mr.Exists("retried"), "withdrawn")

	retry.on.Store(false)
	l, _, err := s.Acquire(ctx, "k", durableClaim(1, time.Second))
	require.NoError(t, err)
	retry.on.Store(true)
	require.NoError(t, s.Complete(ctx, l, Response{Status: 200}))
	require.InDelta(t, time.Hour, mr.TTL("k"), float64(time.Second), "the second attempt left the expiry as the first set it")
	_, rec, err := s.Acquire(ctx, "k", durableClaim(1, time.Second))
	require.NoError(t, err)
	require.Equal(t, Completed, rec.State)
}

// waitHook hands over the reply of each round trip that carries a WAIT pause late, as replicas
// that answer late make it, and records the deadline of every round trip's context by its first
// command.
type waitHook struct {
	passHook

	mu        sync.Mutex
	pause     time.Duration
	deadlines map[string]time.Time
}

// trip records the deadline of cmds' round trip and returns how long to hold its reply.
func (h *waitHook) trip(ctx context.Context, cmds []redis.Cmder) time.Duration {
	d, _ := ctx.Deadline()
	h.mu.Lock()
	defer h.mu.Unlock()
	h.deadlines[cmds[0].Name()] = d
	if slices.ContainsFunc(cmds, func(c redis.Cmder) bool { return c.Name() == "wait" }) {
		return h.pause
	}
	return 0
}

func (h *waitHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		pause := h.trip(ctx, []redis.Cmder{cmd})
		err := next(ctx, cmd)
		time.Sleep(pause)
		return err
	}
}

func (h *waitHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		pause := h.trip(ctx, cmds)
		err := next(ctx, cmds)
		time.Sleep(pause)
		return err
	}
}

// An unconfirmed claim is withdrawn within the claim's own deadline, not a second store timeout
// from the end of its WAIT: Acquire takes no longer than the store's timeout.
func TestWithdrawalWithinTheClaimsDeadline(t *testing.T) {
	const timeout = time.Second
	hook := &waitHook{pause: 100 * time.Millisecond, deadlines: map[string]time.Time{}}
	mr := miniredis.RunT(t)
	client := redis.NewClient(&redis.Options{Addr: mr.Addr(), Protocol: 2})
	client.AddHook(hook)
	client.AddHook(&replicaHook{acked: func(int) int64 { return 0 }})
	s := NewRedis(client, RedisOptions{Timeout: timeout})
	t.Cleanup(func() { _ = s.Close() })

	start := time.Now()
	_, _, err := s.Acquire(t.Context(), "k", durableClaim(1, time.Millisecond))
	require.ErrorIs(t, err, ErrUnconfirmed)
	require.False(t, mr.Exists("k"), "withdrawn")
	hook.mu.Lock()
	claimed, withdrawn := hook.deadlines["set"], hook.deadlines["evalsha"]
	hook.mu.Unlock()
	require.False(t, claimed.IsZero() || withdrawn.IsZero(), "%v", hook.deadlines)
	require.False(t, claimed.After(start.Add(timeout)))
	require.True(t, claimed.Equal(withdrawn), "the withdrawal ends when the claim would have: %v, %v", claimed, withdrawn)

	// A WAIT whose reply comes as the claim's deadline passes leaves the withdrawal no time: it
	// goes on in the background, and the caller still learns that the claim was not confirmed.
	hook.mu.Lock()
	hook.pause = timeout + 100*time.Millisecond
	hook.mu.Unlock()
	_, _, err = s.Acquire(t.Context(), "late", durableClaim(1, time.Millisecond))
	require.ErrorIs(t, err, ErrUnconfirmed)
	require.Eventually(t, func() bool { return !mr.Exists("late") }, 10*time.Second, 10*time.Millisecond, "withdrawn in the background")
}
