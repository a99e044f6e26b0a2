package proxy

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/hmac"
	"crypto/rsa"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"net/http"
	"regexp"
	"strings"
	"time"

	jwtauthnv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/jwt_authn/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// jwtNamespace is the dynamic metadata namespace jwt_authn writes (Filter::setExtractedData).
const jwtNamespace = "envoy.filters.http.jwt_authn"

// jwtStatus is google::jwt_verify::Status, with its getStatusString text.
type jwtStatus string

const (
	jwtOK              jwtStatus = ""
	jwtMissed          jwtStatus = "Jwt is missing"
	jwtExpired         jwtStatus = "Jwt is expired"
	jwtNotYetValid     jwtStatus = "Jwt not yet valid"
	jwtBadFormat       jwtStatus = "Jwt is not in the form of Header.Payload.Signature with two dots and 3 sections"
	jwtBadHeader       jwtStatus = "Jwt header is an invalid Base64url encoded"
	jwtBadPayload      jwtStatus = "Jwt payload is an invalid Base64url encoded"
	jwtVerifyFail      jwtStatus = "Jwt verification fails"
	jwtUnknownIssuer   jwtStatus = "Jwt issuer is not configured"
	jwtAudienceDenied  jwtStatus = "Audiences in Jwt are not allowed"
	jwtKidAlgMismatch  jwtStatus = "Jwks doesn't have key to match kid or alg from Jwt"
	jwtUnsupportedAlgo jwtStatus = "Jwt algorithm is not supported"
	jwtIssNotString    jwtStatus = "Jwt payload [iss] field is not a string"
	jwtSubNotString    jwtStatus = "Jwt payload [sub] field is not a string"
	jwtJtiNotString    jwtStatus = "Jwt payload [jti] field is not a string"
	jwtAudNotString    jwtStatus = "Jwt payload [aud] field is not a string or string list"
)

// jwtFilter emulates Envoy's jwt_authn HTTP filter placed before ext_proc: it verifies the token
// of the rule that matches the request, rejects a missing or invalid one with a local reply (401,
// or 403 for a disallowed audience, with www-authenticate: Bearer realm="<uri>"), removes the
// token's header unless the provider forwards it, and puts the verified payload (and header)
// into the dynamic metadata (source/extensions/filters/http/jwt_authn/filter.cc Filter::onComplete,
// authenticator.cc AuthenticatorImpl::verifyKey).
type jwtFilter struct {
	providers map[string]*jwtProvider
	rules     []jwtRule
	requireds map[string]*jwtauthnv3.JwtRequirement
}

type jwtProvider struct {
	name              string
	issuer            string
	audiences         []string
	keys              []jwk
	locations         []jwtLocation
	forward           bool
	payloadInMetadata string
	headerInMetadata  string
	skew              time.Duration
}

type jwtLocation struct{ header, prefix string }

type jwk struct {
	kid, alg string
	secret   []byte           // oct
	rsa      *rsa.PublicKey   // RSA
	ec       *ecdsa.PublicKey // EC, P-256
}

type jwtRule struct {
	rt  *route
	req *jwtauthnv3.JwtRequirement // nil: no verification
}

