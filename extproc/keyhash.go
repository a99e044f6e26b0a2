package extproc

import (
	"errors"
	"fmt"
	"hash"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/jsonbody"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// KeyRequest is what a request's record name is made of, for tools that compute it outside a
// stream (the key-hash subcommand): the policy route Envoy would choose, and the scope values and
// key the request would carry.
type KeyRequest struct {
	// Route names the policy route, as x-idempotency-route would; "" chooses by Path.
	Route string
	// Path is the request's path, with its query; path parameters are read from it.
	Path string
	// Headers are the request's headers as name, value pairs (names lower-cased as Envoy sends
	// them).
	Headers [][2]string
	// Claims is the payload jwt_authn verified, for jwt_claim scope entries.
	Claims map[string]any
	// PeerIdentity is the mTLS peer's URI SAN, for peer_identity scope entries.
	PeerIdentity string
	// Key is the idempotency key as the client sends it (a quoted sf-string is unquoted).
	Key string
	// Body is the request body, for routes that read its members: match.json and json scope
	// entries.
	Body []byte
}

// KeyHash returns the route a request would take and the key_hash of its record, as
// a stream computes them; keyHash is the hash factory of Options.KeyHash (nil for SHA-256).
func KeyHash(p *policy.Policy, req KeyRequest, keyHash func() hash.Hash) (route *policy.Route, hashed string, err error) {
	sel := policy.Selector{Path: string(splitPath([]byte(req.Path))), Named: req.Route}
	r, params, err := p.Select(sel)
	if err == nil && r.DecidedByBody() {
		r, params, err = p.SelectBody(sel, req.Body)
	}
	if err != nil {
		return nil, "", err
	}
	key, ok := unquoteKey([]byte(req.Key))
	if !ok {
		return nil, "", errors.New("the key is not a valid idempotency key: 1 to 255 visible ASCII characters, or an sf-string of them")
	}
	var h headers
	for _, kv := range req.Headers {
		h = append(h, &corev3.HeaderValue{Key: kv[0], RawValue: []byte(kv[1])})
	}
	info, jwt := requestInfo{headers: h, params: params, peer: req.PeerIdentity}, (*structpb.Struct)(nil)
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
	if len(r.ScopeJSON) > 0 {
		values, err := jsonbody.Values(req.Body, r.ScopeJSON)
		if err != nil {
			return nil, "", fmt.Errorf("body: route %q scopes by members of the request body: %w", r.Name, err)
		}
		info.body = &jsonState{scope: values}
	}
	_, hashed = newDigest(keyHash).storeKey(r, info, jwt, key)
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
