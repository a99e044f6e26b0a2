package cache

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
	"github.com/idempotency-extproc/idempotency-extproc/internal/slowlink"
)

// passHook passes everything through: the test hooks below embed it and override what they
// change.
type passHook struct{}

func (passHook) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (passHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (passHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// hookedRedis returns a Redis store on miniredis whose client runs hook, closed when the test
// ends. RESP2 keeps connection set-up (HELLO) out of the hook.
func hookedRedis(t *testing.T, hook redis.Hook, timeout time.Duration) (*Redis, *miniredis.Miniredis) {
	t.Helper()
	return hookedRedisWith(t, hook, RedisOptions{Timeout: timeout})
}

// hookedRedisWith is hookedRedis with the store's options.
func hookedRedisWith(t *testing.T, hook redis.Hook, opts RedisOptions) (*Redis, *miniredis.Miniredis) {
	t.Helper()
	mr := miniredis.RunT(t)
	client := redis.NewClient(&redis.Options{Addr: mr.Addr(), Protocol: 2})
	client.AddHook(hook)
	s := NewRedis(client, opts)
	t.Cleanup(func() { _ = s.Close() })
	return s, mr
}

// retried runs every command twice, as go-redis does when the first reply is lost after the
// server ran it; the caller sees the second reply.
type retried struct{ passHook }

func (retried) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "set" || cmd.Name() == "evalsha" {
			_ = next(ctx, cmd)
		}
		return next(ctx, cmd)
	}
}
func (retried) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		_ = next(ctx, cmds)
		return next(ctx, cmds)
	}
}

// A retried call must find the caller's own work, not a stranger's.
func TestRedisCallsAreRetrySafe(t *testing.T) {
	s, mr := hookedRedis(t, retried{}, time.Second)
	ctx := t.Context()

	l, rec, err := s.Acquire(ctx, "k", Claim{Fingerprint: []byte("fp"), LockTTL: 30 * time.Second, TTL: time.Minute})
	require.NoError(t, err)
	require.Nil(t, rec)
	require.True(t, l.Held(), "an Acquire retried by its owner must own the key")

	l2, rec, err := s.Acquire(ctx, "k", Claim{Fingerprint: []byte("fp2"), LockTTL: 30 * time.Second, TTL: time.Minute})
	require.NoError(t, err)
	require.False(t, l2.Held())
	require.Equal(t, Pending, rec.State)
	require.Equal(t, []byte("fp"), rec.Fingerprint)

	require.NoError(t, s.Renew(ctx, l, time.Minute), "a retried Renew")
	require.NoError(t, s.Complete(ctx, l, Response{Status: 200}), "a retried Complete")
	require.ErrorIs(t, s.Complete(ctx, Lease{key: "k", token: l2.token}, Response{Status: 200}), ErrLeaseLost)
	require.Equal(t, time.Minute, mr.TTL("k"))
	_, rec, err = s.Acquire(ctx, "k", Claim{LockTTL: time.Second, TTL: time.Second})
	require.NoError(t, err)
	require.Equal(t, Completed, rec.State)
	require.Equal(t, 200, rec.Response.Status)
}

// oldRedis answers SET NX GET as Redis 6.2 does.
type oldRedis struct{ passHook }

type serverError string

func (e serverError) Error() string { return string(e) }
func (serverError) RedisError()     {}

func (oldRedis) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "set" {
			err := serverError("ERR syntax error")
			cmd.SetErr(err)
			return err
		}
		return next(ctx, cmd)
	}
}

func TestRedisBefore7IsNamed(t *testing.T) {
	s, _ := hookedRedis(t, oldRedis{}, time.Second)
	_, _, err := s.Acquire(t.Context(), "k", Claim{LockTTL: time.Second, TTL: time.Second})
	require.ErrorContains(t, err, "Redis 7.0 or later")
}

func TestNewTokenFitsTheLayout(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		tok := newToken()
		require.Len(t, tok, tokenLen)
		require.False(t, seen[tok])
		seen[tok] = true
	}
}

// lostReply makes every command look as if its reply never arrived, after Redis ran it.
type lostReply struct {
	passHook
	on atomic.Bool
}

func (h *lostReply) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if h.on.Load() && err == nil {
			cmd.SetErr(context.DeadlineExceeded)
			return context.DeadlineExceeded
		}
		return err
	}
}

func TestRedisAcquireWithLostReplyFreesTheKey(t *testing.T) {
	hook := &lostReply{}
	hook.on.Store(true)
	s, mr := hookedRedis(t, hook, time.Second)

	_, _, err := s.Acquire(t.Context(), "k", Claim{LockTTL: time.Hour, TTL: time.Hour})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	hook.on.Store(false)
	require.Eventually(t, func() bool { return !mr.Exists("k") }, 5*time.Second, 10*time.Millisecond,
		"the record the failed call created must not block the key for its lease")
}

// retriedToLoading runs every SET, then answers LOADING, as go-redis reports a command whose first
// attempt ran and lost its reply and whose retry met a server still loading.
type retriedToLoading struct{ passHook }

func (retriedToLoading) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if cmd.Name() == "set" && (err == nil || errors.Is(err, redis.Nil)) {
			cmd.SetErr(serverError("LOADING Redis is loading the dataset in memory"))
			return cmd.Err()
		}
		return err
	}
}

func TestRedisAcquireRetriedToAnErrorReplyFreesTheKey(t *testing.T) {
	s, mr := hookedRedis(t, retriedToLoading{}, time.Second)
	_, _, err := s.Acquire(t.Context(), "k", Claim{LockTTL: time.Hour, TTL: time.Hour})
	require.ErrorContains(t, err, "LOADING")
	require.Eventually(t, func() bool { return !mr.Exists("k") }, 5*time.Second, 10*time.Millisecond,
		"the record the first attempt created must not block the key for its lease")
}

