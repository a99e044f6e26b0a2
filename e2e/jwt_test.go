package e2e_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"strings"
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
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
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

// A JWT claim the scope reads is exact or refused, through the built binary and jwt_authn, on
// both stores. jwt_authn passes the verified payload on as a protobuf Struct, so the uids
// 9007199254740993 and 9007199254740992 arrive as one double: each caller gets 400
// scope-claim-ambiguous, never the other's response, and the upstream never runs. A uid below
// 2^53 scopes as before: a new token of the same uid is replayed, another uid runs. jwt_authn
// itself refuses a token whose sub is a number (401), which is why sub needs no such care.
func TestJWTNumericClaimsAreExactOrRefused(t *testing.T) {
	t.Parallel()
	for _, store := range []string{"memory", "redis"} {
		t.Run(store, func(t *testing.T) {
			t.Parallel()
			var args []string
			if store == "redis" {
				args = redisArgs(redistest.Start(t, redistest.Options{}))
			}
			key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
			require.NoError(t, err)
			shipped := string(readRepoFile(t, "envoy/policy.yaml"))
			policy := strings.Replace(shipped, "scope: [{ jwt_claim: sub }]", "scope: [{ jwt_claim: uid }]", 1)
			require.NotEqual(t, shipped, policy, "the transfers route scopes by uid")
			var mu sync.Mutex
			outcomes := map[string]string{} // x-request-id → outcome
			s := newStack(t, stackOptions{
				args:   args,
				policy: policy,
				envoy:  func(b *bootstrapv3.Bootstrap) error { return setDemoJWKS(b, jwksOf(t, &key.PublicKey)) },
				accessLog: func(r proxy.Record) {
					mu.Lock()
					defer mu.Unlock()
					outcomes[r.RequestID] = r.DynamicMetadataValue("idempotency", "outcome")
				},
			})
			transfer := func(id, idemKey string, claims map[string]any) reply {
				claims["iss"], claims["aud"] = "https://issuer.example.com", "payments"
				claims["iat"], claims["exp"] = time.Now().Unix(), time.Now().Add(time.Hour).Unix()
				return s.do(call{path: "/v1/transfers", key: idemKey, body: `{"to":"x"}`, headers: map[string]string{
					"Authorization": "Bearer " + signES256(t, key, claims), "X-Request-Id": id,
				}})
			}

			// json.Number keeps the numbers' text in the signed payload.
			first := transfer("big-1", "tr-big", map[string]any{"sub": "alice", "uid": json.Number("9007199254740993")})
			requireProblem(t, first, http.StatusBadRequest, "scope-claim-ambiguous")
			second := transfer("big-2", "tr-big", map[string]any{"sub": "bob", "uid": json.Number("9007199254740992")})
			requireProblem(t, second, http.StatusBadRequest, "scope-claim-ambiguous")
			require.Zero(t, s.up.Count("tr-big"), "neither caller ran, so neither could be replayed the other's response")

			small := transfer("small-1", "tr-small", map[string]any{"sub": "carol", "uid": json.Number("12345")})
			require.Equal(t, http.StatusOK, small.status, "body: %s", small.body)
			require.Equal(t, "false", small.header.Get(replayed))
			again := transfer("small-2", "tr-small", map[string]any{"sub": "carol", "uid": json.Number("12345"), "jti": "refreshed"})
			require.Equal(t, "true", again.header.Get(replayed), "a new token of the same uid is the same caller")
			require.Equal(t, small.body, again.body)
			other := transfer("small-3", "tr-small", map[string]any{"sub": "dave", "uid": json.Number("12346")})
			require.Equal(t, "false", other.header.Get(replayed), "another uid, its own record")
			require.Equal(t, 2, s.up.Count("tr-small"))

			numericSub := transfer("sub-1", "tr-sub", map[string]any{"sub": json.Number("12345"), "uid": json.Number("1")})
			require.Equal(t, http.StatusUnauthorized, numericSub.status, "jwt_authn refuses a token whose sub is not a string")
			require.Contains(t, string(numericSub.body), "[sub] field is not a string")
			require.Zero(t, s.up.Count("tr-sub"))

			if s.proxy != nil {
				want := map[string]string{"big-1": "scope_claim_ambiguous", "big-2": "scope_claim_ambiguous", "small-1": "executed", "small-2": "replayed", "small-3": "executed"}
				require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(outcomes) >= len(want) }, 5*time.Second, 10*time.Millisecond)
				mu.Lock()
				defer mu.Unlock()
				for id, o := range want {
					require.Equal(t, o, outcomes[id], id)
				}
				require.Contains(t, []string{"", "-"}, outcomes["sub-1"], "jwt_authn answered before ext_proc: no outcome")
			}
		})
	}
}
