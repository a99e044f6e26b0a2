package extproc

import (
	"bytes"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
)

// The gRPC pieces of the decision, table-tested on plain values.

// frame is one gRPC message: flags 0, a 4-byte length, the payload.
func frame(payload string) []byte {
	n := len(payload)
	return append([]byte{0, byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}, payload...)
}

func TestGRPCMessages(t *testing.T) {
	two := append(frame("a"), frame("bc")...)
	cases := []struct {
		name  string
		body  []byte
		n     int
		whole bool
	}{
		{"no body", nil, 0, true},
		{"one message", frame("charge"), 1, true},
		{"an empty message", frame(""), 1, true},
		{"two messages", two, 2, true},
		{"a compressed message", append([]byte{1}, frame("x")[1:]...), 1, true},
		{"a prefix cut short", frame("abc")[:3], 1, false},
		{"a payload cut short", frame("abc")[:7], 1, false},
		{"a second message cut short", two[:len(two)-1], 2, false},
		{"a length past the body", []byte{0, 0xff, 0xff, 0xff, 0xff, 'x'}, 1, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			n, whole := grpcMessages(c.body)
			require.Equal(t, c.n, n)
			require.Equal(t, c.whole, whole)
		})
	}
}

func TestGRPCStatusOf(t *testing.T) {
	cases := []struct {
		name  string
		h     headers
		code  int
		known bool
	}{
		{"OK", info("", "grpc-status", "0").headers, 0, true},
		{"UNAVAILABLE", info("", "content-type", "application/grpc", "grpc-status", "14").headers, 14, true},
		{"none", info("", "content-type", "application/grpc").headers, 0, false},
		{"not a number", info("", "grpc-status", "OK").headers, 0, false},
		{"negative", info("", "grpc-status", "-1").headers, 0, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			code, known := grpcStatusOf(c.h)
			require.Equal(t, c.known, known)
			require.Equal(t, c.code, code)
		})
	}
}

// Every problem answers a gRPC call with the status the contract gives it, and none with OK
// (grpc-go's ext_proc client panics on an ImmediateResponse with grpc_status 0).
func TestGRPCProblemAnswers(t *testing.T) {
	want := map[*problem]codes.Code{
		problemInProgress:          codes.Aborted,
		problemReused:              codes.FailedPrecondition,
		problemMissingKey:          codes.InvalidArgument,
		problemInvalidKey:          codes.InvalidArgument,
		problemGRPCNotUnary:        codes.InvalidArgument,
		problemStoreUnavailable:    codes.Unavailable,
		problemDurabilityUnmet:     codes.Unavailable,
		problemScopeMissing:        codes.Unauthenticated,
		problemNotReplayable:       codes.AlreadyExists,
		problemOutcomeUnknown:      codes.FailedPrecondition,
		problemTooLarge:            codes.ResourceExhausted,
		problemUnknownRoute:        codes.Internal,
		problemBodyNotAvailable:    codes.Internal,
		problemScopeClaimAmbiguous: codes.InvalidArgument,
	}
	r := compiled(t, routeOf(t, ""))
	for _, p := range problems {
		t.Run(p.code, func(t *testing.T) {
			ir := r.grpcProblems[p].GetImmediateResponse()
			require.NotNil(t, ir)
			require.NotZero(t, ir.GetGrpcStatus().GetStatus(), "never OK")
			if c, ok := want[p]; ok {
				require.Equal(t, uint32(c), ir.GetGrpcStatus().GetStatus())
			}
			require.Equal(t, p.code, string(ir.GetBody()), "the code becomes grpc-message")
			for _, h := range ir.GetHeaders().GetSetHeaders() {
				require.NotEqual(t, headerCT, h.GetHeader().GetKey(), "Envoy writes application/grpc itself")
			}
			require.Equal(t, "idempotency_"+p.code, ir.GetDetails())
		})
	}
}