// pipelineCounter counts the script calls sent alone and in pipelines. While hold is set,
// every command waits for release to be closed, so that every slot stays busy and later calls
// queue; held counts the script calls waiting so.
type pipelineCounter struct {
	passHook
	single, batched, batches, held atomic.Int64
	sets                           atomic.Int64 // SET commands sent, alone or batched
	batchedCalls                   atomic.Int64 // SET and EVALSHA commands sent in pipelines
	hold                           atomic.Bool
	release                        chan struct{}
	// seen, when set, is given the context of each pipelined batch once it is let go.
	seen func(ctx context.Context)
}

func (h *pipelineCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.hold.Load() {
			h.held.Add(1)
			<-h.release
		}
		h.single.Add(1)
		if cmd.Name() == "set" {
			h.sets.Add(1)
		}
		return next(ctx, cmd)
	}
}
func (h *pipelineCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if h.hold.Load() {
			h.held.Add(int64(len(cmds)))
			<-h.release
		}
		if h.seen != nil {
			h.seen(ctx)
		}
		h.batches.Add(1)
		h.batched.Add(int64(len(cmds)))
		for _, cmd := range cmds {
			if cmd.Name() == "set" {
				h.sets.Add(1)
			}
			if cmd.Name() == "set" || cmd.Name() == "evalsha" {
				h.batchedCalls.Add(1)
			}
		}
		return next(ctx, cmds)
	}
}

// newHeldRedis returns a Redis store on miniredis whose commands the returned hook can hold.
func newHeldRedis(t *testing.T) (*Redis, *miniredis.Miniredis, *pipelineCounter) {
	hook := &pipelineCounter{release: make(chan struct{})}
	s, mr := hookedRedis(t, hook, 10*time.Second)
	return s, mr, hook
}

// busyKeys names one call per slot of the batcher: held in the hook, they keep every slot busy,
// so that the calls after them queue.
func busyKeys() []string {
	keys := make([]string, pipelineSlots)
	for i := range keys {
		keys[i] = "busy" + strconv.Itoa(i)
	}
	return keys
}

// waitAllWaiting waits until every one of n calls is either held in the hook or queued.
func waitAllWaiting(t *testing.T, s *Redis, hook *pipelineCounter, n int) int {
	t.Helper()
	var queued int
	require.Eventually(t, func() bool {
		s.send.(*pipeline).mu.Lock()
		queued = len(s.send.(*pipeline).queue)
		s.send.(*pipeline).mu.Unlock()
		return int(hook.held.Load())+queued == n
	}, 10*time.Second, time.Millisecond)
	return queued
}

func TestRedisPipelinesConcurrentCalls(t *testing.T) {
	s, mr, hook := newHeldRedis(t)
	ctx := t.Context()
	const n = 100

	// heldBurst runs n calls at once while the hook holds the commands, so that every slot
	// stays busy and the rest queue; then it lets them all go.
	heldBurst := func(call func(i int) error) {
		t.Helper()
		hook.held.Store(0)
		hook.batches.Store(0)
		hook.batched.Store(0)
		hook.release = make(chan struct{})
		hook.hold.Store(true)
		var wg sync.WaitGroup
		errs := make([]error, n)
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = call(i)
			}()
		}
		queued := waitAllWaiting(t, s, hook, n)
		require.Positive(t, queued, "with every slot busy, calls queue")
		hook.hold.Store(false)
		close(hook.release)
		wg.Wait()
		for i := range n {
			require.NoError(t, errs[i], "call %d", i)
		}
		require.Positive(t, hook.batches.Load(), "queued calls left in pipelined batches")
		require.Greater(t, hook.batched.Load(), hook.batches.Load(), "batches carried several calls")
	}

	leases := make([]Lease, n)
	heldBurst(func(i int) error {
		var err error
		leases[i], _, err = s.Acquire(ctx, "k"+strconv.Itoa(i), Claim{LockTTL: time.Hour, TTL: time.Hour})
		if err == nil && !leases[i].Held() {
			err = errors.New("not acquired")
		}
		return err
	})
	require.Len(t, mr.Keys(), n, "every call ran exactly once")

	// Flush the scripts, so that the batched completions find NOSCRIPT and must reload.
	require.NoError(t, s.client.ScriptFlush(ctx).Err())
	heldBurst(func(i int) error { return s.Complete(ctx, leases[i], Response{Status: 200}) })
	for i := range n {
		_, rec, err := s.Acquire(ctx, "k"+strconv.Itoa(i), Claim{LockTTL: time.Hour, TTL: time.Hour})
		require.NoError(t, err)
		require.Equal(t, Completed, rec.State, "record %d", i)
	}
}

func TestRedisPipelineClose(t *testing.T) {
	s, _, hook := newHeldRedis(t)
	hook.hold.Store(true)
	const n = 10
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _, err := s.Acquire(t.Context(), "c"+strconv.Itoa(i), Claim{LockTTL: time.Hour, TTL: time.Hour})
			errs <- err
		}()
	}
	queued := waitAllWaiting(t, s, hook, n)
	s.send.close()
	hook.hold.Store(false)
	close(hook.release)
	wg.Wait()
	close(errs)
	closed := 0
	for err := range errs {
		if errors.Is(err, ErrClosed) {
			closed++
		}
	}
	require.Equal(t, queued, closed, "the calls still queued at Close fail with ErrClosed")
	require.NoError(t, s.Close())
	_, _, err := s.Acquire(t.Context(), "after", Claim{LockTTL: time.Hour, TTL: time.Hour})
	require.Error(t, err)
}

