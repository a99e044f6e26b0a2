// Package extproc is the Envoy external-processing server: one gRPC stream per HTTP request, and
// on it the idempotency state machine of SPEC §3, §4 and §8.
//
// A request's path through the package: Server.Process receives each ProcessingRequest and hands
// it to its stream (stream.go), whose state moves along one transition table; the request
// headers choose the route and key (request.go), the claim makes the one store round trip, the
// response phases record the outcome, and every answer is rendered by one function
// (answer.go). The lease of a running request is renewed in the background (renewal.go).
package extproc

import (
	"context"
	"errors"
	"fmt"
	"hash"
	"io"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

// Options configures a Server. Store is required; the zero value of every other field gives its
// default.
type Options struct {
	// Store holds the records. It bounds each call by its own timeout (cache.Store).
	Store cache.Store
	// Policy decides which requests are covered and how (default policy.Default()).
	Policy *policy.Policy
	// Logger receives one line per covered request and every store failure (default: none).
	Logger *zerolog.Logger
	// Metrics are updated for every request (default: metrics on a registry of their own).
	Metrics *Metrics
	// Clock times lease renewals (default: the wall clock).
	Clock clock.Clock
	// Tracer, when set, traces every covered request and its store calls (SPEC §9); nil turns
	// tracing off at no cost.
	Tracer trace.Tracer
	// KeyHash makes the hash of stored keys and fingerprints (default SHA-256); an HMAC under a
	// secret keeps someone who reads the store from testing guesses (SPEC §12).
	KeyHash func() hash.Hash
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
	metadataNamespace                             string
	keyHash                                       func() hash.Hash
	tracer                                        trace.Tracer

	// The claims and completions too few replicas confirmed (route durability).
	unconfirmedClaims, unconfirmedCompletes prometheus.Counter

	streams sync.WaitGroup
	// misconfigLogs logs each kind of Envoy misconfiguration once per process.
	misconfigLogs map[string]*sync.Once
	// retriedLog logs once that the router retried a covered request; earlyAnswerLog that an
	// upstream answered a streamed request before its body ended.
	retriedLog, earlyAnswerLog sync.Once
	// storeBroken is set once a store call panicked: the store may be locked or half changed.
	storeBroken atomic.Bool
	// unknownRoutes are the x-idempotency-route names already logged as unknown.
	unknownMu     sync.Mutex
	unknownRoutes map[string]bool
}

// routeState is what a route needs per request, built once: its metric series and the answers
// that depend only on the route.
type routeState struct {
	outcomes map[Outcome]prometheus.Counter
	releases map[string]prometheus.Counter
	unknown  map[policy.UnknownOutcome]prometheus.Counter
	// shadow counts what enforcement would have done, by outcome (shadow routes only: empty
	// for a route that enforces, whose streams never count here).
	shadow map[Outcome]prometheus.Counter
	// unreadable counts the stored records this process could not open.
	unreadable prometheus.Counter
	// retried counts covered requests the router sent upstream more than once.
	retried prometheus.Counter
	// waitCalls counts the store calls of duplicates waiting for an in-flight request.
	waitCalls prometheus.Counter
	// stored continues a response that will be stored; notStored also turns its body phase off.
	stored, notStored *extprocv3.ProcessingResponse
	// passThrough and passContinue answer the request headers of an uncovered request, with
	// and without the pass-through mode_override, carrying the route's dynamic metadata.
	passThrough, passContinue *extprocv3.ProcessingResponse
	problems                  map[*problem]*extprocv3.ProcessingResponse
	// name is the route's name as a metadata value.
	name *structpb.Value
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
		store:             opts.Store,
		policy:            opts.Policy,
		log:               *opts.Logger,
		metrics:           opts.Metrics,
		clock:             opts.Clock,
		routes:            make(map[*policy.Route]*routeState),
		metadataNamespace: opts.Policy.MetadataNamespace,
		keyHash:           opts.KeyHash,
		tracer:            opts.Tracer,
		misconfigLogs:     make(map[string]*sync.Once),
		unknownRoutes:     make(map[string]bool),
	}
	for _, kind := range misconfigKinds {
		s.misconfigLogs[kind] = &sync.Once{}
	}
	for _, r := range append([]*policy.Route{opts.Policy.Default}, opts.Policy.Routes...) {
		routeValue := structpb.NewStringValue(r.Name)
		passMeta := metadataFields(s.metadataNamespace, routeValue, Passthrough, "", "")
		rs := &routeState{
			outcomes:     map[Outcome]prometheus.Counter{},
			releases:     map[string]prometheus.Counter{},
			unknown:      map[policy.UnknownOutcome]prometheus.Counter{},
			stored:       markResponseHeaders(r, nil, time.Time{}),
			notStored:    markResponseHeaders(r, noStoreMode, time.Time{}),
			passThrough:  withMetadata(passThroughRequestHeaders, passMeta),
			passContinue: withMetadata(continues[kindRequestHeaders], passMeta),
			problems:     map[*problem]*extprocv3.ProcessingResponse{},
			shadow:       map[Outcome]prometheus.Counter{},
			waitCalls:    s.metrics.waitCalls.WithLabelValues(r.Name),
			unreadable:   s.metrics.unreadable.WithLabelValues(r.Name),
			retried:      s.metrics.upstreamRetries.WithLabelValues(r.Name),
			name:         routeValue,
		}
		if r.Mode == policy.ModeShadow {
			for _, o := range Outcomes {
				rs.shadow[o] = s.metrics.shadow.WithLabelValues(r.Name, string(o))
			}
		}
		for _, o := range Outcomes {
			rs.outcomes[o] = s.metrics.requests.WithLabelValues(r.Name, string(o))
		}
		for _, reason := range releaseReasons {
			rs.releases[reason] = s.metrics.releases.WithLabelValues(r.Name, reason)
		}
		for _, u := range []policy.UnknownOutcome{policy.UnknownOutcomeRelease, policy.UnknownOutcomeKeep, policy.UnknownOutcomeRecord} {
			rs.unknown[u] = s.metrics.unknownOutcomes.WithLabelValues(r.Name, string(u))
		}
		for _, p := range problems {
			resp, err := problemResponse(p, r)
			if err != nil {
				return nil, err
			}
			rs.problems[p] = resp
		}
		s.routes[r] = rs
	}
	d := s.metrics.storeDuration
	s.acquireObs, s.renewObs = d.WithLabelValues("acquire"), d.WithLabelValues("renew")
	s.completeObs, s.releaseObs = d.WithLabelValues("complete"), d.WithLabelValues("release")
	u := s.metrics.unconfirmed
	s.unconfirmedClaims, s.unconfirmedCompletes = u.WithLabelValues(unconfirmedClaim), u.WithLabelValues(unconfirmedComplete)
	return s, nil
}

