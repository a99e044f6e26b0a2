// Package proxy is an HTTP reverse proxy that drives ext_proc servers the way Envoy's ext_proc
// HTTP filter does, for end-to-end tests on machines without an Envoy binary. It models Envoy,
// not the product: every behaviour cites the Envoy source it follows (file and function).
//
// Modelled, from Envoy 1.37's source (ext_proc.cc, processor_state.cc, mutation_utils.cc,
// mutation_rules.cc, matching_utils.cc, http/utility.cc, local_reply.cc, filter_manager.cc,
// router.cc, grpc/async_client_impl.cc, jwt_authn/filter.cc):
//   - one side stream per request, opened by the first message, with protocol_config on it,
//     attributes on each direction's first message and metadata_context on every message;
//   - every body mode: BUFFERED (held during the header call, 413/500 over the buffer limit),
//     STREAMED (pipelined chunks, data held until each answer, the watermark stopping the reading
//     above the buffer limit, the timer re-armed at each send), BUFFERED_PARTIAL (one message up
//     to the limit, the rest unseen), FULL_DUPLEX_STREAMED (no timer, streamed_response required,
//     trailers answered), NONE, GRPC (no case in Filter::onData: no body message, unless the
//     body came whole during the header call); in every mode a body complete during the header
//     call goes as one message (ProcessorState::handleCompleteBodyAvailable); request and
//     response trailers with SEND/SKIP; send_body_without_waiting_for_header_response;
//   - answers: header and body mutations under mutation_rules (disallow_is_error included),
//     CONTINUE_AND_REPLACE, mode_override (merged with the filter-level mode), allowed override
//     modes, override_message_timeout, dynamic_metadata for receiving namespaces, spurious
//     answers, ImmediateResponse;
//   - failures: message_timeout (504), gRPC errors and status_on_error, failure_mode_allow (not
//     once a FULL_DUPLEX_STREAMED body flowed), clean close, observability_mode (send and go,
//     deferred close);
//   - local replies in Utility::sendLocalReply's order, local_reply_config, gRPC trailers-only
//     conversion, through the encoder filters before response headers, straight to the codec
//     after, a reset once headers went downstream; Envoy versions that skip ext_proc for local
//     replies (Behaviour);
//   - the router: a route table with names, metadata and ExtProcPerRoute (disabled, overrides of
//     processing_mode, grpc_initial_metadata, metadata_options, failure_mode_allow), 404 without
//     a route, 503 on connect failure or reset before headers, 504 on the route timeout, resets
//     after the response started, the attempt count, retries on the response status
//     (retry_policy's 5xx, gateway-error, retriable-4xx, retriable-status-codes), hedging on
//     per-try timeouts (hedge_policy's hedge_on_per_try_timeout: hedge.go);
//   - jwt_authn before ext_proc (local JWKS, HS256/RS256), forward_rules, the early stream close
//     of 1.37, the trace context on the side stream, mTLS peer identity;
//   - HTTP/2 without TLS (prior knowledge) toward clients and toward the upstream, beside
//     HTTP/1.1 (Config.DownstreamHTTP2, Config.UpstreamHTTP2): trailers always pass on HTTP/2
//     (enable_trailers is an HTTP/1 option), a body of announced length may still end with
//     trailers, the HTTP/1 codec's content-length: 0 and connection close do not apply, a
//     trailers-only reply is one HEADERS frame, a reset is an RST_STREAM; gRPC requests
//     (Grpc::Common::hasGrpcContentType) get trailers-only local replies
//     (Utility::prepareLocalReply);
//   - streamed_immediate_response (Filter::handleStreamingImmediateResponse, Envoy 1.37+): headers
//     only as the answer to request_headers (held under FULL_DUPLEX_STREAMED while the body goes
//     to the processor), a body only in request body modes NONE and FULL_DUPLEX_STREAMED, parts
//     out of order spurious, headers under mutation_rules, body and trailers straight to the
//     client, the upstream never called. The ProcessorState side (startLocalResponse,
//     processLocalBodyResponse, processLocalTrailersResponse in processor_state.cc) follows the
//     unit tests of filter_local_reply_streaming_test.cc, the source of those functions not
//     having been read; a headers answer without a valid :status gets the proxy's own details.
//
// Not modelled: HTTP/2 over TLS (ALPN), HTTP/2 flow control, settings and header limits, request
// trailers a client did not declare in a trailer header on HTTP/2 (Go's server drops them), the
// te header (dropped whatever its value), http_service, clear_route_cache and route
// re-selection, graceful gRPC close, grpc_service overrides per route, typed metadata,
// connection-level metadata, header count and size limits, the upstream side's own flow control,
// retries on resets, connection failures and per-try timeouts without hedging, and CEL
// expressions other than attribute paths. Body data arrives in reads of up to DefaultReadSize
// unless a Shape says otherwise; real chunk sizes follow socket reads (on HTTP/2, DATA frames:
// grpc-go ends a request with an empty one).
package proxy

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/proto"
)

