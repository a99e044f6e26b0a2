package e2e_test

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/envoyconf"
	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
)

// The request body modes (docs/guarantees.md#request-body-modes) through the front proxy: in each, however the proxy cuts the body
// (one message, many pipelined chunks), the first request runs once, a duplicate is replayed byte
// for byte and a changed body is 422. With a real Envoy the shapes are its own.
func TestEveryBodyModeThroughEnvoy(t *testing.T) {
	t.Parallel()
	body := `{"amount":100,"note":"` + strings.Repeat("n", 100<<10) + `"}`
	for _, tc := range []struct {
		name     string
		req, res filterextproc.ProcessingMode_BodySendMode
		shape    proxy.BodyShape
	}{
		{"buffered", filterextproc.ProcessingMode_BUFFERED, filterextproc.ProcessingMode_BUFFERED, proxy.BodyShape{}},
		{"streamed, pipelined chunks", filterextproc.ProcessingMode_STREAMED, filterextproc.ProcessingMode_STREAMED, proxy.BodyShape{DuringHeaders: proxy.Held, Chunks: []int{4096}}},
		{"streamed, whole during the header call", filterextproc.ProcessingMode_STREAMED, filterextproc.ProcessingMode_BUFFERED, proxy.BodyShape{DuringHeaders: proxy.Whole}},
		{"buffered partial", filterextproc.ProcessingMode_BUFFERED_PARTIAL, filterextproc.ProcessingMode_BUFFERED, proxy.BodyShape{}},
		// The body races the header call, as data arrives: in this mode Envoy sends it without
		// waiting for the header answer, which the processor withholds until the claim.
		{"full duplex", filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED, filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED, proxy.BodyShape{Chunks: []int{16 << 10}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			modes := func(b *bootstrapv3.Bootstrap) error {
				return envoyconf.MutateExtProc(b, func(f *filterextproc.ExternalProcessor) {
					f.ProcessingMode.RequestBodyMode, f.ProcessingMode.ResponseBodyMode = tc.req, tc.res
					if tc.req == filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED {
						// Envoy refuses FULL_DUPLEX_STREAMED without trailer mode SEND
						// (config.cc verifyProcessingModeConfig).
						f.ProcessingMode.RequestTrailerMode = filterextproc.ProcessingMode_SEND
						f.ProcessingMode.ResponseTrailerMode = filterextproc.ProcessingMode_SEND
					}
				})
			}
			shape := tc.shape
			s := newStack(t, stackOptions{envoy: modes, shapes: func(*http.Request) proxy.Shapes {
				return proxy.Shapes{Request: shape, Response: proxy.BodyShape{Chunks: []int{512}}}
			}})
			h := map[string]string{"X-Test-Body-Bytes": "3000"}
			first := s.do(call{key: "mode-1", body: body, headers: h})
			require.Equal(t, http.StatusOK, first.status)
			require.Equal(t, "false", first.header.Get(replayed))
			second := s.do(call{key: "mode-1", body: body, headers: h})
			require.Equal(t, http.StatusOK, second.status)
			require.Equal(t, "true", second.header.Get(replayed))
			require.True(t, bytes.Equal(first.body, second.body), "replayed byte for byte")
			require.Equal(t, 1, s.up.Ran("mode-1"), "the duplicate never ran upstream")
			if tc.req != filterextproc.ProcessingMode_STREAMED {
				// In STREAMED mode Envoy sends the headers upstream before the body's claim (see
				// TestStreamedDuplicatesRunOnce); in the other modes nothing of a duplicate goes.
				require.Equal(t, 1, s.up.Count("mode-1"), "the duplicate never reached the upstream")
			}
			requireProblem(t, s.do(call{key: "mode-1", body: body + " ", headers: h}), 422, "idempotency-key-reused")
			// An uncovered request with a body passes in every mode.
			plain := s.do(call{body: body, headers: h})
			require.Equal(t, http.StatusOK, plain.status)
			require.Empty(t, plain.header.Get(replayed))
		})
	}
}