func compileJWT(c *jwtauthnv3.JwtAuthentication) (*jwtFilter, error) {
	if c == nil {
		return nil, nil
	}
	f := &jwtFilter{providers: map[string]*jwtProvider{}, requireds: c.GetRequirementMap()}
	for name, p := range c.GetProviders() {
		jp := &jwtProvider{
			name: name, issuer: p.GetIssuer(), audiences: p.GetAudiences(), forward: p.GetForward(),
			payloadInMetadata: p.GetPayloadInMetadata(), headerInMetadata: p.GetHeaderInMetadata(),
			skew: 60 * time.Second,
		}
		if s := p.GetClockSkewSeconds(); s > 0 {
			jp.skew = time.Duration(s) * time.Second
		}
		if len(p.GetFromParams()) > 0 || len(p.GetFromCookies()) > 0 {
			return nil, fmt.Errorf("jwt_authn provider %q: from_params and from_cookies are not supported", name)
		}
		for _, h := range p.GetFromHeaders() {
			jp.locations = append(jp.locations, jwtLocation{header: strings.ToLower(h.GetName()), prefix: h.GetValuePrefix()})
		}
		if len(jp.locations) == 0 {
			// The default location: Authorization: Bearer <token> (the access_token query
			// parameter, also a default, is not modelled).
			jp.locations = []jwtLocation{{header: "authorization", prefix: "Bearer "}}
		}
		lj := p.GetLocalJwks()
		if lj == nil {
			return nil, fmt.Errorf("jwt_authn provider %q: only local_jwks is supported", name)
		}
		text, err := dataSourceString(lj)
		if err != nil {
			return nil, fmt.Errorf("jwt_authn provider %q: local_jwks: %w", name, err)
		}
		if jp.keys, err = parseJWKS(text); err != nil {
			return nil, fmt.Errorf("jwt_authn provider %q: %w", name, err)
		}
		f.providers[name] = jp
	}
	for i, r := range c.GetRules() {
		m := r.GetMatch()
		rt := &route{Route: Route{Prefix: m.GetPrefix(), Path: m.GetPath(), Regex: m.GetSafeRegex().GetRegex()}}
		if rt.Regex != "" {
			re, err := regexp.Compile("^(?:" + rt.Regex + ")$")
			if err != nil {
				return nil, fmt.Errorf("jwt_authn rule %d: %w", i, err)
			}
			rt.regex = re
		}
		req := r.GetRequires()
		if n := r.GetRequirementName(); n != "" {
			if req = f.requireds[n]; req == nil {
				return nil, fmt.Errorf("jwt_authn rule %d: no requirement %q", i, n)
			}
		}
		if err := f.checkRequirement(req); err != nil {
			return nil, fmt.Errorf("jwt_authn rule %d: %w", i, err)
		}
		f.rules = append(f.rules, jwtRule{rt: rt, req: req})
	}
	return f, nil
}

func (f *jwtFilter) checkRequirement(r *jwtauthnv3.JwtRequirement) error {
	if r == nil {
		return nil
	}
	switch t := r.GetRequiresType().(type) {
	case *jwtauthnv3.JwtRequirement_ProviderName:
		if f.providers[t.ProviderName] == nil {
			return fmt.Errorf("unknown provider %q", t.ProviderName)
		}
	case *jwtauthnv3.JwtRequirement_RequiresAny:
		for _, sub := range t.RequiresAny.GetRequirements() {
			if err := f.checkRequirement(sub); err != nil {
				return err
			}
		}
	case *jwtauthnv3.JwtRequirement_RequiresAll:
		for _, sub := range t.RequiresAll.GetRequirements() {
			if err := f.checkRequirement(sub); err != nil {
				return err
			}
		}
	case *jwtauthnv3.JwtRequirement_AllowMissing, *jwtauthnv3.JwtRequirement_AllowMissingOrFailed:
	default:
		return fmt.Errorf("requirement %T is not supported", t)
	}
	return nil
}

// decodeHeaders runs the filter on the request headers. It reports whether the request goes on;
// when not, the local reply has been sent.
func (f *jwtFilter) decodeHeaders(x *exchange) bool {
	path, _ := x.dec.hdrs.get(":path")
	var req *jwtauthnv3.JwtRequirement
	if pr := x.routeJWT(); pr != nil {
		// A route's own config wins over the rules (jwt_authn filter.cc Filter::decodeHeaders:
		// a per-route config found by resolveMostSpecificPerFilterConfig goes to
		// FilterConfigImpl::findPerRouteVerifier): disabled verifies nothing, requirement_name
		// names one of requirement_map, an unknown name is a 403.
		if pr.GetDisabled() {
			return true
		}
		if req = f.requireds[pr.GetRequirementName()]; req == nil {
			x.sendLocalReply(localReply{
				code: http.StatusForbidden, body: "Failed JWT authentication: wrong requirement_name",
				details: "jwt_authn_access_denied{Wrong_requirement_name}",
			})
			return false
		}
	} else {
		for _, r := range f.rules {
			if r.rt.matches(path, x.grpc) {
				req = r.req
				break
			}
		}
	}
	if req == nil {
		return true
	}
	st, verified := f.verify(x, req)
	if st != jwtOK {
		code := http.StatusUnauthorized
		if st == jwtAudienceDenied {
			code = http.StatusForbidden
		}
		uri := originalURI(x.dec.hdrs)
		x.sendLocalReply(localReply{
			code: code, body: string(st),
			modify: func(h *headerList) {
				v := `Bearer realm="` + uri + `"`
				if st != jwtMissed {
					v += `, error="invalid_token"`
				}
				h.set("www-authenticate", v)
			},
			details: "jwt_authn_access_denied{" + sanitizeDetails(string(st)) + "}",
		})
		return false
	}
	extracted := &structpb.Struct{Fields: map[string]*structpb.Value{}}
	for _, v := range verified {
		if !v.p.forward {
			x.dec.hdrs.del(v.loc.header)
		}
		if v.p.payloadInMetadata != "" {
			extracted.Fields[v.p.payloadInMetadata] = structpb.NewStructValue(v.payload)
		}
		if v.p.headerInMetadata != "" {
			extracted.Fields[v.p.headerInMetadata] = structpb.NewStructValue(v.header)
		}
	}
	if len(extracted.Fields) > 0 {
		x.setMetadata(jwtNamespace, extracted)
	}
	return true
}

