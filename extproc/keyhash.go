package extproc

import (
	"cmp"
	"fmt"
	"hash"
	"net/http"
	"slices"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// KeyRequest is what a request's record name is made of, for tools that compute it outside a
// stream (the key-hash subcommand): the policy route Envoy would choose, and the scope values and
// key the request would carry.
type KeyRequest struct {
	// Route names the policy route, as x-idempotency-route would; "" chooses by Path.
	Route string
	// Method is the request's method; "" is POST.
	Method string
	// Path is the request's path, with its query: it chooses the route, path parameters are
	// read from it, and a body-hash key hashes it. "" is a request without one (grpc-go's
	// ext_proc client sends none).
	Path string
	// Headers are the request's headers as name, value pairs (names lower-cased as Envoy sends
	// them).
	Headers [][2]string
	// Claims is the payload jwt_authn verified, for jwt_claim scope entries.
	Claims map[string]any
	// PeerIdentity is the mTLS peer's URI SAN, for peer_identity scope entries.
	PeerIdentity string
	// Key is the idempotency key as the client sends it in its header (a quoted sf-string is
	// unquoted); "" when it sends none, and the route's key_json or missing_key gives the key.
	Key string
	// Body is the request body, for routes that read it: match.json, key_json, json scope
	// entries, fingerprint_ignore_json and missing_key: body-hash.
	Body []byte
}

// KeyHash returns the route a request would take and the key_hash of its record, as a stream
// computes them, with the stream's own functions: the route (match.json chosen by readJSON), the
// admission (admit: methods, key headers, TTL header, claims), the key from the headers or the
// body (keyFromBody), the json scope values, require_scope, and a body-hash key. keyHash is the
// hash factory of Options.KeyHash (nil for SHA-256). A request the stream would refuse or pass
// through uncovered has no record: KeyHash says why instead.
func KeyHash(p *policy.Policy, req KeyRequest, keyHash func() hash.Hash) (_ *policy.Route, hashed string, err error) {
	method := cmp.Or(req.Method, http.MethodPost)
	h := headers{{Key: ":method", RawValue: []byte(method)}}
	if req.Path != "" {
		h = append(h, &corev3.HeaderValue{Key: ":path", RawValue: []byte(req.Path)})
	}
	for _, kv := range req.Headers {
		h = append(h, &corev3.HeaderValue{Key: kv[0], RawValue: []byte(kv[1])})
	}
	sel := policy.Selector{Path: string(splitPath([]byte(req.Path))), Named: req.Route}
	var read bodyRead
	var readFor *policy.Route
	r, params, err := p.Select(sel)
	if err == nil && r.DecidedByBody() && !isGRPC(h) {
		r, params, err = p.SelectBy(sel, func(c *policy.Route) bool {
			readFor, read = c, readJSON(compileJSON(c), req.Body)
			return read.matched
		})
	}
	if err != nil {
		return nil, "", err
	}
	if req.Key != "" && len(r.KeyHeaders) > 0 {
		h = append(h, &corev3.HeaderValue{Key: r.KeyHeaders[0], RawValue: []byte(req.Key)})
	}
	info := requestInfo{headers: h, method: h.get(":method"), path: h.get(":path"), params: params, peer: req.PeerIdentity}
	if req.Claims != nil {
		payload, err := structpb.NewStruct(req.Claims)
		if err != nil {
			return nil, "", fmt.Errorf("claims: %w", err)
		}
		info.jwtAuthn = &structpb.Struct{Fields: map[string]*structpb.Value{cmp.Or(r.JWTPayloadKey, "payload"): structpb.NewStructValue(payload)}}
	}
	rt := &route{Route: r, claims: r.ReadsClaims(), bodyFingerprint: r.FingerprintsBody(), json: compileJSON(r)}
	a := admit(rt, info)
	if rt.json != nil && a.covered && a.problem == nil {
		if readFor != r {
			read = readJSON(rt.json, req.Body)
		}
		if read.batch {
			return nil, "", fmt.Errorf("route %q passes a JSON-RPC batch through uncovered: it has no record", r.Name)
		}
		a.problem = read.problem
		if a.problem == nil {
			info.body = &jsonState{scope: read.scope}
			a, a.covered = admitBody(r, a, info, read.key)
		}
	}
	switch {
	case !a.covered:
		why := "it carries no key, and the route's missing_key is optional"
		if !r.Enabled {
			why = "the route is off (enabled: false)"
		} else if !slices.Contains(r.Methods, method) {
			why = "the route's methods leave " + method + " out"
		}
		return nil, "", fmt.Errorf("route %q does not cover this request: %s; it passes through and has no record", r.Name, why)
	case a.problem != nil:
		return nil, "", fmt.Errorf("route %q: the processor answers %d %s: %s", r.Name, a.problem.status, a.problem.code, a.problem.detail)
	}
	d := newDigest(keyHash)
	if a.key == "" {
		if a.grpc {
			return nil, "", fmt.Errorf("route %q makes a gRPC call's key from its framed message (missing_key: body-hash), which key-hash cannot take: give the call's key", r.Name)
		}
		if req.Path == "" {
			return nil, "", fmt.Errorf("route %q makes the key of a request without one from its method, path and body (missing_key: body-hash): give the request's path, with its query", r.Name)
		}
		body := req.Body
		if rt.json != nil {
			body = read.fingerprint // as the stream's keys: what the fingerprint hashes
		}
		a.key = d.bodyHashKey(info.method, info.path, body)
	}
	_, hashed = d.storeKey(r, info, a.jwt, a.key)
	return r, hashed, nil
}

// StorePrefixes returns the distinct key prefixes of the policy's routes: a key_hash names a
// record under one of them.
func StorePrefixes(p *policy.Policy) []string {
	seen := map[string]bool{}
	var out []string
	for _, r := range append([]*policy.Route{p.Default}, p.Routes...) {
		if !seen[r.KeyPrefix] {
			seen[r.KeyPrefix] = true
			out = append(out, r.KeyPrefix)
		}
	}
	return out
}
