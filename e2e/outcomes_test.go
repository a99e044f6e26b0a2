package e2e_test

import (
	"bytes"
	"context"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/envoyconf"
	"github.com/idempotency-extproc/idempotency-extproc/e2e/upstream"
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// storeArgs are the processor flags of each store the outcome tests run against.
func storeArgs(t *testing.T) map[string]func(t *testing.T) []string {
	return map[string]func(t *testing.T) []string{
		"memory": func(*testing.T) []string { return nil },
		"redis": func(t *testing.T) []string {
			srv := redistest.Start(t, redistest.Options{})
			return redisArgs(srv)
		},
	}
}

const replayed = "X-Idempotency-Replayed"

// TestOutcomeTableOverHTTP checks every row of the outcome table (docs/outcomes.md) through HTTP: the status,
// body bytes, headers, and how often the upstream ran.
func TestOutcomeTableOverHTTP(t *testing.T) {
	t.Parallel()
	for name, args := range storeArgs(t) {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			// store_timeout 5s: a store call slower than the default 100 ms on a busy machine
			// would turn a row's outcome into store-unavailable.
			s := newStack(t, stackOptions{args: args(t), policy: `
store_timeout: 5s
defaults: {max_response_bytes: 65536}
routes:
  - {name: strict, match: {path_prefix: /v1/strict}, missing_key: required}
  - {name: hashed, match: {path_prefix: /v1/hashed}, missing_key: body-hash}
`})
			up := s.up

			t.Run("not covered", func(t *testing.T) {
				for range 2 {
					r := s.do(call{method: "GET", path: "/v1/payments", key: "get-1"})
					require.Equal(t, 200, r.status)
					require.Empty(t, r.header.Get(replayed), "untouched")
				}
				require.Equal(t, 2, up.Count("get-1"))
			})
			t.Run("key missing, optional", func(t *testing.T) {
				before := up.Count("")
				for range 2 {
					r := s.do(call{body: `{"n":1}`})
					require.Equal(t, 200, r.status)
					require.Empty(t, r.header.Get(replayed))
				}
				require.Equal(t, before+2, up.Count(""))
			})
			t.Run("key missing, required", func(t *testing.T) {
				before := up.Total()
				r := s.do(call{path: "/v1/strict", body: `{}`})
				requireProblem(t, r, 400, "missing-idempotency-key")
				require.Equal(t, "false", r.header.Get(replayed))
				require.Equal(t, before, up.Total())
			})
			t.Run("key missing, body-hash", func(t *testing.T) {
				before := up.Count("")
				first := s.do(call{path: "/v1/hashed", body: `{"amount":7}`})
				second := s.do(call{path: "/v1/hashed", body: `{"amount":7}`})
				require.Equal(t, "false", first.header.Get(replayed))
				require.Equal(t, "true", second.header.Get(replayed))
				require.Equal(t, first.body, second.body)
				s.do(call{path: "/v1/hashed", body: `{"amount":8}`})
				require.Equal(t, before+2, up.Count(""))
			})
			t.Run("key invalid", func(t *testing.T) {
				r := s.do(call{key: strings.Repeat("k", 256), body: `{}`})
				requireProblem(t, r, 400, "invalid-idempotency-key")
				r = s.do(call{key: "a", headers: map[string]string{"X-Idempotency-Key": "b"}, body: `{}`})
				requireProblem(t, r, 400, "invalid-idempotency-key")
				r = s.do(call{key: "ttl-key", headers: map[string]string{"X-TTL": "soon"}, body: `{}`})
				requireProblem(t, r, 400, "invalid-ttl")
				require.Equal(t, 0, up.Count("ttl-key"))
			})
			t.Run("new key, then replayed byte for byte", func(t *testing.T) {
				h := map[string]string{"X-Test-Status": "201", "X-Test-Body-Bytes": "20000", "X-Test-Cookies": "3"}
				first := s.do(call{key: "new-1", headers: h, body: `{"a":1}`})
				require.Equal(t, 201, first.status)
				require.Equal(t, "false", first.header.Get(replayed))
				require.Equal(t, upstream.Body(20000), first.body)
				second := s.do(call{key: "new-1", headers: h, body: `{"a":1}`})
				require.Equal(t, 201, second.status)
				require.Equal(t, "true", second.header.Get(replayed))
				require.Equal(t, first.body, second.body)
				require.Equal(t, []string{"c1=v1", "c2=v2", "c3=v3"}, second.header.Values("Set-Cookie"))
				require.Equal(t, first.header.Get("Content-Type"), second.header.Get("Content-Type"))
				require.Equal(t, "20000", second.header.Get("Content-Length"))
				require.Empty(t, second.header.Get("X-Envoy-Upstream-Service-Time"), "x-envoy-* is not replayed")
				require.Equal(t, 1, up.Count("new-1"))
			})
			t.Run("same key while the first is in flight", func(t *testing.T) {
				done := make(chan reply)
				go func() {
					r, _ := s.try(call{key: "slow-1", headers: map[string]string{"X-Test-Delay": "5s"}, body: `{}`})
					done <- r
				}()
				require.Eventually(t, func() bool { return up.Count("slow-1") == 1 }, 5*time.Second, 5*time.Millisecond)
				r := s.do(call{key: "slow-1", body: `{}`})
				requireProblem(t, r, 409, "request-in-progress")
				require.Equal(t, "1", r.header.Get("Retry-After"))
				require.Equal(t, "false", r.header.Get(replayed))
				first := <-done
				require.Equal(t, 200, first.status)
				require.Equal(t, "true", s.do(call{key: "slow-1", body: `{}`}).header.Get(replayed))
				require.Equal(t, 1, up.Count("slow-1"))
			})
			t.Run("same key, different payload", func(t *testing.T) {
				s.do(call{key: "fp-1", body: `{"a":1}`})
				requireProblem(t, s.do(call{key: "fp-1", body: `{"a":2}`}), 422, "idempotency-key-reused")
				requireProblem(t, s.do(call{key: "fp-1", path: "/v1/payments?x=1", body: `{"a":1}`}), 422, "idempotency-key-reused")
				require.Equal(t, 1, up.Count("fp-1"))
			})
			t.Run("status not stored", func(t *testing.T) {
				h := map[string]string{"X-Test-Status": "503"}
				r := s.do(call{key: "fail-1", headers: h, body: `{}`})
				require.Equal(t, 503, r.status)
				require.Equal(t, "false", r.header.Get(replayed))
				r = s.do(call{key: "fail-1", body: `{}`})
				require.Equal(t, 200, r.status, "the retry runs again")
				require.Equal(t, 2, up.Count("fail-1"))
			})
			t.Run("response too large to keep", func(t *testing.T) {
				h := map[string]string{"X-Test-Body-Bytes": "70000"}
				r := s.do(call{key: "big-1", headers: h, body: `{}`})
				require.Equal(t, 200, r.status)
				require.Equal(t, upstream.Body(70000), r.body)
				require.Equal(t, "false", r.header.Get(replayed))
				r = s.do(call{key: "big-1", headers: h, body: `{}`})
				requireProblem(t, r, 409, "response-not-replayable")
				require.Empty(t, r.header.Get("Retry-After"))
				require.Equal(t, 1, up.Count("big-1"))
			})
			t.Run("client gone before the response", func(t *testing.T) {
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				req, err := http.NewRequestWithContext(ctx, "POST", s.url+"/v1/payments", strings.NewReader(`{}`))
				require.NoError(t, err)
				req.Header.Set("Idempotency-Key", "gone-1")
				req.Header.Set("X-Test-Delay", "3s")
				done := make(chan error, 1)
				go func() {
					resp, err := s.client.Do(req)
					if err == nil {
						resp.Body.Close()
					}
					done <- err
				}()
				// The client leaves once the upstream has the request, however long the claim took.
				require.Eventually(t, func() bool { return up.Count("gone-1") == 1 }, 5*time.Second, 5*time.Millisecond)
				cancel()
				require.Error(t, <-done)
				require.Eventually(t, func() bool {
					return s.do(call{key: "gone-1", body: `{}`}).status == 200
				}, 5*time.Second, 50*time.Millisecond, "the key is released: a retry runs")
				require.Equal(t, 2, up.Count("gone-1"))
			})
			t.Run("health route skips the processor", func(t *testing.T) {
				r := s.do(call{path: "/healthz", key: "h-1", body: `{}`})
				require.Equal(t, 200, r.status)
				require.Empty(t, r.header.Get(replayed))
				s.do(call{path: "/healthz", key: "h-1", body: `{}`})
				require.Equal(t, 2, up.Count("h-1"))
			})
		})
	}
}

