package extproc

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// The decision layer, table-tested on plain values: no Envoy message, no store, no gRPC.

func routeOf(t *testing.T, yaml string) *policy.Route {
	t.Helper()
	p, err := policy.Parse([]byte(yaml))
	require.NoError(t, err)
	if len(p.Routes) > 0 {
		return p.Routes[0]
	}
	return p.Default
}

// compiled compiles r as the server does at load.
func compiled(t *testing.T, r *policy.Route) *route {
	t.Helper()
	m, err := NewMetrics(prometheus.NewRegistry())
	require.NoError(t, err)
	c, err := compileRoute(r, m, "idempotency")
	require.NoError(t, err)
	return c
}

// proxyless is what grpc-go's ext_proc client sends: the call's metadata, no :method or :path.
func proxyless(pairs ...string) requestInfo {
	r := info("", pairs...)
	r.method, r.path = nil, nil
	return r
}

func info(method string, pairs ...string) requestInfo {
	var h headers
	for i := 0; i+1 < len(pairs); i += 2 {
		h = append(h, &corev3.HeaderValue{Key: pairs[i], RawValue: []byte(pairs[i+1])})
	}
	return requestInfo{headers: h, method: []byte(method), path: []byte("/v1/payments")}
}

func TestAdmit(t *testing.T) {
	jwt := func(payloads map[string]any) *structpb.Struct {
		s, err := structpb.NewStruct(payloads)
		require.NoError(t, err)
		return s
	}
	withJWT := func(r requestInfo, ns *structpb.Struct) requestInfo { r.jwtAuthn = ns; return r }
	cases := []struct {
		name   string
		policy string
		req    requestInfo
		want   admission // compared on covered, problem, key, ttl, needsBody
	}{
		{"a GET is not covered", "", info("GET", "idempotency-key", "k"), admission{}},
		{"no key under optional", "", info("POST"), admission{}},
		{"a disabled route", "defaults: {enabled: false}", info("POST", "idempotency-key", "k"), admission{}},
		{"gRPC by its content-type", "", info("POST", "idempotency-key", "k", "content-type", "application/grpc+proto"),
			admission{covered: true, key: "k", ttl: 24 * time.Hour, needsBody: true, grpc: true}},
		{"gRPC by its route, without :path or content-type (proxyless)", "routes: [{name: charge, match: {path_prefix: /}, grpc: true}]", proxyless("idempotency-key", "k"),
			admission{covered: true, key: "k", ttl: 24 * time.Hour, needsBody: true, grpc: true}},
		{"HTTP on a gRPC route stays HTTP", "routes: [{name: charge, match: {path_prefix: /}, grpc: true}]", info("POST", "idempotency-key", "k"),
			admission{covered: true, key: "k", ttl: 24 * time.Hour, needsBody: true}},
		{"grpc-web is not gRPC", "", info("POST", "idempotency-key", "k", "content-type", "application/grpc-web"),
			admission{covered: true, key: "k", ttl: 24 * time.Hour, needsBody: true}},
		{"a gRPC call without a key under optional", "", info("POST", "content-type", "application/grpc"), admission{}},
		{"a key: claimed at the body", "", info("POST", "idempotency-key", "k"),
			admission{covered: true, key: "k", ttl: 24 * time.Hour, needsBody: true}},
		{"a quoted key is unquoted", "", info("PUT", "idempotency-key", `"k"`),
			admission{covered: true, key: "k", ttl: 24 * time.Hour, needsBody: true}},
		{"no body in the fingerprint: claimed at the headers", "defaults: {fingerprint: [method, path]}", info("POST", "idempotency-key", "k"),
			admission{covered: true, key: "k", ttl: 24 * time.Hour}},
		{"x-ttl", "", info("POST", "idempotency-key", "k", "x-ttl", "60"),
			admission{covered: true, key: "k", ttl: time.Minute, needsBody: true}},
		{"x-ttl capped at max_ttl", "defaults: {ttl: 1h, max_ttl: 2h}", info("POST", "idempotency-key", "k", "x-ttl", "99999999999999999999"),
			admission{covered: true, key: "k", ttl: 2 * time.Hour, needsBody: true}},
		{"body-hash", "defaults: {missing_key: body-hash, fingerprint: [method]}", info("POST"),
			admission{covered: true, ttl: 24 * time.Hour, needsBody: true}},
		{"missing key, required", "defaults: {missing_key: required}", info("POST"),
			admission{covered: true, problem: problemMissingKey}},
		{"an invalid key", "", info("POST", "idempotency-key", "two words"),
			admission{covered: true, problem: problemInvalidKey}},
		{"two keys that differ", "", info("POST", "idempotency-key", "a", "x-idempotency-key", "b"),
			admission{covered: true, problem: problemInvalidKey}},
		{"an invalid x-ttl", "", info("POST", "idempotency-key", "k", "x-ttl", "0"),
			admission{covered: true, problem: problemInvalidTTL}},
		{"require_scope without any scope value", "defaults: {require_scope: true}", info("POST", "idempotency-key", "k"),
			admission{covered: true, problem: problemScopeMissing}},
		{"require_scope with one", "defaults: {require_scope: true}", info("POST", "idempotency-key", "k", "authorization", "Bearer t"),
			admission{covered: true, key: "k", ttl: 24 * time.Hour, needsBody: true}},
		{"several jwt_authn payloads, none named", "defaults: {scope: [{jwt_claim: sub}]}",
			withJWT(info("POST", "idempotency-key", "k"), jwt(map[string]any{"a": map[string]any{"sub": "x"}, "b": map[string]any{"sub": "y"}})),
			admission{covered: true, problem: problemScopeAmbiguous}},
		{"a null subject is no scope", "defaults: {scope: [{jwt_claim: sub}], require_scope: true}",
			withJWT(info("POST", "idempotency-key", "k"), jwt(map[string]any{"a": map[string]any{"sub": nil}})),
			admission{covered: true, problem: problemScopeMissing}},
		{"a number subject is a scope", "defaults: {scope: [{jwt_claim: sub}], require_scope: true}",
			withJWT(info("POST", "idempotency-key", "k"), jwt(map[string]any{"a": map[string]any{"sub": 0}})),
			admission{covered: true, key: "k", ttl: 24 * time.Hour, needsBody: true}},
		{"a whole number below 2^53 is exact", "defaults: {scope: [{jwt_claim: uid}]}",
			withJWT(info("POST", "idempotency-key", "k"), jwt(map[string]any{"a": map[string]any{"uid": 1<<53 - 1}})),
			admission{covered: true, key: "k", ttl: 24 * time.Hour, needsBody: true}},
		{"2^53 may stand for 2^53+1", "defaults: {scope: [{jwt_claim: uid}]}",
			withJWT(info("POST", "idempotency-key", "k"), jwt(map[string]any{"a": map[string]any{"uid": 1 << 53}})),
			admission{covered: true, problem: problemScopeClaimAmbiguous}},
		{"a fraction is refused", "defaults: {scope: [{jwt_claim: uid}]}",
			withJWT(info("POST", "idempotency-key", "k"), jwt(map[string]any{"a": map[string]any{"uid": 0.1}})),
			admission{covered: true, problem: problemScopeClaimAmbiguous}},
		{"2^53 in a list claim", "defaults: {scope: [{jwt_claim: groups}]}",
			withJWT(info("POST", "idempotency-key", "k"), jwt(map[string]any{"a": map[string]any{"groups": []any{"x", -(1 << 53)}}})),
			admission{covered: true, problem: problemScopeClaimAmbiguous}},
		{"a claim not scoped by is not read", "defaults: {scope: [{jwt_claim: sub}]}",
			withJWT(info("POST", "idempotency-key", "k"), jwt(map[string]any{"a": map[string]any{"sub": "x", "uid": 1 << 60}})),
			admission{covered: true, key: "k", ttl: 24 * time.Hour, needsBody: true}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := admit(compiled(t, routeOf(t, c.policy)), c.req)
			require.Equal(t, c.want.covered, got.covered, "covered")
			require.Equal(t, c.want.problem, got.problem, "problem")
			if c.want.problem == nil && c.want.covered {
				require.Equal(t, c.want.key, got.key)
				require.Equal(t, c.want.ttl, got.ttl)
				require.Equal(t, c.want.needsBody, got.needsBody)
				require.Equal(t, c.want.grpc, got.grpc, "grpc")
			}
		})
	}
}

