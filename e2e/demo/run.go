package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/e2e/envoyconf"
	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
	"github.com/idempotency-extproc/idempotency-extproc/e2e/upstream"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// options are the demo's flags.
type options struct {
	// The loopback addresses the demo listens on: the emulator (envoy.yaml's listener), the
	// demo upstream (its upstream cluster), the processor's gRPC (its ext_proc cluster) and the
	// processor's metrics.
	listen, upstream, processor, metrics string
	// envoy and policy are the files the emulator and the processor run.
	envoy, policy string
	// messageTimeout, when positive, replaces envoy.yaml's ext_proc message_timeout.
	messageTimeout time.Duration
	// redisURL, when set, puts the processor's records in that Redis instead of the memory store.
	redisURL string
}

func parseFlags(args []string, stdout io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stdout)
	fs.StringVar(&o.listen, "listen", "127.0.0.1:10000", "the Envoy emulator's listener, in place of envoy.yaml's (port 10000 there)")
	fs.StringVar(&o.upstream, "upstream", "127.0.0.1:0", "the demo upstream, in place of the endpoints of envoy.yaml's upstream cluster (port 0: any free port)")
	fs.StringVar(&o.processor, "processor", "127.0.0.1:0", "the processor's gRPC listener, in place of the endpoints of envoy.yaml's ext_proc cluster")
	fs.StringVar(&o.metrics, "metrics", "127.0.0.1:0", "the processor's Prometheus metrics, at /metrics")
	fs.StringVar(&o.envoy, "envoy", "envoy/envoy.yaml", "the Envoy bootstrap the emulator follows: routes, ext_proc filter, jwt_authn, access-log format")
	fs.StringVar(&o.policy, "policy", "envoy/policy.yaml", "the processor's policy file; the demo takes no program settings (grpc_addr, store, …) from it and refuses a file that gives some")
	fs.DurationVar(&o.messageTimeout, "message-timeout", 0, "replaces envoy.yaml's ext_proc message_timeout (0 keeps it), for a machine too busy to answer within it")
	fs.StringVar(&o.redisURL, "redis-url", os.Getenv("IDEMPOTENCY_REDIS_URL"), "a redis:// or rediss:// URL (default $IDEMPOTENCY_REDIS_URL): the processor keeps its records there, under a key prefix of this run's own, instead of in the memory store")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "Usage: go run ./e2e/demo [flags]  (from the repository root)")
		fmt.Fprintln(fs.Output(), "Runs the processor, an emulator of Envoy's ext_proc filter and a demo upstream on loopback. Flags:")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	for _, a := range []struct{ flag, addr string }{
		{"listen", o.listen}, {"upstream", o.upstream}, {"processor", o.processor}, {"metrics", o.metrics},
	} {
		if err := checkLoopback(a.addr); err != nil {
			return o, fmt.Errorf("-%s: %w", a.flag, err)
		}
	}
	return o, nil
}

// checkLoopback accepts host:port where host is a loopback IP or localhost.
func checkLoopback(addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%q is not host:port", addr)
	}
	if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		return fmt.Errorf("%q: the demo listens on loopback addresses only (127.0.0.1, ::1, localhost)", addr)
	}
	return nil
}