// A call whose caller stopped waiting while it was queued leaves the queue: it never reaches
// Redis, and nothing needs undoing.
func TestRedisAbandonedQueuedCallIsNeverSent(t *testing.T) {
	s, mr, hook := newHeldRedis(t)
	hook.hold.Store(true)
	var wg sync.WaitGroup
	for _, k := range busyKeys() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _, err := s.Acquire(t.Context(), k, Claim{LockTTL: time.Hour, TTL: time.Hour})
			assert.NoError(t, err, k)
		}()
	}
	require.Zero(t, waitAllWaiting(t, s, hook, pipelineSlots), "every slot taken, nothing queued")

	queueLen := func() int {
		s.send.(*pipeline).mu.Lock()
		defer s.send.(*pipeline).mu.Unlock()
		return len(s.send.(*pipeline).queue)
	}
	// The caller stops waiting at its own deadline, earlier than the store's, or when its
	// context is cancelled (the call's context is then the store's, which ends at the store's
	// deadline only: the batcher watches the caller's apart).
	for _, tc := range []struct {
		key  string
		ctx  func() (context.Context, context.CancelFunc)
		want error
	}{
		{"queued", func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(t.Context(), 50*time.Millisecond)
		}, context.DeadlineExceeded},
		{"queued-cancelled", func() (context.Context, context.CancelFunc) {
			ctx, cancel := context.WithCancel(t.Context())
			go func() {
				assert.Eventually(t, func() bool { return queueLen() == 1 }, 10*time.Second, time.Millisecond)
				cancel()
			}()
			return ctx, cancel
		}, context.Canceled},
	} {
		ctx, cancel := tc.ctx()
		_, _, err := s.Acquire(ctx, tc.key, Claim{LockTTL: time.Hour, TTL: time.Hour})
		cancel()
		require.ErrorIs(t, err, tc.want, tc.key)
		require.Zero(t, queueLen(), "the abandoned call left the queue")
	}

	hook.hold.Store(false)
	close(hook.release)
	wg.Wait()
	require.Equal(t, int64(pipelineSlots), hook.sets.Load(), "only the calls waited for were sent")
	require.False(t, mr.Exists("queued"))
	require.False(t, mr.Exists("queued-cancelled"))
	for _, k := range busyKeys() {
		require.True(t, mr.Exists(k), k)
	}
}

// While Redis answers later than the store timeout, every Acquire fails, and none of them may
// leave a pending record behind, or retries would get 409 for a whole lease although nothing
// runs. Some of those calls ran alone, some in batches their callers stopped waiting for, some
// never left the queue. The records are freed while Redis is still slow: the releases have a
// deadline of their own.
func TestRedisSlowServerLeavesNoOrphans(t *testing.T) {
	mr := miniredis.RunT(t)
	var delay atomic.Int64
	const timeout = 100 * time.Millisecond
	s, err := OpenRedis(RedisOptions{URL: "redis://" + slowlink.Start(t, mr.Addr(), &delay), Timeout: timeout})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	// Connections made while Redis is fast, so that the slow phase finds them open (a new one's
	// handshake would time out before any command is sent).
	var wg sync.WaitGroup
	for i := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// A first dial can outlast the 100 ms timeout on a loaded machine: try again.
			var err error
			for range 20 {
				if _, _, err = s.Acquire(t.Context(), "warm"+strconv.Itoa(i), Claim{LockTTL: time.Hour, TTL: time.Hour}); err == nil {
					return
				}
			}
			assert.NoError(t, err)
		}()
	}
	wg.Wait()
	mr.FlushAll()
	delay.Store(int64(3 * timeout / 2))

	var failed atomic.Int64
	const bursts, each = 5, 200
	for b := range bursts {
		for i := range each {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(t.Context(), timeout)
				defer cancel()
				key := fmt.Sprintf("k%d-%d", b, i)
				if _, _, err := s.Acquire(ctx, key, Claim{LockTTL: time.Hour, TTL: time.Hour}); err != nil {
					failed.Add(1)
				}
			}()
		}
		time.Sleep(timeout / 2)
	}
	wg.Wait()
	require.Equal(t, int64(bursts*each), failed.Load(), "every Acquire outlived its deadline")
	left := -1
	assert.Eventually(t, func() bool { left = len(mr.Keys()); return left == 0 }, 20*time.Second, 10*time.Millisecond)
	require.Zero(t, left, "pending records left behind")
	delay.Store(0)
}

// An undo runs only where a command may have run unbeknown to its caller.
func TestUnanswered(t *testing.T) {
	dial := &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}
	read := &net.OpError{Op: "read", Net: "tcp", Err: errors.New("i/o timeout")}
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{nil, false},
		{redis.Nil, false},
		{serverError("ERR wrong number of arguments"), false},
		{serverError("WRONGTYPE Operation against a key holding the wrong kind of value"), false},
		// Replies go-redis retries: an earlier attempt may have run.
		{serverError("LOADING Redis is loading the dataset in memory"), true},
		{serverError("READONLY You can't write against a read only replica."), true},
		{serverError("TRYAGAIN Multiple keys request during rehashing of slot"), true},
		{serverError("CLUSTERDOWN The cluster is down"), true},
		{serverError("ERR max number of clients reached"), true},
		{dial, true}, // go-redis may have written a first attempt
		{fmt.Errorf("wrapped: %w", dial), true},
		{ErrClosed, false},
		{redis.ErrClosed, false},
		{read, true},
		{context.DeadlineExceeded, true},
		{context.Canceled, true},
		{io.EOF, true},
	} {
		require.Equal(t, tc.want, unanswered(tc.err), "%v", tc.err)
	}
}

// TestUnansweredAllocs: most claims end with redis.Nil (the key was free) and every batched call's
// reply passes unanswered, so its answers for a missing value and for no error cost no
// allocation (the retried replies' predicates took 15 and 3 to 5 µs). AllocsPerRun counts the
// whole process's allocations, and the stores of earlier tests may still run timers (a deadline
// slot ending, an orphan pass): the fewest of a few runs is the function's.
func TestUnansweredAllocs(t *testing.T) {
	cmd := redis.NewCmd(t.Context())
	for _, err := range []error{nil, redis.Nil} {
		cmd.SetErr(err)
		allocs := math.Inf(1)
		for range 5 {
			allocs = min(allocs, testing.AllocsPerRun(100, func() {
				require.False(t, unanswered(cmd.Err()))
			}))
		}
		require.Zero(t, allocs, "unanswered(%v)", err)
	}
}