func TestJudgeRecord(t *testing.T) {
	r := routeOf(t, "routes: [{name: pay, match: {path_prefix: /}}]")
	none := routeOf(t, "routes: [{name: pay, match: {path_prefix: /}, fingerprint: []}]")
	fp := []byte("fingerprint")
	completed := func(resp cache.Response) *cache.Record {
		return &cache.Record{State: cache.Completed, Fingerprint: fp, Route: "pay", Response: resp}
	}
	cases := []struct {
		name     string
		route    *policy.Route
		rec      *cache.Record
		want     *problem
		inFlight bool
	}{
		{"completed: the replay", r, completed(cache.Response{Status: 201}), nil, false},
		{"in flight: 409, and a duplicate may wait", r, &cache.Record{State: cache.Pending, Fingerprint: fp, Route: "pay"}, problemInProgress, true},
		{"another payload: 422", r, &cache.Record{State: cache.Completed, Fingerprint: []byte("other"), Route: "pay"}, problemReused, false},
		{"another payload in flight: 422 first", r, &cache.Record{State: cache.Pending, Fingerprint: []byte("other"), Route: "pay"}, problemReused, false},
		{"another route: 422", r, &cache.Record{State: cache.Completed, Fingerprint: fp, Route: "refunds"}, problemReused, false},
		{"another route in flight: 422", r, &cache.Record{State: cache.Pending, Fingerprint: fp, Route: "refunds"}, problemReused, false},
		{"a record naming no route (older layouts)", r, &cache.Record{State: cache.Completed, Fingerprint: fp}, nil, false},
		{"outcome unknown", r, completed(cache.Response{OutcomeUnknown: true, BodyOmitted: true}), problemOutcomeUnknown, false},
		{"body not kept", r, completed(cache.Response{Status: 200, BodyOmitted: true}), problemNotReplayable, false},
		{"no fingerprint, a record without one", none, &cache.Record{State: cache.Completed, Route: "pay"}, nil, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p, inFlight := judgeRecord(c.route, fp, c.rec)
			require.Equal(t, c.want, p)
			require.Equal(t, c.inFlight, inFlight)
		})
	}
}

