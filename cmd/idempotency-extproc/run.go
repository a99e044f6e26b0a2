package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/redis/go-redis/v9"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/logbatch"
)

// runOptions are what tests change in run; a zero field takes its default.
type runOptions struct {
	// drainTimeout is how long open streams may finish after SIGTERM before they are cut
	// (default 15 s).
	drainTimeout time.Duration
	// The processor pings each Envoy connection that has been silent for keepaliveTime (default
	// 30 s) and closes it when the ping is not answered within keepaliveTimeout (default 10 s). A
	// stream whose Envoy vanished without a reset (a lost host, a partition) then ends, and its
	// lease is released, instead of being renewed for as long as TCP takes to notice: minutes.
	keepaliveTime, keepaliveTimeout time.Duration
	// listen opens the listeners (default listen).
	listen func(addr string) (net.Listener, error)
	// adminIdleTimeout is how long a keep-alive connection to the admin listener may stay idle
	// before it is closed (default 2 min: longer than a scrape interval, so that Prometheus
	// keeps its connection from one scrape to the next).
	adminIdleTimeout time.Duration
	// openStore opens the store (default openStore).
	openStore func(ctx context.Context, cfg *config) (cache.Store, error)
}

// withDefaults fills the zero fields of o with their defaults.
func (o runOptions) withDefaults() runOptions {
	if o.drainTimeout == 0 {
		o.drainTimeout = 15 * time.Second
	}
	if o.keepaliveTime == 0 {
		o.keepaliveTime = 30 * time.Second
	}
	if o.keepaliveTimeout == 0 {
		o.keepaliveTimeout = 10 * time.Second
	}
	if o.listen == nil {
		o.listen = listen
	}
	if o.adminIdleTimeout == 0 {
		o.adminIdleTimeout = 2 * time.Minute
	}
	if o.openStore == nil {
		o.openStore = openStore
	}
	return o
}

// recordsTimeout bounds a records API call, which makes one store call per key prefix, each
// bounded by the store.
const recordsTimeout = 5 * time.Second

// The admin listener's bounds on one request: its headers, the whole request (none of its
// requests has a body), and the answer (a /metrics scrape; a records API call is bounded by
// recordsTimeout).
const (
	adminReadHeaderTimeout = 5 * time.Second
	adminReadTimeout       = 10 * time.Second
	adminWriteTimeout      = 30 * time.Second
)

// What one HTTP/2 connection to the gRPC listener may hold. maxStreamsPerConn is above the 1,024
// streams Envoy's default circuit breakers let one Envoy open to the whole cluster; an Envoy whose
// breakers are raised opens another connection when one has this many streams
// (MultiplexedActiveClientBase::onSettings in Envoy's source/common/http/conn_pool_base.cc takes
// the server's SETTINGS_MAX_CONCURRENT_STREAMS as the connection's capacity). maxHeaderListSize
// is above the 60 KiB of headers Envoy accepts by default (max_request_headers_kb), far above the
// few hundred bytes its ext_proc stream sends, and a 256th of grpc-go's 16 MiB default.
const (
	maxStreamsPerConn = 4096
	maxHeaderListSize = 64 << 10
)

// readinessInterval is how often the store is pinged for gRPC health; /readyz pings on demand.
const readinessInterval = 500 * time.Millisecond

// maxPingTimeout bounds a readiness ping whatever store_timeout says, so that a store that stops
// answering turns the process unready within readinessInterval plus this: 1.5 s, less than the
// chart's 2 s readiness probe period.
const maxPingTimeout = time.Second

// pingTimeout is how long a readiness ping may take.
func pingTimeout(storeTimeout time.Duration) time.Duration { return min(storeTimeout, maxPingTimeout) }

// run is the whole program: it returns when ctx is done and every open stream has finished or
// been cut, or at once with an error if the configuration is invalid or a listener cannot open.
// ctx done during start-up, before the listeners open, ends it at once without an error: SIGTERM
// asks the process to stop whatever it is doing, and stopping is not a failure.
// args are the command-line arguments without the program name; getenv reads the environment;
// logs go to stderr. After -h it returns flag.ErrHelp, for its caller to print the usage.
func run(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) error {
	return runWith(ctx, args, getenv, stderr, runOptions{})
}

