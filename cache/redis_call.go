package cache

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// sender sends the Redis store's calls: plain go-redis calls (direct), or the same calls shared
// across requests in pipelined batches (pipeline, RedisOptions.DisableBatching off). Either way a
// call's meaning is the same: one command or script on one key, atomic on its own.
type sender interface {
	// run sends c and returns its reply, or ctx's error when ctx ends first. A call whose reply
	// its caller does not learn (ctx ended, the round trip failed) may still have run: its undo,
	// if it has one, then runs on a goroutine of its own, after the reply is in.
	run(ctx context.Context, c *call) *redis.Cmd
	// close fails the calls not yet sent with ErrClosed.
	close()
}

// call is one command, or one script when script is set, and its reply.
type call struct {
	script *redis.Script // nil: args is the whole command
	keys   []string      // the script's keys
	args   []any
	// stage, when set, is a command sent just before the script, on the same connection and in
	// the same round trip: the staged bytes of a large completion (see Redis.Complete), of which
	// there are stagedBytes.
	stage       []any
	stagedBytes int
	// deadline is when the caller stops waiting, which Redis.boundCall set. A batch carrying the
	// call runs until the latest deadline of its calls. until, when set, is a context that ends
	// at deadline, without the caller's values or cancellation (slotCtx): the one such a batch
	// runs under when the call has the latest deadline.
	deadline time.Time
	until    context.Context
	// ctx backs the call's context where Redis.boundCall made one, so that it is no allocation
	// of its own.
	ctx callCtx
	// undo, when set, runs with the reply of a call that may have run while its caller did not
	// learn what it did: the caller stopped waiting, or the round trip failed.
	undo func(*redis.Cmd)
	// replicas, when above 0, makes the call durable: its round trip ends with a WAIT for that
	// many replicas, bounded by wait, on the connection that carried the call (see sendBatch).
	// The sender sets unconfirmed, before the reply is handed over, when fewer acknowledged it:
	// an error wrapping ErrUnconfirmed that says how many did, or why the WAIT failed.
	replicas    int
	wait        time.Duration
	unconfirmed error

	// keyv and argv back keys, args and stage where they fit (Acquire's and Complete's calls), so
	// that such a call and its lists are one allocation.
	keyv [2]string
	argv [7]any

	// The batcher's bookkeeping, guarded by pipeline.mu.
	taken bool          // out of the queue, in a batch
	left  bool          // the caller stopped waiting after the call was taken
	cmd   *redis.Cmd    // the reply, set while the call is queued or in a batch
	done  chan struct{} // closed when cmd is set; only a queued call, which waits, has one
}

// send sends c in a round trip of its own under ctx. A script goes by SHA and is loaded if need
// be; a staged or durable call goes as a pipeline of its commands.
func (c *call) send(ctx context.Context, client redis.UniversalClient) *redis.Cmd {
	switch {
	case c.stage != nil || c.replicas > 0:
		return sendBatch(ctx, client, []*call{c})[0]
	case c.script != nil:
		return c.script.Run(ctx, client, c.keys, c.args...)
	}
	return client.Do(ctx, c.args...)
}

// direct sends every call in a round trip of its own, on the caller's goroutine: go-redis as it
// is, with the undo of a call whose outcome the caller did not learn.
type direct struct{ client redis.UniversalClient }

var _ sender = direct{}

func (d direct) run(ctx context.Context, c *call) *redis.Cmd {
	if err := callerErr(ctx); err != nil {
		return errorCmd(ctx, err)
	}
	sctx, cancel := alone(ctx)
	cmd := c.send(sctx, d.client)
	cancel()
	if c.undo != nil && unanswered(cmd.Err()) {
		go c.undo(cmd)
	}
	return gaveUp(ctx, cmd)
}

func (direct) close() {}

// unanswered tells whether err leaves unknown what a command did: every error but a reply of
// the server's (redis.Nil among them) and the store's own ErrClosed. A refused connection is
// unanswered too: go-redis retries a command whose connection broke and returns the last
// attempt's error, so a refused dial may follow a first attempt that was written. So is an error
// reply that go-redis retries (retriedReply): it may be the answer to a second attempt, after a
// first one ran and its reply was lost.
func unanswered(err error) bool {
	switch {
	// redis.Nil first: it is how most claims end (the key was free), and the retried replies'
	// predicates below cost 3 to 5 µs and 15 allocations (TestUnansweredAllocs).
	case err == nil, err == redis.Nil, errors.Is(err, ErrClosed), errors.Is(err, redis.ErrClosed):
		return false
	case serverReply(err):
		return retriedReply(err)
	}
	return true
}

// serverReply tells whether err is an error reply of the server's, however wrapped.
func serverReply(err error) bool {
	var reply redis.Error
	return errors.As(err, &reply)
}