type counters struct {
	streamsStarted, streamErrors, streamsClosedEarly, messagesSent, messagesReceived, spurious,
	messageTimeouts, failureModeAllowed, immediateResponses, streamedImmediate, immediateMutationErrors,
	rejectedMutations, modeOverrides, modeOverridesIgnored, timeoutOverrides,
	timeoutOverridesIgnored, localReplies, resets atomic.Int64
}

// Proxy is an Envoy-compatible HTTP proxy with one ext_proc filter. It is safe for concurrent
// use. Every goroutine it starts for a request ends before ServeHTTP returns, except the
// deferred close of an observability-mode stream, which Close waits for.
type Proxy struct {
	cfg            Config
	filter         *filterextproc.ExternalProcessor
	upstream       *url.URL
	messageTimeout time.Duration
	maxMsgTimeout  time.Duration
	statusOnError  int
	requestLimit   int64
	responseLimit  int64
	routeTimeout   time.Duration
	routes         []*route
	rules          *mutationRules
	forward        *forwardRules
	localReply     *localReplyConfig
	jwt            *jwtFilter

	conns     []*grpc.ClientConn
	clients   []extprocv3.ExternalProcessorClient
	healthy   []atomic.Bool // per processor, kept by the health checker
	next      atomic.Uint64
	transport *http.Transport
	stats     counters

	ctx    context.Context // cancelled by Close: aborts requests in flight
	stop   context.CancelFunc
	mu     sync.Mutex
	closed bool
	wg     sync.WaitGroup // requests in flight, health checks, deferred closes

	srv       *http.Server
	ln        net.Listener
	serveDone chan struct{}
	closeOnce sync.Once
	closeErr  error
}

