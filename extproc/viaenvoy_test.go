package extproc_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	jwtauthnv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/jwt_authn/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
)

// This file runs whole HTTP requests through e2e/proxy, the Envoy emulator the end-to-end tests
// use, in front of the harness's server: the proxy is the one model of Envoy's ext_proc filter
// in the repository, and cites Envoy's source for each behaviour (body modes, pipelined STREAMED
// chunks, FULL_DUPLEX_STREAMED, mode_override, trailers, message timeouts, the router's local
// replies and attempt counts). This file only says how a request is delivered (a shape: the
// filter's configuration, how the bodies are cut, how the upstream behaves) and reads what the
// client, the upstream and the proxy's access log saw.

type bodyMode = filterextproc.ProcessingMode_BodySendMode

const (
	modeNone     = filterextproc.ProcessingMode_NONE
	modeStreamed = filterextproc.ProcessingMode_STREAMED
	modeBuffered = filterextproc.ProcessingMode_BUFFERED
	modePartial  = filterextproc.ProcessingMode_BUFFERED_PARTIAL
	modeDuplex   = filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
)

// ending is where an exchange ends early, if it does.
type ending uint8

const (
	endNormally ending = iota
	// endBeforeResponse: the client goes away once the upstream has the whole request, before
	// any response headers; ranUpstream says whether the upstream ran it.
	endBeforeResponse
	// endMidBody: the upstream resets its connection after the response headers and part of the
	// body.
	endMidBody
	// endEnvoyMade: the router makes the response: with attempts 0 no route matches (404
	// route_not_found); otherwise the upstream is tried attempts times (a retry_policy on 5xx
	// re-sends after a 503), and the last attempt either runs and never answers (ranUpstream:
	// the route timeout's 504) or resets before answering (503).
	endEnvoyMade
)

// shape is how Envoy delivers one request and its response.
type shape struct {
	reqMode, respMode bodyMode
	// chunks are the sizes of the request body's reads in the streamed modes (the last takes
	// the rest); whole makes the body arrive complete during the header call.
	chunks []int
	whole  bool
	// trailers: the request and the response have trailers, sent to the processor when
	// trailerSend (request_trailer_mode and response_trailer_mode SEND; always under
	// FULL_DUPLEX_STREAMED, whose configuration requires it).
	trailers, trailerSend bool
	// bufferLimit is the listener's and the upstream cluster's buffer limit (0: 1 MiB).
	bufferLimit int
	// respChunks are the sizes of the response body's reads (the last takes the rest).
	respChunks []int
	end        ending
	// ranUpstream: with endBeforeResponse or endEnvoyMade, the upstream ran the request.
	ranUpstream bool
	// attempts is how many times the router tries the upstream: each attempt before the last
	// gets a 503 that the route's retry_policy (5xx) retries; with endEnvoyMade, 0 means no
	// route matches. noAttempts leaves upstream.request_attempt_count out of the filter's
	// response_attributes.
	attempts   int
	noAttempts bool
	// noDetails leaves response.code_details out of the filter's response_attributes.
	noDetails bool
	// messageTimeout is the filter's message_timeout (0: 5 s, far above any answer here).
	messageTimeout time.Duration
	// bodyBeforeAnswer is send_body_without_waiting_for_header_response.
	bodyBeforeAnswer bool
}

// envoyStatus is the status the router makes for an endEnvoyMade shape.
func (sh shape) envoyStatus() int {
	switch {
	case sh.attempts == 0:
		return http.StatusNotFound
	case sh.ranUpstream:
		return http.StatusGatewayTimeout
	}
	return http.StatusServiceUnavailable
}

// simResult is what the client gets, and what the upstream and Envoy saw.
type simResult struct {
	result
	// ran: the upstream ran the request (it received it whole).
	ran bool
	// stalled: Envoy's message timer fired waiting for an answer (504).
	stalled bool
	// ambiguous: the processor could not know whether the upstream ran.
	ambiguous bool
	// reset: the response was cut (the client got no status, or no whole body).
	reset bool
}

const (
	runHeader       = "x-request-id"
	upstreamTimeout = 150 * time.Millisecond
	jwtSecret       = "harness-jwt-secret-0123456789"
)

