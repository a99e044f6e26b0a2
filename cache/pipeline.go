package cache

import (
	"context"
	"errors"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// maxBatch bounds the calls one pipelined batch carries.
const maxBatch = 128

// pipeline sends the calls of concurrent requests together, so that under load many calls share
// one write and one read on each side instead of a round trip each: that is where a Redis-backed
// replica spends its time.
//
// It holds a few slots. A call that finds a free slot runs at once on the caller's goroutine,
// taking along every call queued so far in one pipelined batch. A call that finds every slot
// busy queues, then waits for its reply or for a free slot, in which case it runs the queue
// itself. So nothing waits when the store is idle, no call is stranded in the queue, and no
// goroutine is added. Each call is still one command or script on one key, atomic on its own:
// batching changes nothing about what it means.
//
// A caller may stop waiting (its context ends) before its call's reply is in. A call still
// queued then leaves the queue and is never sent. A call already sent, or taken into a batch,
// may still run: once its reply is in (or its round trip failed), its undo, if it has one, runs
// on a goroutine of its own. So an undo is sent after the command it undoes (on another
// connection, so Redis runs them in that order unless it reads its sockets out of order), and a
// slow Redis is never sent a queued call that nobody waits for any more.
type pipeline struct {
	client  redis.UniversalClient
	timeout time.Duration
	slots   chan struct{}

	mu     sync.Mutex
	queue  []*call
	closed bool
}

// call is one command, or one script when script is set, and its reply.
type call struct {
	script *redis.Script // nil: args is the whole command
	keys   []string      // the script's keys
	args   []any
	// undo, when set, runs with the reply of a call that may have run while its caller did not
	// learn what it did: the caller stopped waiting, or the round trip failed.
	undo  func(*redis.Cmd)
	taken bool          // out of the queue, in a batch; guarded by pipeline.mu
	left  bool          // the caller stopped waiting after the call was taken; guarded by pipeline.mu
	cmd   *redis.Cmd    // guarded by pipeline.mu while the call is queued or in a batch
	done  chan struct{} // closed when cmd is set; only a queued call, which waits, has one
}

// finish sets c's reply, wakes its caller if it waits, and starts c's undo if the caller did
// not learn what the call did.
func (p *pipeline) finish(c *call, cmd *redis.Cmd) {
	p.mu.Lock()
	c.cmd = cmd
	left := c.left
	p.mu.Unlock()
	if c.done != nil {
		close(c.done)
	}
	if c.undo != nil && (left || unanswered(cmd.Err())) {
		go c.undo(cmd)
	}
}

// unanswered tells whether err leaves unknown what a command did: every error but a reply of
// the server's (redis.Nil among them) and the pipeline's own ErrClosed. A refused connection is
// unanswered too: go-redis retries a command whose connection broke and returns the last
// attempt's error, so a refused dial may follow a first attempt that was written.
//
// So is an error reply that go-redis retries (LOADING, READONLY and the others of its
// shouldRetry): it may be the answer to a second attempt, after a first one ran and its reply
// was lost.
func unanswered(err error) bool {
	var reply redis.Error
	switch {
	case err == nil, errors.Is(err, ErrClosed), errors.Is(err, redis.ErrClosed):
		return false
	case errors.As(err, &reply):
		return retriedReply(reply.Error())
	}
	return true
}

// retriedReply tells whether go-redis retries a command that got the error reply msg.
func retriedReply(msg string) bool {
	for _, prefix := range []string{"LOADING ", "READONLY ", "CLUSTERDOWN ", "TRYAGAIN ", "MASTERDOWN ", "NOREPLICAS ", "ERR max number of clients reached"} {
		if strings.HasPrefix(msg, prefix) {
			return true
		}
	}
	return false
}

// unreachable tells whether err is a refused or failed connection: Redis is not there at all.
func unreachable(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// alone sends c in a round trip of its own; a script goes by SHA and is loaded if need be.
func (c *call) alone(ctx context.Context, client redis.UniversalClient) *redis.Cmd {
	if c.script != nil {
		return c.script.Run(ctx, client, c.keys, c.args...)
	}
	return client.Do(ctx, c.args...)
}

func newPipeline(client redis.UniversalClient, timeout time.Duration, slots int) *pipeline {
	return &pipeline{client: client, timeout: timeout, slots: make(chan struct{}, slots)}
}

// script runs s on keys with args; see run.
func (p *pipeline) script(ctx context.Context, s *redis.Script, keys []string, args ...any) *redis.Cmd {
	return p.run(ctx, &call{script: s, keys: keys, args: args})
}

// run runs c, alone or in a batch. It returns when the reply is in or ctx is done, whichever
// comes first; in the second case a queued call is dropped unsent, and a call already taken
// may still run (then its undo follows its reply).
func (p *pipeline) run(ctx context.Context, c *call) *redis.Cmd {
	if err := ctx.Err(); err != nil {
		return errorCmd(ctx, err)
	}
	select {
	case p.slots <- struct{}{}:
		p.serve(ctx, c)
		return c.cmd
	default:
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return errorCmd(ctx, ErrClosed)
	}
	c.done = make(chan struct{})
	p.queue = append(p.queue, c)
	p.mu.Unlock()
	for {
		p.mu.Lock()
		queued := !c.taken
		p.mu.Unlock()
		slots := p.slots
		if !queued {
			slots = nil // another caller runs it: wait for the reply only
		}
		select {
		case <-c.done:
			return c.cmd
		case slots <- struct{}{}:
			// A slot freed while the call was queued: run the queue, which holds it.
			p.serve(ctx, nil)
		case <-ctx.Done():
			p.mu.Lock()
			switch {
			case c.cmd != nil:
				// The reply came in meanwhile: the caller has it.
				p.mu.Unlock()
				return c.cmd
			case !c.taken:
				p.queue = slices.DeleteFunc(p.queue, func(q *call) bool { return q == c })
			default:
				c.left = true
			}
			p.mu.Unlock()
			return errorCmd(ctx, ctx.Err())
		}
	}
}

// serve runs own (if any) with the calls queued so far, then frees the slot the caller took. The
// caller's own call, alone, runs under ctx; anything else (a batch, another caller's call) runs
// under a timeout of its own, as it serves callers that may stop waiting.
func (p *pipeline) serve(ctx context.Context, own *call) {
	defer func() { <-p.slots }()
	p.mu.Lock()
	n := min(len(p.queue), maxBatch)
	batch := make([]*call, 0, n+1)
	// The calls that waited go first.
	for _, c := range p.queue[:n] {
		c.taken = true
		batch = append(batch, c)
	}
	if own != nil {
		batch = append(batch, own)
	}
	p.queue = append(p.queue[:0], p.queue[n:]...)
	p.mu.Unlock()
	if len(batch) == 0 {
		return
	}
	if len(batch) > 1 || own == nil {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(context.Background(), p.timeout)
		defer cancel()
	}
	p.exec(ctx, batch)
}

// exec sends batch under ctx: one call in a round trip of its own, several in a pipeline.
func (p *pipeline) exec(ctx context.Context, batch []*call) {
	if len(batch) == 1 {
		p.finish(batch[0], batch[0].alone(ctx, p.client))
		return
	}
	for i, cmd := range sendBatch(ctx, p.client, batch) {
		p.finish(batch[i], cmd)
	}
}

// sendBatch sends calls in one pipelined round trip and returns their replies. Scripts go by
// SHA; those a node refuses for not knowing them (a first call, a restart, a failover) are
// loaded once each (on every node under Cluster) and the refused calls sent again together, by
// SHA, or whole (EVAL) if the load failed: under Cluster one node down or slow fails it.
func sendBatch(ctx context.Context, client redis.UniversalClient, calls []*call) []*redis.Cmd {
	cmds := make([]*redis.Cmd, len(calls))
	add := func(pipe redis.Pipeliner, i int) {
		if c := calls[i]; c.script != nil {
			cmds[i] = pipe.EvalSha(ctx, c.script.Hash(), c.keys, c.args...)
		} else {
			cmds[i] = pipe.Do(ctx, c.args...)
		}
	}
	pipe := client.Pipeline()
	for i := range calls {
		add(pipe, i)
	}
	_, _ = pipe.Exec(ctx)
	var refused []int
	loaded := map[*redis.Script]bool{}
	for i, cmd := range cmds {
		s := calls[i].script
		if err := cmd.Err(); s == nil || err == nil || !redis.HasErrorPrefix(err, "NOSCRIPT") {
			continue
		}
		if _, tried := loaded[s]; !tried {
			loaded[s] = s.Load(ctx, client).Err() == nil
		}
		refused = append(refused, i)
	}
	if len(refused) > 0 {
		pipe := client.Pipeline()
		for _, i := range refused {
			if c := calls[i]; loaded[c.script] {
				add(pipe, i)
			} else {
				cmds[i] = c.script.Eval(ctx, pipe, c.keys, c.args...)
			}
		}
		_, _ = pipe.Exec(ctx)
	}
	return cmds
}

// close fails the calls still queued with ErrClosed; batches in flight finish.
func (p *pipeline) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	for _, c := range p.queue {
		// Never sent: nothing to undo.
		c.cmd = errorCmd(context.Background(), ErrClosed)
		close(c.done)
	}
	p.queue = nil
}

func errorCmd(ctx context.Context, err error) *redis.Cmd {
	cmd := redis.NewCmd(ctx)
	cmd.SetErr(err)
	return cmd
}
