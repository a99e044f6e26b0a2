package proxy_test

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/hmac"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"math/big"
	"net/http"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	jwtauthnv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/jwt_authn/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
)

const jwtNS = "envoy.filters.http.jwt_authn"

var b64 = base64.RawURLEncoding

// signHS256 mints a compact HS256 JWS.
func signHS256(t *testing.T, secret []byte, kid string, claims map[string]any) string {
	t.Helper()
	h, _ := json.Marshal(map[string]string{"alg": "HS256", "typ": "JWT", "kid": kid})
	p, err := json.Marshal(claims)
	require.NoError(t, err)
	in := b64.EncodeToString(h) + "." + b64.EncodeToString(p)
	mac := hmac.New(sha256.New, secret)
	mac.Write([]byte(in))
	return in + "." + b64.EncodeToString(mac.Sum(nil))
}

func signRS256(t *testing.T, key *rsa.PrivateKey, kid string, claims map[string]any) string {
	t.Helper()
	h, _ := json.Marshal(map[string]string{"alg": "RS256", "typ": "JWT", "kid": kid})
	p, err := json.Marshal(claims)
	require.NoError(t, err)
	in := b64.EncodeToString(h) + "." + b64.EncodeToString(p)
	sum := sha256.Sum256([]byte(in))
	sig, err := rsa.SignPKCS1v15(rand.Reader, key, crypto.SHA256, sum[:])
	require.NoError(t, err)
	return in + "." + b64.EncodeToString(sig)
}

// jwtConfig is a jwt_authn filter with one provider "test" required on every path.
func jwtConfig(jwks string, forward bool) *jwtauthnv3.JwtAuthentication {
	return &jwtauthnv3.JwtAuthentication{
		Providers: map[string]*jwtauthnv3.JwtProvider{"test": {
			Issuer: "https://issuer.test", Audiences: []string{"api"}, Forward: forward, PayloadInMetadata: "jwt_payload",
			JwksSourceSpecifier: &jwtauthnv3.JwtProvider_LocalJwks{LocalJwks: &corev3.DataSource{
				Specifier: &corev3.DataSource_InlineString{InlineString: jwks},
			}},
		}},
		Rules: []*jwtauthnv3.RequirementRule{
			{Match: &routev3.RouteMatch{PathSpecifier: &routev3.RouteMatch_Prefix{Prefix: "/healthz"}}},
			{Match: &routev3.RouteMatch{PathSpecifier: &routev3.RouteMatch_Prefix{Prefix: "/"}},
				RequirementType: &jwtauthnv3.RequirementRule_Requires{Requires: &jwtauthnv3.JwtRequirement{
					RequiresType: &jwtauthnv3.JwtRequirement_ProviderName{ProviderName: "test"},
				}}},
		},
	}
}

// metadataFilter forwards jwt_authn's namespace and receives "idempotency".
func metadataFilter() *filterextproc.ExternalProcessor {
	f := bufferedFilter()
	f.MetadataOptions = &filterextproc.MetadataOptions{
		ForwardingNamespaces: &filterextproc.MetadataOptions_MetadataNamespaces{Untyped: []string{jwtNS}},
		ReceivingNamespaces:  &filterextproc.MetadataOptions_MetadataNamespaces{Untyped: []string{"idempotency"}},
	}
	f.ResponseAttributes = append(f.ResponseAttributes, "upstream.request_attempt_count")
	return f
}

func claims(extra map[string]any) map[string]any {
	c := map[string]any{"iss": "https://issuer.test", "aud": "api", "sub": "alice", "exp": time.Now().Add(time.Hour).Unix()}
	for k, v := range extra {
		c[k] = v
	}
	return c
}