// run is the whole demo: it returns when ctx is done and everything it started has stopped, or at
// once with an error when a file is bad or a port is taken. args are the flags; everything it
// prints goes to stdout, one line per write.
func run(ctx context.Context, args []string, stdout io.Writer) error {
	o, err := parseFlags(args, stdout)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	steps, err := recipe(readme)
	if err != nil {
		return fmt.Errorf("e2e/demo/README.md: %w", err)
	}

	// The Envoy side: envoy.yaml as the e2e tests read it.
	b, err := envoyconf.Load(o.envoy)
	if err != nil {
		return fromRoot(err, "envoy")
	}
	settings, err := envoyconf.ProxySettings(b)
	if err != nil {
		return fmt.Errorf("%s: %w", o.envoy, err)
	}
	// The processor side: the policy file as the server reads it (a file with program settings
	// would be refused here, where the server would take them).
	data, err := os.ReadFile(o.policy)
	if err != nil {
		return fromRoot(err, "policy")
	}
	pol, err := policy.Parse(data)
	if err != nil {
		return fmt.Errorf("policy file %s: %w", o.policy, err)
	}
	format, err := accessLogFormat(b, pol.MetadataNamespace)
	if err != nil {
		return fmt.Errorf("%s: %w", o.envoy, err)
	}

	// Every port opens before anything runs, so that a taken one fails alone and at once.
	var lns []net.Listener
	defer func() {
		for _, l := range lns {
			_ = l.Close()
		}
	}()
	listen := func(flagName, addr string) (net.Listener, error) {
		l, err := net.Listen("tcp", addr)
		if err != nil {
			return nil, fmt.Errorf("-%s %s: %w", flagName, addr, err)
		}
		lns = append(lns, l)
		return l, nil
	}
	frontLn, err := listen("listen", o.listen)
	if err != nil {
		return err
	}
	upLn, err := listen("upstream", o.upstream)
	if err != nil {
		return err
	}
	procLn, err := listen("processor", o.processor)
	if err != nil {
		return err
	}
	metricsLn, err := listen("metrics", o.metrics)
	if err != nil {
		return err
	}

	out := &lineWriter{w: stdout}
	// The server's default level, info: one line per covered request.
	log := zerolog.New(zerolog.ConsoleWriter{Out: prefixed{out, "processor "}, NoColor: !isTerminal(stdout), TimeFormat: time.TimeOnly}).
		Level(zerolog.InfoLevel).With().Timestamp().Logger()

	// The processor: the server's own wiring (cmd/idempotency-extproc run.go) on the memory store,
	// or on Redis.
	store, storeName, err := openStore(ctx, o.redisURL, pol)
	if err != nil {
		return err
	}
	defer store.Close()
	reg := prometheus.NewRegistry()
	metrics, err := extproc.NewMetrics(reg)
	if err != nil {
		return err
	}
	srv, err := extproc.NewServer(extproc.Options{Store: store, Policy: pol, Logger: &log, Metrics: metrics})
	if err != nil {
		return err
	}
	gs := grpc.NewServer(
		grpc.ChainStreamInterceptor(srv.StreamInterceptor()),
		// A BUFFERED body arrives in one message, up to envoy.yaml's 16 MiB documents route: the
		// server's own bound (cmd/idempotency-extproc maxRecvMsgSize).
		grpc.MaxRecvMsgSize(max(64<<20, 2*max(pol.MaxResponseBytes(), pol.MaxRequestBytes())+1<<20)),
		grpc.NumStreamWorkers(extproc.StreamWorkers),
	)
	extprocv3.RegisterExternalProcessorServer(gs, srv)
	// envoy.yaml health-checks the processor cluster; the store answered above.
	hs := health.NewServer()
	hs.SetServingStatus(extprocv3.ExternalProcessor_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(gs, hs)
	metricsSrv := &http.Server{Handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}), ReadHeaderTimeout: 5 * time.Second}

	// The upstream, which counts executions per key and says so.
	up := upstream.New()
	upSrv := &http.Server{Handler: logExecutions(up, out), ReadHeaderTimeout: 5 * time.Second}

	// The emulator, configured from envoy.yaml and pointed at the two listeners above. Its
	// zero proxy.Behaviour is the newest Envoy it models.
	upstreamURL := "http://" + upLn.Addr().String()
	cfg := settings.ProxyConfig([]string{procLn.Addr().String()}, upstreamURL)
	if o.messageTimeout > 0 {
		f := proto.Clone(cfg.Filter).(*filterextproc.ExternalProcessor)
		f.MessageTimeout = durationpb.New(o.messageTimeout)
		cfg.Filter = f
	}
	cfg.AccessLog = func(r proxy.Record) {
		_, _ = io.WriteString(out, "access    "+format.line(r, upLn.Addr().String(), time.Now()))
	}
	px, err := proxy.New(cfg)
	if err != nil {
		return fmt.Errorf("%s: %w", o.envoy, err)
	}
	front := &http.Server{Handler: px, ReadHeaderTimeout: 10 * time.Second}

	var serving sync.WaitGroup
	errc := make(chan error, 4)
	serve := func(name string, fn func() error) {
		serving.Go(func() {
			if err := fn(); err != nil && !errors.Is(err, http.ErrServerClosed) {
				errc <- fmt.Errorf("%s: %w", name, err)
			}
		})
	}
	serve("processor", func() error { return gs.Serve(procLn) })
	serve("metrics", func() error { return metricsSrv.Serve(metricsLn) })
	serve("upstream", func() error { return upSrv.Serve(upLn) })
	serve("emulator", func() error { return front.Serve(frontLn) })

	printBanner(out, banner{
		front: "http://" + frontLn.Addr().String(), processor: procLn.Addr().String(),
		upstream: upstreamURL, metrics: "http://" + metricsLn.Addr().String() + "/metrics",
		envoy: o.envoy, policy: o.policy, bootstrap: b, settings: settings, steps: steps, store: storeName,
	})

	var failed error
	select {
	case <-ctx.Done():
	case failed = <-errc:
	}
	// A demo stops at once: requests still in flight are cut.
	_ = front.Close()
	_ = px.Close() // cancels the requests in flight, waits for them, closes the gRPC connections
	up.Close()     // releases delayed and hanging upstream requests
	_ = upSrv.Close()
	_ = metricsSrv.Close()
	stopped := make(chan struct{})
	go func() {
		gs.GracefulStop()
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		gs.Stop()
		<-stopped
	}
	waitCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Wait(waitCtx); err != nil {
		failed = errors.Join(failed, fmt.Errorf("processor streams did not finish: %w", err))
	}
	serving.Wait()
	fmt.Fprintln(out, "stopped")
	return failed
}