func TestCanStreamReplay(t *testing.T) {
	cases := []struct {
		mode        filterextproc.ProcessingMode_BodySendMode
		headersOwed bool
		want        bool
	}{
		{filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED, true, true},
		{filterextproc.ProcessingMode_NONE, true, true},
		{filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED, false, false},
		{filterextproc.ProcessingMode_BUFFERED, true, false},
		{filterextproc.ProcessingMode_BUFFERED_PARTIAL, true, false},
		{filterextproc.ProcessingMode_STREAMED, true, false},
	}
	for _, c := range cases {
		t.Run(c.mode.String(), func(t *testing.T) {
			require.Equal(t, c.want, canStreamReplay(c.mode, c.headersOwed))
		})
	}
}

func TestGRPCAdmit(t *testing.T) {
	fds, buffered := filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED, filterextproc.ProcessingMode_BUFFERED
	call := admission{covered: true, grpc: true, key: "k", needsBody: true}
	require.Equal(t, call, grpcAdmit(call, fds), "FULL_DUPLEX_STREAMED: claimed once the message came")
	atHeaders := call
	atHeaders.needsBody = false
	require.Equal(t, atHeaders, grpcAdmit(call, buffered), "other modes: claimed at the headers")
	hashed := admission{covered: true, grpc: true, needsBody: true}
	require.Equal(t, problemBodyNotAvailable, grpcAdmit(hashed, buffered).problem, "no body hash without the body")
	require.Equal(t, hashed, grpcAdmit(hashed, fds))
	plain := admission{covered: true, key: "k", needsBody: true}
	require.Equal(t, plain, grpcAdmit(plain, buffered), "HTTP requests are untouched")
}

func grpcRecord(body []byte, trailers ...cache.Header) *cache.Record {
	return &cache.Record{
		State: cache.Completed,
		Response: cache.Response{Status: 200, Headers: []cache.Header{{Name: "content-type", Value: []byte("application/grpc")}},
			Body: body, Trailers: trailers},
		CreatedAt: time.Unix(1_700_000_000, 0), ExpiresAt: time.Unix(1_700_086_400, 0),
	}
}

func headerMap(m *corev3.HeaderMap) map[string]string {
	out := map[string]string{}
	for _, h := range m.GetHeaders() {
		out[h.GetKey()] = string(h.GetRawValue())
	}
	return out
}

func TestStreamedReplay(t *testing.T) {
	r := routeOf(t, "")
	t.Run("headers, message, trailers", func(t *testing.T) {
		msg := frame("tx_1")
		parts := streamedReplay(grpcRecord(msg, cache.Header{Name: "grpc-status", Value: []byte("0")}), r, "")
		require.Len(t, parts, 3)
		h := parts[0].GetStreamedImmediateResponse().GetHeadersResponse()
		require.NotNil(t, h)
		require.False(t, h.GetEndOfStream())
		got := headerMap(h.GetHeaders())
		require.Equal(t, "200", got[":status"])
		require.Equal(t, "application/grpc", got["content-type"])
		require.Equal(t, "true", got[r.ReplayHeader])
		require.Equal(t, "Tue, 14 Nov 2023 22:13:20 GMT", got[r.FirstSentHeader])
		b := parts[1].GetStreamedImmediateResponse().GetBodyResponse()
		require.Equal(t, msg, b.GetBody())
		require.False(t, b.GetEndOfStream(), "the trailers end it")
		tr := parts[2].GetStreamedImmediateResponse().GetTrailersResponse()
		require.Equal(t, map[string]string{"grpc-status": "0"}, headerMap(tr))
	})
	t.Run("trailers-only", func(t *testing.T) {
		rec := grpcRecord(nil)
		rec.Response.Headers = append(rec.Response.Headers, cache.Header{Name: "grpc-status", Value: []byte("0")})
		parts := streamedReplay(rec, r, "wait=1")
		require.Len(t, parts, 1)
		h := parts[0].GetStreamedImmediateResponse().GetHeadersResponse()
		require.True(t, h.GetEndOfStream())
		require.Equal(t, "wait=1", headerMap(h.GetHeaders())[headerPreferenceApplied])
	})
	t.Run("a large message in chunks", func(t *testing.T) {
		msg := frame(string(bytes.Repeat([]byte{'x'}, 2*maxStreamedChunk)))
		parts := streamedReplay(grpcRecord(msg, cache.Header{Name: "grpc-status", Value: []byte("0")}), r, "")
		require.Len(t, parts, 1+3+1)
		var got []byte
		for _, p := range parts[1:4] {
			b := p.GetStreamedImmediateResponse().GetBodyResponse()
			require.LessOrEqual(t, len(b.GetBody()), maxStreamedChunk)
			got = append(got, b.GetBody()...)
		}
		require.Equal(t, msg, got)
	})
}

