// Package extproc is the Envoy external-processing server: one gRPC stream per HTTP request, and
// on it the idempotency state machine of SPEC §3–4.
package extproc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"runtime/debug"
	"sync"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

// Options configures a Server. Store is required; the zero value of every other field gives its
// default.
type Options struct {
	// Store holds the records.
	Store cache.Store
	// Policy decides which requests are covered and how (default policy.Default()).
	Policy *policy.Policy
	// Logger receives one line per covered request and every store failure (default: none).
	Logger *zerolog.Logger
	// Metrics are updated for every request (default: metrics on a registry of their own).
	Metrics *Metrics
	// Clock times lease renewals (default: the wall clock).
	Clock clock.Clock
}

// Server implements Envoy's ExternalProcessor service. It is safe for concurrent use: each
// stream has its own state, and streams share only the store.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer

	store   cache.Store
	policy  *policy.Policy
	log     zerolog.Logger
	metrics *Metrics
	clock   clock.Clock
	// routes holds what each route needs per request, resolved once.
	routes map[*policy.Route]*routeState
	// The store-duration series of each operation.
	acquireObs, renewObs, completeObs, releaseObs prometheus.Observer

	streams sync.WaitGroup
	// observabilityOnce logs once that Envoy runs the filter in observability mode.
	observabilityOnce sync.Once
}

// routeState is what a route needs per request, built once: its metric series and the answers
// that depend only on the route.
type routeState struct {
	outcomes map[Outcome]prometheus.Counter
	releases map[string]prometheus.Counter
	// stored continues a response that will be stored; notStored also turns its body phase off.
	stored, notStored *extprocv3.ProcessingResponse
	problems          map[*problem]*extprocv3.ProcessingResponse
}

// NewServer returns a Server.
func NewServer(opts Options) (*Server, error) {
	if opts.Store == nil {
		return nil, errors.New("extproc: a store is required")
	}
	if opts.Policy == nil {
		opts.Policy = policy.Default()
	}
	if opts.Logger == nil {
		nop := zerolog.Nop()
		opts.Logger = &nop
	}
	if opts.Metrics == nil {
		m, err := NewMetrics(prometheus.NewRegistry())
		if err != nil {
			return nil, err
		}
		opts.Metrics = m
	}
	if opts.Clock == nil {
		opts.Clock = clock.Real{}
	}
	s := &Server{
		store:   opts.Store,
		policy:  opts.Policy,
		log:     *opts.Logger,
		metrics: opts.Metrics,
		clock:   opts.Clock,
		routes:  make(map[*policy.Route]*routeState),
	}
	for _, r := range append([]*policy.Route{opts.Policy.Default}, opts.Policy.Routes...) {
		rs := &routeState{
			outcomes:  map[Outcome]prometheus.Counter{},
			releases:  map[string]prometheus.Counter{},
			stored:    markResponseHeaders(r.ReplayHeader, nil),
			notStored: markResponseHeaders(r.ReplayHeader, noStoreMode),
			problems:  map[*problem]*extprocv3.ProcessingResponse{},
		}
		for _, o := range Outcomes {
			rs.outcomes[o] = s.metrics.requests.WithLabelValues(r.Name, string(o))
		}
		for _, reason := range []string{ReleaseStatus, ReleaseEnvoyResponse, ReleaseUnknownOutcome} {
			rs.releases[reason] = s.metrics.releases.WithLabelValues(r.Name, reason)
		}
		for _, p := range problems {
			rs.problems[p] = problemResponse(p, r.ReplayHeader)
		}
		s.routes[r] = rs
	}
	d := s.metrics.storeDuration
	s.acquireObs, s.renewObs = d.WithLabelValues("acquire"), d.WithLabelValues("renew")
	s.completeObs, s.releaseObs = d.WithLabelValues("complete"), d.WithLabelValues("release")
	return s, nil
}

