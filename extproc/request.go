package extproc

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// MaxKeyLength is the longest valid idempotency key, in characters.
const MaxKeyLength = 255

var (
	errInvalidKey = errors.New("invalid idempotency key")
	errInvalidTTL = errors.New("invalid ttl")
)

// headers is a header map as Envoy sends it: lower-cased names, values in raw_value, one entry
// per value.
type headers []*corev3.HeaderValue

// get returns the first value of name, or nil when the header is absent: a header present with
// an empty value is an empty slice, not nil.
func (h headers) get(name string) []byte {
	for _, v := range h {
		if v.GetKey() == name {
			return headerValue(v)
		}
	}
	return nil
}

// headerValue returns the value of h, never nil. Envoy sends raw_value; value is read only as a
// fallback for clients that predate it.
func headerValue(h *corev3.HeaderValue) []byte {
	switch {
	case h.RawValue != nil:
		return h.RawValue
	case h.Value == "":
		return []byte{}
	}
	return []byte(h.Value)
}

// parseKey finds the idempotency key in the headers named by names. It reports whether any of
// them is present, and errInvalidKey when a value is not a valid key or the values disagree.
func parseKey(h headers, names []string) (key string, present bool, err error) {
	for _, e := range h {
		name := e.GetKey()
		listed := false
		for _, n := range names {
			if n == name {
				listed = true
				break
			}
		}
		if !listed {
			continue
		}
		k, ok := unquoteKey(headerValue(e))
		switch {
		case !ok:
			return "", true, errInvalidKey
		case present && k != key:
			return "", true, errInvalidKey
		}
		key, present = k, true
	}
	return key, present, nil
}

// unquoteKey trims optional whitespace (spaces and tabs), unquotes an RFC 8941 sf-string (the IETF draft's form)
// and checks that the result is 1 to MaxKeyLength visible ASCII characters.
func unquoteKey(v []byte) (string, bool) {
	v = bytes.Trim(v, " \t") // optional whitespace
	if len(v) > 0 && v[0] == '"' {
		if len(v) < 2 || v[len(v)-1] != '"' {
			return "", false
		}
		inner := v[1 : len(v)-1]
		var b strings.Builder
		for i := 0; i < len(inner); i++ {
			c := inner[i]
			switch {
			case c == '\\':
				i++
				if i == len(inner) || (inner[i] != '"' && inner[i] != '\\') {
					return "", false
				}
				b.WriteByte(inner[i])
			case c == '"':
				return "", false
			default:
				b.WriteByte(c)
			}
		}
		return checkKey(b.String())
	}
	return checkKey(string(v))
}

func checkKey(k string) (string, bool) {
	if len(k) == 0 || len(k) > MaxKeyLength {
		return "", false
	}
	for i := 0; i < len(k); i++ {
		if k[i] < 0x21 || k[i] > 0x7e {
			return "", false
		}
	}
	return k, true
}

// parseTTL reads a ttl_header value: a positive whole number of seconds, capped at max. Numbers
// too large to represent are capped too.
func parseTTL(v []byte, max time.Duration) (time.Duration, error) {
	v = bytes.Trim(v, " \t") // optional whitespace
	if len(v) == 0 {
		return 0, errInvalidTTL
	}
	maxSecs := int64(max / time.Second)
	var secs int64
	for _, c := range v {
		if c < '0' || c > '9' {
			return 0, errInvalidTTL
		}
		if secs <= maxSecs {
			secs = secs*10 + int64(c-'0')
		}
	}
	if secs == 0 {
		return 0, errInvalidTTL
	}
	if secs > maxSecs {
		return max, nil
	}
	return time.Duration(secs) * time.Second, nil
}

