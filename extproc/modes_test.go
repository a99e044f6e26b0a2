package extproc_test

import (
	"strconv"
	"strings"
	"testing"
	"time"

	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
)

// The request body modes (docs/guarantees.md#request-body-modes): whatever the mode, and however
// Envoy cuts the body, a covered request is claimed exactly once, before any of its body reaches
// the upstream.

// bigBody is a request body of n bytes.
func bigBody(n int) string { return strings.Repeat("x", n) }

func TestEveryRequestBodyModeClaimsOnce(t *testing.T) {
	body := `{"amount":1,"currency":"EUR","note":"` + bigBody(150<<10) + `"}`
	shapes := []struct {
		name string
		sh   shape
	}{
		{"buffered", shape{reqMode: modeBuffered, respMode: modeBuffered}},
		{"buffered, trailers", shape{reqMode: modeBuffered, respMode: modeBuffered, trailers: true, trailerSend: true}},
		{"buffered partial, whole", shape{reqMode: modePartial, respMode: modeBuffered}},
		{"streamed, one message", shape{reqMode: modeStreamed, respMode: modeBuffered, whole: true}},
		{"streamed, three chunks", shape{reqMode: modeStreamed, respMode: modeStreamed, chunks: []int{1, 64 << 10}, respChunks: []int{3}}},
		{"streamed, body sent before the header answer", shape{reqMode: modeStreamed, respMode: modeBuffered, chunks: []int{100}, bodyBeforeAnswer: true}},
		{"full duplex, one message", shape{reqMode: modeDuplex, respMode: modeDuplex, whole: true}},
		{"full duplex, chunks", shape{reqMode: modeDuplex, respMode: modeDuplex, chunks: []int{7, 20 << 10, 1}, respChunks: []int{2, 2}}},
		{"full duplex, trailers", shape{reqMode: modeDuplex, respMode: modeDuplex, chunks: []int{5}, trailers: true, trailerSend: true}},
		{"full duplex request, buffered response", shape{reqMode: modeDuplex, respMode: modeBuffered, chunks: []int{64 << 10}}},
	}
	forEachStore(t, func(t *testing.T, newStore func(t *testing.T) testStore) {
		for _, tc := range shapes {
			t.Run(tc.name, func(t *testing.T) {
				ts := newStore(t)
				h := newHarness(t, harnessOptions{store: ts.store, advance: ts.advance, policy: "defaults: {max_request_bytes: 1048576}"})
				req := post("/v1/payments", "k", body)
				first := h.run(req, tc.sh, created)
				require.True(t, first.ran)
				require.Equal(t, 201, first.status)
				require.Equal(t, []string{"false"}, first.header(replayed))

				// The same request, cut another way, is the same request.
				other := tc.sh
				other.whole, other.chunks = !tc.sh.whole, []int{3, 33 << 10}
				dup := h.run(req, other, created)
				require.False(t, dup.ran, "a duplicate never runs")
				require.Equal(t, []string{"true"}, dup.header(replayed))
				require.Equal(t, created.body, dup.body)

				changed := h.run(post("/v1/payments", "k", body+" "), tc.sh, created)
				requireProblem(t, changed.result, 422, "idempotency-key-reused")
				require.Equal(t, 1, h.executions("k"))
			})
		}
	})
}

// Under STREAMED a request whose body ends with trailers cannot be claimed: Envoy sends the
// trailers only once every chunk is answered (Filter::onTrailers holds them while an answer is
// outstanding; ProcessorState::finalizeBodyResponse sends them when the queue is empty), and the
// processor answers no chunk before the body's end. It stalls into Envoy's message timeout
// (504) without its body reaching the upstream, and leaves the key free. A request with
// trailers and no data is claimed at its trailers. docs/guarantees.md#request-body-modes sends
// routes whose clients send request trailers to BUFFERED or FULL_DUPLEX_STREAMED.
func TestStreamedRequestTrailers(t *testing.T) {
	h := newHarness(t, harnessOptions{})
	sh := shape{reqMode: modeStreamed, respMode: modeBuffered, chunks: []int{10}, trailers: true, trailerSend: true, messageTimeout: 300 * time.Millisecond}
	res := h.run(post("/v1/payments", "k", bigBody(40)), sh, created)
	require.True(t, res.stalled)
	require.False(t, res.ran)
	h.waitIdle(t)
	h.requireStoreEmpty(t, "k")
	for i, mode := range []bodyMode{modeBuffered, modeDuplex} {
		ok := sh
		ok.reqMode, ok.messageTimeout = mode, 0 // answered: no short timer to race on a loaded machine
		key := "k-" + strconv.Itoa(i)
		require.True(t, h.run(post("/v1/payments", key, bigBody(40)), ok, created).ran, "%v claims it", mode)
		require.False(t, h.run(post("/v1/payments", key, bigBody(40)), ok, created).ran, "%v replays it", mode)
	}

	trailersOnly := shape{reqMode: modeStreamed, respMode: modeBuffered, trailers: true, trailerSend: true}
	require.True(t, h.run(post("/v1/payments", "k2", ""), trailersOnly, created).ran)
	dup := h.run(post("/v1/payments", "k2", ""), trailersOnly, created)
	require.False(t, dup.ran)
	require.Equal(t, []string{"true"}, dup.header(replayed))
}