// Concurrent duplicates in STREAMED mode, whose chunks Envoy pipelines: exactly one runs. Envoy
// sends a STREAMED request's headers upstream as soon as they are answered, before its body
// (ext_proc.cc: the header answer continues the filter chain; only the chunks wait for theirs),
// so the duplicates' requests reach the upstream and are reset when the processor answers 409
// at the body's end: none of them ever gets its body.
func TestStreamedDuplicatesRunOnce(t *testing.T) {
	t.Parallel()
	modes := func(b *bootstrapv3.Bootstrap) error {
		return envoyconf.MutateExtProc(b, func(f *filterextproc.ExternalProcessor) {
			f.ProcessingMode.RequestBodyMode = filterextproc.ProcessingMode_STREAMED
		})
	}
	s := newStack(t, stackOptions{envoy: modes, shapes: func(*http.Request) proxy.Shapes {
		return proxy.Shapes{Request: proxy.BodyShape{DuringHeaders: proxy.Held, Chunks: []int{1024}}}
	}})
	body := strings.Repeat("b", 20<<10)
	statuses := s.burst(16, func(int) call {
		return call{key: "race-streamed", body: body, headers: map[string]string{"X-Test-Delay": "200ms"}}
	})
	ok := 0
	for _, st := range statuses {
		require.Contains(t, []int{http.StatusOK, http.StatusConflict}, st)
		if st == http.StatusOK {
			ok++
		}
	}
	require.GreaterOrEqual(t, ok, 1)
	require.Equal(t, 1, s.up.Ran("race-streamed"), "one request got its body and ran")
	t.Logf("%d requests reached the upstream with their headers; %d got their body", s.up.Count("race-streamed"), s.up.Ran("race-streamed"))
}

// The outcome reaches Envoy's access log (docs/operating.md): %DYNAMIC_METADATA(idempotency:outcome)% and
// the rest, on every request the processor settles.
func TestOutcomeInTheAccessLog(t *testing.T) {
	t.Parallel()
	if envoyBin != "" {
		t.Log("a real Envoy writes the outcome to its own access log; this reads the emulator's")
	}
	var mu sync.Mutex
	var records []proxy.Record
	s := newStack(t, stackOptions{accessLog: func(r proxy.Record) {
		mu.Lock()
		defer mu.Unlock()
		records = append(records, r)
	}})
	s.do(call{key: "logged", body: `{}`})
	s.do(call{key: "logged", body: `{}`})
	s.do(call{key: "logged", body: `{"x":1}`})
	s.do(call{method: "GET"})
	if s.proxy == nil {
		return
	}
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(records) == 4 }, 5*time.Second, 10*time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	var outcomes, hashes []string
	for _, r := range records {
		outcomes = append(outcomes, r.DynamicMetadataValue("idempotency", "outcome"))
		hashes = append(hashes, r.DynamicMetadataValue("idempotency", "key_hash"))
	}
	require.Equal(t, []string{string(extproc.Executed), string(extproc.Replayed), string(extproc.Mismatch), string(extproc.Passthrough)}, outcomes)
	require.Len(t, hashes[0], 64)
	require.Equal(t, hashes[0], hashes[1], "one record")
	require.Equal(t, "true", records[1].DynamicMetadataValue("idempotency", "replayed"))
	require.Equal(t, "default", records[0].DynamicMetadataValue("idempotency", "route"))
}

// A route scoped by the JWT subject: jwt_authn verifies the token before ext_proc and
// forwards its payload; the policy's transfers route is chosen by Envoy's route name and scopes
// keys by the verified subject, so two users never share a record and a forged header cannot
// stand for a subject.
func TestJWTScopedRouteThroughEnvoy(t *testing.T) {
	t.Parallel()
	s := newStack(t, stackOptions{policy: string(readRepoFile(t, "envoy/policy.yaml"))})
	bearer := func(tok string) map[string]string { return map[string]string{"Authorization": "Bearer " + tok} }
	first := s.do(call{path: "/v1/transfers", key: "t-1", body: `{"to":"x"}`, headers: bearer(envoyconf.DemoTokenDemoUser)})
	require.Equal(t, http.StatusOK, first.status)
	require.Equal(t, "false", first.header.Get(replayed))
	other := s.do(call{path: "/v1/transfers", key: "t-1", body: `{"to":"x"}`, headers: bearer(envoyconf.DemoTokenOtherUser)})
	require.Equal(t, "false", other.header.Get(replayed), "another subject: another record, although the key is equal")
	again := s.do(call{path: "/v1/transfers", key: "t-1", body: `{"to":"x"}`, headers: bearer(envoyconf.DemoTokenDemoUser)})
	require.Equal(t, "true", again.header.Get(replayed))
	require.Equal(t, 2, s.up.Count("t-1"))
	// No token: jwt_authn answers 401 before the processor is asked.
	require.Equal(t, http.StatusUnauthorized, s.do(call{path: "/v1/transfers", key: "t-1", body: `{"to":"x"}`}).status)
	require.Equal(t, 2, s.up.Count("t-1"))
}