// Process implements [extprocv3.ExternalProcessorServer.Process]: it answers each message of
// one HTTP request in lock-step until Envoy ends the stream.
func (s *Server) Process(srv extprocv3.ExternalProcessor_ProcessServer) (err error) {
	s.streams.Add(1)
	defer s.streams.Done()
	st := newStream(s, srv.Context())
	defer func() {
		// A panic in the stream's own code ends this stream only: grpc-go does not recover
		// handlers, and the whole process, with its memory store and every other stream's
		// lease, must not go down with one request. finish then releases or keeps the lease as
		// for any stream cut short. A panic inside a store call goes on and ends the process,
		// without a further store call: the store may be left locked or half changed.
		p := recover()
		if sp, ok := p.(storePanic); ok {
			panic(sp)
		}
		st.finish()
		if p != nil {
			s.log.Error().Str("panic", fmt.Sprint(p)).Bytes("stack", debug.Stack()).Msg("stream handler panicked; the stream is ended")
			err = status.Error(codes.Internal, "idempotency-extproc: internal error")
		}
	}()
	for {
		req, err := srv.Recv()
		if err != nil {
			// Envoy ends every stream with a half-close and a reset (reference §6): both are the
			// normal end, not errors.
			if errors.Is(err, io.EOF) || status.Code(err) == codes.Canceled || errors.Is(err, context.Canceled) {
				return nil
			}
			return err
		}
		if req.GetObservabilityMode() {
			// Envoy ignores every answer (reference §4.1): nothing can be protected, and no
			// lease may be taken for a request that runs whatever the store says.
			s.observabilityOnce.Do(func() {
				s.log.Error().Msg("Envoy's ext_proc filter has observability_mode on: it ignores this processor's answers, so no request is protected; turn it off")
			})
			continue
		}
		resp := st.handle(req)
		if resp == nil {
			return nil
		}
		if err := srv.Send(resp); err != nil {
			return nil // Envoy is gone; finish decides what happens to the lease.
		}
		if resp.GetImmediateResponse() != nil {
			// Envoy processes nothing more for this request (reference §0.4).
			return nil
		}
	}
}

// Wait blocks until every stream handler has returned, and with it released or completed what
// it held, or ctx is done.
func (s *Server) Wait(ctx context.Context) error {
	done := make(chan struct{})
	go func() {
		s.streams.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// The store calls, timed and guarded: a panic inside one goes on as a storePanic. Each is bounded
// by the store itself (cache.Store: its configured timeout, store_timeout for Redis).

// bounded returns ctx for one store call, and the function to defer around the call.
func (s *Server) bounded(ctx context.Context, obs prometheus.Observer) (context.Context, func()) {
	start := time.Now()
	return ctx, func() {
		obs.Observe(time.Since(start).Seconds())
		// Deferred itself, so that recover sees the call's panic.
		if p := recover(); p != nil {
			panic(storePanic{value: p, stack: debug.Stack()})
		}
	}
}

func (s *Server) acquire(ctx context.Context, key string, c cache.Claim) (cache.Lease, *cache.Record, error) {
	ctx, done := s.bounded(ctx, s.acquireObs)
	defer done()
	return s.store.Acquire(ctx, key, c)
}

func (s *Server) renew(ctx context.Context, l cache.Lease, d time.Duration) error {
	ctx, done := s.bounded(ctx, s.renewObs)
	defer done()
	return s.store.Renew(ctx, l, d)
}

func (s *Server) complete(ctx context.Context, l cache.Lease, r cache.Response) error {
	ctx, done := s.bounded(ctx, s.completeObs)
	defer done()
	return s.store.Complete(ctx, l, r)
}

func (s *Server) release(ctx context.Context, l cache.Lease) error {
	ctx, done := s.bounded(ctx, s.releaseObs)
	defer done()
	return s.store.Release(ctx, l)
}

// storePanic is a panic raised inside a store call, with the stack it was raised on. Process
// lets it end the process: the store may be left locked (the memory store's mutex) or half
// changed, and a process that went on would hang or serve from a broken store.
type storePanic struct {
	value any
	stack []byte
}

func (p storePanic) Error() string {
	return fmt.Sprintf("idempotency-extproc: panic in a store call: %v\n\n%s", p.value, p.stack)
}
