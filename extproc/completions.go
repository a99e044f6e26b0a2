package extproc

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

// A record the store failed to write (a timeout, a brief stall, a full Redis refusing writes)
// is not a reason to run its request again. The stream hands it to completions, which keeps the
// lease renewed and retries the write in the background, with backoff, until it lands, the
// record's TTL passes, or the process ends. Duplicates meanwhile find the key pending (409, or a
// wait) and then the replay.
const (
	// retryFirst and retryMax bound the wait before each retry; it doubles from the first, with
	// jitter, up to the most.
	retryFirst = 50 * time.Millisecond
	retryMax   = 5 * time.Second
	// maxPendingCompletions bounds the records retried at once. A completion beyond it is
	// abandoned: counted, logged, and its lease left to expire after lock_ttl.
	maxPendingCompletions = 10_000
	// maxPendingBodyBytes bounds the response bodies the retries keep. A completion beyond it is
	// retried without its body: the request still runs at most once, and its duplicates get 409
	// response-not-replayable instead of the replay.
	maxPendingBodyBytes = 64 << 20
)

// The reasons a pending completion is given up, the reason label of
// idempotency_completions_abandoned_total.
const (
	abandonedCapacity = "capacity" // maxPendingCompletions were pending already
	abandonedExpired  = "expired"  // the record's TTL passed: written now, it would be gone
	abandonedShutdown = "shutdown" // the process ended first (Server.Shutdown)
	// abandonedLeaseLost: the lease was lost while the request ran or its completion was
	// pending (hold.go), whether or not the completion had failed before.
	abandonedLeaseLost = "lease_lost"
)

// completions holds the records whose write is being retried. It is safe for concurrent use.
type completions struct {
	s      *Server
	ctx    context.Context // ends when Shutdown gives up on the writes still pending
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu        sync.Mutex
	count     int // pending
	bodyBytes int // the bodies they keep
	// The bounds: maxPendingCompletions and maxPendingBodyBytes (lower in tests).
	maxCount, maxBodyBytes int
}

func newCompletions(s *Server) *completions {
	ctx, cancel := context.WithCancel(context.Background())
	return &completions{s: s, ctx: ctx, cancel: cancel, maxCount: maxPendingCompletions, maxBodyBytes: maxPendingBodyBytes}
}

// pendingCompletion is one record still to be written.
type pendingCompletion struct {
	hold *hold
	resp cache.Response
	// until is when a record written now would have expired: retrying past it is pointless.
	until time.Time
	// The identity its log lines carry, as the stream's did.
	requestID, keyHash string
	route              *route
}

func (p *pendingCompletion) event(e *zerolog.Event) *zerolog.Event {
	if e == nil {
		return nil
	}
	return e.Str("request_id", p.requestID).Str("route", p.route.Name).Str("key_hash", p.keyHash)
}

// retry takes over a record whose write failed with a store error (not a lost lease). It
// reports false when the record is abandoned at once: too many are pending, or the process is
// shutting down.
func (c *completions) retry(p pendingCompletion) bool {
	m := c.s.metrics
	c.mu.Lock()
	reason := ""
	switch {
	case c.ctx.Err() != nil:
		reason = abandonedShutdown
	case c.count >= c.maxCount:
		reason = abandonedCapacity
	}
	if reason != "" {
		c.mu.Unlock()
		m.completionsAbandoned.WithLabelValues(reason).Inc()
		p.event(c.s.log.Error()).Str("reason", reason).Msg("completion not written and not retried: its lease expires after lock_ttl, and a retry of the request may then run again")
		return false
	}
	if c.bodyBytes+len(p.resp.Body) > c.maxBodyBytes {
		p.resp.Body, p.resp.BodyOmitted = nil, true
	}
	c.count++
	c.bodyBytes += len(p.resp.Body)
	c.wg.Add(1)
	c.mu.Unlock()
	// The headers point into Envoy's whole message (wire.DecodeRequest), which they would keep
	// for as long as the retries last: they take copies of their own.
	p.resp.Headers, p.resp.Trailers = ownHeaders(p.resp.Headers), ownHeaders(p.resp.Trailers)
	m.completionsPending.Inc()
	go c.run(p)
	return true
}