// runWith is run with the options tests change.
func runWith(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer, opts runOptions) error {
	opts = opts.withDefaults()
	cfg, err := startupConfig(args, getenv, false)
	if err != nil {
		return err
	}
	// The collector's pace: see gcHeadroom.
	defer startGCTuner(gcHeadroom, getenv)()
	lines := logbatch.New(stderr, logInterval)
	// Deferred first, so it runs last: every line of the run is written before run returns.
	defer lines.Close()
	log := newLogger(cfg, lines)
	redis.SetLogger(redisLogger{log: log})

	store, err := openStoreUntil(ctx, cfg, opts.openStore)
	if err == nil {
		defer store.Close()
	}
	if ctx.Err() != nil {
		log.Info().Msg("stopped during start-up")
		return nil
	}
	if err != nil {
		return err
	}

	reg := newRegistry(store)
	metrics, err := extproc.NewMetrics(reg)
	if err != nil {
		return err
	}
	tracer, stopTracing, err := openTracing(ctx, getenv)
	if err != nil {
		return err
	}
	defer flushSpans(ctx, stopTracing, log)
	srv, err := extproc.NewServer(extproc.Options{Store: store, Policy: cfg.policy, Logger: &log, Metrics: metrics, KeyHash: cfg.keyHash, Tracer: tracer, MaxStreams: cfg.maxStreams})
	if err != nil {
		return err
	}

	grpcLis, adminLis, err := openListeners(cfg, opts)
	if err != nil {
		return err
	}
	defer grpcLis.Close()
	defer adminLis.Close()
	p, err := newProcess(cfg, opts, store, log, reg, srv)
	if err != nil {
		return err
	}
	return p.serve(ctx, grpcLis, adminLis)
}

// newRegistry is the private registry of the process's metrics, with the Go runtime's and the
// process's collectors, and the memory store's gauges when the store is the memory store.
func newRegistry(store cache.Store) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if m, ok := store.(*cache.Memory); ok {
		reg.MustRegister(memoryMetrics(m)...)
	}
	return reg
}

// flushSpans sends the spans still buffered before the process exits.
func flushSpans(ctx context.Context, stopTracing func(context.Context) error, log zerolog.Logger) {
	flushCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := stopTracing(flushCtx); err != nil {
		log.Warn().Err(err).Msg("tracing: spans not flushed")
	}
}

// openListeners opens the gRPC and admin listeners; an error names the setting whose address
// failed.
func openListeners(cfg *config, opts runOptions) (grpcLis, adminLis net.Listener, err error) {
	grpcLis, err = opts.listen(cfg.grpcAddr)
	if err != nil {
		return nil, nil, fmt.Errorf("grpc-addr: %w", err)
	}
	adminLis, err = opts.listen(cfg.adminAddr)
	if err != nil {
		grpcLis.Close()
		return nil, nil, fmt.Errorf("admin-addr: %w", err)
	}
	return grpcLis, adminLis, nil
}

// process is the serving process: the gRPC server with its health service, the admin server
// and what the drain turns off.
type process struct {
	cfg      *config
	opts     runOptions
	log      zerolog.Logger
	srv      *extproc.Server
	grpc     *grpc.Server
	health   *health.Server
	admin    *http.Server
	rd       *readiness
	ready    prometheus.Gauge
	draining atomic.Bool
	version  string
}

// newProcess builds the servers around srv, NOT_SERVING until the store answers.
func newProcess(cfg *config, opts runOptions, store cache.Store, log zerolog.Logger, reg *prometheus.Registry, srv *extproc.Server) (*process, error) {
	p := &process{cfg: cfg, opts: opts, log: log, srv: srv, grpc: newGRPCServer(cfg, opts, srv), health: health.NewServer()}
	healthpb.RegisterHealthServer(p.grpc, p.health)
	setHealth(p.health, healthpb.HealthCheckResponse_NOT_SERVING)

	rd, err := newReadiness(store, pingTimeout(cfg.policy.StoreTimeout), cfg.policy)
	if err != nil {
		return nil, err
	}
	p.rd = rd
	observeReplicas(reg, rd, srv)
	var records *recordsAPI
	if cfg.adminToken != nil {
		if records, err = newRecordsAPI(store, cfg.adminToken, extproc.StorePrefixes(cfg.policy), recordsTimeout, log, reg); err != nil {
			return nil, err
		}
	}
	p.admin = &http.Server{
		Handler:           adminHandler(reg, rd, &p.draining, records, cfg.adminPprof),
		ReadHeaderTimeout: adminReadHeaderTimeout,
		ReadTimeout:       adminReadTimeout,
		WriteTimeout:      adminWriteTimeout,
		IdleTimeout:       opts.adminIdleTimeout,
	}
	p.ready = registerStateGauges(reg, cfg.policy)
	build := currentBuild()
	reg.MustRegister(buildInfo(build))
	p.version = build.version
	return p, nil
}

