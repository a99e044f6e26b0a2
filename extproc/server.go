// Package extproc is the Envoy external-processing server: one gRPC stream per HTTP request, and
// on it the idempotency state machine (docs/architecture.md follows one request through it).
//
// A request's path through the package: Server.Process receives each ProcessingRequest and hands
// it to its stream (stream.go), whose state moves along one transition table; the request
// headers choose the route and key (request.go), the claim's result is judged by a pure function
// (decide.go), every store call of the request is made by its leaseCall (leasecall.go), and
// every answer is rendered by one function (answer.go). The lease of a running request is
// renewed in the background (renewal.go).
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
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"

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
	// Tracer, when set, traces every covered request and its store calls; nil turns
	// tracing off at no cost.
	Tracer trace.Tracer
	// KeyHash makes the hash of stored keys and fingerprints (default SHA-256); an HMAC under a
	// secret keeps someone who reads the store from testing guesses.
	KeyHash func() hash.Hash
	// MaxStreams is how many ext_proc streams are open at once before the next is refused with
	// RESOURCE_EXHAUSTED (default DefaultMaxStreams).
	MaxStreams int
	// FirstMessageTimeout is how long a stream may stay open without its first message, when the
	// gRPC server has TapHandle (default DefaultFirstMessageTimeout).
	FirstMessageTimeout time.Duration
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
	// routes are the policy's routes, compiled.
	routes map[*policy.Route]*route
	// fixed are the encodings of the answers that never vary, fresh those of the routes' answers
	// of the current second (codec.go).
	fixed map[*extprocv3.ProcessingResponse]mem.Buffer
	fresh encodings
	// digests are the hashes of stored keys and fingerprints, reused across requests.
	digests sync.Pool
	// The store-duration series of each operation.
	acquireObs, renewObs, completeObs, releaseObs prometheus.Observer
	metadataNamespace                             string
	keyHash                                       func() hash.Hash
	tracer                                        trace.Tracer

	// The claims and completions too few replicas confirmed (route durability).
	unconfirmedClaims, unconfirmedCompletes prometheus.Counter
	// replicasSeen is the store's replicas as SetReplicas last gave them, plus one; 0 until then.
	// durabilityLogged is when leaseCall.undurable last logged (Unix ns).
	replicasSeen, durabilityLogged atomic.Int64

	streams sync.WaitGroup
	// open counts the streams admitted and not yet ended, at most maxStreams (limits.go).
	open                atomic.Int64
	maxStreams          int
	firstMessageTimeout time.Duration
	firstMessages       *firstMessageWatch // the streams' first-message deadlines, set by TapHandle
	renewals            renewalQueue       // the leases' renewals, waiting for their turn
	// misconfigLogs logs each kind of Envoy misconfiguration once per process.
	misconfigLogs map[string]*sync.Once
	// retriedLog logs once that the router retried a covered request; earlyAnswerLog that an
	// upstream answered a streamed request before its body ended.
	retriedLog, earlyAnswerLog sync.Once
	// completions retries the records the store failed to write.
	completions *completions
	// holds are the stored keys whose leases this replica holds (hold.go).
	holds holdSet
	// storeBroken is set once a store call panicked: the store may be locked or half changed.
	storeBroken atomic.Bool
	// unknownRoutes are the x-idempotency-route names already logged as unknown.
	unknownMu     sync.Mutex
	unknownRoutes map[string]struct{}
}