func TestJudgeResponse(t *testing.T) {
	r := routeOf(t, "")
	noBody := routeOf(t, "defaults: {store_body: false}")
	upstream := origin{detailsKnown: true, attemptsKnown: true, attempts: 1}
	envoyBefore := origin{detailsKnown: true, envoyMade: true, attemptsKnown: true}
	envoyAfter := origin{detailsKnown: true, envoyMade: true, attemptsKnown: true, attempts: 1}
	cases := []struct {
		name    string
		route   *policy.Route
		resp    response
		want    settlement
		reason  string
		omitted bool
	}{
		{"a 201 with a body: captured", r, response{status: 201, origin: upstream, bodySent: true}, settleCapture, "", false},
		{"a 201 whose headers end it: recorded", r, response{status: 201, origin: upstream, endOfStream: true, bodySent: true}, settleRecord, "", false},
		{"response body mode NONE: recorded without body", r, response{status: 201, origin: upstream}, settleRecord, "", true},
		{"store_body: false: recorded without body", noBody, response{status: 201, origin: upstream, bodySent: true}, settleRecord, "", true},
		{"a 500 from the upstream: released", r, response{status: 500, origin: upstream, bodySent: true}, settleRelease, ReleaseStatus, false},
		{"Envoy's before any attempt: released", r, response{status: 503, origin: envoyBefore, bodySent: true}, settleRelease, ReleaseEnvoyResponse, false},
		{"Envoy's after an attempt: unknown", r, response{status: 504, origin: envoyAfter, bodySent: true}, settleUnknown, "", false},
		{"Envoy's 200 after an attempt: unknown", r, response{status: 200, origin: envoyAfter, bodySent: true}, settleUnknown, "", false},
		{"Envoy's, attempts not sent: unknown", r, response{status: 503, origin: origin{detailsKnown: true, envoyMade: true}, bodySent: true}, settleUnknown, "", false},
		{"no code details, not storable: maybe Envoy's", r, response{status: 503, origin: origin{attemptsKnown: true, attempts: 1}, bodySent: true}, settleUnknown, "", false},
		{"no code details, no attempt: released", r, response{status: 503, origin: origin{attemptsKnown: true}, bodySent: true}, settleRelease, ReleaseEnvoyResponse, false},
		{"no code details, storable: the upstream's", r, response{status: 200, origin: origin{attemptsKnown: true, attempts: 1}, bodySent: true}, settleCapture, "", false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s, reason, omitted := judgeResponse(c.route, c.resp)
			require.Equal(t, c.want, s)
			require.Equal(t, c.reason, reason)
			require.Equal(t, c.omitted, omitted)
		})
	}
}

