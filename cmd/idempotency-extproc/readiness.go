package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// readiness judges whether the process can serve: its store answers a ping within timeout and,
// when a route's durability asks for replicas, has that many in sync. /readyz asks it on demand,
// and watchStore every readinessInterval.
type readiness struct {
	store   cache.Store
	timeout time.Duration
	// need is the most replicas a route's durability asks for; 0 for none. replicas counts them:
	// the store, when it has replicas (Redis), else nil (start-up refuses durability with the
	// memory store). They are counted whatever need is, for idempotency_store_replicas; only
	// with need above 0 does a failed count make the process unready.
	need     int
	replicas cache.Replicated
	// observe, when set, is given every count of the replicas, by /readyz's checks as by
	// watchStore's, or -1 when the store did not answer: requests are refused for durability
	// exactly while /readyz says so.
	observe func(seen int)
}

func newReadiness(store cache.Store, timeout time.Duration, p *policy.Policy) (*readiness, error) {
	r := &readiness{store: store, timeout: timeout}
	for _, route := range append([]*policy.Route{p.Default}, p.Routes...) {
		r.need = max(r.need, route.Durability.Replicas)
	}
	r.replicas, _ = store.(cache.Replicated)
	if r.need > 0 && r.replicas == nil {
		return nil, errors.New("durability.replicas above 0 needs a store with replicas: --store redis")
	}
	return r, nil
}

// errUndurable says that the store has fewer replicas than a route's durability asks for.
type errUndurable struct{ need, seen int }

func (e errUndurable) Error() string {
	return fmt.Sprintf("durability unmet: durability.replicas is %d and the store has %d replicas in sync; covered requests of the routes that ask for more get 503 durability-unmet until replicas are attached", e.need, e.seen)
}

// check returns nil when the process can serve, or why not: the store's error or an
// errUndurable. seen is the replicas counted, or -1 when they were not.
func (r *readiness) check(ctx context.Context) (seen int, err error) {
	ctx, cancel := context.WithTimeout(ctx, r.timeout)
	defer cancel()
	if err := r.store.Ping(ctx); err != nil {
		r.seen(-1)
		return -1, fmt.Errorf("store unavailable: %w", err)
	}
	if r.replicas == nil {
		return -1, nil
	}
	n, err := r.replicas.Replicas(ctx)
	if err != nil {
		r.seen(-1)
		if r.need == 0 {
			return -1, nil // the count is for the gauge only
		}
		return -1, fmt.Errorf("store unavailable: counting its replicas: %w", err)
	}
	r.seen(n)
	if n < r.need {
		return n, errUndurable{need: r.need, seen: n}
	}
	return n, nil
}

func (r *readiness) seen(n int) {
	if r.observe != nil {
		r.observe(n)
	}
}

// The states watchStore reports.
type storeState uint8

const (
	stateUnchecked storeState = iota
	stateServing
	stateUnreachable
	stateUndurable
)

// storeWatch is what watchStore keeps in step with the readiness check.
type storeWatch struct {
	health *health.Server
	ready  prometheus.Gauge // idempotency_ready
	// answered runs once, when the store first answers.
	answered func()
	log      zerolog.Logger
}

// watchStore keeps gRPC health, the gauges and the ext_proc server in step with the readiness
// check, every readinessInterval until ctx is done: SERVING (1) while it passes, NOT_SERVING (0)
// otherwise. It logs each change, and calls w.answered the first time the store answers.
func watchStore(ctx context.Context, r *readiness, w storeWatch) {
	state, seenBefore, answered := stateUnchecked, -1, false
	t := time.NewTicker(readinessInterval)
	defer t.Stop()
	for {
		seen, err := r.check(ctx)
		if ctx.Err() != nil {
			return
		}
		var undurable errUndurable
		now := stateServing
		switch {
		case errors.As(err, &undurable):
			now = stateUndurable
		case err != nil:
			now = stateUnreachable
		}
		if !answered && now != stateUnreachable {
			answered = true
			w.answered()
		}
		if now != state || (now == stateUndurable && seen != seenBefore) {
			switch now {
			case stateServing:
				setHealth(w.health, healthpb.HealthCheckResponse_SERVING)
				w.ready.Set(1)
				ev := w.log.Info()
				if r.need > 0 {
					ev = ev.Int("durability_replicas", r.need).Int("replicas_seen", seen)
				}
				ev.Msg("store is reachable: serving")
			case stateUndurable:
				setHealth(w.health, healthpb.HealthCheckResponse_NOT_SERVING)
				w.ready.Set(0)
				w.log.Warn().Int("durability_replicas", r.need).Int("replicas_seen", seen).
					Msg("durability.replicas is above the replicas the store has in sync: not serving; covered requests of the routes that ask for more get 503 durability-unmet until replicas are attached")
			case stateUnreachable:
				setHealth(w.health, healthpb.HealthCheckResponse_NOT_SERVING)
				w.ready.Set(0)
				w.log.Error().Err(err).Str("op", "ping").Msg("store is unreachable: not serving")
			}
		}
		state, seenBefore = now, seen
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