// routeJWT returns the matched route's jwt_authn config, or nil.
func (x *exchange) routeJWT() *jwtauthnv3.PerRouteConfig {
	if x.route == nil {
		return nil
	}
	return x.route.JWT
}

// originalURI is Http::Utility::buildOriginalUri with jwt_authn's 256-character limit on the path.
func originalURI(h headerList) string {
	scheme, _ := h.get(":scheme")
	host, _ := h.get(":authority")
	path, _ := h.get(":path")
	if len(path) > 256 {
		path = path[:256]
	}
	return scheme + "://" + host + path
}

type verifiedJWT struct {
	p       *jwtProvider
	loc     jwtLocation
	payload *structpb.Struct
	header  *structpb.Struct
}

// verify evaluates a requirement (Verifier): provider_name needs that provider's token valid;
// requires_any needs one branch to pass (all missing: missing); requires_all needs every branch;
// allow_missing passes without a token but not with an invalid one; allow_missing_or_failed
// always passes.
func (f *jwtFilter) verify(x *exchange, r *jwtauthnv3.JwtRequirement) (jwtStatus, []verifiedJWT) {
	switch t := r.GetRequiresType().(type) {
	case *jwtauthnv3.JwtRequirement_ProviderName:
		return f.verifyProvider(x, f.providers[t.ProviderName])
	case *jwtauthnv3.JwtRequirement_RequiresAny:
		first := jwtMissed
		for _, sub := range t.RequiresAny.GetRequirements() {
			st, v := f.verify(x, sub)
			if st == jwtOK {
				return jwtOK, v
			}
			if first == jwtMissed {
				first = st
			}
		}
		return first, nil
	case *jwtauthnv3.JwtRequirement_RequiresAll:
		var all []verifiedJWT
		for _, sub := range t.RequiresAll.GetRequirements() {
			st, v := f.verify(x, sub)
			if st != jwtOK {
				return st, nil
			}
			all = append(all, v...)
		}
		return jwtOK, all
	case *jwtauthnv3.JwtRequirement_AllowMissing:
		var all []verifiedJWT
		for _, p := range f.providers {
			st, v := f.verifyProvider(x, p)
			if st != jwtOK && st != jwtMissed {
				return st, nil
			}
			all = append(all, v...)
		}
		return jwtOK, all
	case *jwtauthnv3.JwtRequirement_AllowMissingOrFailed:
		var all []verifiedJWT
		for _, p := range f.providers {
			if st, v := f.verifyProvider(x, p); st == jwtOK {
				all = append(all, v...)
			}
		}
		return jwtOK, all
	}
	return jwtOK, nil
}

func (f *jwtFilter) verifyProvider(x *exchange, p *jwtProvider) (jwtStatus, []verifiedJWT) {
	for _, loc := range p.locations {
		v, ok := x.dec.hdrs.get(loc.header)
		if !ok {
			continue
		}
		if loc.prefix != "" {
			if len(v) < len(loc.prefix) || !strings.EqualFold(v[:len(loc.prefix)], loc.prefix) {
				continue
			}
			v = v[len(loc.prefix):]
		}
		header, payload, st := p.verifyToken(strings.TrimSpace(v), time.Now())
		if st != jwtOK {
			return st, nil
		}
		return jwtOK, []verifiedJWT{{p: p, loc: loc, payload: payload, header: header}}
	}
	return jwtMissed, nil
}

