package extproc

import (
	"context"
	"crypto/sha256"
	"errors"
	"slices"
	"time"

	"github.com/rs/zerolog"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
)

// leaseCall owns one request's store calls: the claim, the renewals, the completion or the
// release, the hold on the key while the lease is this replica's (hold.go), and what became of
// them. The stream asks it for a call and reads what it reports; nothing else calls the store for
// a request. Each call is timed, counted when it fails, and traced; the store bounds each by its
// own timeout.
//
// While a call runs, its fate is leaseInStore, and only a call that returns moves it on: a panic
// from inside the store leaves it there, so that the stream's finish makes no further store call
// and Server.StreamInterceptor lets the panic end the process. Nothing here recovers.
type leaseCall struct {
	s *Server
	// req is the request, for the identity of log lines (its id and route).
	req *admitted
	// ctx bounds the calls: the stream's context, or the request span's once tracing began.
	ctx context.Context
	// keyHash is the hash of the stored key, the request's identity in logs, metadata and spans.
	keyHash string
	// hold is this replica's hold on the key while the lease is held; nil when none is.
	hold *hold
	// What became of the lease, and the calls' first failure (errDurabilityUnmet when the claim
	// was not made).
	fate leaseFate
	err  error
	// resp is the response to record, as the response phases capture it, and origin where it
	// came from, which a gRPC call's trailers are judged with (judgeGRPCStatus).
	resp   cache.Response
	origin origin
	// fp backs the request's fingerprint (stream.keys), which its claim and hold keep: made
	// once per request, it lives as long as they do. The memory store's lease keeps it too
	// (cache.Store.Acquire), so that a hold would keep the stream's allocation; but that store's
	// writes never go to the completions' retries (it fails one only for a lost lease or a closed
	// store), and Redis's lease keeps a copy.
	fp [sha256.Size]byte
}

// leaseFate is what became of a request's lease: one value, so that no two flags can disagree.
type leaseFate uint8

const (
	// leaseNone: no lease (yet): not claimed, or the claim found a record or failed.
	leaseNone leaseFate = iota
	// leaseHeld: the request runs under its lease.
	leaseHeld
	// leaseInStore: a store call is running; a panic from inside the store leaves it so.
	leaseInStore
	// leaseRecorded: the response was recorded, and the lease spent with it.
	leaseRecorded
	// leaseLeft: given up without a record: left to expire, or to the background retries of
	// its completion, or a completion or a release the store failed.
	leaseLeft
	// leaseReleased and after: released, for the reason releaseReasons[fate-leaseReleased].
	leaseReleased
)

// released returns the reason the lease was released for; "" when it was not.
func (c *leaseCall) released() string {
	if c.fate < leaseReleased {
		return ""
	}
	return releaseReasons[c.fate-leaseReleased]
}

// errDurabilityUnmet is a claim not made: the route asks for more replicas than the store has
// (Server.durabilityUnmet).
var errDurabilityUnmet = errors.New("the store has fewer replicas than the route's durability.replicas")

// event adds the request's identity to a log event: its request id, route and the hash of its
// stored key, never the key itself. It is safe on a disabled (nil) event.
func (c *leaseCall) event(e *zerolog.Event) *zerolog.Event {
	if e == nil {
		return nil
	}
	e = e.Str("request_id", c.req.id)
	if c.req.route != nil {
		e = e.Str("route", c.req.route.Name)
	}
	if c.keyHash != "" {
		e = e.Str("key_hash", c.keyHash)
	}
	return e
}

// storeSpan starts the span of one store call, a child of the request's; it returns nil when
// the request has none. Without a tracer the calls on the request's path skip it (and storeDone).
func (c *leaseCall) storeSpan(op string) trace.Span {
	if c.req.span == nil {
		return nil
	}
	_, sp := c.s.tracer.Start(c.ctx, "idempotency.store."+op, trace.WithSpanKind(trace.SpanKindClient))
	return sp
}