// In STREAMED mode Envoy pipelines the chunks: the processor withholds every answer until the
// chunk that ends the body, so that none of it reaches the upstream before the claim, then
// answers them all, in order.
func TestStreamedChunksAreWithheldUntilTheClaim(t *testing.T) {
	h := newHarness(t, harnessOptions{})
	s := h.openPipelined(5 * time.Second)
	first := requestHeaders(post("/v1/payments", "k", `{"a":1}`))
	s.put(withBodyModes(first, modeStreamed, modeBuffered))
	require.NotNil(t, s.next().GetRequestHeaders())
	s.put(bodyMsg([]byte(`{"a"`), false))
	s.put(bodyMsg([]byte(`:1`), false))
	select {
	case resp := <-s.answers:
		t.Fatalf("a chunk was answered before the body ended: %v", kind(resp))
	case <-time.After(100 * time.Millisecond):
	}
	require.Nil(t, h.record(t, "k"), "not claimed yet")
	s.put(bodyMsg([]byte(`}`), true))
	for i := range 3 {
		resp := s.next()
		require.NotNil(t, resp.GetRequestBody(), "answer %d", i)
		require.Nil(t, resp.GetRequestBody().GetResponse().GetBodyMutation(), "the body goes on unchanged")
	}
	require.Equal(t, cache.Pending, h.record(t, "k").State, "claimed at the last chunk")
}

// A body Envoy would have to hold beyond its buffer limit while the answers are withheld stalls
// until Envoy's message timeout (504): it never reaches the upstream, and nothing is left held.
func TestStreamedBodyOverEnvoysBufferStallsWithoutRunning(t *testing.T) {
	h := newHarness(t, harnessOptions{})
	res := h.run(post("/v1/payments", "k", bigBody(100<<10)), shape{
		reqMode: modeStreamed, respMode: modeBuffered, chunks: []int{16 << 10, 16 << 10, 16 << 10},
		bufferLimit: 32 << 10, messageTimeout: 300 * time.Millisecond,
	}, created)
	require.True(t, res.stalled)
	require.False(t, res.ran)
	h.waitIdle(t)
	h.requireStoreEmpty(t, "k")
}

// The processor holds at most max_request_bytes of a body itself: beyond it, 413
// request-too-large, and the request never runs. A partial BUFFERED_PARTIAL buffer gets the same.
func TestRequestBodyLimits(t *testing.T) {
	for _, tc := range []struct {
		name string
		sh   shape
	}{
		{"streamed", shape{reqMode: modeStreamed, respMode: modeBuffered, chunks: []int{600, 600}}},
		{"full duplex", shape{reqMode: modeDuplex, respMode: modeDuplex, chunks: []int{1000}}},
		// Envoy sends BUFFERED_PARTIAL's buffer, without the end of the body, once a read takes it over
		// the buffer limit (Filter::onData in ext_proc.cc, queueOverHighLimit).
		{"buffered partial, limit reached", shape{reqMode: modePartial, respMode: modeBuffered, bufferLimit: 512, chunks: []int{600}}},
		{"buffered partial, trailers follow", shape{reqMode: modePartial, respMode: modeBuffered, trailers: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, harnessOptions{policy: "defaults: {max_request_bytes: 1024}"})
			res := h.run(post("/v1/payments", "k", bigBody(1500)), tc.sh, created)
			require.False(t, res.ran)
			requireProblem(t, res.result, 413, "request-too-large")
			h.waitIdle(t)
			h.requireStoreEmpty(t, "k")
			require.Equal(t, 1.0, h.counter("idempotency_requests_total", "route", "default", "outcome", "too_large"))
			// Within the limit, it runs.
			small := tc.sh
			small.trailers, small.bufferLimit = false, 0
			require.True(t, h.run(post("/v1/payments", "k", `{}`), small, created).ran)
		})
		// In shadow mode the same request goes on untouched, its whole body reaching the
		// upstream (its upstream checks it byte for byte), and is counted as would-be 413.
		t.Run(tc.name+", shadow", func(t *testing.T) {
			h := newHarness(t, harnessOptions{policy: "defaults: {max_request_bytes: 1024, mode: shadow}"})
			res := h.run(post("/v1/payments", "k", bigBody(1500)), tc.sh, created)
			require.False(t, res.stalled, "every message is answered")
			require.True(t, res.ran)
			require.Equal(t, 201, res.status)
			h.waitIdle(t)
			require.Equal(t, 1.0, h.counter("idempotency_shadow_total", "route", "default", "would", "too_large"))
		})
	}
}