// envoys are the proxies of one harness, one per filter and router configuration, with the
// upstream they share.
type envoys struct {
	h        *harness
	grpcAddr string
	upstream *httptest.Server
	client   *http.Client

	mu      sync.Mutex
	proxies map[string]*proxy.Proxy
	plans   map[string]*plan
	next    atomic.Uint64
	// pki and peers serve requests with a peer identity: the listener's certificates, and a
	// client per identity presenting a certificate with it as URI SAN.
	pki   *pki
	peers map[string]*http.Client
}

// via is what a request says about the route Envoy matched and the connection it came on.
type via struct {
	routeName, named string
	tls              bool
}

// plan is one request's way through the upstream, and what it saw there.
type plan struct {
	req      request
	sh       shape
	u        upstream
	attempts atomic.Int32
	reached  atomic.Bool // the upstream received the whole request (last attempt)
	ran      atomic.Bool
	gone     chan struct{} // closed when the client should go away (endBeforeResponse)
	logged   chan proxy.Record
}

func (h *harness) envoys() *envoys {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.proxies != nil {
		return h.proxies
	}
	t := h.t
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = h.grpcServer.Serve(lis) }()
	e := &envoys{h: h, grpcAddr: lis.Addr().String(), proxies: map[string]*proxy.Proxy{}, plans: map[string]*plan{}}
	e.upstream = httptest.NewServer(http.HandlerFunc(e.serveUpstream))
	t.Cleanup(e.upstream.Close)
	t.Cleanup(func() {
		e.mu.Lock()
		defer e.mu.Unlock()
		for key, p := range e.proxies {
			st := p.Stats()
			require.Zero(t, st.Spurious, "every answer is of the kind Envoy waits for (%s)", key)
			require.Zero(t, st.RejectedMutations, "every header mutation is one Envoy applies (%s)", key)
		}
	})
	tr := &http.Transport{MaxIdleConnsPerHost: 64, DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	e.client = &http.Client{Transport: tr}
	h.proxies = e
	return e
}