// acquire claims key with cl. A free key is held from then on (hold, renewal); a taken one returns
// its record. A failure is logged and kept as the request's (failed), except a record that
// cannot be read (the caller answers it) and a call the stream's end cut short.
func (c *leaseCall) acquire(key string, cl cache.Claim) (*cache.Record, error) {
	s := c.s
	sent := s.clock.Now()
	start, sp := time.Now(), trace.Span(nil)
	if c.req.span != nil {
		sp = c.storeSpan("acquire")
	}
	c.fate = leaseInStore
	lease, rec, err := s.store.Acquire(c.ctx, key, cl)
	c.fate = leaseNone
	s.acquireObs.Observe(time.Since(start).Seconds())
	// An unconfirmed claim is withdrawn: it is answered as any store failure, and the request
	// does not run.
	if err != nil || sp != nil {
		c.storeDone("acquire", sp, err)
	}
	switch {
	case err != nil && c.ctx.Err() != nil:
		// Envoy ended the stream during the call (the client went away): not the store's
		// failure, and nobody waits for an answer. The request never went upstream.
		c.event(s.log.Debug()).Err(err).Msg("stream ended during the store call")
	case errors.Is(err, cache.ErrCorrupt):
		// The record is there but cannot be read (a tampered or unknown-key sealed record, a
		// layout this build does not know): the request ran once, so it must not run again.
		c.req.route.unreadable.Inc()
		c.event(s.log.Error()).Err(err).Msg("stored record cannot be read; answering response-not-replayable")
	case err != nil:
		c.failed("acquire", err)
	case rec == nil:
		c.fate, c.hold = leaseHeld, s.holds.add(&hold{lease: lease, reached: sent})
		s.metrics.inflight.Inc()
		c.renewAfter(cl.LockTTL/3, &c.hold.renewal, c.hold)
	}
	return rec, err
}

// complete records the response captured (resp) and gives up the lease. A write the store fails goes on in the
// background (completions.go), the lease kept renewed, so that a store that stalls or refuses
// writes for a while never lets a duplicate run again; the request's outcome is still
// store_error. It reports whether the record was written now.
func (c *leaseCall) complete() bool {
	resp := c.resp
	c.hold.renewal.stop()
	// The client may already be gone; the record must still be written.
	ctx := context.WithoutCancel(c.ctx)
	err := c.completeHeld(ctx, resp)
	retried := false
	if err != nil && retryable(err) {
		retried = c.s.completions.retry(pendingCompletion{
			hold: c.hold, resp: resp, until: c.s.clock.Now().Add(c.req.adm.ttl),
			requestID: c.req.id, route: c.req.route, keyHash: c.keyHash,
		})
	}
	if retried {
		c.hold = nil // the retries hold the key now
	}
	c.drop(leaseRecorded)
	if err != nil {
		c.fate = leaseLeft
		c.failed("complete", err)
		if retried {
			c.event(c.s.log.Warn()).Msg("completion not written: retrying in the background, the lease kept, so duplicates get 409 until it lands")
		}
		return false
	}
	return true
}

// completeHeld writes the hold's completed record. A lease the store let expire while it was
// away is re-asserted first; one that was removed, or that another request took, is counted as
// lost. A record written but not confirmed by enough replicas (durability) is done: it is
// counted, logged, and nil is returned.
func (c *leaseCall) completeHeld(ctx context.Context, resp cache.Response) error {
	s, h := c.s, c.hold
	h.writing.Lock()
	defer h.writing.Unlock()
	c.fate = leaseInStore
	write := func() error {
		start, sp := time.Now(), trace.Span(nil)
		if c.req.span != nil {
			sp = c.storeSpan("complete")
		}
		err := s.store.Complete(ctx, h.lease, resp)
		s.completeObs.Observe(time.Since(start).Seconds())
		if err != nil || sp != nil {
			c.storeDone("complete", sp, err)
		}
		if errors.Is(err, cache.ErrUnconfirmed) {
			// The record is written and the lease spent: the completion is done. Only a
			// failover before the replicas catch up could lose it.
			c.event(s.log.Warn()).Err(err).Msg("completion not confirmed by the store's replicas; a failover before they catch up may lose the record")
			return nil
		}
		return err
	}
	err := write()
	if errors.Is(err, cache.ErrLeaseLost) && h.mayHaveLapsed(s.clock.Now()) {
		sent := s.clock.Now()
		if err = c.reassert(ctx, nil, h); err == nil {
			h.reachedAt(sent)
			err = write()
		}
	}
	c.fate = leaseHeld
	if errors.Is(err, cache.ErrLeaseLost) {
		c.leaseLost(h, "completion")
	}
	h.spent = err == nil
	return err
}

