package extproc_test

import (
	"context"
	"net"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

// This file holds the harness: the server under test on a gRPC server, its store, clock, metrics
// and logs. Whole HTTP requests reach it through e2e/proxy, the one model of Envoy
// (viaenvoy_test.go: do and run); the message builders here (requestHeaders, responseHeaders, …)
// write the exact messages of tests that hold the server to its answers one by one.

type harness struct {
	t        *testing.T
	client   extprocv3.ExternalProcessorClient
	server   *extproc.Server
	store    cache.Store
	registry *prometheus.Registry
	clock    *clock.Fake
	logs     *syncBuffer

	policy       *policy.Policy
	storeAdvance func(time.Duration)

	mu       sync.Mutex
	executed map[string]int // upstream executions by idempotency-key header value

	// grpcServer serves the server; proxies, made on first use, run requests through e2e/proxy.
	grpcServer *grpc.Server
	inbox      *inbox
	proxies    *envoys
}

type harnessOptions struct {
	policy string // YAML
	store  cache.Store
	// advance moves the store's time when it does not run on the harness clock.
	advance func(time.Duration)
	clock   *clock.Fake
	// tap installs the server's TapHandle, as the binary does.
	tap bool
}

func newHarness(t *testing.T, o harnessOptions) *harness {
	t.Helper()
	p, err := policy.Parse([]byte(o.policy))
	require.NoError(t, err)
	if o.clock == nil {
		o.clock = clock.NewFake(time.Unix(1_700_000_000, 0))
	}
	if o.store == nil {
		m, err := cache.NewMemory(cache.MemoryOptions{Clock: o.clock})
		require.NoError(t, err)
		o.store = m
	}
	reg := prometheus.NewRegistry()
	metrics, err := extproc.NewMetrics(reg)
	require.NoError(t, err)
	logs := &syncBuffer{}
	logger := zerolog.New(logs).Level(zerolog.DebugLevel)
	srv, err := extproc.NewServer(extproc.Options{Store: o.store, Policy: p, Logger: &logger, Metrics: metrics, Clock: o.clock})
	require.NoError(t, err)

	lis := bufconn.Listen(4 << 20)
	answers, ib := &ledger{}, &inbox{}
	// The binary's codec, so that what the tests read is the bytes it sends.
	serverOpts := []grpc.ServerOption{grpc.ChainStreamInterceptor(answers.interceptor, ib.interceptor, srv.StreamInterceptor()), grpc.ForceServerCodecV2(srv.Codec())}
	if o.tap {
		serverOpts = append(serverOpts, grpc.InTapHandle(srv.TapHandle()))
	}
	gs := grpc.NewServer(serverOpts...)
	extprocv3.RegisterExternalProcessorServer(gs, srv)
	go func() { _ = gs.Serve(lis) }()
	conn, err := grpc.NewClient("passthrough:///bufconn",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = conn.Close()
		gs.Stop()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		require.NoError(t, srv.Wait(ctx), "stream handlers must return")
		// Gives up at once any completion a test left retrying in the background.
		gone, stop := context.WithCancel(ctx)
		stop()
		_ = srv.Shutdown(gone)
		require.Empty(t, answers.all(), "every answer is one Envoy asked for, once, in order")
		require.Zero(t, metricValue(t, reg, "idempotency_internal_errors_total", "kind", "illegal_transition"), "no move outside the stream's transition table")
		_ = o.store.Close()
	})
	return &harness{
		t: t, client: extprocv3.NewExternalProcessorClient(conn), server: srv, store: o.store,
		registry: reg, clock: o.clock, logs: logs, executed: map[string]int{},
		policy: p, storeAdvance: o.advance, grpcServer: gs, inbox: ib,
	}
}

// advance moves time forward for the server and the store.
func (h *harness) advance(d time.Duration) {
	h.clock.Advance(d)
	if h.storeAdvance != nil {
		h.storeAdvance(d)
	}
}

// record returns the record stored for a POST to /v1/payments with key and no scope headers,
// or nil when there is none. Probing a free key claims and releases it at once.
func (h *harness) record(t *testing.T, key string) *cache.Record {
	t.Helper()
	return storedRecord(t, h.store, h.policy, key)
}

// storedRecord is harness.record on any store and policy.
func storedRecord(t *testing.T, store cache.Store, p *policy.Policy, key string) *cache.Record {
	t.Helper()
	k := extproc.StoredKey(p, "/v1/payments", key)
	l, rec, err := store.Acquire(t.Context(), k, cache.Claim{LockTTL: time.Second, TTL: time.Second})
	require.NoError(t, err)
	if l.Held() {
		require.NoError(t, store.Release(t.Context(), l))
		return nil
	}
	return rec
}

