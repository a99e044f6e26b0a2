package extproc_test

import (
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// randomShape draws how Envoy delivers one request (as viaenvoy_test.go sends it through e2e/proxy): its body
// modes, how the body is cut, whether it came whole during the header call, trailers, and how the
// exchange ends.
// Shapes that fail by design are left out: request_body_mode NONE on a route that needs the body
// (500 body-not-available), trailers under BUFFERED_PARTIAL (413), a body with trailers under
// STREAMED (it stalls: TestStreamedRequestTrailers), bodies over a limit.
func randomShape(rng *rand.Rand, bodyRoute bool) shape {
	reqModes := []bodyMode{modeBuffered, modePartial, modeStreamed, modeDuplex}
	if !bodyRoute {
		reqModes = append(reqModes, modeNone)
	}
	respModes := []bodyMode{modeBuffered, modePartial, modeStreamed, modeDuplex, modeNone}
	sh := shape{
		reqMode:     reqModes[rng.IntN(len(reqModes))],
		respMode:    respModes[rng.IntN(len(respModes))],
		whole:       rng.IntN(3) == 0,
		trailerSend: true,
	}
	for range rng.IntN(4) {
		sh.chunks = append(sh.chunks, 1+rng.IntN(40))
	}
	for range rng.IntN(3) {
		sh.respChunks = append(sh.respChunks, 1+rng.IntN(8))
	}
	sh.trailers = rng.IntN(5) == 0 && sh.reqMode != modePartial && sh.respMode != modePartial && (sh.reqMode != modeStreamed || !bodyRoute)
	sh.bodyBeforeAnswer = sh.reqMode == modeStreamed && rng.IntN(4) == 0
	switch n := rng.IntN(20); {
	case n < 3:
		sh.end, sh.ranUpstream = endBeforeResponse, rng.IntN(2) == 0
	case n < 5:
		sh.end = endMidBody
	case n < 8:
		sh.end = endEnvoyMade
		sh.attempts, sh.ranUpstream = rng.IntN(3), rng.IntN(2) == 0
		sh.noAttempts = rng.IntN(6) == 0
	}
	return sh
}

// shapesSeed is the seed of TestRandomStreamShapes: IDEMPOTENCY_SHAPES_SEED, or a fixed one so
// that every run is the same unless asked otherwise.
func shapesSeed(t *testing.T) uint64 {
	if v := os.Getenv("IDEMPOTENCY_SHAPES_SEED"); v != "" {
		seed, err := strconv.ParseUint(v, 10, 64)
		require.NoError(t, err, "IDEMPOTENCY_SHAPES_SEED")
		return seed
	}
	return 20261201
}

// TestRandomStreamShapes sends concurrent requests under a few keys, each in a random stream shape
// (body modes × chunkings × bodies whole during the header call × trailers × early ends ×
// Envoy-made responses × attempt counts), on both stores, and holds the processor to its
// guarantee (docs/guarantees.md#at-most-once-while-the-store-is-healthy): while the store is
// healthy, each key reaches the upstream at most once, except ambiguous outcomes under
// unknown_outcome: release, each of which is counted; no request with a body fails because of
// its mode; a replay is always its own key's response.
//
// The same keys go to four routes that share the key prefix (two of which leave the path out of
// their fingerprints) from callers whose JWT tenant claims differ only in type (1, "1", true, "true"; a custom claim,
// since jwt_authn refuses a token whose sub is not a string):
// a key is its caller's and its first route's, so a replay is never another caller's or another
// route's response, and a key reused on another route gets 422.
func TestRandomStreamShapes(t *testing.T) {
	seed := shapesSeed(t)
	t.Logf("seed %d (set IDEMPOTENCY_SHAPES_SEED to replay another)", seed)
	const workers, perWorker = 4, 40
	keys := []string{"k0", "k1", "k2", "k3", "k4"}
	paths := []string{"/v1/payments", "/v1/orders", "/v1/refunds", "/v1/transfers"}
	subjects := []any{float64(1), "1", true, "true"}
	forEachStore(t, func(t *testing.T, newStore func(t *testing.T) testStore) {
		ts := newStore(t)
		h := newHarness(t, harnessOptions{store: ts.store, advance: ts.advance, policy: `
defaults: {lock_ttl: 30s, scope: [{jwt_claim: tenant}]}
routes:
  - {name: orders, match: {path_prefix: /v1/orders}, fingerprint: [method, path]}
  - {name: refunds, match: {path_prefix: /v1/refunds}, fingerprint: [method, body]}
  - {name: transfers, match: {path_prefix: /v1/transfers}, fingerprint: [method, body]}
`})
		var mu sync.Mutex
		ambiguous := map[string]int{} // ambiguous outcomes released, by caller and key
		executed := map[string]int{}  // upstream runs, by caller and key
		routesUsed := map[string]map[string]bool{}
		total := 0
		statuses := map[int]int{}
		var wg sync.WaitGroup
		for w := range workers {
			rng := rand.New(rand.NewPCG(seed, uint64(w)))
			wg.Go(func() {
				for range perWorker {
					ki := rng.IntN(len(keys))
					key := keys[ki]
					// Each key has its route; one request in six reuses it on another, as often as
					// not the other route whose fingerprint leaves the path out.
					path := paths[ki%len(paths)]
					if n := rng.IntN(12); n == 0 {
						path = paths[rng.IntN(len(paths))]
					} else if n == 1 && (path == "/v1/refunds" || path == "/v1/transfers") {
						path = map[string]string{"/v1/refunds": "/v1/transfers", "/v1/transfers": "/v1/refunds"}[path]
					}
					bodyRoute := path != "/v1/orders"
					ci := rng.IntN(len(subjects))
					caller := fmt.Sprintf("%T:%v", subjects[ci], subjects[ci])
					unit := caller + "/" + key // what one record is: the caller's key
					// One body per key: the same request, however Envoy cuts it.
					body := `{"for":"` + key + `","pad":"` + bigBody(70*ki) + `"}`
					if !bodyRoute {
						body = `{"for":"` + key + `"}`
					}
					sh := randomShape(rng, bodyRoute)
					up := upstream{status: 201, headers: []string{"content-type", "application/json"}, body: []byte(`{"key":"` + unit + path + `"}`)}
					mu.Lock()
					if routesUsed[unit] == nil {
						routesUsed[unit] = map[string]bool{}
					}
					routesUsed[unit][path] = true
					mu.Unlock()
					req := withJWT(post(path, key, body), map[string]map[string]any{"provider": {"tenant": subjects[ci]}})
					res := h.run(req, sh, up)
					require.False(t, res.stalled, "no request stalls because of its mode (%+v)", sh)
					switch {
					case res.status == 0 && sh.end == endBeforeResponse:
					case res.reset && sh.end == endMidBody:
					case sh.end == endEnvoyMade && res.ran == (sh.attempts > 0 && sh.ranUpstream) && res.status == sh.envoyStatus():
					case res.status == 201 || res.status == 409:
					case res.status == 422:
						mu.Lock()
						n := len(routesUsed[unit])
						mu.Unlock()
						require.Greater(t, n, 1, "422 only for a key the caller used on another route")
					default:
						t.Errorf("status %d for a request in shape %+v: no request fails because of its mode", res.status, sh)
					}
					if v := res.header(replayed); len(v) == 1 && v[0] == "true" {
						require.Equal(t, up.body, res.body, "a replay is its own caller's, key's and route's response")
					}
					mu.Lock()
					statuses[res.status]++
					if res.ran {
						executed[unit]++
					}
					mu.Unlock()
					if res.ambiguous {
						mu.Lock()
						ambiguous[unit]++
						total++
						mu.Unlock()
					}
				}
			})
		}
		wg.Wait()
		h.waitIdle(t)
		ran := 0
		for _, n := range executed {
			ran += n
		}
		t.Logf("%d requests: %d ran upstream, %d ambiguous outcomes released, statuses %v", workers*perWorker, ran, total, statuses)
		require.Greater(t, statuses[409], 0, "the mix must include duplicates in flight or not replayable")
		require.Greater(t, statuses[422], 0, "the mix must include keys reused on another route")
		require.Greater(t, total, 0, "the mix must include ambiguous outcomes")
		for unit, n := range executed {
			require.LessOrEqual(t, n, 1+ambiguous[unit],
				"%s reached the upstream %d times with %d ambiguous outcomes released", unit, n, ambiguous[unit])
		}
		released := 0.0
		for _, route := range []string{"default", "orders", "refunds", "transfers"} {
			released += h.counter("idempotency_releases_total", "route", route, "reason", "unknown_outcome")
			require.Zero(t, h.counter("idempotency_requests_total", "route", route, "outcome", "store_error"))
		}
		require.Equal(t, float64(total), released, "every ambiguous outcome released is counted")
		require.NotContains(t, h.logs.String(), "move not in the table")
		require.NotContains(t, h.logs.String(), "ran unprotected")
	})
}
