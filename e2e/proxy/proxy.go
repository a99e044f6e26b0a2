// Package proxy is an HTTP reverse proxy that drives ext_proc servers the way Envoy's ext_proc
// HTTP filter does, for end-to-end tests on machines without an Envoy binary.
//
// Each HTTP request gets one ExternalProcessor.Process stream, and the proxy follows Envoy's
// sequencing: lock-step messages bounded by message_timeout, raw_value headers with
// pseudo-headers, attributes and protocol_config on the first messages, BUFFERED, STREAMED and
// BUFFERED_PARTIAL bodies with Envoy's buffer limits, ImmediateResponse local replies,
// mode_override with allowed_override_modes, the default header mutation rules, failure_mode_allow
// and status_on_error, router local replies (503, 504), and the half-close plus reset that ends
// every stream. Comments cite the project's Envoy ext_proc notes (reference/envoy-extproc.md)
// as "reference §N".
//
// What it does not do is listed in the doc comment of Config.
package proxy

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/url"
	"strings"
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

// Defaults that match Envoy's (reference §4.1, §9).
const (
	// DefaultBufferLimit is Envoy's default per_connection_buffer_limit_bytes (1 MiB).
	DefaultBufferLimit = 1 << 20
	// DefaultRouteTimeout is Envoy's default route timeout.
	DefaultRouteTimeout = 15 * time.Second
	// DefaultMessageTimeout is ext_proc's default message_timeout.
	DefaultMessageTimeout = 200 * time.Millisecond
)

// Config describes one proxy: an HTTP listener with a single ext_proc filter in front of a
// router with one upstream cluster.
//
// Response trailers, kept only with UpstreamTrailers: a response whose upstream sent trailers
// ends its body with end_of_stream false (no empty last chunk), then a response_trailers
// message when response_trailer_mode is SEND, in every body mode (trailer mutations are not
// applied); downstream, with DownstreamTrailers, a response without a content-length carries
// them.
//
// Not implemented: request trailers (no request_trailers message is ever sent, as if no
// request had trailers), FULL_DUPLEX_STREAMED and GRPC body modes, observability_mode,
// send_body_without_waiting_for_header_response pipelining (the flag is reported in
// protocol_config and disables mode_override, but bodies still wait for the header answer),
// metadata_options and dynamic_metadata, forward_rules, mutation_rules other than the defaults
// (and so :path and :status mutations, which Envoy's defaults allow, are ignored like the other
// pseudo-headers), streamed_immediate_response, grpc_status in ImmediateResponse,
// clear_route_cache, per-route overrides other than disabling ext_proc, the early stream close
// of Envoy 1.37+, and HTTP/2 downstream.
//
// Approximations: STREAMED bodies are strictly lock-step (Envoy may pipeline chunks); a message
// the processor sends while no answer is awaited is noticed only when the next answer is
// awaited, as a spurious answer; the route timeout starts when the upstream request starts and
// keeps running while the processor handles the response headers.
type Config struct {
	// Filter is the ext_proc filter configuration. The proxy honours processing_mode,
	// allow_mode_override, allowed_override_modes, message_timeout, max_message_timeout,
	// failure_mode_allow, status_on_error, disable_immediate_response,
	// send_body_without_waiting_for_header_response (see the type's doc), request_attributes and
	// response_attributes. grpc_service is ignored: the processors are in Processors. Nil means
	// an empty configuration (headers SEND, bodies NONE).
	Filter *filterextproc.ExternalProcessor
	// Processors are the ext_proc gRPC addresses, host:port or unix:///path. Each HTTP request
	// opens one stream to the next address, round robin.
	Processors []string
	// Upstream is the upstream base URL, e.g. http://127.0.0.1:8080. Only its scheme and host
	// are used; the request's path is forwarded as is.
	Upstream string
	// ListenerBufferLimit bounds BUFFERED request bodies (Envoy's listener
	// per_connection_buffer_limit_bytes); 0 means DefaultBufferLimit.
	ListenerBufferLimit uint32
	// UpstreamBufferLimit bounds BUFFERED response bodies (the upstream cluster's
	// per_connection_buffer_limit_bytes); 0 means DefaultBufferLimit.
	UpstreamBufferLimit uint32
	// UpstreamTrailers and DownstreamTrailers are the enable_trailers of the upstream cluster's
	// and of the connection manager's HTTP/1 options: without the first, the upstream's trailers
	// are dropped (the body ends as if there were none); without the second, they do not go
	// downstream.
	UpstreamTrailers, DownstreamTrailers bool
	// RouteTimeout bounds the upstream exchange, from sending the request to the end of the
	// response body; 0 means DefaultRouteTimeout.
	RouteTimeout time.Duration
	// DisabledPrefixes are path prefixes whose route disables ext_proc (ExtProcPerRoute
	// disabled: true): such requests are proxied untouched and open no stream.
	DisabledPrefixes []string
	// LocalRepliesToExtProc makes router-generated replies (503 connect failure, 504 timeout)
	// go through the response phases, with response.code_details other than via_upstream, as
	// Envoy did before CVE-2025-30157 and may again on 1.37+ (reference §7). When false the
	// processor sees no response phase for them: its stream just ends.
	LocalRepliesToExtProc bool
	// AccessLog, when set, is called once per request after the response has been written (or
	// the request abandoned), like a line of Envoy's access log.
	AccessLog func(Record)
	// HealthCheck, when set, is the processor cluster's active gRPC health check: each processor
	// is asked grpc.health.v1 Check(ServiceName) every Interval; one that fails
	// UnhealthyThreshold checks in a row gets no new stream until it passes HealthyThreshold in a
	// row. When none is healthy all are used, as Envoy's panic threshold does.
	HealthCheck *HealthCheck
	// StreamRetries is how many other processors a request tries when its stream cannot be
	// opened (grpc_service.retry_policy with connect-failure or refused-stream): nothing reached
	// the processor that refused it.
	StreamRetries int
}

