package main

import (
	"context"
	"errors"
	"flag"
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
)

// drainTimeout is how long open streams may finish after SIGTERM before they are cut (a
// variable for the test of the cut).
var drainTimeout = 15 * time.Second

// The processor pings each Envoy connection that has been silent for keepaliveTime and closes it
// when the ping is not answered within keepaliveTimeout (variables for the test). A stream whose
// Envoy vanished without a reset (a lost host, a partition) then ends, and its lease is released,
// instead of being renewed for as long as TCP takes to notice: minutes.
var (
	keepaliveTime    = 30 * time.Second
	keepaliveTimeout = 10 * time.Second
)

// readinessInterval is how often the store is pinged for gRPC health; /readyz pings on demand.
const readinessInterval = 500 * time.Millisecond

// maxPingTimeout bounds a readiness ping whatever store_timeout says, so that a store that stops
// answering turns the process unready within readinessInterval plus this: 1.5 s, under SPEC
// §7's 2 s.
const maxPingTimeout = time.Second

// pingTimeout is how long a readiness ping may take.
func pingTimeout(storeTimeout time.Duration) time.Duration { return min(storeTimeout, maxPingTimeout) }

// run is the whole program: it returns when ctx is done and every open stream has finished or
// been cut, or at once with an error if the configuration is invalid or a listener cannot open.
// args are the command-line arguments without the program name; getenv reads the environment;
// logs and usage go to stderr.
func run(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) error {
	cfg, err := loadConfig(args, getenv, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	log := newLogger(cfg, stderr)
	redis.SetLogger(redisLogger{log: log})

	store, err := openStore(cfg)
	if err != nil {
		return err
	}
	defer store.Close()

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if m, ok := store.(*cache.Memory); ok {
		reg.MustRegister(memoryMetrics(m)...)
	}
	metrics, err := extproc.NewMetrics(reg)
	if err != nil {
		return err
	}
	srv, err := extproc.NewServer(extproc.Options{Store: store, Policy: cfg.policy, Logger: &log, Metrics: metrics})
	if err != nil {
		return err
	}

	grpcLis, err := listenOn(cfg.grpcAddr)
	if err != nil {
		return fmt.Errorf("grpc-addr: %w", err)
	}
	defer grpcLis.Close()
	adminLis, err := listenOn(cfg.adminAddr)
	if err != nil {
		return fmt.Errorf("admin-addr: %w", err)
	}
	defer adminLis.Close()

	gs := grpc.NewServer(
		// A BUFFERED body arrives in one message: the limit must exceed the largest body Envoy
		// may send (reference §0.8, §9).
		grpc.MaxRecvMsgSize(maxRecvMsgSize(cfg)),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: keepaliveTime, Timeout: keepaliveTimeout}),
	)
	extprocv3.RegisterExternalProcessorServer(gs, srv)
	healthSrv := health.NewServer()
	healthpb.RegisterHealthServer(gs, healthSrv)
	setHealth(healthSrv, healthpb.HealthCheckResponse_NOT_SERVING)

	var draining atomic.Bool
	admin := &http.Server{
		Handler:           adminHandler(reg, store, pingTimeout(cfg.policy.StoreTimeout), &draining),
		ReadHeaderTimeout: 5 * time.Second,
	}

	errc := make(chan error, 2)
	go func() { errc <- gs.Serve(grpcLis) }()
	go func() { errc <- admin.Serve(adminLis) }()
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	go watchStore(watchCtx, store, pingTimeout(cfg.policy.StoreTimeout), healthSrv, log)

	log.Info().Str("grpc_addr", addrString(grpcLis)).Str("admin_addr", adminLis.Addr().String()).
		Str("store", cfg.store).Msg("ready")

	// A listener that fails for good ends the process as SIGTERM does, through the drain, so
	// that the streams still open finish or release what they hold; run then returns its error.
	var failed error
	select {
	case <-ctx.Done():
	case failed = <-errc:
		log.Error().Err(failed).Msg("listener failed")
	}

	log.Info().Dur("drain_timeout", drainTimeout).Msg("shutting down: draining open streams")
	stopWatch()
	healthSrv.Shutdown()
	draining.Store(true)
	drained := make(chan struct{})
	go func() {
		gs.GracefulStop()
		close(drained)
	}()
	select {
	case <-drained:
	case <-time.After(drainTimeout):
		log.Warn().Msg("drain timeout: cutting the streams still open")
		gs.Stop()
	}
	// Cut streams release what they hold as their handlers return.
	waitCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Wait(waitCtx); err != nil {
		log.Error().Err(err).Msg("stream handlers did not finish")
	}
	shutdownCtx, cancel2 := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel2()
	_ = admin.Shutdown(shutdownCtx)
	log.Info().Msg("stopped")
	return failed
}

func newLogger(cfg *config, stderr io.Writer) zerolog.Logger {
	var w io.Writer = stderr
	if cfg.logFormat == "console" {
		w = zerolog.ConsoleWriter{Out: stderr, TimeFormat: time.RFC3339}
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

func openStore(cfg *config) (cache.Store, error) {
	if cfg.store == "memory" {
		return cache.NewMemory(cache.MemoryOptions{MaxBytes: cfg.memoryMaxBytes})
	}
	s, err := cache.OpenRedis(cfg.redisOptions(cfg.policy.StoreTimeout))
	if err != nil {
		return nil, fmt.Errorf("redis: %w", err)
	}
	return s, nil
}

// maxRecvMsgSize is 64 MiB, or more when the policy keeps larger responses.
func maxRecvMsgSize(cfg *config) int {
	return max(64<<20, 2*cfg.policy.MaxResponseBytes()+1<<20)
}

// listen opens host:port, or a Unix socket for unix:///path (replacing a stale socket file,
// never another kind of file).
// listenOn is listen, a variable for the test of a listener that fails after start.
var listenOn = listen

func listen(addr string) (net.Listener, error) {
	if path, ok := strings.CutPrefix(addr, "unix://"); ok {
		if fi, err := os.Lstat(path); err == nil && fi.Mode().Type() != os.ModeSocket {
			return nil, fmt.Errorf("%s exists and is not a socket", path)
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, err
		}
		return net.Listen("unix", path)
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

// watchStore keeps gRPC health in step with the store: SERVING while it answers a ping within
// timeout, NOT_SERVING otherwise.
func watchStore(ctx context.Context, store cache.Store, timeout time.Duration, h *health.Server, log zerolog.Logger) {
	ready, known := false, false
	t := time.NewTicker(readinessInterval)
	defer t.Stop()
	for {
		pctx, cancel := context.WithTimeout(ctx, timeout)
		err := store.Ping(pctx)
		cancel()
		if ctx.Err() != nil {
			return
		}
		switch {
		case err == nil && (!ready || !known):
			setHealth(h, healthpb.HealthCheckResponse_SERVING)
			log.Info().Msg("store is reachable: serving")
		case err != nil && (ready || !known):
			setHealth(h, healthpb.HealthCheckResponse_NOT_SERVING)
			log.Error().Err(err).Str("op", "ping").Msg("store is unreachable: not serving")
		}
		ready, known = err == nil, true
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