// A pass over the orphans stops once a batch finds Redis refusing connections, and keeps every
// lease whose release did not run for the next pass; freed, foreign, closed and expired leases
// are dropped.
func TestOrphanPassStopsWhenRedisIsDown(t *testing.T) {
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}
	var batches int
	release := func(ls []Lease) []error {
		batches++
		errs := make([]error, len(ls))
		for i, l := range ls {
			switch {
			case l.key == "gone":
				errs[i] = ErrLeaseLost
			case l.key == "closed":
				errs[i] = ErrClosed
			case l.key == "loading":
				errs[i] = serverError("LOADING Redis is loading the dataset in memory")
			case strings.HasPrefix(l.key, "down"):
				errs[i] = refused
			}
		}
		return errs
	}
	future := time.Now().Add(time.Hour)
	waiting := []orphan{
		{lease: Lease{key: "freed"}, until: future},
		{lease: Lease{key: "gone"}, until: future},
		{lease: Lease{key: "closed"}, until: future},
		{lease: Lease{key: "loading"}, until: future},
		{lease: Lease{key: "expired"}, until: time.Now().Add(-time.Second)},
	}
	for i := range 3 * orphanBatch {
		waiting = append(waiting, orphan{lease: Lease{key: "down" + strconv.Itoa(i)}, until: future})
	}
	kept := freeOnce(waiting, release, time.Now())
	require.Len(t, kept, 1+3*orphanBatch, "every lease whose release did not run is kept, and only those")
	require.Equal(t, "loading", kept[0].lease.key, "an error reply is not an answer")
	for _, o := range kept[1:] {
		require.True(t, strings.HasPrefix(o.lease.key, "down"), o.lease.key)
	}
	require.Equal(t, 1, batches, "no batch is sent after one found Redis down")
}

// A pass takes every lease queued by then and sends them in full batches, however the leases
// trickled in.
func TestOrphansGoInFullBatches(t *testing.T) {
	o := newOrphans(clock.Real{})
	const n = 3*orphanBatch + 100
	for i := range n {
		o.add(Lease{key: strconv.Itoa(i)}, time.Hour)
	}
	var mu sync.Mutex
	var sizes []int
	freed := 0
	done := make(chan struct{})
	release := func(ls []Lease) []error {
		mu.Lock()
		defer mu.Unlock()
		sizes = append(sizes, len(ls))
		if freed += len(ls); freed == n {
			close(done)
		}
		return make([]error, len(ls))
	}
	go o.run(release, time.Millisecond)
	defer o.stop()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the orphans were not all released")
	}
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []int{orphanBatch, orphanBatch, orphanBatch, 100}, sizes)
}

// Freeing thousands of orphans while Redis is slow leaves the connection pool to live calls:
// the releases go in pipelined batches on one connection at a time, so the pool never grows
// past what the live calls and that one connection need.
func TestOrphanReleasesLeaveThePoolToLiveCalls(t *testing.T) {
	mr := miniredis.RunT(t)
	var delay atomic.Int64
	s, err := OpenRedis(RedisOptions{URL: "redis://" + slowlink.Start(t, mr.Addr(), &delay), Timeout: time.Second, PoolSize: 8})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	_, _, err = s.Acquire(t.Context(), "warm", Claim{LockTTL: time.Hour, TTL: time.Hour})
	require.NoError(t, err)
	delay.Store(int64(40 * time.Millisecond))
	const n = 4 * maxOrphans / 5
	for i := range n {
		s.orphans.add(Lease{key: "orphan" + strconv.Itoa(i), token: "t"}, time.Hour)
	}
	for i := range 20 {
		_, _, err := s.Acquire(t.Context(), "live"+strconv.Itoa(i), Claim{LockTTL: time.Hour, TTL: time.Hour})
		require.NoError(t, err, "live call %d", i)
	}
	require.Eventually(t, func() bool { return len(s.orphans.queue) == 0 }, 10*time.Second, 10*time.Millisecond)
	st := s.client.PoolStats()
	require.LessOrEqual(t, st.TotalConns, uint32(3), "the releases hold one connection at a time (live calls one more)")
	require.Zero(t, st.Timeouts, "no call waited for a connection in vain")
}

// failedLoads fails every SCRIPT LOAD, as a Cluster does when one of its nodes is down.
type failedLoads struct{ passHook }

func (failedLoads) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if args := cmd.Args(); cmd.Name() == "script" && len(args) > 1 && strings.EqualFold(fmt.Sprint(args[1]), "load") {
			cmd.SetErr(errors.New("CLUSTERDOWN a node is unreachable"))
			return cmd.Err()
		}
		return next(ctx, cmd)
	}
}

// leasesWithoutScripts acquires n keys, then flushes the scripts, as a restart or a failover
// leaves a node: the next script calls find NOSCRIPT.
func leasesWithoutScripts(t *testing.T, s *Redis, n int) []Lease {
	t.Helper()
	leases := make([]Lease, n)
	for i := range leases {
		var err error
		leases[i], _, err = s.Acquire(t.Context(), "k"+strconv.Itoa(i), Claim{LockTTL: time.Hour, TTL: time.Hour})
		require.NoError(t, err)
	}
	require.NoError(t, s.client.ScriptFlush(t.Context()).Err())
	return leases
}

// A batch refused for NOSCRIPT whose script cannot be loaded goes again with the script whole.
func TestBatchSendsScriptsWholeWhenTheyCannotBeLoaded(t *testing.T) {
	s, mr := hookedRedis(t, failedLoads{}, time.Second)
	leases := leasesWithoutScripts(t, s, 10)
	for i, err := range s.releaseOrphans(leases) {
		require.NoError(t, err, "lease %d", i)
	}
	require.Empty(t, mr.Keys())
}

// scriptCounter counts the pipelined batches of EVALSHA and the commands sent alone, by name.
type scriptCounter struct {
	passHook
	mu      sync.Mutex
	batches int
	alone   []string
}

func (h *scriptCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.mu.Lock()
		h.alone = append(h.alone, cmd.Name())
		h.mu.Unlock()
		return next(ctx, cmd)
	}
}

func (h *scriptCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if cmds[0].Name() == "evalsha" {
			h.mu.Lock()
			h.batches++
			h.mu.Unlock()
		}
		return next(ctx, cmds)
	}
}