// With request_body_mode NONE the body never reaches the processor: a route that needs none is
// claimed at the request headers; any other covered request with a body gets 500
// body-not-available, said once at error, or passes unprotected under fail_mode: open.
func TestRequestBodyModeNone(t *testing.T) {
	none := shape{reqMode: modeNone, respMode: modeBuffered}
	t.Run("route without body in its fingerprint", func(t *testing.T) {
		h := newHarness(t, harnessOptions{policy: "defaults: {fingerprint: [method, path]}"})
		require.True(t, h.run(post("/v1/payments", "k", `{"a":1}`), none, created).ran)
		dup := h.run(post("/v1/payments", "k", `{"a":1}`), none, created)
		require.False(t, dup.ran)
		require.Equal(t, []string{"true"}, dup.header(replayed))
	})
	t.Run("route that needs the body", func(t *testing.T) {
		h := newHarness(t, harnessOptions{})
		for range 2 {
			res := h.run(post("/v1/payments", "k", `{"a":1}`), none, created)
			require.False(t, res.ran)
			requireProblem(t, res.result, 500, "body-not-available")
		}
		require.Equal(t, 1, strings.Count(h.logs.String(), "request_body_mode is NONE"), "said once")
		require.Contains(t, h.logs.String(), `"level":"error"`)
		require.Equal(t, 2.0, h.counter("idempotency_envoy_misconfig_total", "kind", "body_not_available"))
		// A request without a body needs none.
		require.True(t, h.run(post("/v1/payments", "k", ""), none, created).ran)
	})
	t.Run("fail open", func(t *testing.T) {
		h := newHarness(t, harnessOptions{policy: "fail_mode: open"})
		res := h.run(post("/v1/payments", "k", `{"a":1}`), none, created)
		require.True(t, res.ran)
		require.Equal(t, []string{"false"}, res.header(replayed))
		h.waitIdle(t)
		h.requireStoreEmpty(t, "k")
	})
}

// A route whose fingerprint omits the body is claimed at request_headers in every body mode, so a
// duplicate's answer comes before its body is uploaded.
func TestClaimAtHeadersWhenTheBodyIsNotNeeded(t *testing.T) {
	for _, mode := range []bodyMode{modeBuffered, modePartial, modeStreamed, modeDuplex, modeNone} {
		t.Run(mode.String(), func(t *testing.T) {
			h := newHarness(t, harnessOptions{policy: "defaults: {fingerprint: [method, path]}"})
			sh := shape{reqMode: mode, respMode: modeBuffered, chunks: []int{10}}
			require.True(t, h.run(post("/v1/payments", "k", bigBody(100)), sh, created).ran)
			s := h.openPipelined(5 * time.Second)
			s.put(withBodyModes(requestHeaders(post("/v1/payments", "k", bigBody(100))), sh.reqMode, sh.respMode))
			resp := s.next()
			require.NotNil(t, resp.GetImmediateResponse(), "the replay answers the request headers")
			require.Equal(t, created.body, resp.GetImmediateResponse().GetBody())
		})
	}
}