// newGRPCServer is the gRPC server of srv with its bounds on connections and messages.
func newGRPCServer(cfg *config, opts runOptions, srv *extproc.Server) *grpc.Server {
	gs := grpc.NewServer(
		// One stream's panic ends that stream, not the process (unless it came from the store).
		grpc.ChainStreamInterceptor(srv.StreamInterceptor()),
		// An ext_proc stream has 10 s to send its first message.
		grpc.InTapHandle(srv.TapHandle()),
		// The answers that never vary go out as their encoding, made once.
		grpc.ForceServerCodecV2(srv.Codec()),
		// A BUFFERED body arrives in one message (Filter::sendBufferedData in Envoy's
		// source/extensions/filters/http/ext_proc/ext_proc.cc): the limit must exceed the
		// largest body Envoy may send.
		grpc.MaxRecvMsgSize(maxRecvMsgSize(cfg)),
		grpc.NumStreamWorkers(extproc.StreamWorkers),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: opts.keepaliveTime, Timeout: opts.keepaliveTimeout}),
		grpc.MaxConcurrentStreams(maxStreamsPerConn),
		grpc.MaxHeaderListSize(maxHeaderListSize),
	)
	extprocv3.RegisterExternalProcessorServer(gs, srv)
	return gs
}

// observeReplicas has each readiness check publish the replicas it counted, to the
// idempotency_store_replicas gauge and to srv. It is set before the admin listener serves:
// /readyz counts the replicas too.
func observeReplicas(reg *prometheus.Registry, rd *readiness, srv *extproc.Server) {
	replicas := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "idempotency_store_replicas",
		Help: "Replicas in sync with the Redis master, as the readiness check last counted them (under Cluster, the fewest any master has); 0 for the memory store, which has none. A route whose durability.replicas is above it gets 503 durability-unmet.",
	})
	reg.MustRegister(replicas)
	rd.observe = func(seen int) {
		if seen >= 0 {
			replicas.Set(float64(seen))
		}
		srv.SetReplicas(seen)
	}
}

// registerStateGauges registers idempotency_ready, which it returns for the store watch and the
// drain to set, and idempotency_fail_open, set from p.
func registerStateGauges(reg *prometheus.Registry, p *policy.Policy) prometheus.Gauge {
	ready := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "idempotency_ready",
		Help: "1 while the store answers (with the replicas durability asks for) and the process serves new streams (as /readyz and gRPC health say), else 0.",
	})
	reg.MustRegister(ready)
	failOpen := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "idempotency_fail_open",
		Help: "1 when fail_mode is open (a covered request that finds the store failing runs upstream without a lease), 0 when closed.",
	})
	if p.FailMode == policy.FailOpen {
		failOpen.Set(1)
	}
	reg.MustRegister(failOpen)
	return ready
}

// serve serves on the listeners until ctx is done or a listener fails for good, then drains. A
// failed listener ends the process as SIGTERM does, through the drain, so that the streams still
// open finish or release what they hold; serve then returns its error.
func (p *process) serve(ctx context.Context, grpcLis, adminLis net.Listener) error {
	errc := make(chan error, 2)
	go func() { errc <- p.grpc.Serve(grpcLis) }()
	go func() { errc <- p.admin.Serve(adminLis) }()
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	p.watch(watchCtx, grpcLis, adminLis)

	var failed error
	select {
	case <-ctx.Done():
	case failed = <-errc:
		p.log.Error().Err(failed).Msg("listener failed")
	}
	stopWatch()
	p.drain()
	return failed
}