// After a restart or failover, a node refuses every release of a batch for not knowing the
// script: it is loaded once, and the refused releases go again in one round trip.
func TestOrphanReleasesReloadTheScriptOnce(t *testing.T) {
	hook := &scriptCounter{}
	s, mr := hookedRedis(t, hook, time.Second)
	leases := leasesWithoutScripts(t, s, 10)
	hook.mu.Lock()
	hook.batches, hook.alone = 0, nil
	hook.mu.Unlock()
	for i, err := range s.releaseOrphans(leases) {
		require.NoError(t, err, "lease %d", i)
	}
	require.Empty(t, mr.Keys())
	hook.mu.Lock()
	defer hook.mu.Unlock()
	require.Equal(t, 2, hook.batches, "the batch, then the refused releases again")
	require.NotContains(t, hook.alone, "evalsha", "no release alone")
	require.NotContains(t, hook.alone, "eval", "no release alone")
	loads := 0
	for _, name := range hook.alone {
		if name == "script" {
			loads++
		}
	}
	require.Equal(t, 1, loads, "the script loaded once")
}

// Under Cluster and Sentinel the URL's host is not dialled: with rediss://, each node's certificate
// is checked against the address it is dialled at, not against that host.
func TestTLSServerNameFollowsTheNode(t *testing.T) {
	const url = "rediss://user:pass@ignored.example:6380/0"
	c, err := newRedisClient(RedisOptions{URL: url})
	require.NoError(t, err)
	require.Equal(t, "ignored.example", c.(*redis.Client).Options().TLSConfig.ServerName, "standalone dials the URL's host")
	_ = c.Close()

	c, err = newRedisClient(RedisOptions{URL: url, ClusterAddrs: []string{"10.0.0.1:7000"}})
	require.NoError(t, err)
	require.NotNil(t, c.(*redis.ClusterClient).Options().TLSConfig)
	require.Empty(t, c.(*redis.ClusterClient).Options().TLSConfig.ServerName)
	_ = c.Close()

	c, err = newRedisClient(RedisOptions{URL: url, SentinelAddrs: []string{"10.0.0.1:26379"}})
	require.NoError(t, err)
	require.NotNil(t, c.(*redis.Client).Options().TLSConfig)
	require.Empty(t, c.(*redis.Client).Options().TLSConfig.ServerName)
	_ = c.Close()
}

// The store's clients speak RESP2, which spares go-redis its look for push notifications before
// every reply, unless the URL asks for RESP3.
func TestClientsSpeakRESP2(t *testing.T) {
	for _, tc := range []struct {
		name string
		url  string
		want int
	}{
		{"default", "redis://localhost:6379/0", 2},
		{"asked for RESP3", "redis://localhost:6379/0?protocol=3", 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := newRedisClient(RedisOptions{URL: tc.url})
			require.NoError(t, err)
			require.Equal(t, tc.want, c.(*redis.Client).Options().Protocol, "standalone")
			_ = c.Close()
			c, err = newRedisClient(RedisOptions{URL: tc.url, ClusterAddrs: []string{"10.0.0.1:7000"}})
			require.NoError(t, err)
			require.Equal(t, tc.want, c.(*redis.ClusterClient).Options().Protocol, "cluster")
			_ = c.Close()
			c, err = newRedisClient(RedisOptions{URL: tc.url, SentinelAddrs: []string{"10.0.0.1:26379"}})
			require.NoError(t, err)
			require.Equal(t, tc.want, c.(*redis.Client).Options().Protocol, "sentinel")
			_ = c.Close()
		})
	}
}

// layout2Record is a record as the version before layout 3 wrote it: no times.
func layout2Record(state byte, token string, ttl time.Duration, fp string, resp *Response) string {
	b := []byte{layout2, state}
	b = append(b, token...)
	b = appendPadded(b, uint64(ttl.Milliseconds()), 10, ttlDigits)
	b = appendPadded(b, uint64(len(fp)), 16, fpLenDigits)
	b = append(b, fp...)
	if resp != nil {
		b = appendResponse(b, *resp)
	}
	return string(b)
}