// jwt_authn before ext_proc: the verified payload lands in the dynamic metadata
// (filter_metadata["envoy.filters.http.jwt_authn"][payload_in_metadata]), which
// forwarding_namespaces copies into metadata_context of every message; the authorization header
// is removed unless forward (AuthenticatorImpl::verifyKey). Answers' dynamic_metadata is written
// only for receiving namespaces (Filter::setDynamicMetadata) and shows in the access log.
func TestJWTPayloadAndDynamicMetadata(t *testing.T) {
	secret := []byte("test-secret-0123456789")
	jwks := `{"keys":[{"kty":"oct","kid":"k1","alg":"HS256","k":"` + b64.EncodeToString(secret) + `"}]}`
	write := on("response_headers", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		resp := cont(req)
		resp.DynamicMetadata = &structpb.Struct{Fields: map[string]*structpb.Value{
			"idempotency": structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
				"outcome": structpb.NewStringValue("executed"), "replayed": structpb.NewBoolValue(false),
			}}),
			"other": structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{"x": structpb.NewNumberValue(1)}}),
		}}
		return st.Send(resp)
	})
	for _, forward := range []bool{false, true} {
		e := newEnv(t, metadataFilter(), write, func(c *proxy.Config) { c.JWTAuthn = jwtConfig(jwks, forward) })
		tok := signHS256(t, secret, "k1", claims(nil))
		resp, _ := e.do(t, http.MethodPost, "/pay", []byte("x"), "Authorization", "Bearer "+tok)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		log := e.proc.next(t)
		for _, m := range log.msgs {
			p := m.GetMetadataContext().GetFilterMetadata()[jwtNS].GetFields()["jwt_payload"].GetStructValue()
			require.Equal(t, "alice", p.GetFields()["sub"].GetStringValue(), "on every message, %s", kind(m))
		}
		auth := values(t, log.msgs[0].GetRequestHeaders().GetHeaders(), "authorization")
		if forward {
			require.Equal(t, []string{"Bearer " + tok}, auth)
			require.NotEmpty(t, e.up.Requests()[0].Header.Get("Authorization"))
		} else {
			require.Empty(t, auth)
			require.Empty(t, e.up.Requests()[0].Header.Get("Authorization"))
		}
		rec := e.record(t)
		require.Equal(t, "executed", rec.DynamicMetadataValue("idempotency", "outcome"))
		require.Equal(t, "false", rec.DynamicMetadataValue("idempotency", "replayed"))
		require.Equal(t, "-", rec.DynamicMetadataValue("other", "x"), "not a receiving namespace")
		require.Equal(t, "alice", rec.DynamicMetadataValue(jwtNS, "jwt_payload", "sub"))
	}
}