// preferWait returns the wait=N preference of the request's Prefer headers (RFC 7240 §4.3): a
// comma-separated list of token[=value] preferences, each with optional ;-parameters, names
// compared without case.
func preferWait(h headers) (int64, bool) {
	for _, v := range h {
		if v.GetKey() != headerPrefer {
			continue
		}
		for _, pref := range strings.Split(string(headerValue(v)), ",") {
			pref, _, _ = strings.Cut(pref, ";")
			name, value, ok := strings.Cut(strings.TrimSpace(pref), "=")
			if !ok || !strings.EqualFold(strings.TrimSpace(name), "wait") {
				continue
			}
			n, err := strconv.ParseInt(strings.Trim(strings.TrimSpace(value), `"`), 10, 64)
			if err != nil || n < 0 {
				return 0, false
			}
			return n, true
		}
	}
	return 0, false
}

// splitPath returns the path without its query.
func splitPath(p []byte) []byte {
	for i, c := range p {
		if c == '?' || c == '#' {
			return p[:i]
		}
	}
	return p
}

// digest hashes length-prefixed fields so that no two different sequences of fields collide.
// One digest serves every hash of a request: reset between uses, it allocates nothing more.
type digest struct {
	h       hash.Hash // SHA-256, for the body-hash key
	key     hash.Hash // the stored key's and the fingerprint's: SHA-256, or HMAC-SHA256 under a secret
	scratch []byte
	sum     [sha256.Size]byte
}

// newDigest returns a digest whose stored keys are hashed with keyHash (SHA-256 when nil).
func newDigest(keyHash func() hash.Hash) *digest {
	d := &digest{h: sha256.New(), scratch: make([]byte, 0, 64)}
	d.key = d.h
	if keyHash != nil {
		d.key = keyHash()
	}
	return d
}

func (d *digest) reset() { d.h.Reset() }

// field hashes v into h behind its length, a uvarint, so that no two sequences of fields
// collide. A string is copied behind the length (a hash takes bytes); bytes, which may be a whole
// body, are hashed where they are.
func field[T string | []byte](d *digest, h hash.Hash, v T) {
	d.scratch = binary.AppendUvarint(d.scratch[:0], uint64(len(v)))
	if b, ok := any(v).([]byte); ok {
		h.Write(d.scratch)
		h.Write(b)
		return
	}
	d.scratch = append(d.scratch, v...)
	h.Write(d.scratch)
}

// headerValues hashes every value of name in order, preceded by their count, so that an absent
// header, an empty one and several differ.
func (d *digest) headerValues(w hash.Hash, h headers, name string) {
	field(d, w, name)
	count := 0
	for _, v := range h {
		if v.GetKey() == name {
			count++
		}
	}
	d.scratch = binary.AppendUvarint(d.scratch[:0], uint64(count))
	w.Write(d.scratch)
	for _, v := range h {
		if v.GetKey() == name {
			field(d, w, headerValue(v))
		}
	}
}

// fingerprint returns the SHA-256 over the route's fingerprint parts and fingerprint headers.
// A route that lists no part (the mismatch check is off; the policy refuses fingerprint
// headers beside it) gets the hash of its name instead: nothing is checked within the route,
// and a key reused from another route is still another endpoint's (422). Renaming such a route
// makes its records mismatch until they expire.
//
// It is appended to dst, which the caller gives room for one digest, so that it costs no
// allocation.
//
// Under a key-hash secret the fingerprint is keyed too, so that someone who reads the store
// cannot test guesses of a request's body against it.
func (d *digest) fingerprint(dst []byte, r *policy.Route, method, path, body []byte, h headers) []byte {
	w := d.key
	w.Reset()
	if len(r.Fingerprint) == 0 {
		field(d, w, "route")
		field(d, w, r.Name)
		return append(dst, w.Sum(d.sum[:0])...)
	}
	for _, p := range r.Fingerprint {
		field(d, w, string(p))
		switch p {
		case policy.PartMethod:
			field(d, w, method)
		case policy.PartPath:
			field(d, w, path)
		case policy.PartBody:
			field(d, w, body)
		}
	}
	for _, name := range r.FingerprintHeaders {
		d.headerValues(w, h, name)
	}
	return append(dst, w.Sum(d.sum[:0])...)
}

// bodyHashKey is the key of a request without one under missing_key: body-hash: the hex SHA-256
// of its method, path (with query) and body.
func (d *digest) bodyHashKey(method, path, body []byte) string {
	d.reset()
	field(d, d.h, method)
	field(d, d.h, path)
	field(d, d.h, body)
	return hex.EncodeToString(d.h.Sum(d.sum[:0]))
}