// A route named by the Envoy route's gRPC initial metadata (x-idempotency-route) takes that
// policy route whatever its match says; a name the policy lacks is 500 unknown-idempotency-route.
func TestRouteNamedByEnvoyThroughEnvoy(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	routes := map[string]string{}
	named := `
routes:
  - {name: refunds, match: {path_exact: /never-by-path}, ttl: 1h, missing_key: required}
`
	s := newStack(t, stackOptions{policy: named, accessLog: func(r proxy.Record) {
		mu.Lock()
		defer mu.Unlock()
		routes[r.Path] = r.DynamicMetadataValue("idempotency", "route")
	}})
	requireProblem(t, s.do(call{path: "/v1/refunds"}), 400, "missing-idempotency-key")
	require.Equal(t, http.StatusOK, s.do(call{path: "/v1/refunds", key: "r-1", body: `{}`}).status)
	require.Equal(t, http.StatusOK, s.do(call{path: "/v1/payments", body: `{}`}).status, "the defaults elsewhere: no key needed")
	if s.proxy != nil {
		require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return routes["/v1/payments"] != "" }, 5*time.Second, 10*time.Millisecond)
		mu.Lock()
		require.Equal(t, "refunds", routes["/v1/refunds"])
		require.Equal(t, "default", routes["/v1/payments"])
		mu.Unlock()
	}
	unknown := newStack(t, stackOptions{policy: "routes: [{name: other, match: {path_prefix: /x}}]\n"})
	requireProblem(t, unknown.do(call{path: "/v1/refunds", key: "r-1", body: `{}`}), 500, "unknown-idempotency-route")
}

func readRepoFile(t *testing.T, rel string) []byte {
	t.Helper()
	b, err := os.ReadFile(repoFile(t, rel))
	require.NoError(t, err)
	return b
}

// A request that carries trailers and no data gets no body message from Envoy (ext_proc.cc
// Filter::onTrailers: nothing is buffered, so no body is sent; the trailers go only under
// request_trailer_mode SEND). The shipped SEND has the key claimed at the trailers: a duplicate
// is replayed. Under SKIP the request reaches the upstream before any claim, so a duplicate
// runs again, and the processor counts what it saw (unclaimed_request): the reason CheckSpec
// refuses SKIP.
func TestRequestTrailersWithoutBody(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		mode    filterextproc.ProcessingMode_HeaderSendMode
		runs    int
		counted bool
	}{
		{filterextproc.ProcessingMode_SEND, 1, false},
		{filterextproc.ProcessingMode_SKIP, 2, true},
	} {
		t.Run(tc.mode.String(), func(t *testing.T) {
			t.Parallel()
			s := newStack(t, stackOptions{envoy: withTrailers(func(f *filterextproc.ExternalProcessor) {
				f.ProcessingMode.RequestTrailerMode = tc.mode
			})})
			first := trailersOnly(t, s.url, "trailers-only")
			require.Equal(t, http.StatusOK, first.StatusCode)
			require.Equal(t, "false", first.Header.Get(replayed))
			second := trailersOnly(t, s.url, "trailers-only")
			require.Equal(t, http.StatusOK, second.StatusCode)
			require.Equal(t, tc.runs, s.up.Count("trailers-only"))
			if tc.runs == 1 {
				require.Equal(t, "true", second.Header.Get(replayed), "claimed at the trailers, so replayed")
			}
			_, m := s.procs[0].admin("/metrics")
			got := metric(m, `idempotency_envoy_misconfig_total{kind="unclaimed_request"}`)
			if tc.counted {
				require.Positive(t, got, "the unclaimed run is counted")
			} else {
				require.Zero(t, got)
			}
		})
	}
}

