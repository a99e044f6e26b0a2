package extproc_test

import (
	"encoding/json"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// payloadOf reads a verified payload as Envoy's jwt_authn hands it over: JSON parsed into a
// Struct, whose numbers are doubles.
func payloadOf(t *testing.T, js string) map[string]map[string]any {
	t.Helper()
	var claims map[string]any
	require.NoError(t, json.Unmarshal([]byte(js), &claims))
	return map[string]map[string]any{"provider": claims}
}

// A JWT claim is exact or refused. The subjects 2^53+1 and 2^53 arrive from jwt_authn as the one
// double 2^53: neither caller ever gets the other's stored response; both get 400
// scope-claim-ambiguous, the upstream never runs and nothing is stored. Whole numbers below 2^53
// are exact, and keep scoping (and replaying) as before, on either store.
func TestNumericClaimsAreExactOrRefused(t *testing.T) {
	forEachStore(t, func(t *testing.T, newStore func(t *testing.T) testStore) {
		ts := newStore(t)
		h := newHarness(t, harnessOptions{store: ts.store, advance: ts.advance, policy: "defaults: {scope: [{jwt_claim: uid}]}"})
		first := payloadOf(t, `{"sub": "a", "uid": 9007199254740993}`)
		second := payloadOf(t, `{"sub": "b", "uid": 9007199254740992}`)
		forFirst := upstream{status: 201, headers: []string{"content-type", "application/json"}, body: []byte(`{"for":"first"}`)}
		requireProblem(t, h.do(withJWT(post("/v1/payments", "big", `{}`), first), forFirst), 400, "scope-claim-ambiguous")
		res := h.do(withJWT(post("/v1/payments", "big", `{}`), second), created)
		requireProblem(t, res, 400, "scope-claim-ambiguous")
		require.NotEqual(t, forFirst.body, res.body, "never the first caller's response")
		require.Zero(t, h.executions("big"))

		for i, c := range []struct{ name, claim string }{
			{"-2^53", `-9007199254740992`},
			{"a fraction", `1.5`},
			{"2^53 inside a list", `[1, 9007199254740993]`},
			{"a fraction inside an object", `{"org": 0.1}`},
			{"far beyond 2^53", `1e300`},
		} {
			key := fmt.Sprintf("refused-%d", i)
			requireProblem(t, h.do(withJWT(post("/v1/payments", key, `{}`), payloadOf(t, `{"uid": `+c.claim+`}`)), created), 400, "scope-claim-ambiguous")
			require.Zero(t, h.executions(key), c.name)
		}

		for i, uid := range []string{`12345`, `9007199254740991`, `-9007199254740991`, `[1, 2]`, `{"org": 7}`} {
			key := fmt.Sprintf("exact-%d", i)
			caller := payloadOf(t, `{"uid": `+uid+`}`)
			require.True(t, h.do(withJWT(post("/v1/payments", key, `{}`), caller), created).executed, uid)
			require.Equal(t, []string{"true"}, h.do(withJWT(post("/v1/payments", key, `{}`), caller), created).header(replayed), "%s is exact: the same caller is replayed", uid)
			require.True(t, h.do(withJWT(post("/v1/payments", key, `{}`), payloadOf(t, `{"uid": 12346}`)), created).executed, "another number, another caller")
		}
		h.waitIdle(t)
		require.Equal(t, 7.0, h.counter("idempotency_requests_total", "route", "default", "outcome", "scope_claim_ambiguous"))
	})
}

// A number in a claim the route does not scope by changes nothing (exp, iat, a large custom
// claim), and the key-hash tool refuses the numbers the processor refuses.
func TestOnlyScopedClaimsMustBeExact(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: "defaults: {scope: [{jwt_claim: sub}]}"})
	// exp is a fraction, and in the future: jwt_authn checks it.
	caller := payloadOf(t, `{"sub": "alice", "exp": 4102444800.5, "account": 9007199254740993}`)
	require.True(t, h.do(withJWT(post("/v1/payments", "k", `{}`), caller), created).executed)
	require.Equal(t, []string{"true"}, h.do(withJWT(post("/v1/payments", "k", `{}`), caller), created).header(replayed))

	p, err := policy.Parse([]byte("defaults: {scope: [{jwt_claim: uid}]}"))
	require.NoError(t, err)
	_, _, err = extproc.KeyHash(p, extproc.KeyRequest{Path: "/v1/payments", Key: "k", Claims: map[string]any{"uid": float64(1 << 53)}}, nil)
	require.ErrorContains(t, err, "scope-claim-ambiguous")
	_, _, err = extproc.KeyHash(p, extproc.KeyRequest{Path: "/v1/payments", Key: "k", Claims: map[string]any{"uid": float64(12345)}}, nil)
	require.NoError(t, err)
}