// HealthCheck is an active gRPC health check of the processors (Envoy's cluster health_checks
// with grpc_health_check).
type HealthCheck struct {
	Interval, Timeout                    time.Duration
	UnhealthyThreshold, HealthyThreshold int
	ServiceName                          string
}

// Record describes one finished request, with the fields of Envoy's access log that tests need.
type Record struct {
	// RequestID is the x-request-id sent to the processor and the upstream.
	RequestID string
	// Method and Path are the request's :method and :path.
	Method, Path string
	// Processor is the address whose stream served the request, "" when ext_proc was disabled.
	Processor string
	// Status is the status sent downstream, 0 when none was sent.
	Status int
	// CodeDetails is %RESPONSE_CODE_DETAILS%: via_upstream, an ImmediateResponse's details,
	// ext_proc_error_…, upstream_response_timeout, request_payload_too_large, ….
	CodeDetails string
	// ResponseFlags is %RESPONSE_FLAGS%: "-", UF, UT, UC, DC or UR.
	ResponseFlags string
	// Duration is the time from receiving the request to the end of its handling.
	Duration time.Duration
}

// Stats are counters that mirror the ext_proc filter's stats (reference §5, §15) plus a few of
// the proxy's own. All counts are totals since New.
type Stats struct {
	// StreamsStarted counts gRPC streams opened (streams_started).
	StreamsStarted int64
	// StreamErrors counts streams that could not be opened or that ended with a gRPC error
	// status (streams_failed).
	StreamErrors int64
	// MessagesSent and MessagesReceived count ProcessingRequests and ProcessingResponses.
	MessagesSent, MessagesReceived int64
	// Spurious counts responses of the wrong kind (spurious_msgs_received).
	Spurious int64
	// MessageTimeouts counts expired message timers (message_timeouts).
	MessageTimeouts int64
	// FailureModeAllowed counts failures ignored because of failure_mode_allow.
	FailureModeAllowed int64
	// ImmediateResponses counts ImmediateResponses received and acted on.
	ImmediateResponses int64
	// RejectedMutations counts header mutations ignored by the default mutation rules
	// (rejected_header_mutations).
	RejectedMutations int64
	// ImmediateMutationErrors counts ImmediateResponses whose header mutation was invalid:
	// Envoy logs "Immediate response mutations failed" and sends the reply anyway.
	ImmediateMutationErrors int64
	// ModeOverrides and ModeOverridesIgnored count mode_override fields honoured and ignored.
	ModeOverrides, ModeOverridesIgnored int64
	// TimeoutOverrides and TimeoutOverridesIgnored count override_message_timeout fields
	// (override_message_timeout_received / _ignored).
	TimeoutOverrides, TimeoutOverridesIgnored int64
	// LocalReplies counts replies generated by the proxy itself other than ImmediateResponses:
	// 413, 500, 503, 504, status_on_error.
	LocalReplies int64
	// Resets counts downstream connections closed mid-response, Envoy's stream reset.
	Resets int64
}

type counters struct {
	streamsStarted, streamErrors, messagesSent, messagesReceived, spurious, messageTimeouts,
	failureModeAllowed, immediateResponses, immediateMutationErrors, rejectedMutations, modeOverrides,
	modeOverridesIgnored, timeoutOverrides, timeoutOverridesIgnored, localReplies,
	resets atomic.Int64
}

// Proxy is an Envoy-compatible HTTP proxy with one ext_proc filter. It is safe for concurrent
// use; every goroutine it starts for a request ends before ServeHTTP returns.
type Proxy struct {
	cfg            Config
	filter         *filterextproc.ExternalProcessor
	mode           *filterextproc.ProcessingMode
	upstream       *url.URL
	messageTimeout time.Duration
	maxMsgTimeout  time.Duration
	statusOnError  int
	requestLimit   int64
	responseLimit  int64
	routeTimeout   time.Duration

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
	wg     sync.WaitGroup // requests in flight

	srv       *http.Server
	ln        net.Listener
	serveDone chan struct{}
	closeOnce sync.Once
	closeErr  error
}