// Records written before layout 3, raw, as the previous version left them in Redis, still read
// (without CreatedAt; Lookup takes ExpiresAt from the key's expiry), and their owner, should one
// still hold its lease, renews, completes (small and staged) and releases them. On miniredis and
// on a real redis-server.
func TestRedisLayout2RecordsStillWork(t *testing.T) {
	servers := map[string]func(t *testing.T) (redis.UniversalClient, func(time.Duration)){
		"miniredis": func(t *testing.T) (redis.UniversalClient, func(time.Duration)) {
			mr := miniredis.RunT(t)
			return redis.NewClient(&redis.Options{Addr: mr.Addr()}), mr.FastForward
		},
		"redis-server": func(t *testing.T) (redis.UniversalClient, func(time.Duration)) {
			srv := redistest.Start(t, redistest.Options{})
			return redis.NewClient(&redis.Options{Addr: srv.Addr(), DisableIdentity: true}), nil
		},
	}
	for name, open := range servers {
		t.Run(name, func(t *testing.T) {
			client, _ := open(t)
			s := NewRedis(client, RedisOptions{Timeout: 5 * time.Second})
			t.Cleanup(func() { _ = s.Close() })
			ctx := t.Context()
			raw := func(key, v string, px time.Duration) {
				t.Helper()
				require.NoError(t, client.Set(ctx, key, v, px).Err())
			}
			get := func(key string) string {
				t.Helper()
				v, err := client.Get(ctx, key).Result()
				require.NoError(t, err)
				return v
			}
			resp := Response{Status: 201, Headers: []Header{{Name: "content-type", Value: []byte("application/json")}}, Body: []byte(`{"id":1}`)}
			large := Response{Status: 200, Body: bytes.Repeat([]byte{0x5a}, 64<<10)}

			// A completed record replays, and its owner's retried Complete still succeeds.
			token := newToken()
			raw("done", layout2Record('c', token, time.Hour, "fp", &resp), time.Hour)
			_, rec, err := s.Acquire(ctx, "done", internalClaim)
			require.NoError(t, err)
			require.Equal(t, Completed, rec.State)
			require.Equal(t, []byte("fp"), rec.Fingerprint)
			require.Equal(t, resp, rec.Response)
			require.True(t, rec.CreatedAt.IsZero(), "layout 2 has no creation time")
			require.True(t, rec.ExpiresAt.IsZero(), "Acquire does not ask for the key's expiry")
			rec, err = s.Lookup(ctx, "done")
			require.NoError(t, err)
			require.Equal(t, resp, rec.Response)
			require.WithinDuration(t, time.Now().Add(time.Hour), rec.ExpiresAt, time.Minute, "Lookup reads the key's expiry")
			old := Lease{key: "done", token: token, claim: Claim{Fingerprint: []byte("fp"), TTL: time.Hour}}
			require.NoError(t, s.Complete(ctx, old, resp), "a retried Complete")
			require.ErrorIs(t, s.Release(ctx, old), ErrLeaseLost)
			require.Equal(t, layout2Record('c', token, time.Hour, "fp", &resp), get("done"), "left as it was")

			// A pending record is found pending; its owner renews it (layout 2 stays layout 2)
			// and completes it, small or large; another releases it.
			for _, tc := range []struct {
				key  string
				resp *Response
			}{{"small", &resp}, {"large", &large}, {"released", nil}} {
				token := newToken()
				pending := layout2Record('p', token, time.Hour, "fp", nil)
				raw(tc.key, pending, time.Minute)
				_, rec, err := s.Acquire(ctx, tc.key, internalClaim)
				require.NoError(t, err)
				require.Equal(t, Pending, rec.State, tc.key)
				require.Equal(t, []byte("fp"), rec.Fingerprint)
				require.True(t, rec.CreatedAt.IsZero())
				l := Lease{key: tc.key, token: token, claim: Claim{Fingerprint: []byte("fp"), TTL: time.Hour}}
				require.NoError(t, s.Renew(ctx, l, 2*time.Minute))
				require.Equal(t, pending, get(tc.key), "a renewal of a layout 2 record changes its expiry only")
				require.Greater(t, client.PTTL(ctx, tc.key).Val(), time.Minute)
				if tc.resp == nil {
					require.NoError(t, s.Release(ctx, l))
					_, err := s.Lookup(ctx, tc.key)
					require.ErrorIs(t, err, ErrNotFound)
					continue
				}
				require.NoError(t, s.Complete(ctx, l, *tc.resp), tc.key)
				require.NoError(t, s.Complete(ctx, l, *tc.resp), "%s: a retried Complete", tc.key)
				rec, err = s.Lookup(ctx, tc.key)
				require.NoError(t, err)
				require.Equal(t, Completed, rec.State)
				require.Equal(t, []byte("fp"), rec.Fingerprint)
				require.Equal(t, *tc.resp, rec.Response)
				require.True(t, rec.CreatedAt.IsZero(), "the creation time stays unknown")
				require.WithinDuration(t, time.Now().Add(time.Hour), rec.ExpiresAt, time.Minute)
				require.Greater(t, client.PTTL(ctx, tc.key).Val(), 50*time.Minute, "the record lives its TTL")
			}
			keys, err := client.Keys(ctx, "*").Result()
			require.NoError(t, err)
			require.ElementsMatch(t, []string{"done", "small", "large"}, keys, "no staged bytes left behind")
		})
	}
}

func TestStagingKey(t *testing.T) {
	for _, tc := range []struct {
		key, want string
		ok        bool
	}{
		{"idempotency:abc", "idempotency:abc:staged:T{idempotency:abc}", true}, // the whole key is the tag
		{"a{tag}b", "a{tag}b:staged:T", true},                                  // its tag stays first
		{"x{y}z{w}", "x{y}z{w}:staged:T", true},                                // the first tag counts
		{"p:{0123}", "p:{0123}:staged:T", true},                                // a prefix that tags
		{"a{b", "", false},                                                     // a brace, no tag
		{"a{}b{c}", "", false},                                                 // an empty first tag
		{"a}b", "", false},
		{"{}", "", false},
		{"", "", false}, // the empty tag would hash the whole name
	} {
		got, ok := stagingKey(tc.key, "T")
		require.Equal(t, tc.ok, ok, tc.key)
		require.Equal(t, tc.want, got, tc.key)
		if ok {
			require.True(t, strings.HasPrefix(got, tc.key), "%s: the staging key starts with the record's", tc.key)
		}
	}
}

// stagedCounter records the commands a completion sends, but for a new connection's set-up.
type stagedCounter struct {
	passHook
	mu   sync.Mutex
	sent [][]string
}

func (h *stagedCounter) record(cmds ...redis.Cmder) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, c := range cmds {
		if c.Name() == "hello" || c.Name() == "client" {
			continue // a new connection's set-up
		}
		var args []string
		for _, a := range c.Args() {
			if s, ok := a.(string); ok {
				args = append(args, s)
			} else {
				args = append(args, fmt.Sprintf("<%T>", a))
			}
		}
		h.sent = append(h.sent, args)
	}
}

func (h *stagedCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.record(cmd)
		return next(ctx, cmd)
	}
}
func (h *stagedCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.record(cmds...)
		return next(ctx, cmds)
	}
}