// jsonValue is the body's i-th json scope value; nil when it is missing.
func (req requestInfo) jsonValue(i int) []byte {
	if req.body == nil || i >= len(req.body.scope) {
		return nil
	}
	return req.body.scope[i]
}

// storeKey returns key_prefix + the hex hash of the scope values and the client's key, so that
// clients whose scope differs never share a record and raw keys never reach the store, and the
// hex hash alone, the record's key_hash.
//
// Each value is hashed behind its source's name, length-prefixed: a header's as before scope
// sources existed (its name, its value count, its values), so records stored by scope_headers
// keep their keys; a path parameter's likewise (its name, its value); a claim's and the peer's
// behind "jwt_claim:<name>" and "peer_identity:", names no header or group can have, so that
// header: x and jwt_claim: x never collide. A claim's value follows its JSON type (claimType),
// so an absent claim, an empty one, and claims of equal text and different types all differ.
func (d *digest) storeKey(r *policy.Route, req requestInfo, jwt *structpb.Struct, key string) (stored, keyHash string) {
	w := d.key
	w.Reset()
	param, member := 0, 0
	for _, src := range r.Scope {
		switch src.Kind {
		case policy.ScopeHeader:
			d.headerValues(w, req.headers, src.Name)
		case policy.ScopePathParam:
			field(d, w, src.Name)
			field(d, w, req.params[param])
			param++
		case policy.ScopeJWTClaim:
			field(d, w, "jwt_claim:"+src.Name)
			t, v := claim(jwt, src.Name)
			d.scratch = binary.AppendUvarint(d.scratch[:0], uint64(t))
			w.Write(d.scratch)
			if t != claimAbsent {
				field(d, w, v)
			}
		case policy.ScopePeerIdentity:
			field(d, w, "peer_identity:")
			field(d, w, req.peer)
		case policy.ScopeJSON:
			// Behind a name no header, group or claim source has; the value's JSON text, so
			// that 1 and "1" differ and a missing member is empty.
			field(d, w, "json:"+src.Name)
			field(d, w, req.jsonValue(member))
			member++
		}
	}
	field(d, w, key)
	var b strings.Builder
	b.Grow(len(r.KeyPrefix) + 2*sha256.Size)
	b.WriteString(r.KeyPrefix)
	var hexSum [2 * sha256.Size]byte
	hex.Encode(hexSum[:], w.Sum(d.sum[:0]))
	b.Write(hexSum[:])
	stored = b.String()
	return stored, stored[len(r.KeyPrefix):]
}

// scopeEmpty reports whether every scope value of the request is empty or absent
// (require_scope).
func scopeEmpty(r *policy.Route, req requestInfo, jwt *structpb.Struct) bool {
	param, member := 0, 0
	for _, src := range r.Scope {
		switch src.Kind {
		case policy.ScopeHeader:
			for _, v := range req.headers {
				if v.GetKey() == src.Name && len(headerValue(v)) > 0 {
					return false
				}
			}
		case policy.ScopePathParam:
			if req.params[param] != "" {
				return false
			}
			param++
		case policy.ScopeJWTClaim:
			if t, v := claim(jwt, src.Name); t != claimAbsent && t != claimNull && (t != claimString || len(v) > 0) {
				return false
			}
		case policy.ScopePeerIdentity:
			if req.peer != "" {
				return false
			}
		case policy.ScopeJSON:
			// Before the body is read its values are unknown: require_scope is checked again then.
			if req.body == nil {
				return false
			}
			if v := req.jsonValue(member); len(v) > 0 && string(v) != `""` && string(v) != "null" {
				return false
			}
			member++
		}
	}
	return true
}

// claimType is a verified claim's JSON type. It is hashed with the claim's value, so that
// "sub": 1 and "sub": "1", true and "true", or a list and its JSON text are different callers.
// A string is 1, as the presence mark that records written before types were hashed carry, so
// string claims (sub, iss, the usual ones) keep their records' keys.
type claimType uint8

