package extproc

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"hash"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// TestDigestKeepsStoredBytes pins the stored keys and fingerprints of requests that use every
// scope source and fingerprint part, hashed plainly and under a key-hash secret: records already
// stored must go on matching their retries, so these bytes never change. The values are what
// the digest computed when this test was written; two of them are checked by hand: the loose
// route's SHA-256 fingerprint is sha256("\x05route\x05loose"), and the body-hash key is the
// SHA-256 of "\x04POST", "\x11/v1/orders/42?x=1" and "\x1f" followed by the body.
func TestDigestKeepsStoredBytes(t *testing.T) {
	h := headers{
		{Key: "authorization", RawValue: []byte("Bearer a")},
		{Key: "x-tenant", RawValue: []byte("t1")},
		{Key: "x-tenant", RawValue: []byte("")},
		{Key: "x-api-version", RawValue: []byte("2")},
	}
	jwt, err := structpb.NewStruct(map[string]any{"sub": "alice", "n": float64(7)})
	require.NoError(t, err)
	req := requestInfo{
		headers: h, method: []byte("POST"), path: []byte("/v1/orders/42?x=1"),
		peer: "spiffe://example/ns/a", params: []string{"42"},
		body: &jsonState{scope: [][]byte{[]byte(`"acme"`), nil}},
	}
	scoped := &policy.Route{
		Name: "orders", KeyPrefix: "p:",
		Scope: []policy.ScopeSource{
			{Kind: policy.ScopeHeader, Name: "authorization"},
			{Kind: policy.ScopeHeader, Name: "x-tenant"},
			{Kind: policy.ScopeHeader, Name: "x-absent"},
			{Kind: policy.ScopePathParam, Name: "id"},
			{Kind: policy.ScopeJWTClaim, Name: "sub"},
			{Kind: policy.ScopeJWTClaim, Name: "n"},
			{Kind: policy.ScopeJWTClaim, Name: "missing"},
			{Kind: policy.ScopePeerIdentity},
			{Kind: policy.ScopeJSON, Name: "/org"},
			{Kind: policy.ScopeJSON, Name: "/gone"},
		},
		Fingerprint:        []policy.Part{policy.PartMethod, policy.PartPath, policy.PartBody},
		FingerprintHeaders: []string{"x-api-version", "x-tenant", "x-absent"},
	}
	loose := &policy.Route{Name: "loose", KeyPrefix: "idempotency:"}
	body := []byte(`{"amount":100,"currency":"EUR"}`)
	secret := func() hash.Hash { return hmac.New(sha256.New, []byte("secret")) }

	for _, c := range []struct {
		name          string
		keyHash       func() hash.Hash
		route         *policy.Route
		stored, print string
	}{
		{"every source, SHA-256", nil, scoped,
			"p:ac6dcef20578ce37a708bfe14c723f9484b586b333a1a8fd82257b9cc78c7e32",
			"7bc3a89c27c160a490e3c7d7f97595da9fa47f5a5f98cc9a9819e50668a69bcd"},
		{"every source, under a secret", secret, scoped,
			"p:07be5a16bb571f7a5750e5a27a37056e9b139cd0cf4edb6e684a1b940af8367b",
			"c30becba226510d07dd2d69eef34fc5e1922d5413ee786ed37fe0468e1792f97"},
		{"no fingerprint parts, SHA-256", nil, loose,
			"idempotency:4c71db9c519db756d69ad0cccabf0292bc76ee9dbc84c01b96e70cd210f95368",
			"600145634ec353cd3efd0a4317fdf3a7fe76ca4717c88372285a9281e30a38e0"},
		{"no fingerprint parts, under a secret", secret, loose,
			"idempotency:b01d34b078c2c7e77afc2cc4c6bc5bc5a59217af38d6b3f5770ce24a7c38db20",
			"7eded26f654de0a8e4a7dfb7fa2298152748a09d5e53d4fdc8ea0f0a09ed71b9"},
	} {
		d := newDigest(c.keyHash)
		stored, keyHash := d.storeKey(c.route, req, jwt, "key-1")
		print := d.fingerprint(nil, c.route, req.method, req.path, body, h)
		require.Equal(t, c.stored, stored, c.name)
		require.Equal(t, c.stored[len(c.route.KeyPrefix):], keyHash, c.name)
		require.Equal(t, c.print, hex.EncodeToString(print), c.name)
	}
	require.Equal(t, "8006e9dd899a8e8e47e83165b32c8412c1eac355868d4a2383a4bec925afad9f", newDigest(nil).bodyHashKey(req.method, req.path, body), "the body-hash key")
}