// TestJudgeClaim covers every verdict a claim's result can get: what runs, what is answered and
// with which problem, what waits, and what fail_mode and shadow mode change.
func TestJudgeClaim(t *testing.T) {
	r := routeOf(t, "")
	fp := []byte("fp")
	pending := &cache.Record{State: cache.Pending, Fingerprint: fp, Route: r.Name}
	done := &cache.Record{State: cache.Completed, Fingerprint: fp, Route: r.Name, Response: cache.Response{Status: 201}}
	other := &cache.Record{State: cache.Completed, Fingerprint: []byte("other"), Route: r.Name}
	unknown := &cache.Record{State: cache.Completed, Fingerprint: fp, Route: r.Name, Response: cache.Response{OutcomeUnknown: true}}
	omitted := &cache.Record{State: cache.Completed, Fingerprint: fp, Route: r.Name, Response: cache.Response{Status: 201, BodyOmitted: true}}
	down := errors.New("connection refused")
	cases := []struct {
		name             string
		shadow, failOpen bool
		res              claimResult
		want             verdict
	}{
		{"the key is free: run", false, false, claimResult{}, verdict{act: actRun}},
		{"shadow mode runs too", true, false, claimResult{}, verdict{act: actRun}},
		{"a completed record: replay", false, false, claimResult{rec: done}, verdict{act: actReplay}},
		{"another payload: 422", false, false, claimResult{rec: other}, verdict{act: actRefuse, problem: problemReused}},
		{"another payload while in flight: 422, no wait", false, false, claimResult{rec: &cache.Record{State: cache.Pending, Fingerprint: []byte("other"), Route: r.Name}, mayWait: true}, verdict{act: actRefuse, problem: problemReused}},
		{"in flight: 409", false, false, claimResult{rec: pending}, verdict{act: actRefuse, problem: problemInProgress}},
		{"in flight with wait left: wait", false, false, claimResult{rec: pending, mayWait: true}, verdict{act: actWait}},
		{"in flight in shadow mode: no wait", true, false, claimResult{rec: pending, mayWait: true}, verdict{act: actShadow, would: InProgress}},
		{"outcome unknown: 409", false, false, claimResult{rec: unknown}, verdict{act: actRefuse, problem: problemOutcomeUnknown}},
		{"body not kept: 409", false, false, claimResult{rec: omitted}, verdict{act: actRefuse, problem: problemNotReplayable}},
		{"shadow mode would replay", true, false, claimResult{rec: done}, verdict{act: actShadow, would: Replayed}},
		{"store down, fail closed: 503", false, false, claimResult{err: down}, verdict{act: actRefuse, problem: problemStoreUnavailable}},
		{"store down, fail open: unprotected", false, true, claimResult{err: down}, verdict{act: actUnprotected}},
		{"store down in shadow mode", true, true, claimResult{err: down}, verdict{act: actShadow, would: StoreError}},
		{"a record that cannot be read: 409 whatever fail_mode says", false, true, claimResult{err: fmt.Errorf("open: %w", cache.ErrCorrupt)}, verdict{act: actRefuse, problem: problemNotReplayable}},
		{"durability unmet, fail closed: 503", false, false, claimResult{err: errDurabilityUnmet}, verdict{act: actRefuse, problem: problemDurabilityUnmet}},
		{"durability unmet, fail open: unprotected", false, true, claimResult{err: errDurabilityUnmet}, verdict{act: actUnprotected}},
		{"durability unmet in shadow mode", true, false, claimResult{err: errDurabilityUnmet}, verdict{act: actShadow, would: DurabilityUnmet}},
		{"the stream ended during the call: no answer", false, false, claimResult{err: context.Canceled, gone: true}, verdict{act: actNone}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, judgeClaim(r, fp, tc.shadow, tc.failOpen, tc.res))
		})
	}
}

// TestSettle covers the outcome of every move that settles a request.
func TestSettle(t *testing.T) {
	down := errors.New("connection refused")
	cases := []struct {
		name     string
		e        event
		from     state
		answered Outcome
		failed   error
		want     Outcome
	}{
		{"not covered", evPass, stateStart, "", nil, Passthrough},
		{"shadow mode, whatever the store did", evPass, stateCollect, "", down, Passthrough},
		{"a problem", evAnswer, stateCollect, Mismatch, nil, Mismatch},
		{"a replay", evAnswer, stateStart, Replayed, nil, Replayed},
		{"a 503 for the store", evAnswer, stateCollect, StoreError, down, StoreError},
		{"nobody waits for an answer", evAnswer, stateCollect, "", nil, Passthrough},
		{"ran and recorded", evSettle, stateCapture, "", nil, Executed},
		{"ran and released", evSettle, stateRunning, "", nil, Executed},
		{"ran, the completion failed", evSettle, stateCapture, "", down, StoreError},
		{"unprotected: the store failed under fail_mode: open", evSettle, stateUnprotected, "", down, StoreError},
		{"unprotected: durability unmet under fail_mode: open", evSettle, stateUnprotected, "", errDurabilityUnmet, DurabilityUnmet},
		{"unprotected: the body never reached the processor", evSettle, stateUnprotected, "", nil, Passthrough},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, settle(tc.e, tc.from, tc.answered, tc.failed))
		})
	}
}