func withMetadata(r *extprocv3.ProcessingResponse, md *structpb.Struct) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: r.Response, ModeOverride: r.ModeOverride, DynamicMetadata: md}
}

// misconfigured counts a request that showed an Envoy misconfiguration of kind, and calls log
// (if not nil) the first time the process sees that kind.
func (s *Server) misconfigured(kind string, log func()) {
	s.metrics.misconfig.WithLabelValues(kind).Inc()
	if log != nil {
		s.misconfigLogs[kind].Do(log)
	}
}

// firstUnknownRoute reports whether name is the first time an unknown route name is seen.
func (s *Server) firstUnknownRoute(name string) bool {
	s.unknownMu.Lock()
	defer s.unknownMu.Unlock()
	if s.unknownRoutes[name] {
		return false
	}
	s.unknownRoutes[name] = true
	return true
}

// Process implements [extprocv3.ExternalProcessorServer.Process]: it answers the messages of one
// HTTP request until Envoy ends the stream. Outside FULL_DUPLEX_STREAMED each message has one
// answer, except the body chunks whose answers the claim withholds and then sends together.
func (s *Server) Process(srv extprocv3.ExternalProcessor_ProcessServer) error {
	s.streams.Add(1)
	defer s.streams.Done()
	st := newStream(s, srv.Context())
	// Runs on a panic too (see StreamInterceptor): the lease is released or kept as for any
	// stream cut short.
	defer st.finish()
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
			s.misconfigured(MisconfigObservabilityMode, func() {
				s.log.Error().Msg("Envoy's ext_proc filter has observability_mode on: it ignores this processor's answers, so no request is protected; turn it off")
			})
			continue
		}
		answers, ok := st.handle(req)
		if !ok {
			return nil
		}
		for _, resp := range answers {
			if err := srv.Send(resp); err != nil {
				return nil // Envoy is gone; finish decides what happens to the lease.
			}
			if resp.GetImmediateResponse() != nil {
				// Envoy processes nothing more for this request (reference §0.4).
				return nil
			}
		}
	}
}

