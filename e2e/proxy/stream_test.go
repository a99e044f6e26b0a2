package proxy_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
)

// Envoy 1.37 closes the side stream right after the last expected answer
// (Filter::closeGrpcStreamIfLastRespReceived): after a pass-through mode_override at
// request_headers the processor's stream ends while the upstream is still working. Older
// versions keep it open until the request ends.
func TestEarlyStreamClose(t *testing.T) {
	passThrough := on("request_headers", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		resp := cont(req)
		resp.ModeOverride = fullMode(bodyNONE, modeSKIP, bodyNONE)
		return st.Send(resp)
	})
	for _, tc := range []struct {
		envoy proxy.Behaviour
		early bool
	}{{proxy.Envoy137(), true}, {proxy.Envoy136(), false}} {
		e := newEnv(t, bufferedFilter(), passThrough, func(c *proxy.Config) { c.Envoy = tc.envoy })
		// The upstream answers after 1 s: the early close comes about that long before the
		// response, the other one with it (within 300 ms, which a loaded machine may take).
		resp, _ := e.do(t, http.MethodPost, "/x", []byte("x"), "X-Test-Delay", "1s")
		done := time.Now()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		log := e.proc.next(t)
		require.Equal(t, []string{"request_headers"}, kinds(log.msgs))
		if tc.early {
			require.Less(t, log.ended, done.Add(-500*time.Millisecond), "closed long before the response")
			require.Equal(t, int64(1), e.proxy.Stats().StreamsClosedEarly)
		} else {
			require.False(t, log.ended.Before(done.Add(-300*time.Millisecond)), "closed with the request")
			require.Zero(t, e.proxy.Stats().StreamsClosedEarly)
		}
	}
}

// The last STREAMED chunk's answer closes the stream when the response needs no processing.
func TestEarlyCloseAfterLastStreamedChunk(t *testing.T) {
	f := bufferedFilter()
	f.ProcessingMode = fullMode(bodySTR, modeSKIP, bodyNONE)
	e := newEnv(t, f, nil, func(c *proxy.Config) { c.Shapes = shape(proxy.BodyShape{DuringHeaders: proxy.Held, Chunks: []int{10}}) })
	resp, _ := e.do(t, http.MethodPost, "/x", []byte("0123456789abcdefghij"), "X-Test-Delay", "400ms")
	require.Equal(t, http.StatusOK, resp.StatusCode)
	log := e.proc.next(t)
	require.Len(t, bodies(log.msgs), 2)
	require.Equal(t, int64(1), e.proxy.Stats().StreamsClosedEarly)
}

// With tracing (OpenTelemetry), the stream's initial metadata carries the traceparent of a child
// of the request's span (Grpc::AsyncStreamImpl: spawnChild on the stream options' parent span,
// then injectContext); the upstream gets the request's span. Without tracing nothing is added.
func TestTraceContextOnTheSideStream(t *testing.T) {
	incoming := "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	for _, tc := range []struct {
		name    string
		tracing *proxy.Tracing
		header  string
	}{
		{"incoming traceparent", &proxy.Tracing{}, incoming},
		{"new trace", &proxy.Tracing{}, ""},
		{"no tracing", nil, incoming},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, bufferedFilter(), nil, func(c *proxy.Config) { c.Tracing = tc.tracing })
			var hdr []string
			if tc.header != "" {
				hdr = []string{"Traceparent", tc.header}
			}
			resp, _ := e.do(t, http.MethodPost, "/x", []byte("x"), hdr...)
			require.Equal(t, http.StatusOK, resp.StatusCode)
			log := e.proc.next(t)
			rec := e.record(t)
			got := log.md.Get("traceparent")
			up := e.up.Requests()[0].Header.Get("Traceparent")
			if tc.tracing == nil {
				require.Empty(t, got)
				require.Empty(t, rec.TraceParent)
				require.Equal(t, incoming, up, "passed through untouched")
				return
			}
			require.Len(t, got, 1)
			child := strings.Split(got[0], "-")
			parent := strings.Split(rec.TraceParent, "-")
			require.Equal(t, parent[1], child[1], "same trace")
			require.NotEqual(t, parent[2], child[2], "a child span")
			require.Equal(t, rec.TraceParent, up, "the upstream gets the request's span")
			if tc.header != "" {
				require.Equal(t, "0af7651916cd43dd8448eb211c80319c", child[1])
				require.NotEqual(t, "b7ad6b7169203331", parent[2], "the request's span is a child of the incoming one")
			}
			require.Equal(t, "01", child[3])
		})
	}
}

// certs returns a CA pool, a server certificate and a client certificate with a URI SAN.
func certs(t *testing.T, spiffe string) (*x509.CertPool, tls.Certificate, tls.Certificate) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test ca"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	require.NoError(t, err)
	ca, err := x509.ParseCertificate(caDER)
	require.NoError(t, err)
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	leaf := func(serial int64, usage x509.ExtKeyUsage, uris []*url.URL) tls.Certificate {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		require.NoError(t, err)
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "leaf"},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
			ExtKeyUsage: []x509.ExtKeyUsage{usage}, KeyUsage: x509.KeyUsageDigitalSignature,
			DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, URIs: uris}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		require.NoError(t, err)
		return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
	}
	u, err := url.Parse(spiffe)
	require.NoError(t, err)
	return pool, leaf(2, x509.ExtKeyUsageServerAuth, nil), leaf(3, x509.ExtKeyUsageClientAuth, []*url.URL{u})
}

// Under downstream mTLS, connection.uri_san_peer_certificate is the client certificate's first
// URI SAN and connection.mtls is true (Filters::Common::Expr::ConnectionWrapper); :scheme is https.
func TestPeerIdentityAttribute(t *testing.T) {
	const id = "spiffe://cluster.local/ns/shop/sa/checkout"
	pool, serverCert, clientCert := certs(t, id)
	f := bufferedFilter()
	f.RequestAttributes = []string{"connection.uri_san_peer_certificate", "connection.mtls"}
	e := newEnv(t, f, nil, func(c *proxy.Config) {
		c.TLS = &tls.Config{Certificates: []tls.Certificate{serverCert}, ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert}
	})
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{clientCert}}}
	t.Cleanup(tr.CloseIdleConnections)
	e.client = &http.Client{Transport: tr, Timeout: 30 * time.Second}
	require.True(t, strings.HasPrefix(e.proxy.URL(), "https://"))
	resp, _ := e.do(t, http.MethodPost, "/x", []byte("x"))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	log := e.proc.next(t)
	attrs := log.msgs[0].GetAttributes()[fieldsKey].GetFields()
	require.Equal(t, id, attrs["connection.uri_san_peer_certificate"].GetStringValue())
	require.True(t, attrs["connection.mtls"].GetBoolValue())
	require.Equal(t, []string{"https"}, values(t, log.msgs[0].GetRequestHeaders().GetHeaders(), ":scheme"))
}