// FULL_DUPLEX_STREAMED makes Envoy refuse plain body answers: an uncovered request's chunks and
// its response's chunks are echoed as they arrive, and trailers are answered; nothing waits for
// the end of the body.
func TestFullDuplexUncoveredIsEchoed(t *testing.T) {
	h := newHarness(t, harnessOptions{})
	s := h.openPipelined(5 * time.Second)
	s.put(withBodyModes(requestHeaders(post("/v1/payments", "", "abcdef")), modeDuplex, modeDuplex))
	resp := s.next()
	require.NotNil(t, resp.GetRequestHeaders())
	require.Nil(t, resp.GetModeOverride(), "Envoy ignores mode_override in this mode")
	for i, chunk := range []string{"abc", "def"} {
		s.put(bodyMsg([]byte(chunk), false))
		sr := s.next().GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		require.Equal(t, chunk, string(sr.GetBody()), "chunk %d echoed at once", i)
		require.False(t, sr.GetEndOfStream())
	}
	s.put(requestTrailersMsg)
	require.NotNil(t, s.next().GetRequestTrailers())
	s.put(responseHeaders(created))
	require.NotNil(t, s.next().GetResponseHeaders())
	s.put(responseBody([]byte("xyz"), true))
	sr := s.next().GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
	require.Equal(t, "xyz", string(sr.GetBody()))
	require.True(t, sr.GetEndOfStream())
	s.end()
	h.waitIdle(t)
	require.Equal(t, 1.0, h.counter("idempotency_requests_total", "route", "default", "outcome", "passthrough"))
}

// A FULL_DUPLEX_STREAMED body the processor collected goes back to Envoy once claimed, in chunks
// of at most 64 KiB, after the withheld header answer: nothing reached the upstream before.
func TestFullDuplexBodyStreamedBackAfterTheClaim(t *testing.T) {
	h := newHarness(t, harnessOptions{})
	body := bigBody(150 << 10)
	s := h.openPipelined(5 * time.Second)
	s.put(withBodyModes(requestHeaders(post("/v1/payments", "k", body)), modeDuplex, modeDuplex))
	s.put(bodyMsg([]byte(body[:1000]), false))
	select {
	case resp := <-s.answers:
		t.Fatalf("answered before the body ended: %v", kind(resp))
	case <-time.After(100 * time.Millisecond):
	}
	s.put(bodyMsg([]byte(body[1000:]), true))
	require.NotNil(t, s.next().GetRequestHeaders(), "the headers are answered first")
	var back []byte
	sizes := []int{}
	for {
		sr := s.next().GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		back = append(back, sr.GetBody()...)
		sizes = append(sizes, len(sr.GetBody()))
		if sr.GetEndOfStream() {
			break
		}
	}
	require.Equal(t, body, string(back))
	require.Equal(t, []int{64 << 10, 64 << 10, 22 << 10}, sizes)
}

// A request is a gRPC call exactly when Envoy treats it as one (Grpc::Common::hasGrpcContentType
// in source/common/grpc/common.cc: application/grpc, or application/grpc+…), and its problems
// are then answered as gRPC statuses; any other content-type is answered as HTTP.
func TestGRPCCallsByContentType(t *testing.T) {
	grpcTypes := map[string]bool{"application/grpc": true, "application/grpc+proto": true, "application/grpc+json": true}
	for _, ct := range []string{"application/grpc", "application/grpc+proto", "application/grpc+json", "application/grpc-web", "application/grpc;charset=utf-8", "application/grpcx", "Application/grpc"} {
		t.Run(ct, func(t *testing.T) {
			h := newHarness(t, harnessOptions{policy: "defaults: {missing_key: required}"})
			st := h.open()
			ir := st.send(requestHeaders(post("/pkg.Service/Method", "", "\x00\x00\x00\x00\x02hi", "content-type", ct))).GetImmediateResponse()
			require.NotNil(t, ir, "a covered request without a key is refused")
			if grpcTypes[ct] {
				require.Equal(t, uint32(3), ir.GetGrpcStatus().GetStatus(), "INVALID_ARGUMENT")
				require.Equal(t, "missing-idempotency-key", string(ir.GetBody()), "the code, which Envoy sends as grpc-message")
				return
			}
			require.Nil(t, ir.GetGrpcStatus())
			require.Equal(t, 400, int(ir.GetStatus().GetCode()))
			require.Contains(t, string(ir.GetBody()), `"code":"missing-idempotency-key"`)
		})
	}
}