// withRouteTimeout shortens the "/" route's timeout in envoy.yaml.
func withRouteTimeout(d time.Duration) func(b *bootstrapv3.Bootstrap) error {
	return func(b *bootstrapv3.Bootstrap) error {
		return envoyconf.MutateHCM(b, func(hcm *hcmv3.HttpConnectionManager) error {
			for _, vh := range hcm.GetRouteConfig().GetVirtualHosts() {
				for _, r := range vh.GetRoutes() {
					if r.GetMatch().GetPrefix() == "/" {
						r.GetRoute().Timeout = durationpb.New(d)
					}
				}
			}
			return nil
		})
	}
}

func TestEnvoyMadeResponsesRelease(t *testing.T) {
	t.Parallel()
	for _, local := range []bool{false, true} {
		name := "stream ends"
		if local {
			name = "local reply sent to the processor"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			t.Run("upstream timeout 504", func(t *testing.T) {
				s := newStack(t, stackOptions{envoy: withRouteTimeout(time.Second), localReplies: local})
				r := s.do(call{key: "to-1", headers: map[string]string{"X-Test-Delay": "3s"}, body: `{}`})
				require.Equal(t, 504, r.status)
				// Without local replies the processor learns of the 504 only when Envoy ends the
				// stream, which may be just after the client has it: until the release, a retry
				// meets the lease (409).
				require.Eventually(t, func() bool {
					r = s.do(call{key: "to-1", body: `{}`})
					return r.status != 409
				}, 5*time.Second, 20*time.Millisecond)
				require.Equal(t, 200, r.status, "Envoy's 504 is not the outcome: the retry runs")
				require.Equal(t, "false", r.header.Get(replayed))
				require.Equal(t, 2, s.up.Count("to-1"))
			})
			t.Run("connection refused 503", func(t *testing.T) {
				s := newStack(t, stackOptions{upstream: "http://127.0.0.1:1", localReplies: local})
				for range 2 {
					r := s.do(call{key: "refused-1", body: `{}`})
					require.Equal(t, 503, r.status, "each attempt reaches the (absent) upstream: nothing was stored")
				}
			})
		})
	}
}