// verifyToken checks a compact JWS: format, issuer, audiences, exp and nbf (with the clock skew),
// and the HS256 or RS256 signature with a key of the JWKS (matching kid when the token has one).
func (p *jwtProvider) verifyToken(tok string, now time.Time) (*structpb.Struct, *structpb.Struct, jwtStatus) {
	parts := strings.Split(tok, ".")
	if len(parts) != 3 {
		return nil, nil, jwtBadFormat
	}
	hb, err := base64.RawURLEncoding.DecodeString(parts[0])
	if err != nil {
		return nil, nil, jwtBadHeader
	}
	pb, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		return nil, nil, jwtBadPayload
	}
	sig, err := base64.RawURLEncoding.DecodeString(parts[2])
	if err != nil {
		return nil, nil, jwtVerifyFail
	}
	var hdr struct {
		Alg string `json:"alg"`
		Kid string `json:"kid"`
	}
	if json.Unmarshal(hb, &hdr) != nil {
		return nil, nil, jwtBadHeader
	}
	var claims map[string]any
	if json.Unmarshal(pb, &claims) != nil {
		return nil, nil, jwtBadPayload
	}
	if st := claimTypes(claims); st != jwtOK {
		return nil, nil, st
	}
	if p.issuer != "" {
		if iss, _ := claims["iss"].(string); iss != p.issuer {
			return nil, nil, jwtUnknownIssuer
		}
	}
	if len(p.audiences) > 0 && !audienceAllowed(claims["aud"], p.audiences) {
		return nil, nil, jwtAudienceDenied
	}
	if exp, ok := claims["exp"].(float64); ok && now.After(time.Unix(int64(exp), 0).Add(p.skew)) {
		return nil, nil, jwtExpired
	}
	if nbf, ok := claims["nbf"].(float64); ok && now.Add(p.skew).Before(time.Unix(int64(nbf), 0)) {
		return nil, nil, jwtNotYetValid
	}
	signed := []byte(parts[0] + "." + parts[1])
	matched := false
	for _, k := range p.keys {
		if (hdr.Kid != "" && k.kid != "" && k.kid != hdr.Kid) || (k.alg != "" && k.alg != hdr.Alg) {
			continue
		}
		switch {
		case hdr.Alg == "HS256" && k.secret != nil:
			matched = true
			mac := hmac.New(sha256.New, k.secret)
			mac.Write(signed)
			if hmac.Equal(mac.Sum(nil), sig) {
				return mustStruct(hb), mustStruct(pb), jwtOK
			}
		case hdr.Alg == "RS256" && k.rsa != nil:
			matched = true
			sum := sha256.Sum256(signed)
			if rsa.VerifyPKCS1v15(k.rsa, crypto.SHA256, sum[:], sig) == nil {
				return mustStruct(hb), mustStruct(pb), jwtOK
			}
		case hdr.Alg == "ES256" && k.ec != nil:
			// JWS (RFC 7518 §3.4): the signature is R and S, 32 bytes each, big-endian, as
			// jwt_verify_lib's verifySignatureEC reads it.
			matched = true
			sum := sha256.Sum256(signed)
			if len(sig) == 64 && ecdsa.Verify(k.ec, sum[:], new(big.Int).SetBytes(sig[:32]), new(big.Int).SetBytes(sig[32:])) {
				return mustStruct(hb), mustStruct(pb), jwtOK
			}
		}
	}
	if hdr.Alg != "HS256" && hdr.Alg != "RS256" && hdr.Alg != "ES256" {
		return nil, nil, jwtUnsupportedAlgo
	}
	if !matched {
		return nil, nil, jwtKidAlgMismatch
	}
	return nil, nil, jwtVerifyFail
}

func audienceAllowed(aud any, allowed []string) bool {
	var auds []string
	switch a := aud.(type) {
	case string:
		auds = []string{a}
	case []any:
		for _, v := range a {
			if s, ok := v.(string); ok {
				auds = append(auds, s)
			}
		}
	}
	for _, a := range auds {
		for _, want := range allowed {
			if a == want {
				return true
			}
		}
	}
	return false
}

// leftPad pads b with zeros on the left to n bytes.
func leftPad(b []byte, n int) []byte {
	if len(b) >= n {
		return b
	}
	return append(make([]byte, n-len(b)), b...)
}