// A large completion's bytes go in a plain SET of a staging key, renamed by the script; a small
// one's go through the script. A stale lease's staged bytes never reach the record, and none stay.
func TestRedisLargeCompletionIsStaged(t *testing.T) {
	hook := &stagedCounter{}
	s, mr := hookedRedis(t, hook, time.Second)
	ctx := t.Context()
	// Loaded, so that each call goes by SHA at once.
	require.NoError(t, completeScript.Load(ctx, s.client).Err())
	require.NoError(t, completeStagedScript.Load(ctx, s.client).Err())
	for _, size := range []int{100, stagedRecordBytes} {
		key := "k" + strconv.Itoa(size)
		l, _, err := s.Acquire(ctx, key, internalClaim)
		require.NoError(t, err)
		hook.mu.Lock()
		hook.sent = nil
		hook.mu.Unlock()
		require.NoError(t, s.Complete(ctx, l, Response{Status: 200, Body: make([]byte, size)}))
		hook.mu.Lock()
		sent := hook.sent
		hook.mu.Unlock()
		if size < stagedRecordBytes {
			require.Len(t, sent, 1)
			require.Equal(t, "evalsha", sent[0][0])
			continue
		}
		require.Len(t, sent, 2, "one pipeline: the staging SET, then the script")
		require.Equal(t, []string{"set", key + ":staged:" + l.token + "{" + key + "}", "<[]uint8>", "px", "<int64>"}, sent[0])
		require.Equal(t, "evalsha", sent[1][0])
		require.NotContains(t, sent[1], "<[]uint8>", "the record's bytes do not go through the script")
		_, rec, err := s.Acquire(ctx, key, internalClaim)
		require.NoError(t, err)
		require.Len(t, rec.Response.Body, size)
	}
	require.ElementsMatch(t, []string{"k100", "k" + strconv.Itoa(stagedRecordBytes)}, mr.Keys(), "no staged bytes left")

	// A stale lease: its staged bytes are dropped, the owner's record is untouched.
	stale, _, err := s.Acquire(ctx, "contended", Claim{LockTTL: time.Second, TTL: time.Hour})
	require.NoError(t, err)
	mr.FastForward(2 * time.Second)
	owner, _, err := s.Acquire(ctx, "contended", internalClaim)
	require.NoError(t, err)
	require.ErrorIs(t, s.Complete(ctx, stale, Response{Status: 200, Body: make([]byte, 2*stagedRecordBytes)}), ErrLeaseLost)
	_, rec, err := s.Acquire(ctx, "contended", internalClaim)
	require.NoError(t, err)
	require.Equal(t, Pending, rec.State)
	require.NoError(t, s.Complete(ctx, owner, Response{Status: 201, Body: bytes.Repeat([]byte("o"), 2*stagedRecordBytes)}))
	require.Len(t, mr.Keys(), 3, "no staged bytes left")
}

// A staged completion leaves the record with its own TTL, long or short: a TTL of at least
// stagingTTL is staged with the record and carried by RENAME, a shorter one set by the script.
// A script that finds nothing staged fails and leaves the pending record as it was. On miniredis
// and on a real redis-server.
func TestRedisStagedCompletionTTL(t *testing.T) {
	servers := map[string]func(t *testing.T) redis.UniversalClient{
		"miniredis": func(t *testing.T) redis.UniversalClient {
			return redis.NewClient(&redis.Options{Addr: miniredis.RunT(t).Addr()})
		},
		"redis-server": func(t *testing.T) redis.UniversalClient {
			srv := redistest.Start(t, redistest.Options{})
			return redis.NewClient(&redis.Options{Addr: srv.Addr(), DisableIdentity: true})
		},
	}
	for name, open := range servers {
		t.Run(name, func(t *testing.T) {
			client := open(t)
			s := NewRedis(client, RedisOptions{Timeout: 5 * time.Second})
			t.Cleanup(func() { _ = s.Close() })
			ctx := t.Context()
			body := bytes.Repeat([]byte("s"), 2*stagedRecordBytes)
			for _, ttl := range []time.Duration{5 * time.Hour, 5 * time.Second, stagingTTL} {
				key := "ttl-" + ttl.String()
				l, _, err := s.Acquire(ctx, key, Claim{LockTTL: 30 * time.Second, TTL: ttl})
				require.NoError(t, err)
				require.NoError(t, s.Complete(ctx, l, Response{Status: 200, Body: body}))
				left := client.PTTL(ctx, key).Val()
				require.LessOrEqual(t, left, ttl, key)
				require.Greater(t, left, ttl-2*time.Second, "%s: the record's own TTL", key)
				_, rec, err := s.Acquire(ctx, key, internalClaim)
				require.NoError(t, err)
				require.Equal(t, body, rec.Response.Body)
			}

			l, _, err := s.Acquire(ctx, "unstaged", internalClaim)
			require.NoError(t, err)
			staging, ok := stagingKey(l.key, l.token)
			require.True(t, ok)
			err = completeStagedScript.Run(ctx, client, []string{l.key, staging}, l.token).Err()
			require.ErrorContains(t, err, "staged record missing")
			_, rec, err := s.Acquire(ctx, "unstaged", internalClaim)
			require.NoError(t, err)
			require.Equal(t, Pending, rec.State, "nothing staged, nothing completed")
			keys, err := client.Keys(ctx, "*").Result()
			require.NoError(t, err)
			require.ElementsMatch(t, []string{"ttl-5h0m0s", "ttl-5s", "ttl-1m0s", "unstaged"}, keys, "no staged bytes left")
		})
	}
}

// A retried large completion (go-redis sends the pipeline again after a lost reply) stages its
// bytes twice and succeeds, and leaves no staged bytes.
func TestRedisRetriedLargeCompletion(t *testing.T) {
	s, mr := hookedRedis(t, retried{}, time.Second)
	ctx := t.Context()
	l, _, err := s.Acquire(ctx, "k", internalClaim)
	require.NoError(t, err)
	body := bytes.Repeat([]byte("r"), 3*stagedRecordBytes)
	require.NoError(t, s.Complete(ctx, l, Response{Status: 200, Body: body}))
	require.Equal(t, []string{"k"}, mr.Keys())
	_, rec, err := s.Acquire(ctx, "k", internalClaim)
	require.NoError(t, err)
	require.Equal(t, body, rec.Response.Body)
}

// With batching off, concurrent calls each go in a round trip of their own, at once: none waits
// for another's, and none shares a pipeline.
func TestRedisUnbatchedSendsEachCallAlone(t *testing.T) {
	hook := &pipelineCounter{release: make(chan struct{})}
	s, mr := hookedRedisWith(t, hook, RedisOptions{Timeout: 10 * time.Second, DisableBatching: true})
	hook.hold.Store(true)
	const n = 20
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			l, _, err := s.Acquire(t.Context(), "k"+strconv.Itoa(i), Claim{LockTTL: time.Hour, TTL: time.Hour})
			if assert.NoError(t, err) && assert.True(t, l.Held()) {
				assert.NoError(t, s.Complete(t.Context(), l, Response{Status: 200}))
			}
		})
	}
	// Every call is in the hook at once: sent, not queued behind the others.
	require.Eventually(t, func() bool { return hook.held.Load() == n }, 10*time.Second, time.Millisecond)
	hook.hold.Store(false)
	close(hook.release)
	wg.Wait()
	require.Zero(t, hook.batchedCalls.Load(), "no call in a pipelined batch (a new connection's set-up is one)")
	require.Equal(t, int64(n), hook.sets.Load())
	require.Len(t, mr.Keys(), n)
}