// retriedReply tells whether go-redis retries a command that got the error reply err.
//
// Nothing in go-redis answers that question: which replies it retries is decided in a private
// function (shouldRetry in its error.go), with no exported list or predicate. What it exports is
// one predicate per kind of reply, each matching the reply however it is wrapped (typed errors,
// replies inside a script's error): these are the kinds shouldRetry retries in go-redis v9.23.
// TestRetriedRepliesFollowGoRedis sends every error reply Redis has through a stand-in server
// and fails when go-redis retries another set than this one, so an upgrade that changes the list
// is caught.
func retriedReply(err error) bool {
	return redis.IsLoadingError(err) || redis.IsReadOnlyError(err) || redis.IsClusterDownError(err) ||
		redis.IsTryAgainError(err) || redis.IsMasterDownError(err) || redis.IsNoReplicasError(err) ||
		redis.IsMaxClientsError(err)
}

// unreachable tells whether err is a refused or failed connection: Redis is not there at all.
func unreachable(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// sendBatch sends calls in one pipelined round trip and returns their replies. Scripts go by
// SHA; those a node refuses for not knowing them (a first call, a restart, a failover) are
// loaded once each (on every node under Cluster) and the refused calls sent again together, by
// SHA, or whole (EVAL) if the load failed: under Cluster one node down or slow fails it. A staged
// call's stage goes just before its script, and once: a script sent again finds it in place.
//
// When some calls are durable, each pipeline ends with one WAIT for the most replicas any of
// them asks, bounded by the shortest wait any of them allows, and each durable call is judged by
// the WAIT of the pipeline that carried it (confirm). A pipeline is one connection, and WAIT
// counts every write its connection made before it, so one WAIT confirms every call of its
// round trip; under Cluster, where a pipeline is split among the nodes, the calls go instead
// to the master of their key's slot, one pipeline per master (sendByMaster).
func sendBatch(ctx context.Context, client redis.UniversalClient, calls []*call) []*redis.Cmd {
	w := waitOf(calls)
	if cc, ok := client.(*redis.ClusterClient); ok && w.replicas > 0 {
		return sendByMaster(ctx, cc, calls)
	}
	cmds := make([]*redis.Cmd, len(calls))
	var stages []*redis.Cmd // only when a call stages its bytes
	pipe := client.Pipeline()
	add := func(i int) {
		c := calls[i]
		if c.stage != nil {
			if stages == nil {
				stages = make([]*redis.Cmd, len(calls))
			}
			stages[i] = pipe.Do(ctx, c.stage...)
		}
		cmds[i] = c.queue(ctx, pipe, true)
	}
	// A script goes first where there is one. go-redis judges a pipeline by its first reply,
	// passing an error reply through its retry and bad-connection predicates: a free key's claim
	// answers nil, which is such an error (about 14 allocations), and a script never does. The
	// calls of a batch are concurrent, on keys of their own or not, so any order is one they
	// could have run in.
	first := max(slices.IndexFunc(calls, func(c *call) bool { return c.script != nil }), 0)
	add(first)
	for i := range calls {
		if i != first {
			add(i)
		}
	}
	waited := w.add(ctx, pipe)
	_, _ = pipe.Exec(ctx)
	for _, c := range calls {
		confirm(c, waited)
	}
	resendRefused(ctx, client, calls, cmds)
	for i, st := range stages {
		// A failed stage fails its call with its own error (an OOM reply, a broken connection)
		// rather than with the script's finding nothing staged.
		if st != nil && st.Err() != nil && cmds[i].Err() != nil {
			cmds[i] = errorCmd(ctx, st.Err())
		}
	}
	return cmds
}

// queue adds c to pipe and returns its reply: a script by SHA (EVALSHA), or whole (EVAL) when
// bySHA is false.
func (c *call) queue(ctx context.Context, pipe redis.Pipeliner, bySHA bool) *redis.Cmd {
	switch {
	case c.script == nil:
		return pipe.Do(ctx, c.args...)
	case bySHA:
		return pipe.EvalSha(ctx, c.script.Hash(), c.keys, c.args...)
	}
	return c.script.Eval(ctx, pipe, c.keys, c.args...)
}

// resendRefused sends again, in one more pipelined round trip, the calls of sendBatch whose
// scripts a node refused for not knowing them, and puts their new replies in cmds. Each refused
// script is loaded once first; a call whose script did not load goes whole (EVAL). The calls sent
// again went on that pipeline's connection: its own WAIT judges them, over the first one's finding.
func resendRefused(ctx context.Context, client redis.UniversalClient, calls []*call, cmds []*redis.Cmd) {
	var refused []int
	var loaded map[*redis.Script]bool
	for i, cmd := range cmds {
		s := calls[i].script
		if err := cmd.Err(); s == nil || err == nil || !redis.HasErrorPrefix(err, "NOSCRIPT") {
			continue
		}
		if loaded == nil {
			loaded = map[*redis.Script]bool{}
		}
		if _, tried := loaded[s]; !tried {
			loaded[s] = s.Load(ctx, client).Err() == nil
		}
		refused = append(refused, i)
	}
	if len(refused) == 0 {
		return
	}
	pipe := client.Pipeline()
	for _, i := range refused {
		cmds[i] = calls[i].queue(ctx, pipe, loaded[calls[i].script])
	}
	rewaited := waitOf(pick(calls, refused)).add(ctx, pipe)
	_, _ = pipe.Exec(ctx)
	for _, i := range refused {
		confirm(calls[i], rewaited)
	}
}

func errorCmd(ctx context.Context, err error) *redis.Cmd {
	cmd := redis.NewCmd(ctx)
	cmd.SetErr(err)
	return cmd
}

// wait is the WAIT that ends a durable round trip: for replicas replicas, for at most timeout.
// Its zero value adds none.
type wait struct {
	replicas int
	timeout  time.Duration
}

// waitOf returns the WAIT calls need: the most replicas any asks for, within the shortest wait
// any allows, so that no call waits longer than it allows and none is confirmed by fewer
// replicas than it asks (confirm compares each with the count the WAIT returns).
func waitOf(calls []*call) wait {
	var w wait
	for _, c := range calls {
		if c.replicas <= 0 {
			continue
		}
		if w.replicas == 0 || c.wait < w.timeout {
			w.timeout = c.wait
		}
		w.replicas = max(w.replicas, c.replicas)
	}
	return w
}

// add queues the WAIT on pipe, last, and returns its reply; nil for the zero wait.
func (w wait) add(ctx context.Context, pipe redis.Pipeliner) *redis.Cmd {
	if w.replicas == 0 {
		return nil
	}
	// WAIT takes whole milliseconds, and 0 would wait for ever: claims have at least 1ms.
	return pipe.Do(ctx, "wait", w.replicas, max(w.timeout.Milliseconds(), 1))
}

// confirm sets c.unconfirmed from waited, the reply of the WAIT that ended the round trip that
// carried c; a call that is not durable is left alone.
func confirm(c *call, waited *redis.Cmd) {
	if c.replicas <= 0 {
		return
	}
	c.unconfirmed = nil
	n, err := waited.Int64()
	switch {
	case err != nil:
		c.unconfirmed = fmt.Errorf("%w: WAIT failed: %w", ErrUnconfirmed, err)
	case n < int64(c.replicas):
		c.unconfirmed = fmt.Errorf("%w: %d of %d replicas acknowledged within %v", ErrUnconfirmed, n, c.replicas, c.wait)
	}
}

// pick returns calls[i] for each i of idx.
func pick(calls []*call, idx []int) []*call {
	out := make([]*call, len(idx))
	for j, i := range idx {
		out[j] = calls[i]
	}
	return out
}

// key returns the key c is on: its script's first key, or its command's first argument.
func (c *call) key() string {
	if c.script != nil {
		return c.keys[0]
	}
	k, _ := c.args[1].(string)
	return k
}

// sendByMaster sends durable calls under Cluster: each to the master that owns its key's slot
// (ClusterClient.MasterForKey), the calls of one master in one pipeline that ends with its WAIT,
// the masters at once. WAIT names no key, so in a Cluster pipeline it would go to any node, and
// the Cluster client would follow a MOVED reply to another node than the WAIT's: here neither
// can happen. A call that finds the slot map stale (a MOVED reply after a failover, a master
// that is gone) fails, and the map is reloaded for the calls that follow.
func sendByMaster(ctx context.Context, cc *redis.ClusterClient, calls []*call) []*redis.Cmd {
	cmds := make([]*redis.Cmd, len(calls))
	var masters []*redis.Client
	byMaster := map[*redis.Client][]int{}
	for i, c := range calls {
		m, err := cc.MasterForKey(ctx, c.key())
		if err != nil {
			cmds[i] = errorCmd(ctx, err)
			continue
		}
		if byMaster[m] == nil {
			masters = append(masters, m)
		}
		byMaster[m] = append(byMaster[m], i)
	}
	var wg sync.WaitGroup
	for _, m := range masters {
		wg.Go(func() {
			idx := byMaster[m]
			for j, cmd := range sendBatch(ctx, m, pick(calls, idx)) {
				cmds[idx[j]] = cmd
			}
		})
	}
	wg.Wait()
	for _, cmd := range cmds {
		if err := cmd.Err(); err != nil && !errors.Is(err, redis.Nil) {
			// Cheap: go-redis reloads in the background, at most once per 200 ms.
			cc.ReloadState(ctx)
			break
		}
	}
	return cmds
}