func (h *harness) requireStoreEmpty(t *testing.T, key string) {
	t.Helper()
	require.Nil(t, h.record(t, key), "no record may be left for %q", key)
}

// waitIdle waits until every stream handler has returned.
func (h *harness) waitIdle(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	require.NoError(t, h.server.Wait(ctx))
}

// counter returns the value of the series of a counter or gauge with the given label pairs.
func (h *harness) counter(name string, labels ...string) float64 {
	h.t.Helper()
	return metricValue(h.t, h.registry, name, labels...)
}

// metricValue returns the value in reg of the series of a counter or gauge with the given label
// pairs, 0 when there is none.
func metricValue(t *testing.T, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	metrics:
		for _, m := range f.GetMetric() {
			got := map[string]string{}
			for _, l := range m.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			for i := 0; i+1 < len(labels); i += 2 {
				if got[labels[i]] != labels[i+1] {
					continue metrics
				}
			}
			if m.GetCounter() != nil {
				return m.GetCounter().GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	return 0
}

// stream is one ext_proc stream, as Envoy opens one per HTTP request.
type stream struct {
	t      *testing.T
	s      extprocv3.ExternalProcessor_ProcessClient
	cancel context.CancelFunc
}

func (h *harness) open() *stream { return h.openNamed("") }

// openNamed opens a stream whose gRPC initial metadata names the policy route named, as an Envoy
// route's ExtProcPerRoute grpc_initial_metadata does ("" for none).
func (h *harness) openNamed(named string) *stream {
	ctx, cancel := context.WithCancel(h.t.Context())
	if named != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "x-idempotency-route", named)
	}
	s, err := h.client.Process(ctx)
	require.NoError(h.t, err)
	st := &stream{t: h.t, s: s, cancel: cancel}
	h.t.Cleanup(st.end)
	return st
}

// send sends one message and waits for its answer, as Envoy does in lock-step.
func (s *stream) send(m *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
	s.t.Helper()
	require.NoError(s.t, s.s.Send(m))
	resp, err := s.s.Recv()
	require.NoError(s.t, err)
	return resp
}

// end closes the stream the way Envoy does: half-close, then reset
// (ExternalProcessorStreamImpl::close in source/extensions/filters/http/ext_proc/client_impl.cc).
func (s *stream) end() {
	_ = s.s.CloseSend()
	s.cancel()
}

// request is an HTTP request as the client sends it, with what Envoy adds to its first message.
type request struct {
	method  string
	path    string
	headers []string // name, value pairs
	body    []byte
	// routeName is the xds.route_name attribute, peer connection.uri_san_peer_certificate.
	routeName, peer string
	// jwt holds the payloads jwt_authn verified, by payload_in_metadata name.
	jwt map[string]map[string]any
	// named is the x-idempotency-route gRPC initial metadata of the stream.
	named string
}

func post(path, key string, body string, extra ...string) request {
	h := append([]string{}, extra...)
	if key != "" {
		h = append(h, "idempotency-key", key)
	}
	return request{method: "POST", path: path, headers: h, body: []byte(body)}
}

// upstream is the response the upstream gives when it runs.
type upstream struct {
	status  int
	headers []string
	body    []byte
	// The rest only shapes a hand-written response_headers message (responseHeaders); through
	// the proxy, a shape says how Envoy makes a response. details is response.code_details (""
	// means via_upstream); attempts is upstream.request_attempt_count (0 for an upstream response
	// means 1, its first attempt); noAttempts and noDetails leave the attributes out, as a
	// filter that does not request them.
	details               string
	attempts              int
	noAttempts, noDetails bool
}

var created = upstream{
	status:  201,
	headers: []string{"content-type", "application/json", "set-cookie", "a=1", "set-cookie", "b=2", "content-length", "13", "date", "Mon, 30 Nov 2026 00:00:00 GMT", "connection", "keep-alive", "x-envoy-upstream-service-time", "3"},
	body:    []byte(`{"id":"tx_1"}`),
}

// result is what the HTTP client receives.
type result struct {
	status   int
	headers  []string // name, value pairs in order
	body     []byte
	executed bool // whether the upstream ran
	// logged is the proxy's access log line for the request: its dynamic metadata holds what
	// the server wrote in the receiving namespaces.
	logged proxy.Record
	// received are the kinds of the messages the processor received for the request, in order
	// ("request_headers", "request_body", "response_headers", …).
	received []string
}