// ownHeaders copies hs, names and values, into memory of their own. A value's capacity is its
// length, so that an append to it reallocates. It runs only for a completion retried in the
// background.
func ownHeaders(hs []cache.Header) []cache.Header {
	if hs == nil {
		return nil
	}
	out := make([]cache.Header, len(hs))
	for i, h := range hs {
		out[i] = cache.Header{Name: strings.Clone(h.Name), Value: slices.Clip(bytes.Clone(h.Value))}
	}
	return out
}

// run retries p's write until it lands or is given up.
func (c *completions) run(p pendingCompletion) {
	defer func() {
		c.mu.Lock()
		c.count--
		c.bodyBytes -= len(p.resp.Body)
		c.mu.Unlock()
		c.s.metrics.completionsPending.Dec()
		c.s.holds.remove(p.hold)
		c.wg.Done()
	}()
	s, m := c.s, c.s.metrics
	// The writes' store calls, made as a request's are: renewed until Shutdown gives up (c.ctx).
	call := &leaseCall{s: s, req: &admitted{id: p.requestID, route: p.route}, ctx: c.ctx, keyHash: p.keyHash, hold: p.hold}
	ren := call.renewAfter(p.hold.lease.Claim().LockTTL/3, &renewal{}, p.hold)
	defer ren.stop()
	wait := retryFirst
	for attempt := 1; ; attempt++ {
		// Half the wait, plus up to as much again at random: replicas that lost the store
		// together do not retry together.
		if !sleep(s.clock, c.ctx, wait/2+rand.N(wait/2+1)) {
			m.completionsAbandoned.WithLabelValues(abandonedShutdown).Inc()
			p.event(s.log.Warn()).Int("attempts", attempt-1).Msg("shutting down with the completion still not written: its lease expires after lock_ttl, and a retry of the request may then run again")
			return
		}
		if !s.clock.Now().Before(p.until) {
			m.completionsAbandoned.WithLabelValues(abandonedExpired).Inc()
			p.event(s.log.Warn()).Int("attempts", attempt-1).Msg("completion still not written when its record would have expired; retries stop")
			return
		}
		// Not under c.ctx: a write under way when Shutdown gives up still gets its answer, within
		// the store's own timeout.
		err := call.completeHeld(context.Background(), p.resp)
		switch {
		case err == nil:
			m.completionRetries.WithLabelValues("landed").Inc()
			p.event(s.log.Info()).Int("attempts", attempt).Bool("body_kept", !p.resp.BodyOmitted).Msg("completion written after retrying")
			return
		case errors.Is(err, cache.ErrLeaseLost):
			m.completionRetries.WithLabelValues("lease_lost").Inc()
			p.event(s.log.Warn()).Int("attempts", attempt).Msg("lease lost while its completion was retried: not written")
			return
		}
		m.completionRetries.WithLabelValues("failed").Inc()
		p.event(s.log.Debug()).Int("attempt", attempt).Err(err).Msg("completion retry failed")
		wait = min(2*wait, retryMax)
	}
}

// wait blocks until no write is pending or ctx is done.
func (c *completions) wait(ctx context.Context) error {
	return waitGroup(ctx, &c.wg)
}

// stop gives up every pending write (each is counted and logged) and returns once their
// goroutines have ended; a write under way first gets its answer, within the store's timeout.
func (c *completions) stop() {
	c.cancel()
	c.wg.Wait()
}

// retryable reports whether a failed write is worth retrying: not when the lease is lost (the
// record is another's now, or gone) or the store is closed.
func retryable(err error) bool {
	return !errors.Is(err, cache.ErrLeaseLost) && !errors.Is(err, cache.ErrClosed)
}

// sleep waits d on clk and reports false when ctx ended first.
func sleep(clk clock.Clock, ctx context.Context, d time.Duration) bool {
	done := make(chan struct{})
	t := clk.AfterFunc(d, func() { close(done) })
	select {
	case <-done:
		return true
	case <-ctx.Done():
		t.Stop()
		return false
	}
}