// New checks cfg, copies cfg.Filter, fills in Envoy's defaults and dials (lazily) every
// processor. It fails on a configuration the proxy cannot follow faithfully, such as
// FULL_DUPLEX_STREAMED.
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
	mode := filter.GetProcessingMode()
	if mode == nil {
		mode = &filterextproc.ProcessingMode{}
	}
	for _, m := range []filterextproc.ProcessingMode_BodySendMode{mode.GetRequestBodyMode(), mode.GetResponseBodyMode()} {
		if !supportedBodyMode(m) {
			return nil, fmt.Errorf("proxy: body mode %v is not implemented", m)
		}
	}
	if filter.GetObservabilityMode() {
		return nil, errors.New("proxy: observability_mode is not implemented")
	}
	p := &Proxy{
		cfg:            cfg,
		filter:         filter,
		mode:           mode,
		upstream:       u,
		messageTimeout: DefaultMessageTimeout,
		statusOnError:  http.StatusInternalServerError,
		requestLimit:   int64(cfg.ListenerBufferLimit),
		responseLimit:  int64(cfg.UpstreamBufferLimit),
		routeTimeout:   cfg.RouteTimeout,
	}
	// An unset message_timeout is 200 ms; an explicit 0 fires at once (reference §4.1).
	if d := filter.GetMessageTimeout(); d != nil {
		p.messageTimeout = d.AsDuration()
	}
	// max_message_timeout 0 disables override_message_timeout (reference §4.1).
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
	p.transport = &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		DisableCompression:  true, // forward bodies byte for byte
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     30 * time.Second,
	}
	for _, addr := range cfg.Processors {
		conn, err := grpc.NewClient(addr,
			grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithConnectParams(grpc.ConnectParams{
				Backoff:           backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
				MinConnectTimeout: time.Second,
			}),
			// Envoy's envoy_grpc max_receive_message_length defaults to unlimited (reference §9).
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

func supportedBodyMode(m filterextproc.ProcessingMode_BodySendMode) bool {
	switch m {
	case filterextproc.ProcessingMode_NONE, filterextproc.ProcessingMode_STREAMED,
		filterextproc.ProcessingMode_BUFFERED, filterextproc.ProcessingMode_BUFFERED_PARTIAL:
		return true
	}
	return false
}

// Start builds a proxy with New and serves it on 127.0.0.1 on a free port until the test ends.
// It fails the test if cfg is invalid.
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
	p.ln = ln
	p.srv = &http.Server{Handler: p, ReadHeaderTimeout: 10 * time.Second}
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
	return "http://" + p.ln.Addr().String()
}

// Stats returns a snapshot of the counters.
func (p *Proxy) Stats() Stats {
	c := &p.stats
	return Stats{
		StreamsStarted:          c.streamsStarted.Load(),
		StreamErrors:            c.streamErrors.Load(),
		MessagesSent:            c.messagesSent.Load(),
		MessagesReceived:        c.messagesReceived.Load(),
		Spurious:                c.spurious.Load(),
		MessageTimeouts:         c.messageTimeouts.Load(),
		FailureModeAllowed:      c.failureModeAllowed.Load(),
		ImmediateResponses:      c.immediateResponses.Load(),
		RejectedMutations:       c.rejectedMutations.Load(),
		ImmediateMutationErrors: c.immediateMutationErrors.Load(),
		ModeOverrides:           c.modeOverrides.Load(),
		ModeOverridesIgnored:    c.modeOverridesIgnored.Load(),
		TimeoutOverrides:        c.timeoutOverrides.Load(),
		TimeoutOverridesIgnored: c.timeoutOverridesIgnored.Load(),
		LocalReplies:            c.localReplies.Load(),
		Resets:                  c.resets.Load(),
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

// ServeHTTP proxies one request, running the ext_proc phases around the upstream exchange.
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

	x := &exchange{
		p:     p,
		w:     w,
		r:     r,
		ctx:   ctx,
		start: time.Now(),
		mode:  proto.Clone(p.mode).(*filterextproc.ProcessingMode),
	}
	if !p.disabled(r.URL.Path) {
		i := p.pick(-1)
		sctx, scancel := context.WithCancel(ctx)
		x.side = &sideStream{index: i, addr: p.cfg.Processors[i], client: p.clients[i], ctx: sctx, cancel: scancel, active: true}
		x.rec.Processor = x.side.addr
	}
	x.serve()
}

// disabled reports whether path is under a route with ext_proc disabled (reference §4.4).
func (p *Proxy) disabled(path string) bool {
	for _, prefix := range p.cfg.DisabledPrefixes {
		if strings.HasPrefix(path, prefix) {
			return true
		}
	}
	return false
}