// New checks cfg, copies cfg.Filter, fills in Envoy's defaults and dials (lazily) every
// processor. It fails on a configuration Envoy rejects (FULL_DUPLEX_STREAMED without trailer mode
// SEND or with failure_mode_allow, http_service with a body or trailer mode that sends) and on
// one the proxy cannot follow faithfully.
func New(cfg Config) (*Proxy, error) {
	if len(cfg.Processors) == 0 {
		return nil, errors.New("proxy: no processors")
	}
	u, err := url.Parse(cfg.Upstream)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("proxy: upstream %q is not an http(s) URL", cfg.Upstream)
	}
	filter := &filterextproc.ExternalProcessor{}
	if cfg.Filter != nil {
		filter = proto.Clone(cfg.Filter).(*filterextproc.ExternalProcessor)
	}
	if filter.ProcessingMode == nil {
		filter.ProcessingMode = &filterextproc.ProcessingMode{}
	}
	if err := verifyFilter(filter); err != nil {
		return nil, err
	}
	p := &Proxy{
		cfg:            cfg,
		filter:         filter,
		upstream:       u,
		messageTimeout: DefaultMessageTimeout,
		statusOnError:  http.StatusInternalServerError,
		requestLimit:   int64(cfg.ListenerBufferLimit),
		responseLimit:  int64(cfg.UpstreamBufferLimit),
		routeTimeout:   cfg.RouteTimeout,
	}
	// An unset message_timeout is 200 ms (ExternalProcessingFilterConfig::DefaultMessageTimeoutMs
	// in source/extensions/filters/http/ext_proc/config.h); an explicit 0 fires at once.
	if d := filter.GetMessageTimeout(); d != nil {
		p.messageTimeout = d.AsDuration()
	}
	// max_message_timeout 0 disables override_message_timeout: Filter::onNewTimeout
	// (source/extensions/filters/http/ext_proc/ext_proc.cc) ignores any override above it.
	p.maxMsgTimeout = filter.GetMaxMessageTimeout().AsDuration()
	if c := filter.GetStatusOnError().GetCode(); c >= 100 && c <= 999 {
		p.statusOnError = int(c)
	}
	if p.requestLimit == 0 {
		p.requestLimit = DefaultBufferLimit
	}
	if p.responseLimit == 0 {
		p.responseLimit = DefaultBufferLimit
	}
	if p.routeTimeout <= 0 {
		p.routeTimeout = DefaultRouteTimeout
	}
	if p.routes, err = buildRoutes(cfg); err != nil {
		return nil, err
	}
	if p.rules, err = compileMutationRules(filter.GetMutationRules()); err != nil {
		return nil, fmt.Errorf("proxy: %w", err)
	}
	if fr := filter.GetForwardRules(); fr != nil {
		if p.forward, err = compileForwardRules(fr.GetAllowedHeaders().GetPatterns(), fr.GetDisallowedHeaders().GetPatterns()); err != nil {
			return nil, fmt.Errorf("proxy: %w", err)
		}
	}
	if p.localReply, err = compileLocalReplyConfig(cfg.LocalReplyConfig); err != nil {
		return nil, fmt.Errorf("proxy: %w", err)
	}
	if p.jwt, err = compileJWT(cfg.JWTAuthn); err != nil {
		return nil, fmt.Errorf("proxy: %w", err)
	}
	p.transport = &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		DisableCompression:  true, // forward bodies byte for byte
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     30 * time.Second,
	}
	if cfg.UpstreamHTTP2 {
		// http2_protocol_options on the upstream cluster: HTTP/2 with prior knowledge over
		// plaintext, HTTP/2 through TLS.
		p.transport.Protocols = new(http.Protocols)
		p.transport.Protocols.SetUnencryptedHTTP2(true)
		p.transport.Protocols.SetHTTP2(true)
	}
	for _, addr := range cfg.Processors {
		conn, err := grpc.NewClient(addr,
			grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithConnectParams(grpc.ConnectParams{
				Backoff:           backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
				MinConnectTimeout: time.Second,
			}),
			// Envoy's envoy_grpc max_receive_message_length defaults to unlimited (its field doc
			// in api/envoy/config/core/v3/grpc_service.proto).
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(math.MaxInt32), grpc.MaxCallSendMsgSize(math.MaxInt32)),
		)
		if err != nil {
			p.closeConns()
			return nil, fmt.Errorf("proxy: processor %q: %w", addr, err)
		}
		p.conns = append(p.conns, conn)
		p.clients = append(p.clients, extprocv3.NewExternalProcessorClient(conn))
	}
	p.ctx, p.stop = context.WithCancel(context.Background())
	p.healthy = make([]atomic.Bool, len(p.clients))
	for i := range p.healthy {
		p.healthy[i].Store(true)
	}
	if hc := cfg.HealthCheck; hc != nil && hc.Interval > 0 {
		for i := range p.conns {
			p.wg.Add(1)
			go p.checkHealth(i, *hc)
		}
	}
	return p, nil
}

// checkHealth runs the active health check of processor i until Close.
func (p *Proxy) checkHealth(i int, hc HealthCheck) {
	defer p.wg.Done()
	client := healthpb.NewHealthClient(p.conns[i])
	fails, passes := 0, 0
	t := time.NewTicker(hc.Interval)
	defer t.Stop()
	for {
		select {
		case <-p.ctx.Done():
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(p.ctx, max(hc.Timeout, time.Millisecond))
		resp, err := client.Check(ctx, &healthpb.HealthCheckRequest{Service: hc.ServiceName})
		cancel()
		if err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			fails, passes = 0, passes+1
			if passes >= max(hc.HealthyThreshold, 1) {
				p.healthy[i].Store(true)
			}
			continue
		}
		fails, passes = fails+1, 0
		if fails >= max(hc.UnhealthyThreshold, 1) {
			p.healthy[i].Store(false)
		}
	}
}

// pick returns the next processor in round robin among the healthy ones, or among all when none
// is healthy (Envoy's panic mode), skipping the index avoid (-1 for none) when it can.
func (p *Proxy) pick(avoid int) int {
	n := len(p.clients)
	start := int((p.next.Add(1) - 1) % uint64(n))
	for _, wantHealthy := range []bool{true, false} {
		for k := range n {
			i := (start + k) % n
			if i == avoid && n > 1 {
				continue
			}
			if !wantHealthy || p.healthy[i].Load() {
				return i
			}
		}
	}
	return start
}