// proxyFor returns the proxy for sh's configuration and v's route and listener, started on first
// use.
func (e *envoys) proxyFor(sh shape, v via) *proxy.Proxy {
	envoyMade := sh.end == endEnvoyMade
	key := fmt.Sprint(sh.reqMode, sh.respMode, sh.trailerSend, sh.bufferLimit, sh.messageTimeout, sh.bodyBeforeAnswer,
		envoyMade && sh.attempts == 0, sh.attempts > 1, envoyMade && sh.ranUpstream, sh.noAttempts, sh.noDetails, v)
	e.mu.Lock()
	defer e.mu.Unlock()
	if p := e.proxies[key]; p != nil {
		return p
	}
	timeout := sh.messageTimeout
	if timeout == 0 {
		timeout = 5 * time.Second
	}
	send := func(mode bodyMode) filterextproc.ProcessingMode_HeaderSendMode {
		if sh.trailerSend || mode == modeDuplex {
			return filterextproc.ProcessingMode_SEND
		}
		return filterextproc.ProcessingMode_SKIP
	}
	filter := &filterextproc.ExternalProcessor{
		ProcessingMode: &filterextproc.ProcessingMode{
			RequestBodyMode: sh.reqMode, ResponseBodyMode: sh.respMode,
			RequestTrailerMode: send(sh.reqMode), ResponseTrailerMode: send(sh.respMode),
		},
		AllowModeOverride:                       true,
		MessageTimeout:                          durationpb.New(timeout),
		SendBodyWithoutWaitingForHeaderResponse: sh.bodyBeforeAnswer,
		ResponseAttributes:                      []string{"response.code_details", "upstream.request_attempt_count"},
		MetadataOptions: &filterextproc.MetadataOptions{
			ForwardingNamespaces: &filterextproc.MetadataOptions_MetadataNamespaces{Untyped: []string{"envoy.filters.http.jwt_authn"}},
			ReceivingNamespaces:  &filterextproc.MetadataOptions_MetadataNamespaces{Untyped: []string{"idempotency", "idem"}},
		},
	}
	if sh.noAttempts {
		filter.ResponseAttributes = slices.DeleteFunc(filter.ResponseAttributes, func(a string) bool { return a == "upstream.request_attempt_count" })
	}
	if sh.noDetails {
		filter.ResponseAttributes = slices.DeleteFunc(filter.ResponseAttributes, func(a string) bool { return a == "response.code_details" })
	}
	rt := proxy.Route{Prefix: "/", Name: v.routeName}
	if v.routeName != "" {
		filter.RequestAttributes = append(filter.RequestAttributes, "xds.route_name")
	}
	if v.named != "" {
		rt.ExtProc = &filterextproc.ExtProcPerRoute{Override: &filterextproc.ExtProcPerRoute_Overrides{Overrides: &filterextproc.ExtProcOverrides{
			GrpcInitialMetadata: []*corev3.HeaderValue{{Key: "x-idempotency-route", Value: v.named}},
		}}}
	}
	var serverTLS *tls.Config
	if v.tls {
		filter.RequestAttributes = append(filter.RequestAttributes, "connection.uri_san_peer_certificate")
		serverTLS = &tls.Config{Certificates: []tls.Certificate{e.pkiFor().server}, ClientCAs: e.pki.pool, ClientAuth: tls.RequireAndVerifyClientCert}
	}
	if envoyMade && sh.ranUpstream {
		rt.Timeout = upstreamTimeout // the upstream never answers: the route timeout always fires
	}
	if envoyMade && sh.attempts == 0 {
		rt.Prefix = "/nowhere/" // no route: the router's 404
	}
	if sh.attempts > 1 {
		rt.Retry = &routev3.RetryPolicy{RetryOn: "5xx", NumRetries: wrapperspb.UInt32(uint32(sh.attempts - 1))}
	}
	p := proxy.Start(e.h.t, proxy.Config{
		Filter: filter, Processors: []string{e.grpcAddr}, Upstream: e.upstream.URL, Routes: []proxy.Route{rt},
		ListenerBufferLimit: uint32(sh.bufferLimit), UpstreamBufferLimit: uint32(sh.bufferLimit),
		UpstreamTrailers: true, DownstreamTrailers: true,
		JWTAuthn: harnessJWT(),
		TLS:      serverTLS,
		Shapes:   e.shapes,
		AccessLog: func(r proxy.Record) {
			if p := e.plan(r.RequestID); p != nil {
				p.logged <- r
			}
		},
	})
	e.proxies[key] = p
	return p
}

// jwtPayloads are the payload_in_metadata names a request's jwt may use: each is a provider
// of harnessJWT that reads its token from the header x-jwt-<name>.
var jwtPayloads = []string{"provider", "p", "corp", "partner"}

// harnessJWT is a jwt_authn filter whose providers (jwtPayloads) verify HS256 tokens signed with
// jwtSecret, each from its own header, and put their payloads in the dynamic metadata; requests
// without a token pass. No provider reads Authorization: the tests use it as a plain header.
func harnessJWT() *jwtauthnv3.JwtAuthentication {
	jwks := `{"keys":[{"kty":"oct","kid":"k1","alg":"HS256","k":"` + base64.RawURLEncoding.EncodeToString([]byte(jwtSecret)) + `"}]}`
	providers := map[string]*jwtauthnv3.JwtProvider{}
	for _, name := range jwtPayloads {
		providers[name] = &jwtauthnv3.JwtProvider{
			PayloadInMetadata: name,
			FromHeaders:       []*jwtauthnv3.JwtHeader{{Name: "x-jwt-" + name}},
			JwksSourceSpecifier: &jwtauthnv3.JwtProvider_LocalJwks{LocalJwks: &corev3.DataSource{
				Specifier: &corev3.DataSource_InlineString{InlineString: jwks},
			}},
		}
	}
	return &jwtauthnv3.JwtAuthentication{
		Providers: providers,
		Rules: []*jwtauthnv3.RequirementRule{{
			Match: &routev3.RouteMatch{PathSpecifier: &routev3.RouteMatch_Prefix{Prefix: "/"}},
			RequirementType: &jwtauthnv3.RequirementRule_Requires{Requires: &jwtauthnv3.JwtRequirement{
				RequiresType: &jwtauthnv3.JwtRequirement_AllowMissing{AllowMissing: &emptypb.Empty{}},
			}},
		}},
	}
}