// openStore opens the demo's store: the memory store, or, with redisURL, Redis, once it answers.
// On Redis every route's key_prefix gets a prefix of this run's own, idempotency-demo:RUN:, so
// that the recipe starts afresh on every run whatever earlier runs left there (for their TTL).
// It returns the store and how the banner names it.
func openStore(ctx context.Context, redisURL string, pol *policy.Policy) (cache.Store, string, error) {
	if redisURL == "" {
		s, err := cache.NewMemory(cache.MemoryOptions{})
		return s, "memory store", err
	}
	s, err := cache.OpenRedis(cache.RedisOptions{URL: redisURL, Timeout: pol.StoreTimeout})
	if err != nil {
		return nil, "", fmt.Errorf("-redis-url: %w", err)
	}
	pingCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := s.Ping(pingCtx); err != nil {
		_ = s.Close()
		return nil, "", fmt.Errorf("-redis-url: Redis does not answer: %w", err)
	}
	run := demoPrefix + strconv.FormatInt(time.Now().UnixNano(), 36) + ":"
	for _, r := range append([]*policy.Route{pol.Default}, pol.Routes...) {
		r.KeyPrefix = run + r.KeyPrefix
	}
	return s, "Redis (keys under " + run + ")", nil
}

// demoPrefix begins the key prefix of a demo run on Redis.
const demoPrefix = "idempotency-demo:"

// fromRoot adds to a missing file's error where the demo looks for it.
func fromRoot(err error, flagName string) error {
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%w (run the demo from the repository root, or give the file with -%s)", err, flagName)
	}
	return err
}

// logExecutions prints a line when up starts running a request and one when it has answered,
// with how many times requests with that Idempotency-Key have run: the number a replay must not
// raise. The request's x-request-id ties the lines to the access log; the key is not printed.
func logExecutions(up *upstream.Upstream, out io.Writer) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		what := fmt.Sprintf("upstream  %s %s (x-request-id %s)", r.Method, r.URL.RequestURI(), r.Header.Get("X-Request-Id"))
		fmt.Fprintf(out, "%s: running\n", what)
		sw := &statusWriter{ResponseWriter: w}
		up.ServeHTTP(sw, r)
		key := "this Idempotency-Key"
		if upstream.Key(r) == "" {
			key = "no Idempotency-Key"
		}
		fmt.Fprintf(out, "%s: answered %d; executions with %s: %d\n", what, sw.status, key, up.Count(upstream.Key(r)))
	})
}

// statusWriter remembers the status written through it (0: none, the client went away).
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(p)
}