// NewServer returns a Server.
func NewServer(opts Options) (*Server, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	s := &Server{
		store:             opts.Store,
		policy:            opts.Policy,
		log:               *opts.Logger,
		metrics:           opts.Metrics,
		clock:             opts.Clock,
		routes:            make(map[*policy.Route]*route),
		metadataNamespace: opts.Policy.MetadataNamespace,
		keyHash:           opts.KeyHash,
		tracer:            opts.Tracer,
		misconfigLogs:     make(map[string]*sync.Once),
		unknownRoutes:     make(map[string]struct{}),
	}
	s.maxStreams, s.firstMessageTimeout = opts.MaxStreams, opts.FirstMessageTimeout
	s.renewals.clock = opts.Clock
	s.metrics.streams.limit.Set(float64(opts.MaxStreams))
	s.completions = newCompletions(s)
	for _, kind := range misconfigKinds {
		s.misconfigLogs[kind] = &sync.Once{}
	}
	for _, r := range append([]*policy.Route{opts.Policy.Default}, opts.Policy.Routes...) {
		c, err := compileRoute(r, s.metrics, s.metadataNamespace)
		if err != nil {
			return nil, err
		}
		c.encodings = &s.fresh
		s.routes[r] = c
	}
	if s.fixed, err = fixedAnswers(s.routes); err != nil {
		return nil, err
	}
	s.digests.New = func() any { return newDigest(s.keyHash) }
	d := s.metrics.storeDuration
	s.acquireObs, s.renewObs = d.WithLabelValues("acquire"), d.WithLabelValues("renew")
	s.completeObs, s.releaseObs = d.WithLabelValues("complete"), d.WithLabelValues("release")
	u := s.metrics.unconfirmed
	s.unconfirmedClaims, s.unconfirmedCompletes = u.WithLabelValues(unconfirmedClaim), u.WithLabelValues(unconfirmedComplete)
	return s, nil
}

// withDefaults returns o with every field left zero set to its default.
func (o Options) withDefaults() (Options, error) {
	if o.Store == nil {
		return o, errors.New("extproc: a store is required")
	}
	if o.MaxStreams < 0 || o.FirstMessageTimeout < 0 {
		return o, errors.New("extproc: MaxStreams and FirstMessageTimeout must not be negative")
	}
	if o.Policy == nil {
		o.Policy = policy.Default()
	}
	if o.Logger == nil {
		nop := zerolog.Nop()
		o.Logger = &nop
	}
	if o.Metrics == nil {
		m, err := NewMetrics(prometheus.NewRegistry())
		if err != nil {
			return o, err
		}
		o.Metrics = m
	}
	if o.Clock == nil {
		o.Clock = clock.Real{}
	}
	if o.MaxStreams == 0 {
		o.MaxStreams = DefaultMaxStreams
	}
	if o.FirstMessageTimeout == 0 {
		o.FirstMessageTimeout = DefaultFirstMessageTimeout
	}
	return o, nil
}

// misconfigured counts a request that showed an Envoy misconfiguration of kind, and calls log
// (if not nil) the first time the process sees that kind.
func (s *Server) misconfigured(kind string, log func()) {
	s.metrics.misconfig.WithLabelValues(kind).Inc()
	if log != nil {
		s.misconfigLogs[kind].Do(log)
	}
}

// StreamWorkers is how many goroutines the gRPC server serving a Server should keep to run
// streams (grpc.NumStreamWorkers). Envoy opens one stream per HTTP request, and without workers
// grpc-go starts a goroutine for each, whose stack then grows on every request through the
// store calls and the answers (runtime.morestack copying it). A worker keeps its grown stack
// from one stream to the next, until a garbage collection finds it idle and shrinks it. A
// stream arriving while every worker is busy gets a goroutine of its own, as without workers,
// so the number bounds only the memory the idle ones hold.
// grpc-go marks the option experimental: recheck it when upgrading grpc-go.
// Measured in e2e/bench (docs/performance.md): 5 to 10 µs of CPU per first execution, with the
// null processor served the same way.
const StreamWorkers = 256

// maxUnknownRoutes bounds the unknown route names remembered for logging once each: Envoy's
// callers can send any number of names, and the set must not grow with them. Once full it is
// emptied, so a name may be logged again.
const maxUnknownRoutes = 1024

// maxLoggedBytes bounds a client-chosen string in a log line (a route name, a request id).
const (
	maxLoggedRouteName = 256
	maxLoggedRequestID = 128
)

