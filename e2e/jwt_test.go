package e2e_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"sync"
	"testing"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	jwtauthnv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/jwt_authn/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/envoyconf"
	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
)

// The transfers route scopes keys by the subject jwt_authn verified, not by the token: a client
// that refreshes its token (another token, the same subject) is replayed its response, another
// subject with the same key gets a record of its own, and the outcome names the policy route.
// The demo provider's key is replaced with one made here, so that tokens can be signed.
func TestJWTSubjectScopesAcrossTokens(t *testing.T) {
	t.Parallel()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	var mu sync.Mutex
	routes := map[string]string{} // x-request-id → policy route
	s := newStack(t, stackOptions{
		policy: string(readRepoFile(t, "envoy/policy.yaml")),
		envoy:  func(b *bootstrapv3.Bootstrap) error { return setDemoJWKS(b, jwksOf(t, &key.PublicKey)) },
		accessLog: func(r proxy.Record) {
			mu.Lock()
			defer mu.Unlock()
			routes[r.RequestID] = r.DynamicMetadataValue("idempotency", "route")
		},
	})
	tok := func(sub, jti string) map[string]string {
		return map[string]string{"Authorization": "Bearer " + signES256(t, key, map[string]any{
			"iss": "https://issuer.example.com", "aud": "payments", "sub": sub, "jti": jti,
			"iat": time.Now().Unix(), "exp": time.Now().Add(time.Hour).Unix(),
		})}
	}
	transfer := func(h map[string]string, id string) reply {
		h["X-Request-Id"] = id
		return s.do(call{path: "/v1/transfers", key: "tr-1", body: `{"to":"x"}`, headers: h})
	}
	first := transfer(tok("alice", "1"), "r1")
	require.Equal(t, http.StatusOK, first.status)
	require.Equal(t, "false", first.header.Get(replayed))
	refreshed := transfer(tok("alice", "2"), "r2")
	require.Equal(t, "true", refreshed.header.Get(replayed), "a new token of the same subject is the same caller")
	bob := transfer(tok("bob", "3"), "r3")
	require.Equal(t, "false", bob.header.Get(replayed), "another subject, its own record")
	require.Equal(t, 2, s.up.Count("tr-1"))
	if s.proxy != nil {
		require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(routes) == 3 }, 5*time.Second, 10*time.Millisecond)
		mu.Lock()
		require.Equal(t, map[string]string{"r1": "transfers", "r2": "transfers", "r3": "transfers"}, routes)
		mu.Unlock()
	}
}

// setDemoJWKS replaces the local JWKS of envoy.yaml's demo provider.
func setDemoJWKS(b *bootstrapv3.Bootstrap, jwks string) error {
	return envoyconf.MutateHCM(b, func(hcm *hcmv3.HttpConnectionManager) error {
		for _, f := range hcm.GetHttpFilters() {
			if f.GetName() != "envoy.filters.http.jwt_authn" {
				continue
			}
			c := &jwtauthnv3.JwtAuthentication{}
			if err := f.GetTypedConfig().UnmarshalTo(c); err != nil {
				return err
			}
			c.GetProviders()["demo"].JwksSourceSpecifier = &jwtauthnv3.JwtProvider_LocalJwks{
				LocalJwks: &corev3.DataSource{Specifier: &corev3.DataSource_InlineString{InlineString: jwks}},
			}
			a, err := anypb.New(c)
			if err != nil {
				return err
			}
			f.ConfigType = &hcmv3.HttpFilter_TypedConfig{TypedConfig: a}
		}
		return nil
	})
}

func jwksOf(t *testing.T, pub *ecdsa.PublicKey) string {
	t.Helper()
	raw, err := pub.Bytes() // 0x04 || X || Y
	require.NoError(t, err)
	enc := base64.RawURLEncoding.EncodeToString
	js, err := json.Marshal(map[string]any{"keys": []map[string]string{{
		"kty": "EC", "crv": "P-256", "alg": "ES256", "kid": "test", "use": "sig",
		"x": enc(raw[1:33]), "y": enc(raw[33:]),
	}}})
	require.NoError(t, err)
	return string(js)
}

// signES256 makes a compact JWS of claims under key (RFC 7515, ES256: r || s, 32 bytes each).
func signES256(t *testing.T, key *ecdsa.PrivateKey, claims map[string]any) string {
	t.Helper()
	enc := base64.RawURLEncoding.EncodeToString
	header, err := json.Marshal(map[string]string{"alg": "ES256", "kid": "test", "typ": "JWT"})
	require.NoError(t, err)
	payload, err := json.Marshal(claims)
	require.NoError(t, err)
	signing := enc(header) + "." + enc(payload)
	sum := sha256.Sum256([]byte(signing))
	r, sig, err := ecdsa.Sign(rand.Reader, key, sum[:])
	require.NoError(t, err)
	out := make([]byte, 64)
	r.FillBytes(out[:32])
	sig.FillBytes(out[32:])
	return signing + "." + enc(out)
}