// release frees the key so that a retry runs again. A renewal under way is let finish first, not
// cut short: its re-assertion, already sent, could land after the release and write the claim
// back, and duplicates would get 409 until lock_ttl passed. It waits at most for that renewal's
// store calls, each bounded by store_timeout.
func (c *leaseCall) release(reason string) {
	s, h := c.s, c.hold
	// The wait for the renewal is the release's: timed and traced with it.
	start, sp := time.Now(), c.storeSpan("release")
	h.writing.Lock()
	h.spent = true
	h.writing.Unlock()
	h.renewal.stop()
	c.fate = leaseInStore
	err := s.store.Release(context.WithoutCancel(c.ctx), c.hold.lease)
	c.fate = leaseHeld
	s.releaseObs.Observe(time.Since(start).Seconds())
	c.storeDone("release", sp, err)
	if err != nil {
		c.drop(leaseLeft)
		c.failed("release", err)
		return
	}
	c.drop(leaseReleased + leaseFate(slices.Index(releaseReasons, reason)))
	c.req.route.releases[reason].Inc()
	c.event(s.log.Debug()).Str("reason", reason).Msg("lease released")
}

// leave gives up the lease without a store call: it expires after lock_ttl.
func (c *leaseCall) leave() {
	c.hold.renewal.stop()
	c.drop(leaseLeft)
}

// drop forgets the hold, the lease having become f: the key is this replica's no longer (unless
// the background retries took it over).
func (c *leaseCall) drop(f leaseFate) {
	c.s.holds.remove(c.hold)
	c.hold, c.fate = nil, f
	c.s.metrics.inflight.Dec()
}

// failed logs a failed store operation and keeps the first failure: the request's outcome is
// store_error.
func (c *leaseCall) failed(op string, err error) {
	if c.err == nil {
		c.err = err
	}
	ev := c.s.log.Error()
	if errors.Is(err, cache.ErrLeaseLost) {
		ev = c.s.log.Warn()
	}
	c.event(ev).Str("op", op).Err(err).Msg("store operation failed")
}

// renew extends h's lease by its lock TTL. It runs on a renewal's timer goroutine, where a panic
// ends the process by itself; sp is its span, or nil.
func (c *leaseCall) renew(ctx context.Context, sp trace.Span, h *hold) error {
	start := time.Now()
	err := c.s.store.Renew(ctx, h.lease, h.lease.Claim().LockTTL)
	c.s.renewObs.Observe(time.Since(start).Seconds())
	c.storeDone("renew", sp, err)
	return err
}

// storeDone ends a store call's span (nil without a tracer), marking it failed when err is not
// nil, and counts a failed call by operation and kind (storeErrorKind). A lost lease is not the
// store's failure, nor is a call the stream's end cut short. A write the replicas did not confirm
// (durability) is counted apart, in idempotency_durability_unconfirmed_total. With neither a span
// nor an error there is nothing to do, and the request's own calls skip it.
func (c *leaseCall) storeDone(op string, sp trace.Span, err error) {
	s := c.s
	if sp != nil {
		if err != nil {
			sp.RecordError(err)
			sp.SetStatus(codes.Error, "store operation failed")
		}
		sp.End()
	}
	switch {
	case err == nil, errors.Is(err, cache.ErrLeaseLost), errors.Is(err, context.Canceled):
	case errors.Is(err, cache.ErrUnconfirmed) && op == "acquire":
		s.unconfirmedClaims.Inc()
	case errors.Is(err, cache.ErrUnconfirmed) && op == "complete":
		s.unconfirmedCompletes.Inc()
	default:
		s.metrics.storeErrors.WithLabelValues(op, storeErrorKind(err)).Inc()
	}
}

// The kinds of store failure, the kind label of idempotency_store_errors_total.
const (
	storeErrorOOM         = "oom"         // the store refuses writes: it is full (cache.ErrFull)
	storeErrorTimeout     = "timeout"     // no answer within store_timeout
	storeErrorCorrupt     = "corrupt"     // a record that cannot be read
	storeErrorUnavailable = "unavailable" // anything else: refused or broken connections, errors
)

var storeErrorKinds = []string{storeErrorOOM, storeErrorTimeout, storeErrorCorrupt, storeErrorUnavailable}

func storeErrorKind(err error) string {
	switch {
	case errors.Is(err, cache.ErrFull):
		return storeErrorOOM
	case errors.Is(err, context.DeadlineExceeded):
		return storeErrorTimeout
	case errors.Is(err, cache.ErrCorrupt):
		return storeErrorCorrupt
	}
	return storeErrorUnavailable
}
