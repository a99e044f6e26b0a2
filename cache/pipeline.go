package cache

import (
	"context"
	"slices"
	"sync"

	"github.com/redis/go-redis/v9"
)

// maxBatch bounds the calls one pipelined batch carries.
const maxBatch = 128

// unbatchedBytes: a call that stages at least this many bytes (a large completion) skips the
// batcher and goes in a round trip of its own, as with batching off. In the comparative
// benchmark's run 19 (docs/runs/history.md), 1 MiB first executions cost redis-server 38% more
// CPU and ran 0.90x as fast batched as unbatched, while at 64 KiB the two cost the same; deep
// pipelines of large values cost redis-server more per value. The threshold lies between the
// two measured sizes. Run 22, with Redis full before each section, has the two within noise at
// 1 MiB with this bypass; whether the bypass is still needed was not measured.
const unbatchedBytes = 256 << 10

// pipeline is the batcher: it sends the calls of concurrent requests together, so that under load
// many calls share one write and one read on each side instead of a round trip each: that is
// where a Redis-backed replica spends its time. RedisOptions.DisableBatching turns it off
// (direct); the comparative benchmark runs both (e2e/bench -redis-batching).
//
// It holds pipelineSlots slots. A call that finds a free slot runs at once on the caller's
// goroutine, taking along every call queued so far in one pipelined batch. A call that finds
// every slot busy queues, then waits for its reply or for a free slot, in which case it runs the
// queue itself. So nothing waits when the store is idle, no call is stranded in the queue, and no
// goroutine is added. Each call is still one command or script on one key, atomic on its own:
// batching changes nothing about what it means.
//
// The calls of durable claims (call.replicas) have a batcher of their own, so that no other call
// waits for replicas. Its batches go as any other and end with one WAIT (sendBatch): a pipeline
// is one connection, and WAIT confirms every write its connection made before it, so one WAIT
// confirms every call of its batch, each against the replicas it asks for.
//
// Deadlines are the calls' own (call.deadline, set by Redis.boundCall): the batcher adds none. A
// caller's own call, sent alone, runs under the caller's context (alone); a batch, which serves callers
// that may each stop waiting, runs until the latest deadline among its calls.
//
// A caller may stop waiting (its context ends) before its call's reply is in. A call still
// queued then leaves the queue and is never sent. A call already sent, or taken into a batch,
// may still run: once its reply is in (or its round trip failed), its undo, if it has one, runs
// on a goroutine of its own. So an undo is sent after the command it undoes (on another
// connection, so Redis runs them in that order unless it reads its sockets out of order), and a
// slow Redis is never sent a queued call that nobody waits for any more.
type pipeline struct {
	client redis.UniversalClient
	slots  chan struct{}

	mu     sync.Mutex
	queue  []*call
	closed bool
}

var _ sender = (*pipeline)(nil)

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

// newPipeline returns a batcher on client with slots batches in flight at most.
func newPipeline(client redis.UniversalClient, slots int) *pipeline {
	return &pipeline{client: client, slots: make(chan struct{}, slots)}
}

// run runs c, alone or in a batch. It returns when the reply is in or ctx is done, whichever
// comes first; in the second case a queued call is dropped unsent, and a call already taken
// may still run (then its undo follows its reply).
func (p *pipeline) run(ctx context.Context, c *call) *redis.Cmd {
	if err := callerErr(ctx); err != nil {
		return errorCmd(ctx, err)
	}
	if c.stagedBytes >= unbatchedBytes {
		p.mu.Lock()
		closed := p.closed
		p.mu.Unlock()
		if closed {
			return errorCmd(ctx, ErrClosed)
		}
		return direct{client: p.client}.run(ctx, c)
	}
	select {
	case p.slots <- struct{}{}:
		p.serve(ctx, c)
		return gaveUp(ctx, c.cmd)
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
	// The caller stops waiting at the call's deadline or when its own context ends (boundCall).
	caller := callerDone(ctx)
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
			return gaveUp(ctx, c.cmd)
		case slots <- struct{}{}:
			// A slot freed while the call was queued: run the queue, which holds it.
			p.serve(ctx, nil)
			continue
		case <-ctx.Done():
		case <-caller:
		}
		p.mu.Lock()
		switch {
		case c.cmd != nil:
			// The reply came in meanwhile: the caller has it.
			p.mu.Unlock()
			return gaveUp(ctx, c.cmd)
		case !c.taken:
			p.queue = slices.DeleteFunc(p.queue, func(q *call) bool { return q == c })
		default:
			c.left = true
		}
		p.mu.Unlock()
		return errorCmd(ctx, callerErr(ctx))
	}
}

// serve runs own (if any) with the calls queued so far, then frees the slot the caller took. The
// caller's own call, alone, runs under ctx, or the caller's own context when it can be
// cancelled (alone); anything else (a batch, another caller's call) runs
// until the latest deadline of its calls, as it serves callers that may each stop waiting.
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
	if len(batch) == 1 && own != nil {
		// The caller's own call, alone: go-redis lets the caller go when it gives up.
		var cancel context.CancelFunc
		ctx, cancel = alone(ctx)
		defer cancel()
	} else {
		latest := batch[0]
		for _, c := range batch[1:] {
			if c.deadline.After(latest.deadline) {
				latest = c
			}
		}
		if ctx = latest.until; ctx == nil {
			var cancel context.CancelFunc
			ctx, cancel = context.WithDeadline(context.Background(), latest.deadline)
			defer cancel()
		}
	}
	p.exec(ctx, batch)
}

// exec sends batch under ctx: one call in a round trip of its own, several in a pipeline.
func (p *pipeline) exec(ctx context.Context, batch []*call) {
	if len(batch) == 1 {
		p.finish(batch[0], batch[0].send(ctx, p.client))
		return
	}
	for i, cmd := range sendBatch(ctx, p.client, batch) {
		p.finish(batch[i], cmd)
	}
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