// watch logs that the listeners are up and starts watching the store. The process is ready
// once its store has answered, which may take a while (Redis down, a wrong password): until then
// it serves NOT_SERVING and /readyz 503, and it logs ready when the store first answers.
func (p *process) watch(ctx context.Context, grpcLis, adminLis net.Listener) {
	configPath := p.cfg.configPath
	if configPath == "" {
		configPath = "(built-in defaults)"
	}
	listening := func(e *zerolog.Event) *zerolog.Event {
		return e.Str("grpc_addr", addrString(grpcLis)).Str("admin_addr", adminLis.Addr().String()).Str("store", p.cfg.store)
	}
	listening(p.log.Info()).Msg("listening: waiting for the store to answer")
	go watchStore(ctx, p.rd, storeWatch{
		health: p.health, ready: p.ready, log: p.log,
		answered: func() {
			listening(p.log.Info()).Str("version", p.version).Str("config", configPath).
				Strs("routes", routeNames(p.cfg.policy)).Msg("ready")
		},
	})
}

// drain stops taking streams, lets the open ones finish for the drain timeout, cuts the rest,
// and waits for their handlers and the completion retries.
func (p *process) drain() {
	p.log.Info().Dur("drain_timeout", p.opts.drainTimeout).Msg("shutting down: draining open streams")
	p.health.Shutdown()
	p.draining.Store(true)
	p.ready.Set(0)
	graceEnd := time.Now().Add(p.opts.drainTimeout)
	drained := make(chan struct{})
	go func() {
		p.grpc.GracefulStop()
		close(drained)
	}()
	select {
	case <-drained:
	case <-time.After(p.opts.drainTimeout):
		p.log.Warn().Msg("drain timeout: cutting the streams still open")
		p.grpc.Stop()
	}
	// Cut streams release what they hold as their handlers return. Completions the store failed
	// to write are retried for what is left of the drain (5 s at least), then given up.
	waitCtx, cancel := context.WithDeadline(context.Background(), later(graceEnd, time.Now().Add(5*time.Second)))
	defer cancel()
	if err := p.srv.Shutdown(waitCtx); err != nil {
		p.log.Error().Err(err).Msg("stream handlers or completion retries did not finish")
	}
	shutdownCtx, cancel2 := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel2()
	_ = p.admin.Shutdown(shutdownCtx)
	p.log.Info().Msg("stopped")
}

// later returns the later of a and b.
func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// buildInfo is idempotency_build_info: 1, labelled with the build.
func buildInfo(b build) prometheus.Collector {
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "idempotency_build_info",
		Help:        "1, labelled with the version, the Go version and the VCS revision the binary was built from.",
		ConstLabels: prometheus.Labels{"version": b.version, "goversion": b.goVersion, "revision": b.revision},
	})
	g.Set(1)
	return g
}

// routeNames are the names of p's routes in the order they match, the default last.
func routeNames(p *policy.Policy) []string {
	names := make([]string, 0, len(p.Routes)+1)
	for _, r := range p.Routes {
		names = append(names, r.Name)
	}
	return append(names, p.Default.Name)
}

// logInterval is how long a log line at info or below may wait to be written with others (warn
// and above are written at once): a write per line would cost a system call per covered request.
const logInterval = 50 * time.Millisecond

// newLogger returns the process' logger, writing to out (a logbatch.Writer).
func newLogger(cfg *config, out *logbatch.Writer) zerolog.Logger {
	var w io.Writer = out
	if cfg.logFormat == "console" {
		w = out.Formatted(zerolog.ConsoleWriter{Out: out, TimeFormat: time.RFC3339})
	}
	return zerolog.New(w).Level(cfg.logLevel).With().Timestamp().Logger()
}

// redisLogger sends go-redis' own messages (one per failed dial while Redis is down) to the
// process log at debug level; the store watcher reports outages once, at error level.
type redisLogger struct{ log zerolog.Logger }

func (l redisLogger) Printf(_ context.Context, format string, v ...any) {
	l.log.Debug().Str("component", "go-redis").Msgf(format, v...)
}