// signJWT mints a compact HS256 JWS of claims.
func signJWT(claims map[string]any) (string, error) {
	b64 := base64.RawURLEncoding
	head, err := json.Marshal(map[string]string{"alg": "HS256", "typ": "JWT", "kid": "k1"})
	if err != nil {
		return "", err
	}
	payload, err := json.Marshal(claims)
	if err != nil {
		return "", err
	}
	in := b64.EncodeToString(head) + "." + b64.EncodeToString(payload)
	mac := hmac.New(sha256.New, []byte(jwtSecret))
	mac.Write([]byte(in))
	return in + "." + b64.EncodeToString(mac.Sum(nil)), nil
}

func (e *envoys) plan(id string) *plan {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.plans[id]
}

// sizes turns chunk sizes whose last takes the rest into the proxy's, whose last repeats.
func sizes(chunks []int, total int) []int {
	return append(append([]int{}, chunks...), max(total, 1))
}

// shapes tells the proxy how the request's bodies arrive.
func (e *envoys) shapes(r *http.Request) proxy.Shapes {
	p := e.plan(r.Header.Get(runHeader))
	if p == nil {
		return proxy.Shapes{}
	}
	req := proxy.BodyShape{DuringHeaders: proxy.Held, Chunks: sizes(p.sh.chunks, len(p.req.body))}
	switch {
	case p.sh.whole:
		req.DuringHeaders = proxy.Whole
	case p.sh.bodyBeforeAnswer || p.sh.reqMode == modeDuplex:
		req.DuringHeaders = proxy.Race
	}
	return proxy.Shapes{Request: req, Response: proxy.BodyShape{Chunks: sizes(p.sh.respChunks, len(p.u.body))}}
}

// serveUpstream plays the upstream of the request r names: it checks that the body arrived
// whole, counts a run, and answers or ends as the shape says.
func (e *envoys) serveUpstream(w http.ResponseWriter, r *http.Request) {
	p := e.plan(r.Header.Get(runHeader))
	if p == nil {
		http.Error(w, "no plan", http.StatusTeapot)
		return
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		// Envoy reset the request mid-body: nothing ran, but no byte of a body may reach the
		// upstream before the processor lets the whole request through.
		if len(body) > 0 {
			e.h.t.Errorf("%d bytes of a %d-byte body reached the upstream of a request that did not go through", len(body), len(p.req.body))
		}
		return
	}
	if !bytes.Equal(body, p.req.body) {
		e.h.t.Errorf("the upstream got %d bytes of a %d-byte body", len(body), len(p.req.body))
		panic(http.ErrAbortHandler)
	}
	if p.sh.trailers && r.Trailer.Get("x-checksum") != "1" {
		e.h.t.Errorf("the upstream got request trailers %v in shape %+v, body %d bytes", r.Trailer, p.sh, len(body))
	}
	sh := p.sh
	attempt := int(p.attempts.Add(1))
	if attempt < sh.attempts {
		w.WriteHeader(http.StatusServiceUnavailable) // retried by the router; nothing ran
		return
	}
	p.reached.Store(true)
	switch sh.end {
	case endBeforeResponse:
		if sh.ranUpstream {
			e.run(p)
		}
		close(p.gone)
		<-r.Context().Done()
		return
	case endEnvoyMade:
		if sh.ranUpstream {
			e.run(p)
			<-r.Context().Done() // the route timeout ends it
			return
		}
		panic(http.ErrAbortHandler) // reset before the response started
	case endNormally, endMidBody:
		e.run(p)
	}
	u := p.u
	for i := 0; i+1 < len(u.headers); i += 2 {
		if k := http.CanonicalHeaderKey(u.headers[i]); k != "Content-Length" && k != "Connection" && k != "Date" {
			w.Header().Add(k, u.headers[i+1])
		}
	}
	if sh.trailers {
		w.Header().Set("Trailer", "X-Checksum")
	}
	if w.Header().Get("Content-Type") == "" {
		w.Header()["Content-Type"] = nil // u has none: no type sniffed from the body either
	}
	w.WriteHeader(u.status)
	if sh.end == endMidBody {
		_, _ = w.Write(u.body[:len(u.body)/2])
		_ = http.NewResponseController(w).Flush()
		panic(http.ErrAbortHandler)
	}
	_, _ = w.Write(u.body)
	if sh.trailers {
		w.Header().Set("X-Checksum", "1")
	}
}

