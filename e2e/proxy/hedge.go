package proxy

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"slices"
	"time"
)

// Hedging on per-try timeouts, as Envoy's router does it (source/common/router/router.cc):
//
//   - a route hedges when its hedge_policy sets hedge_on_per_try_timeout
//     (FilterUtility::finalHedgingParams) and its retry_policy sets per_try_timeout and retries
//     something (RetryStateImpl::create makes no retry state for an empty retry_on, and
//     Filter::onSoftPerTryTimeout does nothing without one);
//   - the per-try timer starts once the whole request reached the router
//     (Filter::onRequestComplete, UpstreamRequest::setupPerTryTimeout);
//   - when it fires, Filter::onPerTryTimeout calls Filter::onSoftPerTryTimeout, which leaves the
//     attempt running and, while no response went downstream, asks
//     RetryStateImpl::shouldHedgeRetryPerTryTimeout, which retries whatever the retry_on
//     conditions while retries are left (num_retries, default 1): a new attempt with the same
//     headers and body goes upstream beside the first. Envoy sends it after the retry backoff
//     (25 ms base by default); the proxy sends it at once;
//   - the first attempt whose response headers are not retried wins, and the router resets the
//     others (Filter::onUpstreamHeaders, resetOtherUpstreams); a failed or retriable attempt
//     while another is in flight is dropped, the other awaited (Filter::onUpstreamReset and
//     onUpstreamHeaders with retries already in flight).
//
// Per-try timeouts without hedging (a reset, then a retry on 5xx or gateway-error) are not
// modelled.

// hedging reports whether the route hedges on per-try timeouts, and its per-try timeout.
func (x *exchange) hedging() (time.Duration, bool) {
	if x.route == nil || !x.route.Hedge.GetHedgeOnPerTryTimeout() {
		return 0, false
	}
	rp := x.route.Retry
	if rp.GetRetryOn() == "" || rp.GetPerTryTimeout() == nil || rp.GetPerTryTimeout().AsDuration() <= 0 {
		return 0, false
	}
	return rp.GetPerTryTimeout().AsDuration(), true
}

// attemptSlots is the capacity of the first attempt's result channel, which hedged attempts
// share: one result per attempt, so that no attempt's goroutine blocks on it.
func (x *exchange) attemptSlots() int {
	if _, ok := x.hedging(); !ok {
		return 1
	}
	return 1 + int(x.retriesAllowed())
}

// retriesAllowed is RetryPolicy.num_retries, 1 when unset.
func (x *exchange) retriesAllowed() uint32 {
	if n := x.route.Retry.GetNumRetries(); n != nil {
		return n.GetValue()
	}
	return 1
}

// startPerTry arms the per-try timer of the current attempt (UpstreamRequest::setupPerTryTimeout)
// on a hedging route.
func (x *exchange) startPerTry() {
	if d, ok := x.hedging(); ok && !x.localComplete && x.res == nil {
		x.perTryDL = time.Now().Add(d)
	}
}

// onPerTryTimeout is Filter::onSoftPerTryTimeout: the attempt keeps running and, while retries
// are left and nothing went downstream, another one starts beside it.
func (x *exchange) onPerTryTimeout() {
	if x.up == nil || x.res != nil || x.localComplete || uint32(x.attempts) > x.retriesAllowed() {
		return
	}
	body := x.up.whole
	if b := x.up.body; b != nil {
		whole, done := b.sentBody()
		if !done {
			return
		}
		body = whole
	}
	x.attempts++
	ctx, cancel := context.WithCancelCause(x.ctx)
	uc := &upstreamCall{ctx: ctx, stop: cancel, result: x.up.result, start: time.Now()}
	req := x.up.req.Clone(ctx)
	req.Body, req.ContentLength = http.NoBody, 0
	if len(body) > 0 {
		req.Body, req.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
	}
	uc.req, uc.whole = req, body
	x.inFlight = append(x.inFlight, x.up)
	x.up = uc
	x.roundTrip(uc, req)
	x.startPerTry()
}

// pickAttempt settles a result while hedged attempts are in flight. It reports false when the
// result is dropped (it failed or would be retried, and another attempt is still running);
// otherwise the result's attempt becomes x.up and the others are reset.
func (x *exchange) pickAttempt(res upstreamResult) bool {
	if len(x.inFlight) == 0 || res.from == nil {
		return true
	}
	others := slices.DeleteFunc(append(x.inFlight, x.up), func(uc *upstreamCall) bool { return uc == res.from })
	failed := res.err != nil || (x.route.Retry != nil && (wouldRetryStatus(x.route.Retry, res.resp.StatusCode) || wouldRetryGRPC(x.route.Retry, res.resp.Header)))
	if failed && len(others) > 0 {
		if res.resp != nil {
			_ = res.resp.Body.Close()
		}
		x.up, x.inFlight = others[len(others)-1], others[:len(others)-1]
		return false
	}
	for _, uc := range others {
		uc.cancel()
	}
	x.up, x.inFlight = res.from, nil
	x.perTryDL = time.Time{}
	return true
}

// cancelOtherAttempts resets the hedged attempts beside x.up (Filter::onLocalReply resets every
// upstream request).
func (x *exchange) cancelOtherAttempts() {
	for _, uc := range x.inFlight {
		uc.cancel()
	}
	x.inFlight = nil
	x.perTryDL = time.Time{}
}
