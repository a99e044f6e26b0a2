package extproc

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"hash"
	"slices"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"

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

// get returns the first value of name, or nil.
func (h headers) get(name string) []byte {
	for _, v := range h {
		if v.GetKey() == name {
			return headerValue(v)
		}
	}
	return nil
}

// headerValue returns the value of h. Envoy sends raw_value; value is read only as a fallback for
// clients that predate it.
func headerValue(h *corev3.HeaderValue) []byte {
	if h.RawValue != nil {
		return h.RawValue
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

// unquoteKey trims optional whitespace, unquotes an RFC 8941 sf-string (the IETF draft's form)
// and checks that the result is 1 to MaxKeyLength visible ASCII characters.
func unquoteKey(v []byte) (string, bool) {
	v = trimOWS(v)
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

func trimOWS(v []byte) []byte {
	for len(v) > 0 && (v[0] == ' ' || v[0] == '\t') {
		v = v[1:]
	}
	for len(v) > 0 && (v[len(v)-1] == ' ' || v[len(v)-1] == '\t') {
		v = v[:len(v)-1]
	}
	return v
}

// parseTTL reads a ttl_header value: a positive whole number of seconds, capped at max. Numbers
// too large to represent are capped too.
func parseTTL(v []byte, max time.Duration) (time.Duration, error) {
	v = trimOWS(v)
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
	h       hash.Hash
	scratch []byte
	sum     [sha256.Size]byte
}

func newDigest() *digest { return &digest{h: sha256.New(), scratch: make([]byte, 0, 64)} }

func (d *digest) reset() { d.h.Reset() }

func (d *digest) length(n int) {
	d.scratch = binary.AppendUvarint(d.scratch[:0], uint64(n))
	d.h.Write(d.scratch)
}

func (d *digest) field(b []byte) {
	d.length(len(b))
	d.h.Write(b)
}

func (d *digest) fieldString(s string) {
	d.scratch = binary.AppendUvarint(d.scratch[:0], uint64(len(s)))
	d.scratch = append(d.scratch, s...)
	d.h.Write(d.scratch)
}

// headerValues hashes every value of name in order, preceded by their count, so that an absent
// header, an empty one and several differ.
func (d *digest) headerValues(h headers, name string) {
	d.fieldString(name)
	count := 0
	for _, v := range h {
		if v.GetKey() == name {
			count++
		}
	}
	d.length(count)
	for _, v := range h {
		if v.GetKey() == name {
			d.field(headerValue(v))
		}
	}
}

// finish returns the hash of what was written; it is valid until the next reset.
func (d *digest) finish() []byte { return d.h.Sum(d.sum[:0]) }

// fingerprint returns the SHA-256 over the route's fingerprint parts and fingerprint headers.
// A route that lists no part (SPEC §4: the mismatch check is off; the policy refuses fingerprint
// headers beside it) gets the hash of its name instead: nothing is checked within the route,
// and a key reused from another route is still another endpoint's (422). Renaming such a route
// makes its records mismatch until they expire.
func (d *digest) fingerprint(r *policy.Route, method, path, body []byte, h headers) []byte {
	d.reset()
	if len(r.Fingerprint) == 0 {
		d.fieldString("route")
		d.fieldString(r.Name)
		return append([]byte(nil), d.finish()...)
	}
	for _, p := range r.Fingerprint {
		d.fieldString(string(p))
		switch p {
		case policy.PartMethod:
			d.field(method)
		case policy.PartPath:
			d.field(path)
		case policy.PartBody:
			d.field(body)
		}
	}
	for _, name := range r.FingerprintHeaders {
		d.headerValues(h, name)
	}
	return append([]byte(nil), d.finish()...)
}

// bodyHashKey is the key of a request without one under missing_key: body-hash: the hex SHA-256
// of its method, path (with query) and body.
func (d *digest) bodyHashKey(method, path, body []byte) string {
	d.reset()
	d.field(method)
	d.field(path)
	d.field(body)
	return hex.EncodeToString(d.finish())
}

// storeKey returns key_prefix + hex SHA-256 of the scope values and the client's key, so that
// clients whose scope differs never share a record and raw keys never reach the store. short is
// the first 12 hex digits, for logs.
func (d *digest) storeKey(r *policy.Route, h headers, pathParams []string, key string) (stored, short string) {
	d.reset()
	for _, name := range r.ScopeHeaders {
		d.headerValues(h, name)
	}
	for i, name := range r.ScopePathParams {
		d.fieldString(name)
		d.fieldString(pathParams[i])
	}
	d.fieldString(key)
	var b strings.Builder
	b.Grow(len(r.KeyPrefix) + 2*sha256.Size)
	b.WriteString(r.KeyPrefix)
	var hexSum [2 * sha256.Size]byte
	hex.Encode(hexSum[:], d.finish())
	b.Write(hexSum[:])
	stored = b.String()
	return stored, stored[len(r.KeyPrefix) : len(r.KeyPrefix)+12]
}

// lookup returns the first value of name and whether the header is present.
func (h headers) lookup(name string) ([]byte, bool) {
	for _, v := range h {
		if v.GetKey() == name {
			return headerValue(v), true
		}
	}
	return nil, false
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
// route's exclude_response_headers (SPEC §4, replay fidelity).
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