// firstUnknownRoute reports whether an unknown route name, cut to maxLoggedRouteName bytes, is
// not among the names remembered (at most maxUnknownRoutes of them), and remembers it.
func (s *Server) firstUnknownRoute(name string) bool {
	name = name[:min(len(name), maxLoggedRouteName)]
	s.unknownMu.Lock()
	defer s.unknownMu.Unlock()
	if _, ok := s.unknownRoutes[name]; ok {
		return false
	}
	if len(s.unknownRoutes) >= maxUnknownRoutes {
		clear(s.unknownRoutes)
	}
	s.unknownRoutes[name] = struct{}{}
	return true
}

// Process implements [extprocv3.ExternalProcessorServer.Process]: it answers the messages of one
// HTTP request until Envoy ends the stream. Outside FULL_DUPLEX_STREAMED each message has one
// answer, except the body chunks whose answers the claim withholds and then sends together. A
// stream beyond MaxStreams is refused at once with RESOURCE_EXHAUSTED (limits.go).
func (s *Server) Process(srv extprocv3.ExternalProcessor_ProcessServer) error {
	first, _ := srv.Context().Value(firstMessageKey{}).(*firstMessageContext)
	if err := s.enter(first); err != nil {
		return err
	}
	// The gauge of open streams comes down before Wait sees the stream end.
	s.streams.Add(1)
	defer s.streams.Done()
	defer s.leave()
	st := newStream(s, srv.Context(), first)
	// Runs on a panic too (see StreamInterceptor): the lease is released or kept as for any
	// stream cut short.
	defer st.finish()
	for {
		req, err := srv.Recv()
		if first != nil {
			if err := first.arrived(); err != nil {
				return err
			}
			first = nil
		}
		if err != nil {
			// Envoy ends every stream with a half-close and a reset
			// (ExternalProcessorStreamImpl::close in
			// source/extensions/filters/http/ext_proc/client_impl.cc): both are the normal end, not
			// errors.
			if errors.Is(err, io.EOF) || status.Code(err) == codes.Canceled || errors.Is(err, context.Canceled) {
				return nil
			}
			return err
		}
		if req.GetObservabilityMode() {
			// Envoy ignores every answer (Filter::onReceiveMessage returns at once in observability
			// mode, source/extensions/filters/http/ext_proc/ext_proc.cc): nothing can be protected,
			// and no lease may be taken for a request that runs whatever the store says.
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
				// Envoy processes nothing more for this request: Filter::onReceiveMessage marks
				// processing complete and closes the stream before Filter::sendImmediateResponse.
				return nil
			}
		}
		// Sent: the stream keeps none of it, bodies streamed back included, while it waits for
		// Envoy's next message.
		clear(answers)
	}
}

// StreamInterceptor returns the gRPC stream interceptor that keeps one stream's panic from ending
// the process: grpc-go does not recover handlers, and the whole process, with its memory store
// and every other stream's lease, must not go down with one request. The stream ends with
// codes.Internal, and its lease is released or kept as for any stream cut short. A panic inside a
// store call (the stream's leaseCall is then leaseInStore, and stream.finish marks the store
// broken) goes on and ends the process, and no further store call is made: the store may be left
// locked (the memory store's mutex) or half changed, and a process that went on would hang or
// serve from a broken store. Install it on the gRPC server that serves s.
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

// Shutdown waits until every stream handler has returned and every completion whose write is
// being retried has been written, or ctx is done. Then it gives up the writes still pending
// (their leases expire after lock_ttl; each is counted and logged) and returns once no
// background work of the server remains. Call it once the gRPC server has stopped.
func (s *Server) Shutdown(ctx context.Context) error {
	err := s.Wait(ctx)
	if err == nil {
		err = s.completions.wait(ctx)
	}
	s.completions.stop()
	return err
}

// Wait blocks until every stream handler has returned, and with it released or completed what
// it held (or handed a completion the store failed to write to the background retries), or ctx
// is done.
func (s *Server) Wait(ctx context.Context) error {
	return waitGroup(ctx, &s.streams)
}

// waitGroup waits for wg or for ctx, whichever ends first. sync.WaitGroup has no wait with a
// deadline, so a goroutine waits and is left to end with the group when ctx wins.
func waitGroup(ctx context.Context, wg *sync.WaitGroup) error {
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