// claimTypes refuses a payload whose iss, sub or jti is not a string, or whose aud is neither a
// string nor a list of strings, as jwt_verify_lib does while parsing the token
// (Jwt::parseFromString in google/jwt_verify_lib src/jwt.cc, StructUtils::GetString and
// GetStringList returning WRONG_TYPE), before any key or issuer is looked at.
func claimTypes(claims map[string]any) jwtStatus {
	for name, st := range map[string]jwtStatus{"iss": jwtIssNotString, "sub": jwtSubNotString, "jti": jwtJtiNotString} {
		if v, ok := claims[name]; ok {
			if _, isString := v.(string); !isString {
				return st
			}
		}
	}
	aud, present := claims["aud"]
	if !present {
		return jwtOK
	}
	switch a := aud.(type) {
	case string:
	case []any:
		for _, e := range a {
			if _, isString := e.(string); !isString {
				return jwtAudNotString
			}
		}
	default:
		return jwtAudNotString
	}
	return jwtOK
}

// mustStruct parses a token's JSON header or payload into the Struct jwt_authn writes to the
// dynamic metadata: jwt_verify_lib parses both with JsonStringToMessage into a
// google.protobuf.Struct (Jwt::parseFromString in google/jwt_verify_lib src/jwt.cc: header_pb_,
// payload_pb_), and AuthenticatorImpl::handleGoodJwt (source/extensions/filters/http/jwt_authn/
// authenticator.cc) hands payload_pb_ to the metadata under payload_in_metadata. A Struct's
// numbers are doubles (google.protobuf.Value's number_value), so a number is rounded to the
// nearest double: 9007199254740993 arrives as 9007199254740992. protojson's Struct parsing does
// the same rounding, and nothing here keeps the exact text.
func mustStruct(js []byte) *structpb.Struct {
	s := &structpb.Struct{}
	if err := s.UnmarshalJSON(js); err != nil {
		return &structpb.Struct{}
	}
	return s
}

// parseJWKS reads a JWKS with "oct" (HS256), "RSA" (RS256) and P-256 "EC" (ES256) keys, the
// key types of jwt_verify_lib (jwks.cc) that the tests use.
func parseJWKS(text string) ([]jwk, error) {
	var set struct {
		Keys []struct {
			Kty string `json:"kty"`
			Kid string `json:"kid"`
			Alg string `json:"alg"`
			K   string `json:"k"`
			N   string `json:"n"`
			E   string `json:"e"`
			Crv string `json:"crv"`
			X   string `json:"x"`
			Y   string `json:"y"`
		} `json:"keys"`
	}
	if err := json.Unmarshal([]byte(text), &set); err != nil {
		return nil, fmt.Errorf("local_jwks: %w", err)
	}
	var out []jwk
	for _, k := range set.Keys {
		key := jwk{kid: k.Kid, alg: k.Alg}
		switch k.Kty {
		case "oct":
			b, err := base64.RawURLEncoding.DecodeString(strings.TrimRight(k.K, "="))
			if err != nil {
				return nil, fmt.Errorf("local_jwks: key %q: %w", k.Kid, err)
			}
			key.secret = b
		case "RSA":
			n, err1 := base64.RawURLEncoding.DecodeString(strings.TrimRight(k.N, "="))
			e, err2 := base64.RawURLEncoding.DecodeString(strings.TrimRight(k.E, "="))
			if err := errors.Join(err1, err2); err != nil {
				return nil, fmt.Errorf("local_jwks: key %q: %w", k.Kid, err)
			}
			key.rsa = &rsa.PublicKey{N: new(big.Int).SetBytes(n), E: int(new(big.Int).SetBytes(e).Int64())}
		case "EC":
			if k.Crv != "P-256" {
				return nil, fmt.Errorf("local_jwks: key %q: curve %q is not supported", k.Kid, k.Crv)
			}
			x, err1 := base64.RawURLEncoding.DecodeString(strings.TrimRight(k.X, "="))
			y, err2 := base64.RawURLEncoding.DecodeString(strings.TrimRight(k.Y, "="))
			if err := errors.Join(err1, err2); err != nil {
				return nil, fmt.Errorf("local_jwks: key %q: %w", k.Kid, err)
			}
			pub, err := ecdsa.ParseUncompressedPublicKey(elliptic.P256(), append(append([]byte{4}, leftPad(x, 32)...), leftPad(y, 32)...))
			if err != nil {
				return nil, fmt.Errorf("local_jwks: key %q: not a point of P-256: %w", k.Kid, err)
			}
			key.ec = pub
		default:
			return nil, fmt.Errorf("local_jwks: key type %q is not supported", k.Kty)
		}
		out = append(out, key)
	}
	if len(out) == 0 {
		return nil, errors.New("local_jwks: no key")
	}
	return out, nil
}