func (e *envoys) run(p *plan) {
	p.ran.Store(true)
	e.h.count(p.req)
}

// run sends r through the proxy configured for sh and returns what the client gets. The upstream
// answers with u when it runs.
func (h *harness) run(r request, sh shape, u upstream) simResult {
	h.t.Helper()
	t := h.t
	e := h.envoys()
	px := e.proxyFor(sh, via{routeName: r.routeName, named: r.named, tls: r.peer != ""})
	id := "run-" + strconv.FormatUint(e.next.Add(1), 10)
	p := &plan{req: r, sh: sh, u: u, gone: make(chan struct{}), logged: make(chan proxy.Record, 1)}
	e.mu.Lock()
	e.plans[id] = p
	e.mu.Unlock()

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var body io.Reader = bytes.NewReader(r.body)
	if sh.trailers {
		body = io.MultiReader(bytes.NewReader(r.body)) // unknown length: chunked, with trailers
	}
	hr, err := http.NewRequestWithContext(ctx, r.method, px.URL()+r.path, body)
	require.NoError(t, err)
	if len(r.body) == 0 && !sh.trailers {
		hr.Body = http.NoBody
	}
	if sh.trailers {
		hr.ContentLength = -1
		hr.Trailer = http.Header{"X-Checksum": {"1"}}
	}
	for i := 0; i+1 < len(r.headers); i += 2 {
		if r.headers[i] == ":authority" {
			hr.Host = r.headers[i+1] // HTTP/1.1's Host, Envoy's :authority
			continue
		}
		hr.Header.Add(r.headers[i], r.headers[i+1])
	}
	hr.Header.Set(runHeader, id)
	for name, payload := range r.jwt {
		require.Contains(t, jwtPayloads, name, "a payload name harnessJWT has a provider for")
		// A jti of its own makes every token another, whatever its claims.
		claims := map[string]any{"exp": time.Now().Add(time.Hour).Unix(), "jti": id + "-" + name}
		maps.Copy(claims, payload)
		tok, err := signJWT(claims)
		require.NoError(t, err)
		hr.Header.Set("x-jwt-"+name, tok)
	}
	go func() {
		select {
		case <-p.gone:
			cancel()
		case <-ctx.Done():
		}
	}()

	var res simResult
	client := e.client
	if r.peer != "" {
		client = e.peerClient(r.peer)
	}
	resp, err := client.Do(hr)
	if err == nil {
		res.status = resp.StatusCode
		for name, vs := range resp.Header {
			for _, v := range vs {
				res.headers = append(res.headers, strings.ToLower(name), v)
			}
		}
		res.body, err = io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if err != nil {
			res.reset = true
		}
	} else if !errors.Is(err, context.Canceled) {
		res.reset = true
	}
	var rec proxy.Record
	select {
	case rec = <-p.logged:
	case <-time.After(10 * time.Second):
		t.Fatalf("no access log line for %s", id)
	}
	e.mu.Lock()
	delete(e.plans, id)
	e.mu.Unlock()

	res.logged = rec
	res.received = h.inbox.received(id)
	res.ran = p.ran.Load()
	res.executed = res.ran
	res.stalled = rec.CodeDetails == "ext_proc_error_per-message_timeout_exceeded"
	switch sh.end {
	case endBeforeResponse:
		res.ambiguous = p.reached.Load()
	case endEnvoyMade:
		// The processor let the request through when the router made the response (404 without
		// a route, 503 or 504 after attempts).
		envoyMade := rec.CodeDetails == "route_not_found" || rec.CodeDetails == "upstream_response_timeout" ||
			strings.HasPrefix(rec.CodeDetails, "upstream_reset_before_response_started")
		res.ambiguous = envoyMade && (sh.attempts > 0 || sh.noAttempts)
	}
	return res
}