// Under request_trailer_mode SKIP a request with trailers and no data skips the body phase
// (Filter::onTrailers in ext_proc.cc continues when nothing is buffered and trailers are not
// sent): the processor first hears of it at the response, after it ran without a lease. That is
// counted and said once, naming the setting; with SEND the trailers message ends the body and
// the request is claimed. A response Envoy made without attempting the upstream (its own 413)
// is no such run.
func TestUnclaimedRequestIsCounted(t *testing.T) {
	h := newHarness(t, harnessOptions{})
	trailersOnly := func(key string) *stream {
		s := h.open()
		m := requestHeaders(post("/v1/payments", key, ""))
		m.GetRequestHeaders().EndOfStream = false // trailers follow
		resp := s.send(m)
		require.NotNil(t, resp.GetRequestHeaders(), "BUFFERED: the headers answered, the body awaited")
		return s
	}
	for _, key := range []string{"k1", "k2"} {
		s := trailersOnly(key)
		resp := s.send(responseHeaders(created))
		require.NotNil(t, resp.GetResponseHeaders())
		s.end()
	}
	s := trailersOnly("k3")
	s.send(responseHeaders(upstream{status: 413, details: "request_payload_too_large", attempts: 0}))
	s.end()
	h.waitIdle(t)
	require.Equal(t, 2.0, h.counter("idempotency_envoy_misconfig_total", "kind", "unclaimed_request"))
	require.Equal(t, 1, strings.Count(h.logs.String(), "request_trailer_mode: SEND"), "said once, naming the setting")

	// With SEND: claimed at the trailers, once.
	s = trailersOnly("k4")
	resp := s.send(requestTrailersMsg)
	require.NotNil(t, resp.GetRequestTrailers(), "claimed: the request runs")
	s.send(responseHeaders(created))
	s.send(responseBody(created.body, true))
	s.end()
	h.waitIdle(t)
	s = trailersOnly("k4")
	resp = s.send(requestTrailersMsg)
	require.Equal(t, 201, int(resp.GetImmediateResponse().GetStatus().GetCode()), "the duplicate is replayed")
	s.end()
	require.Equal(t, 2.0, h.counter("idempotency_envoy_misconfig_total", "kind", "unclaimed_request"))

	// Under STREAMED Envoy sends the headers upstream before the claim, and an upstream may
	// answer before the body ends: it ran unprotected (passthrough), which no setting explains.
	s = h.open()
	m := requestHeaders(post("/v1/payments", "k5", `{"a":1}`))
	m.GetRequestHeaders().EndOfStream = false
	m.ProtocolConfig.RequestBodyMode = filterextproc.ProcessingMode_STREAMED
	s.send(m)
	require.NoError(t, s.s.Send(requestBody([]byte(`{"a":`))))
	resp = s.send(responseHeaders(created))
	require.NotNil(t, resp.GetRequestBody(), "the withheld chunk's answer comes first")
	s.end()
	h.waitIdle(t)
	require.Equal(t, 2.0, h.counter("idempotency_envoy_misconfig_total", "kind", "unclaimed_request"), "not a misconfiguration")
	require.Equal(t, 3.0, h.counter("idempotency_requests_total", "route", "default", "outcome", "passthrough"), "k1, k2 and k5 ran without a lease")
}

// When Envoy refuses the pass-through mode_override (allow_mode_override off, an
// allowed_override_modes list that does not match), it sends the later phases anyway: the
// processor says so once at warn and counts every request.
func TestRefusedModeOverrideIsDetected(t *testing.T) {
	h := newHarness(t, harnessOptions{})
	for range 2 {
		s := h.open()
		resp := s.send(requestHeaders(request{method: "GET", path: "/v1/payments"}))
		require.NotNil(t, resp.GetModeOverride())
		resp = s.send(responseHeaders(created)) // Envoy ignored the override
		require.NotNil(t, resp.GetResponseHeaders())
		resp = s.send(responseBody(created.body, true))
		require.NotNil(t, resp.GetResponseBody())
		s.end()
	}
	// A response that is not stored gets the no-store override; a body after it is a refusal too.
	s := h.open()
	s.send(requestHeaders(post("/v1/payments", "k", `{}`)))
	s.send(requestBody([]byte(`{}`)))
	resp := s.send(responseHeaders(upstream{status: 500, body: []byte("x")}))
	require.NotNil(t, resp.GetModeOverride())
	require.NotNil(t, s.send(responseBody([]byte("x"), true)).GetResponseBody())
	s.end()
	h.waitIdle(t)
	require.Equal(t, 3.0, h.counter("idempotency_envoy_misconfig_total", "kind", "mode_override_refused"))
	require.Equal(t, 1, strings.Count(h.logs.String(), "Envoy ignored this processor's mode_override"))
	require.Contains(t, h.logs.String(), `"level":"warn"`)
}