// memoryMetrics report what the memory store m holds (cache.Memory.Stats): its accounted bytes,
// which --memory-max-bytes bounds, and records, and where it keeps their bytes: the segments
// mapped outside the Go heap are in the process' resident memory but in none of the Go runtime's
// memory metrics, and a segment that could not be mapped is on the Go heap.
func memoryMetrics(m *cache.Memory) []prometheus.Collector {
	return []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "idempotency_memory_bytes",
			Help: "Bytes the memory store accounts for against --memory-max-bytes: records' keys, fingerprints, responses and per-record overhead.",
		}, func() float64 { return float64(m.Stats().Bytes) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "idempotency_memory_records",
			Help: "Records the memory store holds, pending and completed, including expired ones not yet removed.",
		}, func() float64 { return float64(m.Stats().Records) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "idempotency_memory_mapped_bytes",
			Help: "Bytes of the memory store's segments mapped outside the Go heap.",
		}, func() float64 { return float64(m.Stats().Arena.MappedBytes) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "idempotency_memory_heap_segments_total",
			Help: "Memory store segments allocated on the Go heap because mapping one failed or is not supported.",
		}, func() float64 { return float64(m.Stats().Arena.HeapSegments) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "idempotency_memory_unmap_failures_total",
			Help: "Freed memory store segments the system refused to unmap, left mapped and unused.",
		}, func() float64 { return float64(m.Stats().Arena.UnmapFailures) }),
	}
}

// openStoreUntil opens the store with open, or gives up when ctx is done first: a store that
// does not answer must not keep SIGTERM waiting. A store that opens after that is closed.
func openStoreUntil(ctx context.Context, cfg *config, open func(context.Context, *config) (cache.Store, error)) (cache.Store, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	type opened struct {
		store cache.Store
		err   error
	}
	done := make(chan opened) // unbuffered: a store nobody receives is closed below
	abandoned := make(chan struct{})
	go func() {
		s, err := open(ctx, cfg)
		select {
		case done <- opened{s, err}:
		case <-abandoned:
			if s != nil {
				_ = s.Close()
			}
		}
	}()
	select {
	case o := <-done:
		return o.store, o.err
	case <-ctx.Done():
		close(abandoned)
		return nil, ctx.Err()
	}
}

func openStore(_ context.Context, cfg *config) (cache.Store, error) {
	if cfg.store == "memory" {
		return cache.NewMemory(cache.MemoryOptions{MaxBytes: cfg.memoryMaxBytes, Keyring: cfg.keyring})
	}
	s, err := cache.OpenRedis(cfg.redisOptions(cfg.policy.StoreTimeout))
	if err != nil {
		return nil, fmt.Errorf("redis: %w", err)
	}
	return s, nil
}

// maxRecvMsgSize is 64 MiB, or more when the policy keeps larger responses or requests.
func maxRecvMsgSize(cfg *config) int {
	return max(64<<20, 2*max(cfg.policy.MaxResponseBytes(), cfg.policy.MaxRequestBytes())+1<<20)
}

// listen opens host:port, or a Unix socket for unix:///path (replacing a stale socket file,
// never another kind of file). The socket is readable and writable by its owner and its group,
// and by no one else: connecting needs write permission, and Envoy in another container of the
// pod may run as another user in the pod's group (Istio's proxy runs as 1337, and the pod's
// fsGroup is the group of every container and of the socket).
func listen(addr string) (net.Listener, error) {
	if path, ok := strings.CutPrefix(addr, "unix://"); ok {
		if fi, err := os.Lstat(path); err == nil && fi.Mode().Type() != os.ModeSocket {
			return nil, fmt.Errorf("%s exists and is not a socket", path)
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, err
		}
		return listenUnix(path)
	}
	return net.Listen("tcp", addr)
}

func addrString(l net.Listener) string {
	if l.Addr().Network() == "unix" {
		return "unix://" + l.Addr().String()
	}
	return l.Addr().String()
}

func setHealth(h *health.Server, s healthpb.HealthCheckResponse_ServingStatus) {
	h.SetServingStatus("", s)
	h.SetServingStatus(extprocv3.ExternalProcessor_ServiceDesc.ServiceName, s)
}