func (r result) header(name string) []string {
	var vs []string
	for i := 0; i < len(r.headers); i += 2 {
		if r.headers[i] == name {
			vs = append(vs, r.headers[i+1])
		}
	}
	return vs
}

func requestHeaders(r request) *extprocv3.ProcessingRequest {
	hs := []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte(r.method)},
		{Key: ":path", RawValue: []byte(r.path)},
		{Key: ":scheme", RawValue: []byte("https")},
		{Key: "x-request-id", RawValue: []byte("req-" + strconv.Itoa(len(r.body)))},
	}
	if !slices.Contains(r.headers, ":authority") {
		hs = append(hs, &corev3.HeaderValue{Key: ":authority", RawValue: []byte("api.example.com")})
	}
	for i := 0; i < len(r.headers); i += 2 {
		hs = append(hs, &corev3.HeaderValue{Key: r.headers[i], RawValue: []byte(r.headers[i+1])})
	}
	m := &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers:     &corev3.HeaderMap{Headers: hs},
			EndOfStream: len(r.body) == 0,
		}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{
			RequestBodyMode:  filterextproc.ProcessingMode_BUFFERED,
			ResponseBodyMode: filterextproc.ProcessingMode_BUFFERED,
		},
	}
	attrs := map[string]any{}
	if r.routeName != "" {
		attrs["xds.route_name"] = r.routeName
	}
	if r.peer != "" {
		attrs["connection.uri_san_peer_certificate"] = r.peer
	}
	if len(attrs) > 0 {
		a, err := structpb.NewStruct(attrs)
		if err != nil {
			panic(err)
		}
		m.Attributes = map[string]*structpb.Struct{"envoy.filters.http.ext_proc": a}
	}
	if r.jwt != nil {
		payloads := map[string]any{}
		for k, v := range r.jwt {
			payloads[k] = v
		}
		ns, err := structpb.NewStruct(payloads)
		if err != nil {
			panic(err)
		}
		m.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy.filters.http.jwt_authn": ns}}
	}
	return m
}

func requestBody(b []byte) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: b, EndOfStream: true}}}
}

func responseHeaders(u upstream) *extprocv3.ProcessingRequest {
	hs := []*corev3.HeaderValue{{Key: ":status", RawValue: []byte(strconv.Itoa(u.status))}}
	for i := 0; i < len(u.headers); i += 2 {
		hs = append(hs, &corev3.HeaderValue{Key: u.headers[i], RawValue: []byte(u.headers[i+1])})
	}
	details, attempts := u.details, u.attempts
	if details == "" && !u.noDetails {
		details, attempts = "via_upstream", max(attempts, 1)
	}
	fields := map[string]any{"response.code_details": details, "upstream.request_attempt_count": attempts}
	if u.noAttempts {
		delete(fields, "upstream.request_attempt_count")
	}
	if u.noDetails {
		delete(fields, "response.code_details")
	}
	attrs, err := structpb.NewStruct(fields)
	if err != nil {
		panic(err)
	}
	return &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers:     &corev3.HeaderMap{Headers: hs},
			EndOfStream: len(u.body) == 0,
		}},
		Attributes: map[string]*structpb.Struct{"envoy.filters.http.ext_proc": attrs},
	}
}

func responseBody(b []byte, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: b, EndOfStream: eos}}}
}

// do runs one whole HTTP request through e2e/proxy in front of the server, with BUFFERED request
// and response bodies, and returns what the client gets. The upstream answers with u when the
// server lets the request through.
func (h *harness) do(r request, u upstream) result {
	h.t.Helper()
	return h.run(r, buffered, u).result
}

// buffered is the shape of do: BUFFERED request and response bodies, the upstream answering.
var buffered = shape{reqMode: modeBuffered, respMode: modeBuffered}

// envoyMade is the buffered shape whose response the router makes after attempts tries (see
// endEnvoyMade): with ran, the last attempt ran upstream and the route timeout fired.
func envoyMade(attempts int, ran bool) shape {
	sh := buffered
	sh.end, sh.attempts, sh.ranUpstream = endEnvoyMade, attempts, ran
	return sh
}

func keyOf(r request) string {
	for i := 0; i < len(r.headers); i += 2 {
		if r.headers[i] == "idempotency-key" {
			return r.headers[i+1]
		}
	}
	return ""
}

func (h *harness) executions(key string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.executed[key]
}

// syncBuffer collects log output from concurrent goroutines.
type syncBuffer struct {
	mu  sync.Mutex
	buf []byte
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	return len(p), nil
}

// Reset drops what was written so far.
func (b *syncBuffer) Reset() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = nil
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(b.buf)
}