// count records one upstream execution of r.
func (h *harness) count(r request) {
	h.mu.Lock()
	h.executed[keyOf(r)]++
	h.mu.Unlock()
}

// pki is a CA and the listener's certificate it signed.
type pki struct {
	pool   *x509.CertPool
	server tls.Certificate
	ca     *x509.Certificate
	caKey  *ecdsa.PrivateKey
}

// pkiFor returns the envoys' CA and listener certificate, made on first use.
func (e *envoys) pkiFor() *pki {
	if e.pki != nil {
		return e.pki
	}
	t := e.h.t
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "harness ca"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &caKey.PublicKey, caKey)
	require.NoError(t, err)
	ca, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	e.pki = &pki{pool: x509.NewCertPool(), ca: ca, caKey: caKey}
	e.pki.pool.AddCert(ca)
	e.pki.server = e.pki.leaf(t, x509.ExtKeyUsageServerAuth, nil)
	return e.pki
}

// leaf returns a certificate the CA signed for 127.0.0.1, with uris as URI SANs.
func (k *pki) leaf(t *testing.T, usage x509.ExtKeyUsage, uris []*url.URL) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	serial, err := rand.Int(rand.Reader, big.NewInt(1<<62))
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: serial, Subject: pkix.Name{CommonName: "leaf"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		ExtKeyUsage: []x509.ExtKeyUsage{usage}, KeyUsage: x509.KeyUsageDigitalSignature,
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, URIs: uris}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, k.ca, &key.PublicKey, k.caKey)
	require.NoError(t, err)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// peerClient returns a client whose certificate names peer as its URI SAN: the proxy's
// connection.uri_san_peer_certificate.
func (e *envoys) peerClient(peer string) *http.Client {
	e.mu.Lock()
	defer e.mu.Unlock()
	if c := e.peers[peer]; c != nil {
		return c
	}
	t := e.h.t
	u, err := url.Parse(peer)
	require.NoError(t, err)
	k := e.pkiFor()
	tr := &http.Transport{DisableCompression: true, TLSClientConfig: &tls.Config{
		RootCAs: k.pool, Certificates: []tls.Certificate{k.leaf(t, x509.ExtKeyUsageClientAuth, []*url.URL{u})},
	}}
	t.Cleanup(tr.CloseIdleConnections)
	if e.peers == nil {
		e.peers = map[string]*http.Client{}
	}
	e.peers[peer] = &http.Client{Transport: tr}
	return e.peers[peer]
}

// inbox records, by the x-request-id of their request_headers, the kinds of the messages each of
// the server's streams received: what Envoy sent the processor for one request.
type inbox struct {
	mu   sync.Mutex
	seen map[string][]string
}

func (ib *inbox) interceptor(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	return handler(srv, &inboxStream{ServerStream: ss, ib: ib})
}

// received returns the kinds of the messages the stream of request id received.
func (ib *inbox) received(id string) []string {
	ib.mu.Lock()
	defer ib.mu.Unlock()
	return slices.Clone(ib.seen[id])
}

type inboxStream struct {
	grpc.ServerStream
	ib *inbox
	id string
}

func (s *inboxStream) RecvMsg(m any) error {
	if err := s.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	req := m.(*extprocv3.ProcessingRequest)
	for _, hv := range req.GetRequestHeaders().GetHeaders().GetHeaders() {
		if hv.GetKey() == runHeader {
			s.id = string(hv.GetRawValue())
		}
	}
	if s.id == "" {
		return nil
	}
	kind := "other"
	switch req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		kind = "request_headers"
	case *extprocv3.ProcessingRequest_RequestBody:
		kind = "request_body"
	case *extprocv3.ProcessingRequest_RequestTrailers:
		kind = "request_trailers"
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		kind = "response_headers"
	case *extprocv3.ProcessingRequest_ResponseBody:
		kind = "response_body"
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		kind = "response_trailers"
	}
	s.ib.mu.Lock()
	defer s.ib.mu.Unlock()
	if s.ib.seen == nil {
		s.ib.seen = map[string][]string{}
	}
	s.ib.seen[s.id] = append(s.ib.seen[s.id], kind)
	return nil
}