// Start builds a proxy with New and serves it on 127.0.0.1 on a free port until the test ends,
// over TLS when cfg.TLS is set. It fails the test if cfg is invalid.
func Start(t testing.TB, cfg Config) *Proxy {
	t.Helper()
	p, err := New(cfg)
	if err != nil {
		t.Fatalf("proxy.Start: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		_ = p.Close()
		t.Fatalf("proxy.Start: %v", err)
	}
	if cfg.TLS != nil {
		ln = tls.NewListener(ln, cfg.TLS)
	}
	p.ln = ln
	p.srv = &http.Server{Handler: p, ReadHeaderTimeout: 10 * time.Second}
	if cfg.DownstreamHTTP2 && cfg.TLS == nil {
		p.srv.Protocols = new(http.Protocols)
		p.srv.Protocols.SetHTTP1(true)
		p.srv.Protocols.SetUnencryptedHTTP2(true)
	}
	p.serveDone = make(chan struct{})
	go func() {
		defer close(p.serveDone)
		_ = p.srv.Serve(ln)
	}()
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// URL returns the base URL of a proxy made by Start, "" for one made by New.
func (p *Proxy) URL() string {
	if p.ln == nil {
		return ""
	}
	if p.cfg.TLS != nil {
		return "https://" + p.ln.Addr().String()
	}
	return "http://" + p.ln.Addr().String()
}

// Stats returns a snapshot of the counters.
func (p *Proxy) Stats() Stats {
	c := &p.stats
	return Stats{
		StreamsStarted:             c.streamsStarted.Load(),
		StreamErrors:               c.streamErrors.Load(),
		StreamsClosedEarly:         c.streamsClosedEarly.Load(),
		MessagesSent:               c.messagesSent.Load(),
		MessagesReceived:           c.messagesReceived.Load(),
		Spurious:                   c.spurious.Load(),
		MessageTimeouts:            c.messageTimeouts.Load(),
		FailureModeAllowed:         c.failureModeAllowed.Load(),
		ImmediateResponses:         c.immediateResponses.Load(),
		StreamedImmediateResponses: c.streamedImmediate.Load(),
		RejectedMutations:          c.rejectedMutations.Load(),
		ImmediateMutationErrors:    c.immediateMutationErrors.Load(),
		ModeOverrides:              c.modeOverrides.Load(),
		ModeOverridesIgnored:       c.modeOverridesIgnored.Load(),
		TimeoutOverrides:           c.timeoutOverrides.Load(),
		TimeoutOverridesIgnored:    c.timeoutOverridesIgnored.Load(),
		LocalReplies:               c.localReplies.Load(),
		Resets:                     c.resets.Load(),
	}
}

// Close stops the listener of a proxy made by Start, aborts the requests in flight and waits
// for them, then closes the processor connections. It is safe to call more than once.
func (p *Proxy) Close() error {
	p.closeOnce.Do(func() {
		p.mu.Lock()
		p.closed = true
		p.mu.Unlock()
		p.stop()
		if p.srv != nil {
			p.closeErr = p.srv.Close()
			<-p.serveDone
		}
		p.wg.Wait()
		p.closeConns()
		p.transport.CloseIdleConnections()
	})
	return p.closeErr
}

func (p *Proxy) closeConns() {
	for _, c := range p.conns {
		_ = c.Close()
	}
}

// enter registers a request unless the proxy is closed.
func (p *Proxy) enter() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.wg.Add(1)
	return true
}

// ServeHTTP proxies one request through the filter chain.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !p.enter() {
		http.Error(w, "proxy closed", http.StatusServiceUnavailable)
		return
	}
	defer p.wg.Done()

	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	stopAfter := context.AfterFunc(p.ctx, cancel)
	defer stopAfter()

	x := &exchange{p: p, filter: p.filter, w: w, r: r, ctx: ctx, cancel: cancel, start: time.Now()}
	if p.cfg.Shapes != nil {
		x.shape = p.cfg.Shapes(r)
	}
	x.run()
	if x.resetH2 {
		// An HTTP/2 stream is reset on its own (RST_STREAM), the connection stays.
		panic(http.ErrAbortHandler)
	}
}