func TestStreamedResponseReplayedByteForByte(t *testing.T) {
	t.Parallel()
	streamed := func(b *bootstrapv3.Bootstrap) error {
		return envoyconf.MutateExtProc(b, func(f *filterextproc.ExternalProcessor) {
			f.ProcessingMode.ResponseBodyMode = filterextproc.ProcessingMode_STREAMED
		})
	}
	const size = 3 << 20
	s := newStack(t, stackOptions{envoy: streamed, policy: "defaults: {max_response_bytes: 4194304}"})
	h := map[string]string{"X-Test-Body-Bytes": itoa(size), "X-Test-Chunked": "true", "X-Test-Chunk-Size": "65536"}
	first := s.do(call{key: "stream-1", headers: h, body: `{}`})
	require.Equal(t, 200, first.status)
	require.True(t, bytes.Equal(upstream.Body(size), first.body), "the first response streams through intact")
	second := s.do(call{key: "stream-1", headers: h, body: `{}`})
	require.Equal(t, "true", second.header.Get(replayed))
	require.True(t, bytes.Equal(first.body, second.body), "replayed byte for byte")
	require.Equal(t, itoa(size), second.header.Get("Content-Length"))
	require.Equal(t, 1, s.up.Count("stream-1"))
}

// A STREAMED response whose upstream sends trailers ends only with its trailers: with
// response_trailer_mode SEND it is stored and replayed; with SKIP the processor never sees it
// end, so the record is completed without its body: the upstream ran, and a retry gets 409
// response-not-replayable instead of running again.
func TestStreamedResponseWithTrailers(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		mode   filterextproc.ProcessingMode_HeaderSendMode
		stored bool
	}{
		{filterextproc.ProcessingMode_SEND, true},
		{filterextproc.ProcessingMode_SKIP, false},
	} {
		t.Run(tc.mode.String(), func(t *testing.T) {
			t.Parallel()
			streamed := withTrailers(func(f *filterextproc.ExternalProcessor) {
				f.ProcessingMode.ResponseBodyMode = filterextproc.ProcessingMode_STREAMED
				f.ProcessingMode.ResponseTrailerMode = tc.mode
			})
			s := newStack(t, stackOptions{envoy: streamed})
			h := map[string]string{"X-Test-Body-Bytes": "4096", "X-Test-Chunked": "true", "X-Test-Trailer-Grpc-Status": "0"}
			first := s.do(call{key: "trailed", headers: h, body: `{}`})
			require.Equal(t, 200, first.status)
			require.True(t, bytes.Equal(upstream.Body(4096), first.body))
			if !tc.stored {
				require.Eventually(t, func() bool {
					return s.do(call{key: "trailed", headers: h, body: `{}`}).problemCode() == "response-not-replayable"
				}, 5*time.Second, 50*time.Millisecond, "completed without its body once the stream ends")
				require.Equal(t, 1, s.up.Count("trailed"), "the retry never runs")
				return
			}
			second := s.do(call{key: "trailed", headers: h, body: `{}`})
			require.Equal(t, "true", second.header.Get(replayed))
			require.True(t, bytes.Equal(first.body, second.body))
			require.Equal(t, 1, s.up.Count("trailed"))
		})
	}
}

func TestBufferedResponseOverEnvoyLimitCompletesWithoutBody(t *testing.T) {
	t.Parallel()
	// Envoy answers 500 for a BUFFERED response over its limit and never sends the body
	// (response_payload_too_large: ActiveStreamEncoderFilter::responseDataTooLarge in
	// source/common/http/filter_manager.cc): the upstream ran all the same, so the record is
	// completed without its body and a retry gets 409 response-not-replayable instead of
	// running again.
	s := newStack(t, stackOptions{})
	h := map[string]string{"X-Test-Body-Bytes": itoa(2 << 20)}
	r := s.do(call{key: "over-1", headers: h, body: `{}`})
	require.Equal(t, 500, r.status)
	require.Eventually(t, func() bool {
		return s.do(call{key: "over-1", body: `{}`}).problemCode() == "response-not-replayable"
	}, 5*time.Second, 50*time.Millisecond)
	require.Equal(t, 1, s.up.Count("over-1"))
}

func itoa(n int) string { return strconv.Itoa(n) }