func TestGRPCReplayRefused(t *testing.T) {
	r := routeOf(t, "")
	rec := grpcRecord(frame("x"), cache.Header{Name: "grpc-status", Value: []byte("5")})
	ir := grpcReplayRefused(rec, r).GetImmediateResponse()
	require.Equal(t, uint32(codes.AlreadyExists), ir.GetGrpcStatus().GetStatus())
	require.Equal(t, "response-not-replayable", string(ir.GetBody()))
	got := map[string]string{}
	for _, h := range ir.GetHeaders().GetSetHeaders() {
		got[h.GetHeader().GetKey()] = string(h.GetHeader().GetRawValue())
	}
	require.Equal(t, "5", got[headerOriginalGRPCStatus])
	require.Contains(t, ir.GetDetails(), "original_grpc_status_5", "grpc-go's ext_proc client keeps only status and details")
}

func TestJudgeGRPCResponse(t *testing.T) {
	r := routeOf(t, "defaults: {store_grpc_statuses: [OK, NOT_FOUND]}")
	upstream := origin{detailsKnown: true, attempts: 1, attemptsKnown: true}
	envoy := origin{detailsKnown: true, envoyMade: true, attempts: 1, attemptsKnown: true}
	neverSent := origin{detailsKnown: true, envoyMade: true, attempts: 0, attemptsKnown: true}
	cases := []struct {
		name   string
		resp   response
		code   int
		known  bool
		settle settlement
		reason string
	}{
		{"a message follows: decided at the trailers", response{status: 200, origin: upstream}, 0, false, settleCapture, ""},
		{"trailers-only OK", response{status: 200, origin: upstream, endOfStream: true}, 0, true, settleRecord, ""},
		{"trailers-only NOT_FOUND, stored by the route", response{status: 200, origin: upstream, endOfStream: true}, 5, true, settleRecord, ""},
		{"trailers-only UNAVAILABLE", response{status: 200, origin: upstream, endOfStream: true}, 14, true, settleRelease, ReleaseStatus},
		{"trailers-only without grpc-status", response{status: 200, origin: upstream, endOfStream: true}, 0, false, settleUnknown, ""},
		{"Envoy's reply after the upstream was called", response{status: 200, origin: envoy, endOfStream: true}, 14, true, settleUnknown, ""},
		{"Envoy's reply, never sent upstream", response{status: 200, origin: neverSent, endOfStream: true}, 14, true, settleRelease, ReleaseEnvoyResponse},
		{"not a gRPC answer", response{status: 503, origin: upstream}, 0, false, settleRelease, ReleaseStatus},
		{"no details, UNAVAILABLE", response{status: 200, origin: origin{attempts: 1, attemptsKnown: true}, endOfStream: true}, 14, true, settleUnknown, ""},
		{"no details, OK", response{status: 200, origin: origin{}, endOfStream: true}, 0, true, settleRecord, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s, reason, _ := judgeGRPCResponse(r, c.resp, c.code, c.known)
			require.Equal(t, c.settle, s)
			require.Equal(t, c.reason, reason)
		})
	}
	// At the trailers.
	s, reason := judgeGRPCStatus(r, upstream, 0, true)
	require.Equal(t, []any{settleRecord, ""}, []any{s, reason})
	s, reason = judgeGRPCStatus(r, upstream, 13, true)
	require.Equal(t, []any{settleRelease, ReleaseStatus}, []any{s, reason})
	s, _ = judgeGRPCStatus(r, upstream, 0, false)
	require.Equal(t, settleUnknown, s, "trailers without grpc-status")
}