// A STREAMED request body followed by trailers is never claimed: Envoy holds the trailers while
// a chunk's answer is outstanding (Filter::onTrailers: a callback other than Idle pauses them) and
// the processor answers the chunks only at the claim, which waits for the end. Envoy's
// message_timeout ends it with 504 and the upstream never gets the body (a known limit:
// docs/guarantees.md#request-body-modes). BUFFERED claims the same request at its trailers.
func TestStreamedBodyWithTrailersStalls(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		mode   filterextproc.ProcessingMode_BodySendMode
		status int
		ran    int
	}{
		{filterextproc.ProcessingMode_STREAMED, http.StatusGatewayTimeout, 0},
		{filterextproc.ProcessingMode_BUFFERED, http.StatusOK, 1},
	} {
		t.Run(tc.mode.String(), func(t *testing.T) {
			t.Parallel()
			s := newStack(t, stackOptions{envoy: withTrailers(func(f *filterextproc.ExternalProcessor) {
				f.ProcessingMode.RequestBodyMode = tc.mode
				if tc.mode == filterextproc.ProcessingMode_STREAMED {
					// The stall ends at the message timeout: soon. BUFFERED keeps the
					// harness's, which a message on a loaded machine never meets.
					f.MessageTimeout = durationpb.New(500 * time.Millisecond)
				}
			})})
			r := chunkedWithTrailer(t, s.url, "streamed-trailers", `{"amount":1}`, 0)
			require.Equal(t, tc.status, r.StatusCode)
			require.Equal(t, tc.ran, s.up.Ran("streamed-trailers"))
		})
	}
}

// trailersOnly sends a chunked POST with no data and one trailer, which net/http's client
// cannot produce (it sends an empty body without chunking). The trailers follow the headers
// after a pause, so that they reach Envoy after the processor answered the headers: had they come
// during the header call, Envoy 1.37 would hold the request forever
// (ProcessorState::handleCompleteBodyAvailable sends nothing without data), in either trailer
// mode.
func trailersOnly(t *testing.T, url, key string) *http.Response {
	return chunkedWithTrailer(t, url, key, "", 300*time.Millisecond)
}

// chunkedWithTrailer sends a chunked POST of body (no chunk when empty) and one trailer, the
// body and trailer pause after the headers.
func chunkedWithTrailer(t *testing.T, url, key, body string, pause time.Duration) *http.Response {
	t.Helper()
	chunk := ""
	if body != "" {
		chunk = strconv.FormatInt(int64(len(body)), 16) + "\r\n" + body + "\r\n"
	}
	conn, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	// A request Envoy held forever would otherwise hang the run.
	require.NoError(t, conn.SetDeadline(time.Now().Add(20*time.Second)))
	_, err = io.WriteString(conn, "POST /v1/payments HTTP/1.1\r\nHost: api\r\nIdempotency-Key: "+key+
		"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum\r\nConnection: close\r\n\r\n")
	require.NoError(t, err)
	time.Sleep(pause)
	_, err = io.WriteString(conn, chunk+"0\r\nX-Checksum: abc\r\n\r\n")
	require.NoError(t, err)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	require.NoError(t, err)
	_, err = io.ReadAll(resp.Body)
	require.NoError(t, err)
	resp.Body.Close()
	return resp
}

// withTrailers is a stackOptions.envoy that turns on HTTP/1 trailers (Envoy drops them unless
// enabled: the client and the upstream speak HTTP/1) and then changes the ext_proc filter.
func withTrailers(fn func(*filterextproc.ExternalProcessor)) func(*bootstrapv3.Bootstrap) error {
	return func(b *bootstrapv3.Bootstrap) error {
		if err := envoyconf.EnableHTTP1Trailers(b); err != nil {
			return err
		}
		return envoyconf.MutateExtProc(b, fn)
	}
}