// A batch serves callers with deadlines of their own: it runs until the latest of them, so that
// no caller's call is cut short by another's earlier deadline, and the batcher adds none of its
// own (the store's timeout is set once, in Redis.boundCall).
func TestBatchRunsUntilItsLatestDeadline(t *testing.T) {
	hook := &pipelineCounter{release: make(chan struct{})}
	s, _ := hookedRedisWith(t, hook, RedisOptions{Timeout: time.Hour})
	p := s.send.(*pipeline)
	hook.hold.Store(true)
	// Every slot busy, so that the next calls queue and leave in one batch.
	var wg sync.WaitGroup
	for _, k := range busyKeys() {
		wg.Go(func() {
			_, _, err := s.Acquire(t.Context(), k, Claim{LockTTL: time.Hour, TTL: time.Hour})
			assert.NoError(t, err)
		})
	}
	require.Eventually(t, func() bool { return hook.held.Load() == pipelineSlots }, 10*time.Second, time.Millisecond)
	var deadlines []time.Time
	var mu sync.Mutex
	hook.seen = func(ctx context.Context) {
		d, _ := ctx.Deadline()
		mu.Lock()
		deadlines = append(deadlines, d)
		mu.Unlock()
	}
	soon, late := time.Now().Add(time.Minute), time.Now().Add(2*time.Minute)
	for _, d := range []time.Time{soon, late} {
		wg.Go(func() {
			ctx, cancel := context.WithDeadline(t.Context(), d)
			defer cancel()
			_, _, err := s.Acquire(ctx, "q"+d.String(), Claim{LockTTL: time.Hour, TTL: time.Hour})
			assert.NoError(t, err)
		})
	}
	require.Eventually(t, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return len(p.queue) == 2
	}, 10*time.Second, time.Millisecond)
	hook.hold.Store(false)
	close(hook.release)
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	require.Contains(t, deadlines, late, "the batch of both queued calls ran until the later deadline")
}

// The orphan releaser runs on the store's clock: a release that found Redis down is tried again
// once the clock has moved by the pause, not before, even when the lease's lock TTL has passed
// on that clock meanwhile: its Acquire may still wait in a connection's buffers, to be applied,
// with a whole lock TTL, when Redis answers again.
func TestOrphansRetryOnTheStoreClock(t *testing.T) {
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	o := newOrphans(clk)
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}
	calls := make(chan []Lease, 10)
	var down atomic.Bool
	down.Store(true)
	release := func(ls []Lease) []error {
		calls <- slices.Clone(ls)
		errs := make([]error, len(ls))
		if down.Load() {
			for i := range errs {
				errs[i] = refused
			}
		}
		return errs
	}
	const pause = 100 * time.Millisecond
	// Both are queued before run starts, so that its first pass takes both. A lease added
	// after a pass that failed waits for the next retry, which this clock sets only when the
	// test moves it.
	o.add(Lease{key: "long"}, time.Hour)
	o.add(Lease{key: "short"}, pause/2)
	go o.run(release, pause)
	defer o.stop()
	require.ElementsMatch(t, []Lease{{key: "long"}, {key: "short"}}, <-calls, "one pass takes every lease queued")
	require.Eventually(t, func() bool { return clk.Pending() == 1 }, 10*time.Second, time.Millisecond, "a retry is set on the clock")
	select {
	case ls := <-calls:
		t.Fatalf("retried before the clock moved: %v", ls)
	default:
	}
	down.Store(false)
	clk.Advance(pause)
	require.ElementsMatch(t, []Lease{{key: "long"}, {key: "short"}}, <-calls, "both are tried again, the one past its lock TTL too")
	require.Eventually(t, func() bool { return clk.Pending() == 0 }, 10*time.Second, time.Millisecond, "nothing left to retry")
}

// A completion that stages at least unbatchedBytes skips the batcher: with every slot busy it
// runs at once, in a round trip of its own (its staging SET and its script), while small calls
// queue behind the busy slots.
func TestLargeCompletionsSkipTheBatcher(t *testing.T) {
	s, mr, hook := newHeldRedis(t)
	ctx := t.Context()
	claim := Claim{LockTTL: time.Hour, TTL: time.Hour}
	var leases []Lease
	for i := range 4 {
		l, _, err := s.Acquire(ctx, "big"+strconv.Itoa(i), claim)
		require.NoError(t, err)
		leases = append(leases, l)
	}
	hook.held.Store(0)
	hook.hold.Store(true)
	var wg sync.WaitGroup
	errs := make(chan error, pipelineSlots+4)
	do := func(f func() error) {
		wg.Add(1)
		go func() { defer wg.Done(); errs <- f() }()
	}
	// Small calls take every slot and are held.
	for _, k := range busyKeys() {
		do(func() error { _, _, err := s.Acquire(ctx, k, claim); return err })
	}
	require.Eventually(t, func() bool { return hook.held.Load() == pipelineSlots }, 10*time.Second, time.Millisecond)
	// Small completions queue; the large one goes on at once (held in the hook as its pipeline
	// of two commands, not queued).
	for i := range 3 {
		do(func() error { return s.Complete(ctx, leases[i], Response{Status: 201, Body: []byte("small")}) })
	}
	do(func() error {
		return s.Complete(ctx, leases[3], Response{Status: 201, Body: make([]byte, unbatchedBytes)})
	})
	p := s.send.(*pipeline)
	require.Eventually(t, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return hook.held.Load() == pipelineSlots+2 && len(p.queue) == 3
	}, 10*time.Second, time.Millisecond, "the large completion runs while every slot is busy; the small ones queue")
	hook.hold.Store(false)
	close(hook.release)
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	for i := range 4 {
		_, rec, err := s.Acquire(ctx, "big"+strconv.Itoa(i), claim)
		require.NoError(t, err)
		require.Equal(t, Completed, rec.State)
	}
	require.NotEmpty(t, mr.Keys())
}