// StreamInterceptor returns the gRPC stream interceptor that keeps one stream's panic from ending
// the process: grpc-go does not recover handlers, and the whole process, with its memory store
// and every other stream's lease, must not go down with one request. The stream ends with
// codes.Internal, and its lease is released or kept as for any stream cut short. A panic inside a
// store call goes on and ends the process, and no further store call is made: the store may be
// left locked (the memory store's mutex) or half changed, and a process that went on would hang
// or serve from a broken store. Install it on the gRPC server that serves s.
func (s *Server) StreamInterceptor() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) (err error) {
		defer func() {
			p := recover()
			if p == nil {
				return
			}
			if s.storeBroken.Load() {
				panic(fmt.Sprintf("idempotency-extproc: panic in a store call: %v", p))
			}
			s.log.Error().Str("panic", fmt.Sprint(p)).Bytes("stack", debug.Stack()).Msg("stream handler panicked; the stream is ended")
			err = status.Error(codes.Internal, "idempotency-extproc: internal error")
		}()
		return handler(srv, ss)
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

// The store calls of a stream, each timed. The store bounds each by its own timeout. While one
// runs, st.inStore is set, and only a call that returns clears it: a panic from inside the store
// leaves it set, so that the stream's finish makes no further store call and StreamInterceptor
// lets the panic end the process. Nothing here recovers.

func (s *Server) acquire(st *stream, c cache.Claim) (cache.Lease, *cache.Record, error) {
	start, sp := time.Now(), st.storeSpan("acquire")
	st.inStore = true
	l, rec, err := s.store.Acquire(st.ctx, st.storeKey, c)
	st.inStore = false
	s.acquireObs.Observe(time.Since(start).Seconds())
	endStoreSpan(sp, err)
	if errors.Is(err, cache.ErrUnconfirmed) {
		// Withdrawn: the caller answers it as any store failure, and the request does not run.
		s.unconfirmedClaims.Inc()
	}
	return l, rec, err
}

func (s *Server) complete(st *stream, ctx context.Context, l cache.Lease, r cache.Response) error {
	start, sp := time.Now(), st.storeSpan("complete")
	st.inStore = true
	err := s.store.Complete(ctx, l, r)
	st.inStore = false
	s.completeObs.Observe(time.Since(start).Seconds())
	endStoreSpan(sp, err)
	if errors.Is(err, cache.ErrUnconfirmed) {
		// The record is written and the lease spent: the completion is done. Only a failover
		// before the replicas catch up could lose it.
		s.unconfirmedCompletes.Inc()
		st.event(s.log.Warn()).Err(err).Msg("completion not confirmed by the store's replicas; a failover before they catch up may lose the record")
		return nil
	}
	return err
}

func (s *Server) release(st *stream, ctx context.Context, l cache.Lease) error {
	start, sp := time.Now(), st.storeSpan("release")
	st.inStore = true
	err := s.store.Release(ctx, l)
	st.inStore = false
	s.releaseObs.Observe(time.Since(start).Seconds())
	endStoreSpan(sp, err)
	return err
}

// renew runs on a renewal's timer goroutine, where a panic ends the process by itself; sp is its
// span, or nil.
func (s *Server) renew(ctx context.Context, sp trace.Span, l cache.Lease, d time.Duration) error {
	start := time.Now()
	err := s.store.Renew(ctx, l, d)
	s.renewObs.Observe(time.Since(start).Seconds())
	endStoreSpan(sp, err)
	return err
}