const (
	claimAbsent claimType = iota
	claimString
	claimNumber
	claimBool
	claimNull
	claimList
	claimObject
)

// claim returns the type and value of a verified claim: a string as it is, anything else (a
// number, an audience list, an object) as its JSON, which encoding/json writes with sorted keys.
func claim(payload *structpb.Struct, name string) (claimType, []byte) {
	v, ok := payload.GetFields()[name]
	if !ok {
		return claimAbsent, nil
	}
	var t claimType
	switch k := v.GetKind().(type) {
	case *structpb.Value_StringValue:
		return claimString, []byte(k.StringValue)
	case *structpb.Value_NumberValue:
		t = claimNumber
	case *structpb.Value_BoolValue:
		t = claimBool
	case *structpb.Value_ListValue:
		t = claimList
	case *structpb.Value_StructValue:
		t = claimObject
	default:
		t = claimNull
	}
	b, err := json.Marshal(v.AsInterface())
	if err != nil {
		// A number JSON cannot write (NaN, ±Inf) still differs from every string and other type.
		return t, []byte(fmt.Sprint(v.AsInterface()))
	}
	return t, b
}

// maxExactInteger is 2^53: every integer of smaller magnitude is exactly one double, and from
// 2^53 on a double stands for two integers or more.
const maxExactInteger = 1 << 53

// claimsExact reports whether every number in the claims r scopes by stands for one value. Envoy
// hands the verified payload over as a protobuf Struct (jwt_verify_lib's Jwt::parseFromString
// parses it with JsonStringToMessage; jwt_authn's AuthenticatorImpl::handleGoodJwt writes it to
// the metadata), whose numbers are doubles: 9007199254740993 arrives as 9007199254740992, and a
// fraction as the double nearest every decimal within half a unit in its last place. A whole
// number below 2^53 is exact; anything else would let two callers share a scope, so it is
// refused (scope-claim-ambiguous) rather than hashed. Numbers inside a list or object claim count
// too.
func claimsExact(r *policy.Route, payload *structpb.Struct) bool {
	for _, src := range r.Scope {
		if src.Kind == policy.ScopeJWTClaim && !exactValue(payload.GetFields()[src.Name]) {
			return false
		}
	}
	return true
}

// exactValue reports whether every number in v is a whole number below 2^53 in magnitude.
func exactValue(v *structpb.Value) bool {
	switch k := v.GetKind().(type) {
	case *structpb.Value_NumberValue:
		n := k.NumberValue
		return math.Abs(n) < maxExactInteger && n == math.Trunc(n)
	case *structpb.Value_ListValue:
		for _, e := range k.ListValue.GetValues() {
			if !exactValue(e) {
				return false
			}
		}
	case *structpb.Value_StructValue:
		for _, e := range k.StructValue.GetFields() {
			if !exactValue(e) {
				return false
			}
		}
	}
	return true
}

// notReplayed are the headers a replay never carries: they describe one connection, or Envoy
// computes them for the local reply (content-length), or they would be stale (date).
var notReplayed = map[string]bool{
	"connection":        true,
	"keep-alive":        true,
	"proxy-connection":  true,
	"transfer-encoding": true,
	"upgrade":           true,
	"te":                true,
	"trailer":           true,
	"content-length":    true,
	"date":              true,
}

// replayableHeaders returns the response headers to store, in order: everything but
// pseudo-headers, hop-by-hop headers, content-length, date, x-envoy-*, the replay header and the
// route's exclude_response_headers (replay fidelity, docs/outcomes.md).
func replayableHeaders(h headers, r *policy.Route) []cache.Header {
	out := make([]cache.Header, 0, len(h))
	for _, v := range h {
		name := v.GetKey()
		switch {
		case name == "" || name[0] == ':',
			notReplayed[name],
			strings.HasPrefix(name, "x-envoy-"),
			name == r.ReplayHeader,
			slices.Contains(r.ExcludeResponseHeaders, name):
			continue
		}
		out = append(out, cache.Header{Name: name, Value: headerValue(v)})
	}
	return out
}