// The response body modes: a STREAMED response is captured across its chunks, a BUFFERED_PARTIAL
// one that does not end in its buffer is completed without a body, and a BUFFERED one over
// Envoy's buffer limit (Envoy's own 500, the body never seen) too: the upstream ran in each case,
// so a retry never runs again.
func TestResponseBodyModes(t *testing.T) {
	big := upstream{status: 200, headers: []string{"content-type", "text/plain"}, body: []byte(bigBody(3000))}
	for _, tc := range []struct {
		name     string
		sh       shape
		replayed bool
	}{
		{"streamed", shape{reqMode: modeBuffered, respMode: modeStreamed, respChunks: []int{1000, 1000}}, true},
		{"streamed with trailers", shape{reqMode: modeBuffered, respMode: modeStreamed, respChunks: []int{1000}, trailers: true, trailerSend: true}, true},
		{"full duplex", shape{reqMode: modeBuffered, respMode: modeDuplex, respChunks: []int{1}}, true},
		{"partial, whole", shape{reqMode: modeBuffered, respMode: modePartial}, true},
		{"partial, cut", shape{reqMode: modeBuffered, respMode: modePartial, bufferLimit: 1024}, false},
		{"buffered, over Envoy's limit", shape{reqMode: modeBuffered, respMode: modeBuffered, bufferLimit: 1024}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, harnessOptions{})
			require.True(t, h.run(post("/v1/payments", "k", `{}`), tc.sh, big).ran)
			h.waitIdle(t)
			dup := h.run(post("/v1/payments", "k", `{}`), tc.sh, big)
			require.False(t, dup.ran)
			if tc.replayed {
				require.Equal(t, big.body, dup.body)
				require.Equal(t, []string{"true"}, dup.header(replayed))
				return
			}
			requireProblem(t, dup.result, 409, "response-not-replayable")
		})
	}
}

// The stream ends before any response headers (client gone, upstream reset or timeout): the
// outcome is unknown, and unknown_outcome decides. release frees the key at once and counts it;
// keep leaves the lease to expire; record keeps an outcome-unknown record that refuses duplicates
// with 409 outcome-unknown until its TTL ends.
func TestUnknownOutcomes(t *testing.T) {
	ended := shape{reqMode: modeBuffered, respMode: modeBuffered, end: endBeforeResponse, ranUpstream: true}
	forEachStore(t, func(t *testing.T, newStore func(t *testing.T) testStore) {
		t.Run("release", func(t *testing.T) {
			ts := newStore(t)
			h := newHarness(t, harnessOptions{store: ts.store, advance: ts.advance})
			h.run(post("/v1/payments", "k", `{}`), ended, created)
			h.waitIdle(t)
			require.True(t, h.do(post("/v1/payments", "k", `{}`), created).executed, "at-least-once for an ambiguous outcome")
			require.Equal(t, 1.0, h.counter("idempotency_releases_total", "route", "default", "reason", "unknown_outcome"))
		})
		t.Run("keep", func(t *testing.T) {
			ts := newStore(t)
			h := newHarness(t, harnessOptions{store: ts.store, advance: ts.advance, policy: "defaults: {unknown_outcome: keep, lock_ttl: 3s}"})
			h.run(post("/v1/payments", "k", `{}`), ended, created)
			h.waitIdle(t)
			requireProblem(t, h.do(post("/v1/payments", "k", `{}`), created), 409, "request-in-progress")
			require.Equal(t, 1.0, h.counter("idempotency_unknown_outcomes_total", "route", "default", "action", "keep"))
		})
		t.Run("record", func(t *testing.T) {
			ts := newStore(t)
			h := newHarness(t, harnessOptions{store: ts.store, advance: ts.advance, policy: "defaults: {unknown_outcome: record, ttl: 10s}"})
			h.run(post("/v1/payments", "k", `{}`), ended, created)
			h.waitIdle(t)
			res := h.do(post("/v1/payments", "k", `{}`), created)
			requireProblem(t, res, 409, "outcome-unknown")
			require.Equal(t, 1, h.executions("k"))
			rec := h.record(t, "k")
			require.True(t, rec.Response.OutcomeUnknown)
			require.Zero(t, rec.Response.Status, "no response was seen")
			require.Equal(t, 422, h.do(post("/v1/payments", "k", `{"other":1}`), created).status, "the fingerprint is still checked first")
			h.advance(11 * time.Second)
			require.True(t, h.do(post("/v1/payments", "k", `{}`), created).executed, "until the record's TTL ends")
		})
	})
}