// A missing or invalid token gets jwt_authn's local reply (Filter::onComplete): 401 (403 for a
// disallowed audience) with the status text and www-authenticate. On 1.37 it goes through
// ext_proc's encoder path: the stream starts with response_headers, attempt count 0.
func TestJWTRejections(t *testing.T) {
	secret := []byte("test-secret-0123456789")
	jwks := `{"keys":[{"kty":"oct","kid":"k1","alg":"HS256","k":"` + b64.EncodeToString(secret) + `"}]}`
	for _, tc := range []struct {
		name    string
		auth    string
		want    int
		body    string
		wwwAuth string
	}{
		{"missing", "", 401, "Jwt is missing", `Bearer realm="http://HOST/pay"`},
		{"bad signature", "Bearer " + signHS256(t, []byte("wrong-secret-000000000"), "k1", claims(nil)), 401, "Jwt verification fails",
			`Bearer realm="http://HOST/pay", error="invalid_token"`},
		{"expired", "Bearer " + signHS256(t, secret, "k1", claims(map[string]any{"exp": time.Now().Add(-time.Hour).Unix()})), 401, "Jwt is expired",
			`Bearer realm="http://HOST/pay", error="invalid_token"`},
		{"audience", "Bearer " + signHS256(t, secret, "k1", claims(map[string]any{"aud": "other"})), 403, "Audiences in Jwt are not allowed",
			`Bearer realm="http://HOST/pay", error="invalid_token"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, metadataFilter(), nil, func(c *proxy.Config) { c.JWTAuthn = jwtConfig(jwks, false) })
			var hdr []string
			if tc.auth != "" {
				hdr = []string{"Authorization", tc.auth}
			}
			resp, got := e.do(t, http.MethodPost, "/pay", []byte("x"), hdr...)
			require.Equal(t, tc.want, resp.StatusCode)
			require.Equal(t, tc.body, string(got))
			host := e.proxy.URL()[len("http://"):]
			require.Equal(t, replaceHost(tc.wwwAuth, host), resp.Header.Get("Www-Authenticate"))
			require.Zero(t, e.up.Total())
			rec := e.record(t)
			require.Equal(t, "jwt_authn_access_denied{"+sanitize(tc.body)+"}", rec.CodeDetails)
			log := e.proc.next(t)
			require.Equal(t, []string{"response_headers", "response_body"}, kinds(log.msgs))
			attrs := log.msgs[0].GetAttributes()[fieldsKey].GetFields()
			require.Equal(t, float64(0), attrs["upstream.request_attempt_count"].GetNumberValue())
			require.Equal(t, float64(tc.want), attrs["response.code"].GetNumberValue())
		})
	}
	// A rule without a requirement lets the request through untouched.
	e := newEnv(t, metadataFilter(), nil, func(c *proxy.Config) { c.JWTAuthn = jwtConfig(jwks, false) })
	resp, _ := e.do(t, http.MethodGet, "/healthz", nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	e.proc.next(t)
}

func replaceHost(s, host string) string {
	out := []byte{}
	for i := 0; i < len(s); i++ {
		if i+4 <= len(s) && s[i:i+4] == "HOST" {
			out = append(out, host...)
			i += 3
			continue
		}
		out = append(out, s[i])
	}
	return string(out)
}

func sanitize(s string) string {
	b := []byte(s)
	for i, c := range b {
		if c == ' ' {
			b[i] = '_'
		}
	}
	return string(b)
}

// RS256 with an RSA JWKS works the same way.
func TestJWTRS256(t *testing.T) {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	require.NoError(t, err)
	e := big.NewInt(int64(key.E)).Bytes()
	jwks := `{"keys":[{"kty":"RSA","kid":"r1","alg":"RS256","n":"` + b64.EncodeToString(key.N.Bytes()) + `","e":"` + b64.EncodeToString(e) + `"}]}`
	env := newEnv(t, metadataFilter(), nil, func(c *proxy.Config) { c.JWTAuthn = jwtConfig(jwks, false) })
	resp, _ := env.do(t, http.MethodPost, "/pay", []byte("x"), "Authorization", "Bearer "+signRS256(t, key, "r1", claims(map[string]any{"sub": "bob"})))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	log := env.proc.next(t)
	p := log.msgs[0].GetMetadataContext().GetFilterMetadata()[jwtNS].GetFields()["jwt_payload"].GetStructValue()
	require.Equal(t, "bob", p.GetFields()["sub"].GetStringValue())
}

// ES256 with a P-256 JWKS (the shipped envoy.yaml's key type) works the same way; a signature
// that does not verify is 401.
func TestJWTES256(t *testing.T) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	pub, err := key.PublicKey.Bytes() // 0x04 | X | Y
	require.NoError(t, err)
	jwks := `{"keys":[{"kty":"EC","crv":"P-256","kid":"e1","alg":"ES256","x":"` + b64.EncodeToString(pub[1:33]) + `","y":"` + b64.EncodeToString(pub[33:]) + `"}]}`
	sign := func(claims map[string]any) string {
		h, _ := json.Marshal(map[string]string{"alg": "ES256", "typ": "JWT", "kid": "e1"})
		p, err := json.Marshal(claims)
		require.NoError(t, err)
		in := b64.EncodeToString(h) + "." + b64.EncodeToString(p)
		sum := sha256.Sum256([]byte(in))
		r, s, err := ecdsa.Sign(rand.Reader, key, sum[:])
		require.NoError(t, err)
		sig := append(r.FillBytes(make([]byte, 32)), s.FillBytes(make([]byte, 32))...)
		return in + "." + b64.EncodeToString(sig)
	}
	env := newEnv(t, metadataFilter(), nil, func(c *proxy.Config) { c.JWTAuthn = jwtConfig(jwks, false) })
	tok := sign(claims(map[string]any{"sub": "carol"}))
	resp, _ := env.do(t, http.MethodPost, "/pay", []byte("x"), "Authorization", "Bearer "+tok)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	log := env.proc.next(t)
	p := log.msgs[0].GetMetadataContext().GetFilterMetadata()[jwtNS].GetFields()["jwt_payload"].GetStructValue()
	require.Equal(t, "carol", p.GetFields()["sub"].GetStringValue())
	forged := tok[:len(tok)-4] + "AAAA"
	resp, _ = env.do(t, http.MethodPost, "/pay", []byte("x"), "Authorization", "Bearer "+forged)
	require.Equal(t, http.StatusUnauthorized, resp.StatusCode)
}

// An ImmediateResponse's dynamic_metadata is written too (setDecoderDynamicMetadata before
// sendImmediateResponse), and metadata_context is present (empty) without forwarded namespaces.
func TestImmediateResponseDynamicMetadata(t *testing.T) {
	ir := immediate(typev3.StatusCode_Conflict, "in progress", nil, "")
	ir.DynamicMetadata = &structpb.Struct{Fields: map[string]*structpb.Value{
		"idempotency": structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{"outcome": structpb.NewStringValue("in_progress")}}),
	}}
	e := newEnv(t, metadataFilter(), on("request_headers", sendOnce(ir)))
	resp, _ := e.do(t, http.MethodPost, "/pay", []byte("x"))
	require.Equal(t, http.StatusConflict, resp.StatusCode)
	require.Equal(t, "in_progress", e.record(t).DynamicMetadataValue("idempotency", "outcome"))
	log := e.proc.next(t)
	require.NotNil(t, log.msgs[0].GetMetadataContext())
	require.Empty(t, log.msgs[0].GetMetadataContext().GetFilterMetadata())
}
