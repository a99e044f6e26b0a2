package envoyconf

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"math/big"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	jwtauthnv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/jwt_authn/v3"

	"github.com/idempotency-extproc/idempotency-extproc/internal/check/checktest"
)

// The demo tokens verify against envoy.yaml's local JWKS and carry the claims its provider
// requires, so Envoy accepts them on the transfers route.
func TestDemoTokens(t *testing.T) {
	text := readEnvoyFile(t, "envoy.yaml")
	b, err := Parse([]byte(text))
	require.NoError(t, err)
	hcm, err := checktest.FirstHCM(b)
	require.NoError(t, err)
	jwt := &jwtauthnv3.JwtAuthentication{}
	require.NoError(t, hcm.GetHttpFilters()[0].GetTypedConfig().UnmarshalTo(jwt))
	provider := jwt.GetProviders()["demo"]

	var jwks struct {
		Keys []struct{ Kty, Crv, Alg, Kid, X, Y string } `json:"keys"`
	}
	require.NoError(t, json.Unmarshal([]byte(provider.GetLocalJwks().GetInlineString()), &jwks))
	require.Len(t, jwks.Keys, 1)
	k := jwks.Keys[0]
	require.Equal(t, []string{"EC", "P-256", "ES256"}, []string{k.Kty, k.Crv, k.Alg})
	coord := func(s string) []byte {
		raw, err := base64.RawURLEncoding.DecodeString(s)
		require.NoError(t, err)
		require.Len(t, raw, 32)
		return raw
	}
	pub, err := ecdsa.ParseUncompressedPublicKey(elliptic.P256(), append(append([]byte{4}, coord(k.X)...), coord(k.Y)...))
	require.NoError(t, err, "the JWKS key is a P-256 point")

	for token, sub := range map[string]string{DemoTokenDemoUser: "demo-user", DemoTokenOtherUser: "other-user"} {
		require.Contains(t, text, token, "envoy.yaml shows the token")
		parts := strings.Split(token, ".")
		require.Len(t, parts, 3)
		var header struct{ Alg, Kid string }
		var claims struct {
			Iss, Aud, Sub string
			Exp           int64
		}
		for i, v := range []any{&header, &claims} {
			raw, err := base64.RawURLEncoding.DecodeString(parts[i])
			require.NoError(t, err)
			require.NoError(t, json.Unmarshal(raw, v))
		}
		require.Equal(t, "ES256", header.Alg)
		require.Equal(t, k.Kid, header.Kid)
		require.Equal(t, provider.GetIssuer(), claims.Iss)
		require.Contains(t, provider.GetAudiences(), claims.Aud)
		require.Equal(t, sub, claims.Sub)
		require.Greater(t, claims.Exp, time.Now().Add(50*365*24*time.Hour).Unix())
		sig, err := base64.RawURLEncoding.DecodeString(parts[2])
		require.NoError(t, err)
		require.Len(t, sig, 64)
		digest := sha256.Sum256([]byte(parts[0] + "." + parts[1]))
		r, s := new(big.Int).SetBytes(sig[:32]), new(big.Int).SetBytes(sig[32:])
		require.True(t, ecdsa.Verify(pub, digest[:], r, s), "token for %s", sub)
		digest[0] ^= 1
		require.False(t, ecdsa.Verify(pub, digest[:], r, s))
	}
}
