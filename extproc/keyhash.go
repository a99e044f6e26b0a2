package extproc

import (
	"errors"
	"fmt"
	"hash"

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
	// Method is the request's method; only a key made under missing_key: body-hash reads it.
	Method string
	// Path is the request's path, with its query; path parameters are read from it.
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
// computes them, with the stream's own functions: the route match.json chooses (readJSON), the
// key from the header or the body (keyFromBody), the json scope values, and a body-hash key.
// keyHash is the hash factory of Options.KeyHash (nil for SHA-256). A request the stream would
// refuse or pass through uncovered has no record, and KeyHash says why.
func KeyHash(p *policy.Policy, req KeyRequest, keyHash func() hash.Hash) (route *policy.Route, hashed string, err error) {
	sel := policy.Selector{Path: string(splitPath([]byte(req.Path))), Named: req.Route}
	var read bodyRead
	var readFor *policy.Route
	r, params, err := p.Select(sel)
	if err == nil && r.DecidedByBody() {
		r, params, err = p.SelectBy(sel, func(c *policy.Route) bool {
			readFor, read = c, readJSON(compileJSON(c), req.Body)
			return read.matched
		})
	}
	if err != nil {
		return nil, "", err
	}
	j := compileJSON(r)
	if j != nil && readFor != r {
		read = readJSON(j, req.Body)
	}
	switch {
	case read.batch:
		return nil, "", fmt.Errorf("body: route %q passes a JSON-RPC batch through uncovered: it has no record", r.Name)
	case read.problem != nil:
		return nil, "", fmt.Errorf("body: route %q: %s (%s)", r.Name, read.problem.detail, read.problem.code)
	}
	a := admission{}
	if req.Key != "" {
		if a.key, _ = unquoteKey([]byte(req.Key)); a.key == "" {
			return nil, "", errors.New("the key is not a valid idempotency key: 1 to 255 visible ASCII characters, or an sf-string of them")
		}
	}
	if j != nil {
		a, _ = keyFromBody(r, a, read.key)
		if a.problem != nil {
			return nil, "", fmt.Errorf("the key and the body's key_json member differ: the processor answers 400 %s", a.problem.code)
		}
	}
	if a.key == "" && r.MissingKey != policy.MissingKeyBodyHash {
		where := "its key headers"
		if len(r.KeyJSON) > 0 {
			where += " or the body's key_json members"
		}
		return nil, "", fmt.Errorf("no key: route %q takes it from %s, and the request carries none", r.Name, where)
	}
	var h headers
	for _, kv := range req.Headers {
		h = append(h, &corev3.HeaderValue{Key: kv[0], RawValue: []byte(kv[1])})
	}
	info, jwt := requestInfo{headers: h, params: params, peer: req.PeerIdentity, body: &jsonState{scope: read.scope}}, (*structpb.Struct)(nil)
	if req.Claims != nil {
		payload, err := structpb.NewStruct(req.Claims)
		if err != nil {
			return nil, "", fmt.Errorf("claims: %w", err)
		}
		jwt = payload
		if !claimsExact(r, payload) {
			return nil, "", errors.New("claims: a claim the route scopes by is a number that is not a whole number below 2^53; the processor answers such a request 400 scope-claim-ambiguous and stores nothing")
		}
	}
	d := newDigest(keyHash)
	if a.key == "" {
		body := req.Body
		if j != nil {
			body = read.fingerprint // as the stream's keys: what the fingerprint hashes
		}
		a.key = d.bodyHashKey([]byte(req.Method), []byte(req.Path), body)
	}
	_, hashed = d.storeKey(r, info, jwt, a.key)
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
