package extproc_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
)

// key-hash finds the record a stream stored however the route takes its key: from the body's
// key_json member with no header, from a key header given as a header, as a hash of method, path
// and body under missing_key: body-hash (a JSON-RPC route's without its id, as its fingerprint);
// and it refuses what the stream refuses or passes through, saying why, rather than name a
// record that cannot exist.
func TestKeyHashTakesTheKeyAsTheStreamDoes(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: mcpRoutes + `
  - name: hashed
    match: {path_prefix: /hashed}
    missing_key: body-hash
  - name: rpc-hashed
    match: {path_prefix: /rpc}
    json_rpc: true
    missing_key: body-hash
  - name: required-json
    match: {path_prefix: /req}
    key_json: [/id]
    missing_key: required
  - name: scoped
    match: {path_prefix: /scoped}
    scope: [{header: x-tenant}]
    require_scope: true
  - name: post-only
    match: {path_prefix: /post}
    methods: [POST]
  - name: off
    match: {path_prefix: /off}
    enabled: false
  - name: grpc-hashed
    match: {path_prefix: /pay.Payments/}
    grpc: true
    missing_key: body-hash
`})
	stored := func(req extproc.KeyRequest) bool {
		t.Helper()
		r, hashed, err := extproc.KeyHash(h.policy, req, nil)
		require.NoError(t, err)
		l, rec, err := h.store.Acquire(t.Context(), r.KeyPrefix+hashed, cache.Claim{LockTTL: time.Second, TTL: time.Second})
		require.NoError(t, err)
		if l.Held() {
			require.NoError(t, h.store.Release(t.Context(), l))
		}
		return rec != nil && rec.State == cache.Completed
	}
	json := []string{"content-type", "application/json"}
	run := func(path, body string) {
		t.Helper()
		require.True(t, h.do(request{method: "POST", path: path, headers: json, body: []byte(body)}, toolResult).executed)
	}
	run("/api", `{"request_id":"r-1","sent_at":"09:00"}`)
	run("/hashed", `amount=1`)
	require.True(t, h.do(post("/hashed", "k-1", `amount=1`), created).executed)
	run("/rpc", `{"jsonrpc":"2.0","id":1,"method":"charge"}`)
	h.waitIdle(t)

	require.True(t, stored(extproc.KeyRequest{Path: "/api", Body: []byte(`{"request_id":"r-1","sent_at":"09:05"}`)}),
		"the key from the body, with no header")
	require.True(t, stored(extproc.KeyRequest{Path: "/api", Key: "r-1", Body: []byte(`{"request_id":"r-1"}`)}),
		"a header key the body repeats")
	require.False(t, stored(extproc.KeyRequest{Path: "/api", Body: []byte(`{"request_id":"r-2"}`)}))
	require.True(t, stored(extproc.KeyRequest{Method: "POST", Path: "/hashed", Body: []byte(`amount=1`)}), "the body's hash")
	require.False(t, stored(extproc.KeyRequest{Method: "POST", Path: "/hashed", Body: []byte(`amount=2`)}))
	require.False(t, stored(extproc.KeyRequest{Method: "PUT", Path: "/hashed", Body: []byte(`amount=1`)}))
	require.True(t, stored(extproc.KeyRequest{Path: "/hashed", Key: "k-1", Body: []byte(`amount=1`)}), "a header key, not the body's hash")
	require.True(t, stored(extproc.KeyRequest{Path: "/hashed", Headers: [][2]string{{"idempotency-key", "k-1"}}, Body: []byte(`amount=1`)}),
		"the header key given as a header")
	require.True(t, stored(extproc.KeyRequest{Method: "POST", Path: "/rpc", Body: []byte(`{"jsonrpc":"2.0","id":7,"method":"charge"}`)}),
		"a JSON-RPC retry's new id is the same key")

	for _, c := range []struct {
		name string
		req  extproc.KeyRequest
		err  string
	}{
		{"header and body keys differ", extproc.KeyRequest{Path: "/api", Key: "r-9", Body: []byte(`{"request_id":"r-1"}`)}, "idempotency-key-conflict"},
		{"no key anywhere", extproc.KeyRequest{Path: "/api", Body: []byte(`{"amount":1}`)}, "no key"},
		{"a JSON-RPC batch", extproc.KeyRequest{Path: "/mcp", Route: "mcp-tool-calls", Key: "k", Body: []byte(`[{"jsonrpc":"2.0","id":1,"method":"tools/call"}]`)}, "batch"},
		{"a body that is not JSON", extproc.KeyRequest{Path: "/api", Key: "k", Body: []byte(`{`)}, "invalid-json-body"},
		{"an invalid body key", extproc.KeyRequest{Path: "/api", Body: []byte(`{"request_id":"a b"}`)}, "invalid-idempotency-key"},
		{"two key headers that differ", extproc.KeyRequest{Path: "/hashed", Key: "k-1", Headers: [][2]string{{"idempotency-key", "k-2"}}}, "invalid-idempotency-key"},
		{"a body-hash key without the path it hashes", extproc.KeyRequest{Route: "hashed", Body: []byte(`amount=1`)}, "give the request's path"},
		{"no key where one is required", extproc.KeyRequest{Path: "/req", Body: []byte(`{"n":1}`)}, "400 missing-idempotency-key"},
		{"require_scope and no scope", extproc.KeyRequest{Path: "/scoped", Key: "k"}, "401 scope-missing"},
		{"a method the route does not cover", extproc.KeyRequest{Path: "/post", Method: "PUT", Key: "k"}, "does not cover"},
		{"a route that is off", extproc.KeyRequest{Path: "/off", Key: "k"}, "does not cover"},
		{"a gRPC call's body-hash key", extproc.KeyRequest{Path: "/pay.Payments/Charge", Headers: [][2]string{{"content-type", "application/grpc"}}, Body: []byte("x")}, "framed message"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, _, err := extproc.KeyHash(h.policy, c.req, nil)
			require.ErrorContains(t, err, c.err)
		})
	}
}