// Unwrap lets http.ResponseController flush the upstream's chunked answers.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// banner is what the demo says it runs.
type banner struct {
	front, processor, upstream, metrics string
	envoy, policy                       string
	bootstrap                           *bootstrapv3.Bootstrap
	settings                            envoyconf.Settings
	steps                               []step
	store                               string // where the records are, as the banner says it
}

func printBanner(out io.Writer, b banner) {
	var s strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&s, format+"\n", args...) }
	p("idempotency-extproc demo: one process, loopback only.")
	p("")
	p("This is an emulator of Envoy's ext_proc filter (e2e/proxy), for trying the product: it is not")
	p("Envoy. In production the processor runs behind Envoy, Istio or Envoy Gateway; start from")
	p("envoy/envoy.yaml (envoy/istio-envoyfilter.yaml, envoy/envoy-gateway.yaml).")
	p("")
	p("  emulator   %-24s from %s (listener %s there):", b.front, b.envoy, listenerOf(b.bootstrap))
	p("  %-35s its routes, ext_proc filter, jwt_authn and access-log format", "")
	p("  processor  %-24s idempotency-extproc over gRPC, %s, %s", b.processor, b.store, b.policy)
	p("  %-35s (cluster %s there)", "", clusterOf(b.bootstrap, b.settings.ProcessorCluster))
	p("  upstream   %-24s counts executions per Idempotency-Key; x-test-delay: 3s slows it", b.upstream)
	p("  %-35s (cluster %s there)", "", clusterOf(b.bootstrap, b.settings.UpstreamCluster))
	p("  metrics    %s", b.metrics)
	p("")
	p("Send requests to %s. The recipe of e2e/demo/README.md:", b.front)
	for _, st := range b.steps {
		p("")
		p("  %s", st.title)
		for _, c := range st.commands {
			p("    %s", strings.ReplaceAll(c, recipeURL, b.front))
		}
	}
	p("")
	p("Each request prints a line of the emulator's access log (\"access\"), rendered with the")
	p("access_log format of %s (fields the emulator does not record print -): idempotency= is the", b.envoy)
	p("outcome the processor returned in dynamic metadata. \"upstream\" lines show each execution,")
	p("\"processor\" lines are the processor's log. Ctrl-C stops.")
	p("")
	_, _ = io.WriteString(out, s.String())
}

// listenerOf describes envoy.yaml's first listener, which the emulator's -listen replaces.
func listenerOf(b *bootstrapv3.Bootstrap) string {
	ls := b.GetStaticResources().GetListeners()
	if len(ls) == 0 {
		return "(none)"
	}
	sa := ls[0].GetAddress().GetSocketAddress()
	return fmt.Sprintf("%s, %s", ls[0].GetName(), net.JoinHostPort(sa.GetAddress(), fmt.Sprint(sa.GetPortValue())))
}

// clusterOf describes the endpoints envoy.yaml gives cluster name, which the demo replaces.
func clusterOf(b *bootstrapv3.Bootstrap, name string) string {
	var eps []string
	for _, c := range b.GetStaticResources().GetClusters() {
		if c.GetName() != name {
			continue
		}
		for _, le := range c.GetLoadAssignment().GetEndpoints() {
			for _, ep := range le.GetLbEndpoints() {
				sa := ep.GetEndpoint().GetAddress().GetSocketAddress()
				eps = append(eps, net.JoinHostPort(sa.GetAddress(), fmt.Sprint(sa.GetPortValue())))
			}
		}
	}
	return fmt.Sprintf("%s, %s", name, strings.Join(eps, " "))
}

// lineWriter serializes writes to w, so that lines from the emulator, the upstream and the
// processor never interleave: each of them writes whole lines in one call.
type lineWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lineWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// prefixed writes each line it is given to w with prefix before it, in one write.
type prefixed struct {
	w      io.Writer
	prefix string
}

func (p prefixed) Write(b []byte) (int, error) {
	var s strings.Builder
	for line := range strings.SplitAfterSeq(string(b), "\n") {
		if line != "" {
			s.WriteString(p.prefix + line)
		}
	}
	if _, err := io.WriteString(p.w, s.String()); err != nil {
		return 0, err
	}
	return len(b), nil
}

// isTerminal reports whether w is a terminal, where the processor's log may use colours.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
