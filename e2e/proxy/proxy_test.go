package proxy_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
	"github.com/idempotency-extproc/idempotency-extproc/e2e/upstream"
	"github.com/idempotency-extproc/idempotency-extproc/internal/leakcheck"
)

func TestMain(m *testing.M) {
	leakcheck.Main(m)
}

const (
	fieldsKey = "envoy.filters.http.ext_proc"
	modeSEND  = filterextproc.ProcessingMode_SEND
	modeSKIP  = filterextproc.ProcessingMode_SKIP
	bodyNONE  = filterextproc.ProcessingMode_NONE
	bodyBUF   = filterextproc.ProcessingMode_BUFFERED
	bodySTR   = filterextproc.ProcessingMode_STREAMED
	bodyPART  = filterextproc.ProcessingMode_BUFFERED_PARTIAL
)

func sha(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// closedAddr returns a loopback address nothing listens on.
func closedAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return addr
}

func TestContinuePassthrough(t *testing.T) {
	e := newEnv(t, bufferedFilter(), nil)
	body := []byte("hello")
	resp, got := e.do(t, http.MethodPost, "/v1/pay?x=1", body,
		"Idempotency-Key", "k1", "X-Test-Status", "201", "X-Test-Cookies", "3", "X-Multi", "a", "X-Multi", "b")

	require.Equal(t, http.StatusCreated, resp.StatusCode)
	require.Equal(t, []string{"c1=v1", "c2=v2", "c3=v3"}, resp.Header.Values("Set-Cookie"))
	require.Equal(t, "application/json", resp.Header.Get("Content-Type"))
	require.Equal(t, int64(len(got)), resp.ContentLength)
	require.NotEmpty(t, resp.Header.Get("X-Envoy-Upstream-Service-Time"))
	require.Equal(t, "envoy", resp.Header.Get("Server"))
	var sum upstream.Summary
	require.NoError(t, json.Unmarshal(got, &sum))
	require.Equal(t, upstream.Summary{Execution: 1, Key: "k1", Method: "POST", Path: "/v1/pay?x=1", BodySHA256: sha(body)}, sum)

	log := e.proc.next(t)
	require.Equal(t, []string{"request_headers", "request_body", "response_headers", "response_body"}, kinds(log.msgs))
	rh, rb, sh, sb := log.msgs[0], log.msgs[1], log.msgs[2], log.msgs[3]

	// request_headers: pseudo-headers, lower-case names, raw_value only, repeated entries
	// (MutationUtils::headersToProto), HCM headers
	// (ConnectionManagerUtility::mutateRequestHeaders), end_of_stream false.
	hm := rh.GetRequestHeaders().GetHeaders()
	require.False(t, rh.GetRequestHeaders().GetEndOfStream())
	require.Equal(t, []string{"POST"}, values(t, hm, ":method"))
	require.Equal(t, []string{"/v1/pay?x=1"}, values(t, hm, ":path"))
	require.Equal(t, []string{"http"}, values(t, hm, ":scheme"))
	require.Equal(t, []string{e.proxy.URL()[len("http://"):]}, values(t, hm, ":authority"))
	require.Equal(t, []string{"a", "b"}, values(t, hm, "x-multi"))
	require.Equal(t, []string{"k1"}, values(t, hm, "idempotency-key"))
	require.Equal(t, []string{"5"}, values(t, hm, "content-length"))
	require.Equal(t, []string{"http"}, values(t, hm, "x-forwarded-proto"))
	ids := values(t, hm, "x-request-id")
	require.Len(t, ids, 1)
	require.Empty(t, values(t, hm, "host"))

	// protocol_config on the first message only (Filter::encodeProtocolConfig); attributes on the
	// first message of each direction (Filter::addAttributes).
	require.Equal(t, bodyBUF, rh.GetProtocolConfig().GetRequestBodyMode())
	require.Equal(t, bodyBUF, rh.GetProtocolConfig().GetResponseBodyMode())
	attrs := rh.GetAttributes()[fieldsKey].GetFields()
	require.Equal(t, ids[0], attrs["request.id"].GetStringValue())
	require.Equal(t, "/v1/pay?x=1", attrs["request.path"].GetStringValue())
	require.Equal(t, "POST", attrs["request.method"].GetStringValue())
	for _, m := range log.msgs[1:] {
		require.Nil(t, m.GetProtocolConfig())
	}
	require.Empty(t, rb.GetAttributes())
	require.Empty(t, sb.GetAttributes())

	require.Equal(t, body, rb.GetRequestBody().GetBody())
	require.True(t, rb.GetRequestBody().GetEndOfStream())

	shm := sh.GetResponseHeaders().GetHeaders()
	require.False(t, sh.GetResponseHeaders().GetEndOfStream())
	require.Equal(t, []string{"201"}, values(t, shm, ":status"))
	require.Equal(t, []string{"c1=v1", "c2=v2", "c3=v3"}, values(t, shm, "set-cookie"))
	require.Len(t, values(t, shm, "x-envoy-upstream-service-time"), 1)
	require.Equal(t, []string{strconv.Itoa(len(got))}, values(t, shm, "content-length"))
	rattrs := sh.GetAttributes()[fieldsKey].GetFields()
	require.Equal(t, "via_upstream", rattrs["response.code_details"].GetStringValue())
	require.Equal(t, float64(201), rattrs["response.code"].GetNumberValue())
	require.Equal(t, float64(0), rattrs["response.flags"].GetNumberValue())

	require.Equal(t, got, sb.GetResponseBody().GetBody())
	require.True(t, sb.GetResponseBody().GetEndOfStream())

	// The upstream got the HCM headers too.
	reqs := e.up.Requests()
	require.Len(t, reqs, 1)
	require.Equal(t, ids[0], reqs[0].Header.Get("X-Request-Id"))
	require.Equal(t, "http", reqs[0].Header.Get("X-Forwarded-Proto"))
	require.Equal(t, []string{"a", "b"}, reqs[0].Header.Values("X-Multi"))

	rec := e.record(t)
	require.Equal(t, proxy.Record{RequestID: ids[0], Method: "POST", Path: "/v1/pay?x=1", Processor: e.proc.addr,
		Status: 201, CodeDetails: "via_upstream", ResponseFlags: "-", Attempts: 1, Duration: rec.Duration}, rec)
	st := e.proxy.Stats()
	require.Equal(t, int64(1), st.StreamsStarted)
	require.Equal(t, int64(4), st.MessagesSent)
	require.Equal(t, int64(4), st.MessagesReceived)
}

func TestBodylessRequestAndResponse(t *testing.T) {
	e := newEnv(t, bufferedFilter(), nil)
	resp, got := e.do(t, http.MethodGet, "/a", nil, "X-Request-Id", "given-id", "X-Test-Status", "204")
	require.Equal(t, http.StatusNoContent, resp.StatusCode)
	require.Empty(t, got)

	log := e.proc.next(t)
	// end_of_stream true means no body message in that direction
	// (ProcessorState::handleHeadersResponseWithContinue).
	require.Equal(t, []string{"request_headers", "response_headers"}, kinds(log.msgs))
	require.True(t, log.msgs[0].GetRequestHeaders().GetEndOfStream())
	require.Equal(t, []string{"given-id"}, values(t, log.msgs[0].GetRequestHeaders().GetHeaders(), "x-request-id"))
	require.True(t, log.msgs[1].GetResponseHeaders().GetEndOfStream())
}

func TestImmediateResponse(t *testing.T) {
	replay := &extprocv3.HeaderMutation{SetHeaders: append(
		[]*corev3.HeaderValueOption{
			setRaw("content-type", "application/json", false),
			setRaw("set-cookie", "a=1", false),
			setRaw("set-cookie", "b=2", true),
			setRaw("x-envoy-upstream-service-time", "7", false), // dropped by the default rules
			setRaw(":status", "418", false),                     // allowed, then overwritten by the local reply rewrite
		},
		valueOnly("x-value-only", "v"),
	)}
	tests := []struct {
		name        string
		at          string
		resp        *extprocv3.ProcessingResponse
		wantStatus  int
		wantBody    string
		wantHeaders map[string][]string
		wantKinds   []string
		wantDetails string
		// wantMutationErrs counts replies whose header mutation was invalid.
		wantMutationErrs int64
		wantRejects      int64
	}{
		{
			name: "at request_headers", at: "request_headers",
			resp:       immediate(typev3.StatusCode_Created, `{"id":1}`, replay, "replayed hit"),
			wantStatus: 201, wantBody: `{"id":1}`,
			wantHeaders: map[string][]string{
				"Content-Type": {"application/json"}, "Set-Cookie": {"a=1", "b=2"},
				"Content-Length": {"8"}, "X-Value-Only": {""},
			},
			wantKinds: []string{"request_headers"}, wantDetails: "replayed_hit", wantRejects: 1,
		},
		{
			name: "at request_body", at: "request_body",
			resp:       immediate(typev3.StatusCode_Conflict, "in progress", nil, ""),
			wantStatus: 409, wantBody: "in progress",
			wantHeaders: map[string][]string{"Content-Type": {"text/plain"}, "Content-Length": {"11"}},
			wantKinds:   []string{"request_headers", "request_body"},
		},
		{
			name: "at response_headers", at: "response_headers",
			resp:        immediate(typev3.StatusCode_UnprocessableEntity, "", nil, ""),
			wantStatus:  422,
			wantHeaders: map[string][]string{"Content-Length": {"0"}},
			wantKinds:   []string{"request_headers", "request_body", "response_headers"},
		},
		{
			name: "missing status is 200", at: "request_headers",
			resp:       immediate(0, "x", nil, ""),
			wantStatus: 200, wantBody: "x",
			wantHeaders: map[string][]string{"Content-Type": {"text/plain"}, "Content-Length": {"1"}},
			wantKinds:   []string{"request_headers"},
		},
		{
			name: "1xx status is 200", at: "request_headers",
			resp:       immediate(typev3.StatusCode_Continue, "", nil, ""),
			wantStatus: 200,
			wantKinds:  []string{"request_headers"},
		},
		// An invalid mutation does not fail an immediate reply: Envoy logs it and sends the
		// reply with the entries before it applied (sendImmediateResponse).
		{
			name: "value and raw_value both set", at: "request_headers",
			resp: immediate(typev3.StatusCode_Created, "x", &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
				setRaw("x-before", "1", false), bothSet("x-both", "v"), setRaw("x-after", "2", false),
			}}, ""),
			wantStatus: 201, wantBody: "x",
			wantHeaders:      map[string][]string{"X-Before": {"1"}, "X-Both": nil, "X-After": nil},
			wantKinds:        []string{"request_headers"},
			wantMutationErrs: 1, wantRejects: 1,
		},
		{
			name: "invalid header name", at: "request_body",
			resp: immediate(typev3.StatusCode_Created, "x", &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
				setRaw("bad name", "v", false),
			}}, ""),
			wantStatus: 201, wantBody: "x",
			wantKinds:        []string{"request_headers", "request_body"},
			wantMutationErrs: 1, wantRejects: 1,
		},
		{
			name: "invalid header value", at: "request_headers",
			resp: immediate(typev3.StatusCode_Created, "x", &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
				setRaw("x-bad", "a\r\nb", false),
			}}, ""),
			wantStatus: 201, wantBody: "x",
			wantHeaders:      map[string][]string{"X-Bad": nil},
			wantKinds:        []string{"request_headers"},
			wantMutationErrs: 1, wantRejects: 1,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, bufferedFilter(), on(tt.at, sendOnce(tt.resp)))
			resp, got := e.do(t, http.MethodPost, "/pay", []byte("{}"), "Idempotency-Key", "k")
			require.Equal(t, tt.wantStatus, resp.StatusCode)
			require.Equal(t, tt.wantBody, string(got))
			for k, v := range tt.wantHeaders {
				require.Equal(t, v, resp.Header.Values(k), k)
			}
			require.Empty(t, resp.Header.Values("X-Envoy-Upstream-Service-Time"))
			log := e.proc.next(t)
			// No response phase follows an ImmediateResponse: Filter::onReceiveMessage marks
			// processing complete.
			require.Equal(t, tt.wantKinds, kinds(log.msgs))
			if tt.at != "response_headers" {
				require.Zero(t, e.up.Total())
			}
			rec := e.record(t)
			if tt.wantDetails != "" {
				require.Equal(t, tt.wantDetails, rec.CodeDetails)
			}
			st := e.proxy.Stats()
			require.Equal(t, int64(1), st.ImmediateResponses)
			require.Equal(t, tt.wantRejects, st.RejectedMutations)
			require.Equal(t, tt.wantMutationErrs, st.ImmediateMutationErrors)
		})
	}
}

func TestModeOverride(t *testing.T) {
	passThrough := fullMode(bodyNONE, modeSKIP, bodyNONE) // the processor's, at request_headers
	notStored := fullMode(bodyNONE, modeSEND, bodyNONE)   // the processor's, at response_headers
	allowList := []*filterextproc.ProcessingMode{passThrough, notStored}
	all := []string{"request_headers", "request_body", "response_headers", "response_body"}
	override := func(at string, m *filterextproc.ProcessingMode) handler {
		return on(at, func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
			resp := cont(req)
			resp.ModeOverride = m
			return st.Send(resp)
		})
	}
	tests := []struct {
		name      string
		allow     bool
		allowed   []*filterextproc.ProcessingMode
		h         handler
		wantKinds []string
		honoured  int64
	}{
		{name: "allowed at request_headers", allow: true, allowed: allowList,
			h: override("request_headers", passThrough), wantKinds: []string{"request_headers"}, honoured: 1},
		{name: "allowed at response_headers", allow: true, allowed: allowList,
			h: override("response_headers", notStored), wantKinds: all[:3], honoured: 1},
		{name: "DEFAULT header modes mean no change", allow: true, allowed: allowList,
			h:         override("request_headers", &filterextproc.ProcessingMode{ResponseHeaderMode: modeSKIP}),
			wantKinds: []string{"request_headers"}, honoured: 1},
		{name: "not in allowed_override_modes", allow: true, allowed: allowList,
			h: override("request_headers", fullMode(bodyNONE, modeSKIP, bodyBUF)), wantKinds: all},
		{name: "allow_mode_override false", allow: false,
			h: override("request_headers", passThrough), wantKinds: all},
		// Both bodies become NONE; header modes left DEFAULT do not change.
		{name: "no allow-list takes body modes literally", allow: true,
			h: override("request_headers", &filterextproc.ProcessingMode{}), wantKinds: []string{"request_headers", "response_headers"}, honoured: 1},
		{name: "ignored in a body answer", allow: true, allowed: allowList,
			h: override("request_body", passThrough), wantKinds: all},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := bufferedFilter()
			f.AllowModeOverride = tt.allow
			f.AllowedOverrideModes = tt.allowed
			e := newEnv(t, f, tt.h)
			resp, got := e.do(t, http.MethodPost, "/pay", []byte("body"))
			require.Equal(t, http.StatusOK, resp.StatusCode)
			require.Contains(t, string(got), sha([]byte("body")))
			require.Equal(t, tt.wantKinds, kinds(e.proc.next(t).msgs))
			require.Equal(t, tt.honoured, e.proxy.Stats().ModeOverrides)
		})
	}
}

func TestProcessorFailures(t *testing.T) {
	slow := func(d time.Duration) handler {
		return func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
			select {
			case <-time.After(d):
			case <-st.Context().Done():
			}
			return st.Send(cont(req))
		}
	}
	wrongKind := func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		return st.Send(answer(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{}}, &extprocv3.CommonResponse{}))
	}
	tests := []struct {
		name        string
		h           handler
		cfg         func(*proxy.Config)
		unreachable bool
		wantStatus  int // with failure_mode_allow false
		wantDetails string
		wantStats   func(proxy.Stats) int64
	}{
		{name: "spurious answer", h: on("request_headers", wrongKind), wantStatus: 500,
			wantDetails: "spurious_message", wantStats: func(s proxy.Stats) int64 { return s.Spurious }},
		{name: "message timeout", h: on("request_headers", slow(time.Second)),
			cfg:        func(c *proxy.Config) { c.Filter.MessageTimeout = durationpb.New(100 * time.Millisecond) },
			wantStatus: 504, wantDetails: "ext_proc_error_per-message_timeout_exceeded",
			wantStats: func(s proxy.Stats) int64 { return s.MessageTimeouts }},
		{name: "gRPC error", h: on("request_body", statusErr(codes.Internal, "boom")), wantStatus: 500,
			wantDetails: "ext_proc_error_gRPC_error_13{boom}", wantStats: func(s proxy.Stats) int64 { return s.StreamErrors }},
		{name: "gRPC error with status_on_error", h: on("request_headers", statusErr(codes.Internal, "boom")),
			cfg: func(c *proxy.Config) {
				c.Filter.StatusOnError = &typev3.HttpStatus{Code: typev3.StatusCode_ServiceUnavailable}
			},
			wantStatus: 503, wantStats: func(s proxy.Stats) int64 { return s.StreamErrors }},
		{name: "processor unreachable", unreachable: true, wantStatus: 500,
			wantStats: func(s proxy.Stats) int64 { return s.StreamErrors }},
	}
	for _, tt := range tests {
		for _, allow := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/failure_mode_allow=%v", tt.name, allow), func(t *testing.T) {
				f := bufferedFilter()
				f.FailureModeAllow = allow
				opts := []func(*proxy.Config){}
				if tt.cfg != nil {
					opts = append(opts, tt.cfg)
				}
				if tt.unreachable {
					addr := closedAddr(t)
					opts = append(opts, func(c *proxy.Config) { c.Processors = []string{addr} })
				}
				e := newEnv(t, f, tt.h, opts...)
				resp, got := e.do(t, http.MethodPost, "/pay", []byte("x"))
				rec := e.record(t)
				if allow {
					// Processing is skipped and the request goes on (failureModeAllow() in
					// Filter::onReceiveMessage, onMessageTimeout and onGrpcError).
					require.Equal(t, http.StatusOK, resp.StatusCode)
					require.Equal(t, 1, e.up.Total())
					require.Equal(t, int64(1), e.proxy.Stats().FailureModeAllowed)
				} else {
					require.Equal(t, tt.wantStatus, resp.StatusCode, string(got))
					require.Zero(t, e.up.Total())
					if tt.wantDetails != "" {
						require.Equal(t, tt.wantDetails, rec.CodeDetails)
					}
				}
				require.Equal(t, int64(1), tt.wantStats(e.proxy.Stats()))
				if !tt.unreachable {
					log := e.proc.next(t)
					require.NotContains(t, kinds(log.msgs), "response_headers")
				}
			})
		}
	}
}

func TestCleanCloseContinuesWithoutProcessing(t *testing.T) {
	h := on("request_headers", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		if err := st.Send(cont(req)); err != nil {
			return err
		}
		return errClose
	})
	e := newEnv(t, bufferedFilter(), h)
	resp, _ := e.do(t, http.MethodPost, "/pay", []byte("x"))
	// A clean close (status OK) means "proceed without the server"
	// (ExternalProcessorStreamImpl::onRemoteClose, Filter::onGrpcClose).
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, []string{"request_headers"}, kinds(e.proc.next(t).msgs))
	require.Equal(t, 1, e.up.Total())
}

func TestOverrideMessageTimeout(t *testing.T) {
	h := on("request_headers", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		if err := st.Send(&extprocv3.ProcessingResponse{OverrideMessageTimeout: durationpb.New(20 * time.Second)}); err != nil {
			return err
		}
		time.Sleep(3 * time.Second)
		return st.Send(cont(req))
	})
	// The override must reach the proxy within the configured timeout (1 s) on a loaded machine;
	// the answer comes 3 s later, past the configured timeout and within the override.
	for _, max := range []time.Duration{0, 30 * time.Second} {
		t.Run(fmt.Sprintf("max_message_timeout=%v", max), func(t *testing.T) {
			t.Parallel()
			f := bufferedFilter()
			f.MessageTimeout = durationpb.New(time.Second)
			if max > 0 {
				f.MaxMessageTimeout = durationpb.New(max)
			}
			e := newEnv(t, f, h)
			resp, _ := e.do(t, http.MethodPost, "/pay", []byte("x"))
			e.proc.next(t)
			if max == 0 {
				// max_message_timeout 0 disables the API (Filter::onNewTimeout).
				require.Equal(t, http.StatusGatewayTimeout, resp.StatusCode)
				require.Equal(t, int64(1), e.proxy.Stats().TimeoutOverridesIgnored)
				return
			}
			require.Equal(t, http.StatusOK, resp.StatusCode)
			require.Equal(t, int64(1), e.proxy.Stats().TimeoutOverrides)
		})
	}
}

func TestRequestOverBufferLimit(t *testing.T) {
	for _, tc := range []struct {
		name      string
		envoy     proxy.Behaviour
		wantKinds []string
	}{
		// 1.37 sends the filter manager's 413 through the encoder filters, ext_proc included.
		{"1.37", proxy.Envoy137(), []string{"request_headers", "response_headers", "response_body"}},
		// 1.34–1.36 keep local replies away from the processor (skip_ext_proc_on_local_reply).
		{"1.36", proxy.Envoy136(), []string{"request_headers"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Whole: the body keeps arriving while request_headers is answered, so the 413 comes
			// after the processor saw (and answered) the headers.
			whole := func(*http.Request) proxy.Shapes {
				return proxy.Shapes{Request: proxy.BodyShape{DuringHeaders: proxy.Whole}}
			}
			e := newEnv(t, bufferedFilter(), nil, func(c *proxy.Config) {
				c.ListenerBufferLimit = 1024
				c.Envoy = tc.envoy
				c.Shapes = whole
			})
			resp, got := e.do(t, http.MethodPost, "/pay", bytes.Repeat([]byte("a"), 100<<10))
			require.Equal(t, http.StatusRequestEntityTooLarge, resp.StatusCode)
			require.Equal(t, "Payload Too Large", string(got))
			require.Equal(t, "request_payload_too_large", e.record(t).CodeDetails)
			// The processor never gets the body (ActiveStreamDecoderFilter::requestDataTooLarge).
			log := e.proc.next(t)
			require.Equal(t, tc.wantKinds, kinds(log.msgs))
			require.Zero(t, e.up.Total())
			if len(log.msgs) > 1 {
				attrs := log.msgs[1].GetAttributes()[fieldsKey].GetFields()
				require.Equal(t, "request_payload_too_large", attrs["response.code_details"].GetStringValue())
				require.Equal(t, "Payload Too Large", string(log.msgs[2].GetResponseBody().GetBody()))
			}

			// At the limit exactly, the body goes through.
			resp, _ = e.do(t, http.MethodPost, "/pay", bytes.Repeat([]byte("a"), 1024))
			require.Equal(t, http.StatusOK, resp.StatusCode)
			require.Len(t, kinds(e.proc.next(t).msgs), 4)
			e.record(t)
		})
	}
}

func TestResponseOverBufferLimit(t *testing.T) {
	e := newEnv(t, bufferedFilter(), nil, func(c *proxy.Config) { c.UpstreamBufferLimit = 1024 })
	for _, chunked := range []string{"false", "true"} {
		resp, got := e.do(t, http.MethodPost, "/pay", []byte("x"), "X-Test-Body-Bytes", "4096", "X-Test-Chunked", chunked)
		require.Equal(t, http.StatusInternalServerError, resp.StatusCode)
		require.Equal(t, "Internal Server Error", string(got))
		require.Equal(t, "response_payload_too_large", e.record(t).CodeDetails)
		// response_body never reaches the processor
		// (ActiveStreamEncoderFilter::responseDataTooLarge).
		require.Equal(t, []string{"request_headers", "request_body", "response_headers"}, kinds(e.proc.next(t).msgs))
	}
}

func TestStreamedResponse(t *testing.T) {
	const n = 3<<20 + 12345
	f := bufferedFilter()
	f.ProcessingMode.ResponseBodyMode = bodySTR
	var answered atomic.Int64
	h := on("response_body", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		answered.Add(1)
		return st.Send(cont(req))
	})
	e := newEnv(t, f, h)
	for _, chunked := range []string{"false", "true"} {
		t.Run("chunked="+chunked, func(t *testing.T) {
			answered.Store(0)
			resp, got := e.do(t, http.MethodPost, "/download", []byte("x"), "X-Test-Body-Bytes", strconv.Itoa(n), "X-Test-Chunked", chunked)
			require.Equal(t, http.StatusOK, resp.StatusCode)
			// Envoy removes content-length for STREAMED
			// (ProcessorState::shouldRemoveContentLength).
			require.Equal(t, int64(-1), resp.ContentLength)
			require.True(t, bytes.Equal(upstream.Body(n), got), "body delivered byte for byte")

			log := e.proc.next(t)
			var streamed []byte
			var chunks int
			for i, m := range log.msgs {
				b := m.GetResponseBody()
				if b == nil {
					continue
				}
				chunks++
				// Data held during the header call goes as one chunk: up to the buffer limit plus
				// the read that crossed it (ProcessorState::sendBufferedDataInStreamedMode).
				require.LessOrEqual(t, len(b.GetBody()), proxy.DefaultBufferLimit+proxy.DefaultReadSize)
				require.Equal(t, i == len(log.msgs)-1, b.GetEndOfStream(), "only the last chunk ends the stream")
				streamed = append(streamed, b.GetBody()...)
			}
			require.Greater(t, chunks, 3)
			require.Equal(t, int64(chunks), answered.Load(), "every chunk answered")
			require.True(t, bytes.Equal(got, streamed))
			require.Nil(t, values(t, log.msgs[2].GetResponseHeaders().GetHeaders(), "transfer-encoding"))
		})
	}
}

// A response whose upstream sends trailers ends its body with end_of_stream false, with no
// empty last chunk; the trailers then come in a response_trailers message only with
// response_trailer_mode SEND, in every body mode (Filter::onTrailers). Without the upstream's
// enable_trailers, Envoy's HTTP/1 codec drops them: the body ends the stream as usual.
func TestResponseTrailers(t *testing.T) {
	bodyKinds := map[filterextproc.ProcessingMode_BodySendMode]bool{bodySTR: true, filterextproc.ProcessingMode_BUFFERED: true, filterextproc.ProcessingMode_BUFFERED_PARTIAL: true}
	for _, tc := range []struct {
		bodyMode filterextproc.ProcessingMode_BodySendMode
		trailers filterextproc.ProcessingMode_HeaderSendMode
		enabled  bool // the upstream cluster's and the connection manager's enable_trailers
		empty    bool // a body of no bytes: BUFFERED sends no body message before the trailers
	}{
		{bodySTR, filterextproc.ProcessingMode_SEND, true, false},
		{bodySTR, filterextproc.ProcessingMode_SKIP, true, false},
		{filterextproc.ProcessingMode_BUFFERED, filterextproc.ProcessingMode_SEND, true, false},
		{filterextproc.ProcessingMode_BUFFERED, filterextproc.ProcessingMode_SKIP, true, false},
		{filterextproc.ProcessingMode_BUFFERED_PARTIAL, filterextproc.ProcessingMode_SEND, true, false},
		{filterextproc.ProcessingMode_NONE, filterextproc.ProcessingMode_SEND, true, false},
		{bodySTR, filterextproc.ProcessingMode_SEND, false, false},
		{filterextproc.ProcessingMode_BUFFERED, filterextproc.ProcessingMode_SEND, true, true},
	} {
		t.Run(fmt.Sprintf("%s/%s/enabled=%v/empty=%v", tc.bodyMode, tc.trailers, tc.enabled, tc.empty), func(t *testing.T) {
			size := 100
			if tc.empty {
				size = 0
			}
			f := bufferedFilter()
			f.ProcessingMode.ResponseBodyMode = tc.bodyMode
			f.ProcessingMode.ResponseTrailerMode = tc.trailers
			e := newEnv(t, f, continueAll, func(c *proxy.Config) {
				c.UpstreamTrailers, c.DownstreamTrailers = tc.enabled, tc.enabled
				// An empty body with trailers arrives during the header call: only older Envoys
				// go on (TestEmptyBodyWithTrailersDuringHeadersStalls is the newer one).
				c.Envoy.CompleteBodyWithoutDataContinues = tc.empty
			})
			resp, got := e.do(t, http.MethodPost, "/grpcish", []byte("x"), "X-Test-Body-Bytes", strconv.Itoa(size), "X-Test-Trailer-Grpc-Status", "0")
			require.Equal(t, http.StatusOK, resp.StatusCode)
			require.True(t, bytes.Equal(upstream.Body(size), got))
			msgs := e.proc.next(t).msgs
			require.Equal(t, []string{"request_headers", "request_body", "response_headers"}, kinds(msgs[:3]))
			var body []byte
			rest := msgs[3:]
			for len(rest) > 0 && kind(rest[0]) == "response_body" {
				b := rest[0].GetResponseBody()
				last := !tc.enabled && len(rest) == 1
				require.Equal(t, last, b.GetEndOfStream(), "with trailers they end the stream, not the body")
				if !last {
					require.NotEmpty(t, b.GetBody(), "no empty chunk but one that ends the stream")
				}
				body = append(body, b.GetBody()...)
				rest = rest[1:]
			}
			if bodyKinds[tc.bodyMode] {
				require.True(t, bytes.Equal(upstream.Body(size), body))
			} else {
				require.Empty(t, body)
			}
			if tc.enabled && tc.trailers == filterextproc.ProcessingMode_SEND {
				require.Equal(t, []string{"response_trailers"}, kinds(rest))
				require.Equal(t, []string{"0"}, values(t, rest[0].GetResponseTrailers().GetTrailers(), "grpc-status"))
			} else {
				require.Empty(t, rest, "no message says the response ended")
			}
			if tc.bodyMode == bodySTR {
				want := ""
				if tc.enabled {
					want = "0"
				}
				require.Equal(t, want, resp.Trailer.Get("Grpc-Status"), "a STREAMED response carries its trailers downstream when enabled")
			}
		})
	}
}

// Envoy merges each mode_override with the configured mode, not with an earlier override: a
// header or trailer mode left DEFAULT at response_headers falls back to the configuration.
func TestModeOverrideMergesWithTheConfiguredMode(t *testing.T) {
	f := bufferedFilter() // response_trailer_mode SKIP
	override := func(req *extprocv3.ProcessingRequest, m *filterextproc.ProcessingMode) *extprocv3.ProcessingResponse {
		resp := cont(req)
		resp.ModeOverride = m
		return resp
	}
	h := func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		switch kind(req) {
		case "request_headers":
			return st.Send(override(req, &filterextproc.ProcessingMode{
				RequestBodyMode: filterextproc.ProcessingMode_BUFFERED, ResponseBodyMode: filterextproc.ProcessingMode_BUFFERED,
				ResponseTrailerMode: filterextproc.ProcessingMode_SEND,
			}))
		case "response_headers":
			return st.Send(override(req, &filterextproc.ProcessingMode{
				RequestBodyMode: filterextproc.ProcessingMode_BUFFERED, ResponseBodyMode: filterextproc.ProcessingMode_BUFFERED,
			}))
		}
		return continueAll(st, req)
	}
	e := newEnv(t, f, h, func(c *proxy.Config) { c.UpstreamTrailers = true })
	resp, _ := e.do(t, http.MethodPost, "/pay", []byte("x"), "X-Test-Body-Bytes", "10", "X-Test-Trailer-Grpc-Status", "0")
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, []string{"request_headers", "request_body", "response_headers", "response_body"}, kinds(e.proc.next(t).msgs),
		"the second override's DEFAULT trailer mode is the configured SKIP, not the first override's SEND")
	require.Equal(t, int64(2), e.proxy.Stats().ModeOverrides)
}

func TestStreamedResponseFailureResets(t *testing.T) {
	f := bufferedFilter()
	f.ProcessingMode.ResponseBodyMode = bodySTR
	var chunks atomic.Int64
	h := on("response_body", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		if chunks.Add(1) == 3 {
			return statusErr(codes.Internal, "boom")(st, req)
		}
		return st.Send(cont(req))
	})
	e := newEnv(t, f, h)
	req, err := http.NewRequest(http.MethodPost, e.proxy.URL()+"/download", bytes.NewReader([]byte("x")))
	require.NoError(t, err)
	req.Header.Set("X-Test-Body-Bytes", strconv.Itoa(1<<20))
	resp, err := e.client.Do(req)
	require.NoError(t, err)
	defer func() { _ = resp.Body.Close() }()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	// The headers are downstream already, so the failure resets the stream instead of a 500.
	_, err = io.ReadAll(resp.Body)
	require.Error(t, err)
	e.proc.next(t)
	require.Equal(t, int64(1), e.proxy.Stats().Resets)
	require.Equal(t, 200, e.record(t).Status)
}

func TestHead(t *testing.T) {
	e := newEnv(t, bufferedFilter(), nil)
	resp, got := e.do(t, http.MethodHead, "/x", nil, "X-Test-Body-Bytes", "100")
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Empty(t, got)
	log := e.proc.next(t)
	require.Equal(t, []string{"request_headers", "response_headers"}, kinds(log.msgs))
	require.True(t, log.msgs[1].GetResponseHeaders().GetEndOfStream())
}

func TestStreamedRequestBody(t *testing.T) {
	f := bufferedFilter()
	f.ProcessingMode.RequestBodyMode = bodySTR
	upper := on("request_body", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		b := bytes.ToUpper(req.GetRequestBody().GetBody())
		return st.Send(answer(req, &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: b}}}))
	})
	e := newEnv(t, f, upper)
	body := bytes.Repeat([]byte("abcdefgh"), 64<<10) // 512 KiB
	resp, got := e.do(t, http.MethodPost, "/upload", body)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Contains(t, string(got), sha(bytes.ToUpper(body)))
	log := e.proc.next(t)
	var total int
	for _, m := range log.msgs {
		total += len(m.GetRequestBody().GetBody())
	}
	require.Equal(t, len(body), total)
	// content-length is dropped for STREAMED (ProcessorState::shouldRemoveContentLength).
	require.Empty(t, e.up.Requests()[0].Header.Get("Content-Length"))
}

func TestBufferedPartialResponse(t *testing.T) {
	f := bufferedFilter()
	f.ProcessingMode.ResponseBodyMode = bodyPART
	// The body arrives after the header answer, in reads of 512 bytes: the message holds what
	// was queued when the queue first exceeded the limit, end_of_stream false; the rest passes
	// unseen (Filter::handleDataBufferedPartialMode).
	shapes := func(*http.Request) proxy.Shapes {
		return proxy.Shapes{Response: proxy.BodyShape{DuringHeaders: proxy.Held, Chunks: []int{512}}}
	}
	e := newEnv(t, f, nil, func(c *proxy.Config) { c.UpstreamBufferLimit = 1024; c.Shapes = shapes })
	resp, got := e.do(t, http.MethodPost, "/x", []byte("x"), "X-Test-Body-Bytes", "4096")
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.True(t, bytes.Equal(upstream.Body(4096), got))
	log := e.proc.next(t)
	require.Equal(t, []string{"request_headers", "request_body", "response_headers", "response_body"}, kinds(log.msgs))
	last := log.msgs[3].GetResponseBody()
	require.Len(t, last.GetBody(), 1536)
	require.False(t, last.GetEndOfStream())
	require.Equal(t, int64(-1), resp.ContentLength, "BUFFERED_PARTIAL removes content-length")

	// A body that fits and arrives during the header call goes whole, end_of_stream true
	// (ProcessorState::handleCompleteBodyAvailable).
	e2 := newEnv(t, f, nil, func(c *proxy.Config) {
		c.UpstreamBufferLimit = 1024
		c.Shapes = func(*http.Request) proxy.Shapes {
			return proxy.Shapes{Response: proxy.BodyShape{DuringHeaders: proxy.Whole}}
		}
	})
	resp, got = e2.do(t, http.MethodPost, "/x", []byte("x"), "X-Test-Body-Bytes", "1000")
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.True(t, bytes.Equal(upstream.Body(1000), got))
	log = e2.proc.next(t)
	whole := log.msgs[len(log.msgs)-1].GetResponseBody()
	require.Len(t, whole.GetBody(), 1000)
	require.True(t, whole.GetEndOfStream())
}

func TestMutations(t *testing.T) {
	mutate := func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		var c extprocv3.CommonResponse
		switch kind(req) {
		case "request_headers":
			c.HeaderMutation = &extprocv3.HeaderMutation{
				SetHeaders: []*corev3.HeaderValueOption{
					setRaw("x-added", "1", false),
					setRaw("x-multi", "c", true),
					setRaw("host", "evil", false),            // ignored
					setRaw(":path", "/elsewhere", false),     // allowed by the default rules
					setRaw("x-envoy-retry-on", "5xx", false), // ignored
				},
				RemoveHeaders: []string{"x-remove-me", ":authority"}, // the latter ignored
			}
		case "request_body":
			c.HeaderMutation = &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{setRaw("content-length", "3", false)}}
			c.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: []byte("new")}}
		case "response_headers":
			c.HeaderMutation = &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
				setRaw("x-idempotency-replayed", "false", false),
				setRaw("set-cookie", "z=9", true),
			}}
		case "response_body":
			// Header mutations still count in a BUFFERED body answer, and a replaced body needs a
			// matching content-length (ProcessorState::handleBodyResponse).
			c.HeaderMutation = &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
				setRaw("x-from-body", "yes", false),
				setRaw("content-length", "8", false),
			}}
			c.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: []byte("REPLACED")}}
		}
		return st.Send(answer(req, &c))
	}
	e := newEnv(t, bufferedFilter(), mutate)
	resp, got := e.do(t, http.MethodPost, "/orig", []byte("old body"), "X-Remove-Me", "1", "X-Multi", "a", "X-Test-Cookies", "1")
	require.Equal(t, http.StatusOK, resp.StatusCode)
	// The response body changed and content-length follows it.
	require.Equal(t, "REPLACED", string(got))
	require.Equal(t, int64(8), resp.ContentLength)
	require.Equal(t, "false", resp.Header.Get("X-Idempotency-Replayed"))
	require.Equal(t, []string{"c1=v1", "z=9"}, resp.Header.Values("Set-Cookie"))
	require.Equal(t, "yes", resp.Header.Get("X-From-Body"))

	reqs := e.up.Requests()
	require.Len(t, reqs, 1)
	r := reqs[0]
	require.Equal(t, "/elsewhere", r.Path)
	require.Equal(t, sha([]byte("new")), r.BodySHA256)
	require.Equal(t, "1", r.Header.Get("X-Added"))
	require.Equal(t, []string{"a", "c"}, r.Header.Values("X-Multi"))
	require.Empty(t, r.Header.Get("X-Remove-Me"))
	require.Empty(t, r.Header.Get("X-Envoy-Retry-On"))
	require.Equal(t, int64(3), e.proxy.Stats().RejectedMutations)
	e.proc.next(t)
}

// An invalid mutation in an answer other than an ImmediateResponse fails the request with
// status_on_error (500 by default), whatever failure_mode_allow says (Envoy's
// Filter::handleErrorResponse).
func TestInvalidMutationUsesStatusOnError(t *testing.T) {
	bad := func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		return st.Send(answer(req, &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{
			SetHeaders: []*corev3.HeaderValueOption{bothSet("x-both", "v")},
		}}))
	}
	for _, tc := range []struct {
		statusOnError *typev3.HttpStatus
		want          int
	}{
		{nil, http.StatusInternalServerError},
		{&typev3.HttpStatus{Code: typev3.StatusCode_ServiceUnavailable}, http.StatusServiceUnavailable},
	} {
		for _, allow := range []bool{false, true} {
			t.Run(fmt.Sprintf("%d/failure_mode_allow=%v", tc.want, allow), func(t *testing.T) {
				f := bufferedFilter()
				f.FailureModeAllow = allow
				e := newEnv(t, f, on("request_headers", bad), func(c *proxy.Config) { c.Filter.StatusOnError = tc.statusOnError })
				resp, _ := e.do(t, http.MethodPost, "/pay", []byte("x"))
				require.Equal(t, tc.want, resp.StatusCode)
				require.Zero(t, e.up.Total())
				e.proc.next(t)
			})
		}
	}
}

func TestContinueAndReplace(t *testing.T) {
	replace := func(body string) handler {
		return func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
			return st.Send(answer(req, &extprocv3.CommonResponse{
				Status:       extprocv3.CommonResponse_CONTINUE_AND_REPLACE,
				BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: []byte(body)}},
			}))
		}
	}
	h := func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		switch kind(req) {
		case "request_headers":
			return replace("replaced")(st, req)
		case "response_headers":
			return replace("R")(st, req)
		}
		return continueAll(st, req)
	}
	e := newEnv(t, bufferedFilter(), h)
	resp, got := e.do(t, http.MethodPost, "/x", []byte("original"))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, "R", string(got))
	require.Equal(t, sha([]byte("replaced")), e.up.Requests()[0].BodySHA256)
	// No further message in a direction after CONTINUE_AND_REPLACE
	// (ProcessorState::handleHeadersResponseWithContinueAndReplace).
	require.Equal(t, []string{"request_headers", "response_headers"}, kinds(e.proc.next(t).msgs))
}

func TestBodyMutationContentLengthMismatch(t *testing.T) {
	h := on("request_body", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		return st.Send(answer(req, &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: []byte("longer body")}}}))
	})
	e := newEnv(t, bufferedFilter(), h)
	resp, _ := e.do(t, http.MethodPost, "/x", []byte("short"))
	// BUFFERED with header SEND keeps content-length; a mismatched mutation is a 500
	// (ProcessorState::handleBodyResponse).
	require.Equal(t, http.StatusInternalServerError, resp.StatusCode)
	require.Equal(t, "mismatch_between_content_length_and_the_length_of_the_mutated_body", e.record(t).CodeDetails)
	require.Zero(t, e.up.Total())
	e.proc.next(t)
}

func TestUpstreamFailures(t *testing.T) {
	tests := []struct {
		name        string
		refused     bool
		wantStatus  int
		wantDetails string
		wantFlags   string
		wantFlagBit float64
	}{
		{name: "connection refused", refused: true, wantStatus: 503,
			wantDetails: "upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}", wantFlags: "UF", wantFlagBit: 0x20},
		{name: "route timeout", wantStatus: 504, wantDetails: "upstream_response_timeout", wantFlags: "UT", wantFlagBit: 0x4},
	}
	for _, tt := range tests {
		for _, toExtProc := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/local replies to ext_proc=%v", tt.name, toExtProc), func(t *testing.T) {
				opts := []func(*proxy.Config){func(c *proxy.Config) {
					c.Envoy.SkipExtProcOnLocalReply = !toExtProc
					// The route timeout is the failure of the second case; a refused connection
					// must not race it on a busy machine.
					c.RouteTimeout = 200 * time.Millisecond
					if tt.refused {
						c.RouteTimeout = 30 * time.Second
					}
				}}
				if tt.refused {
					addr := closedAddr(t)
					opts = append(opts, func(c *proxy.Config) { c.Upstream = "http://" + addr })
				}
				f := bufferedFilter()
				f.ResponseAttributes = append(f.ResponseAttributes, "upstream.request_attempt_count")
				e := newEnv(t, f, nil, opts...)
				resp, _ := e.do(t, http.MethodPost, "/pay", []byte("x"), "X-Test-Delay", "5s")
				require.Equal(t, tt.wantStatus, resp.StatusCode)
				rec := e.record(t)
				require.Equal(t, tt.wantDetails, rec.CodeDetails)
				require.Equal(t, tt.wantFlags, rec.ResponseFlags)
				// The router sets the attempt count before it asks for a connection
				// (Router::Filter::continueDecodeHeaders): a refused connection counts.
				require.Equal(t, 1, rec.Attempts)

				log := e.proc.next(t)
				if !toExtProc {
					// No response phase: the stream just ends (Behaviour.SkipExtProcOnLocalReply).
					require.Equal(t, []string{"request_headers", "request_body"}, kinds(log.msgs))
					return
				}
				require.Equal(t, []string{"request_headers", "request_body", "response_headers", "response_body"}, kinds(log.msgs))
				sh := log.msgs[2]
				require.Equal(t, []string{strconv.Itoa(tt.wantStatus)}, values(t, sh.GetResponseHeaders().GetHeaders(), ":status"))
				attrs := sh.GetAttributes()[fieldsKey].GetFields()
				require.Equal(t, tt.wantDetails, attrs["response.code_details"].GetStringValue())
				require.Equal(t, float64(tt.wantStatus), attrs["response.code"].GetNumberValue())
				require.Equal(t, tt.wantFlagBit, attrs["response.flags"].GetNumberValue())
				require.Equal(t, float64(1), attrs["upstream.request_attempt_count"].GetNumberValue())
			})
		}
	}
}

func TestClientDisconnect(t *testing.T) {
	t.Run("waiting for the upstream", func(t *testing.T) {
		e := newEnv(t, bufferedFilter(), nil)
		ctx, cancel := context.WithCancel(context.Background())
		errc := make(chan error, 1)
		go func() {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.proxy.URL()+"/hang", bytes.NewReader([]byte("x")))
			req.Header.Set("X-Test-Hang", "true")
			resp, err := e.client.Do(req)
			if err == nil {
				_ = resp.Body.Close()
			}
			errc <- err
		}()
		require.Eventually(t, func() bool { return e.up.Total() == 1 }, 5*time.Second, 5*time.Millisecond)
		start := time.Now()
		cancel()
		require.Error(t, <-errc)
		log := e.proc.next(t)
		require.Less(t, time.Since(start), 2*time.Second)
		require.Equal(t, []string{"request_headers", "request_body"}, kinds(log.msgs))
		require.Equal(t, "DC", e.record(t).ResponseFlags)
		// The upstream request is cancelled too.
		require.Eventually(t, func() bool { return e.up.Active() == 0 }, 2*time.Second, 5*time.Millisecond)
	})
	t.Run("waiting for the processor", func(t *testing.T) {
		var sawCancel atomic.Bool
		started := make(chan struct{}, 1)
		h := on("request_headers", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
			started <- struct{}{}
			select {
			case <-st.Context().Done():
				sawCancel.Store(true)
				return st.Context().Err()
			case <-time.After(10 * time.Second):
				return st.Send(cont(req))
			}
		})
		e := newEnv(t, bufferedFilter(), h)
		ctx, cancel := context.WithCancel(context.Background())
		errc := make(chan error, 1)
		go func() {
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, e.proxy.URL()+"/x", nil)
			resp, err := e.client.Do(req)
			if err == nil {
				_ = resp.Body.Close()
			}
			errc <- err
		}()
		<-started
		cancel()
		require.Error(t, <-errc)
		e.proc.next(t)
		require.True(t, sawCancel.Load(), "the stream is cancelled at once")
		require.Zero(t, e.up.Total())
	})
}

func TestConcurrentRequests(t *testing.T) {
	e := newEnv(t, bufferedFilter(), nil)
	const n = 50
	var wg sync.WaitGroup
	codes := make(chan int, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			body := bytes.Repeat([]byte{byte(i)}, 1000*i+1)
			req, err := http.NewRequest(http.MethodPost, e.proxy.URL()+"/c", bytes.NewReader(body))
			if err != nil {
				t.Error(err)
				return
			}
			req.Header.Set("Idempotency-Key", strconv.Itoa(i))
			resp, err := e.client.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			got, _ := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			if !bytes.Contains(got, []byte(sha(body))) {
				t.Errorf("request %d: upstream saw another body: %s", i, got)
			}
			codes <- resp.StatusCode
		}()
	}
	wg.Wait()
	close(codes)
	for c := range codes {
		require.Equal(t, http.StatusOK, c)
	}
	for range n {
		require.Len(t, e.proc.next(t).msgs, 4)
	}
	require.Equal(t, n, e.up.Total())
}

// twoProcessors starts two fake processors behind a proxy (with hc as its health check, if any)
// and returns them with a function that sends one request, requires a 200 and names the
// processor that served it.
func twoProcessors(t *testing.T, hc *proxy.HealthCheck) (a, b *fakeProcessor, served func() string) {
	t.Helper()
	b = startProcessor(t, nil)
	e := newEnv(t, bufferedFilter(), nil, func(c *proxy.Config) {
		c.Processors = append(c.Processors, b.addr)
		c.HealthCheck = hc
	})
	served = func() string {
		resp, _ := e.do(t, http.MethodPost, "/x", []byte("x"))
		require.Equal(t, http.StatusOK, resp.StatusCode)
		return e.record(t).Processor
	}
	return e.proc, b, served
}

func TestRoundRobin(t *testing.T) {
	a, b, served := twoProcessors(t, nil)
	var order []string
	for range 4 {
		order = append(order, served())
	}
	require.Equal(t, []string{a.addr, b.addr, a.addr, b.addr}, order)
	for range 2 {
		a.next(t)
		b.next(t)
	}
}

func TestHealthCheckSteersNewStreams(t *testing.T) {
	a, b, served := twoProcessors(t, &proxy.HealthCheck{Interval: 20 * time.Millisecond, Timeout: time.Second, UnhealthyThreshold: 1, HealthyThreshold: 1})
	a.health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	require.Eventually(t, func() bool {
		for range 4 {
			if served() != b.addr {
				return false
			}
		}
		return true
	}, 5*time.Second, 10*time.Millisecond, "a NOT_SERVING processor gets no new stream")
	a.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	require.Eventually(t, func() bool { return served() == a.addr }, 5*time.Second, 10*time.Millisecond)

	// With no healthy processor, all are used (Envoy's panic threshold). b is seen unhealthy
	// first, so that from then on requests reach both only once a is seen unhealthy too.
	b.health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	require.Eventually(t, func() bool {
		for range 4 {
			if served() != a.addr {
				return false
			}
		}
		return true
	}, 5*time.Second, 10*time.Millisecond)
	a.health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	require.Eventually(t, func() bool {
		seen := map[string]bool{}
		for range 4 {
			seen[served()] = true
		}
		return len(seen) == 2
	}, 5*time.Second, 10*time.Millisecond, "with none healthy, every processor gets streams")
}

func TestStreamRetriesOnRefusedProcessor(t *testing.T) {
	b := startProcessor(t, nil)
	up := upstream.Start(t)
	for _, retries := range []int{0, 2} {
		p := proxy.Start(t, proxy.Config{Filter: bufferedFilter(), Processors: []string{closedAddr(t), b.addr}, Upstream: up.URL(), StreamRetries: retries})
		client := newClient(t)
		codes := map[int]int{}
		for range 6 {
			resp, err := client.Post(p.URL()+"/x", "text/plain", bytes.NewReader([]byte("x")))
			require.NoError(t, err)
			require.NoError(t, resp.Body.Close())
			codes[resp.StatusCode]++
		}
		if retries == 0 {
			require.Equal(t, map[int]int{200: 3, 500: 3}, codes, "without retries a refused stream fails the request")
		} else {
			require.Equal(t, map[int]int{200: 6}, codes, "a refused stream is opened on the other processor")
		}
	}
}

func TestUnixSocketProcessor(t *testing.T) {
	path := filepath.Join(t.TempDir(), "extproc.sock")
	ln, err := net.Listen("unix", path)
	require.NoError(t, err)
	proc := serveProcessor(t, ln, "unix://"+path, nil)
	up := upstream.Start(t)
	p := proxy.Start(t, proxy.Config{Filter: bufferedFilter(), Processors: []string{proc.addr}, Upstream: up.URL()})
	resp, err := newClient(t).Post(p.URL()+"/x", "text/plain", bytes.NewReader([]byte("x")))
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Len(t, proc.next(t).msgs, 4)
}

func TestDisabledPrefix(t *testing.T) {
	e := newEnv(t, bufferedFilter(), nil, func(c *proxy.Config) { c.DisabledPrefixes = []string{"/healthz"} })
	resp, got := e.do(t, http.MethodGet, "/healthz/live", nil, "X-Test-Body-Bytes", "10")
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, upstream.Body(10), got)
	require.Equal(t, "", e.record(t).Processor)
	e.proc.none(t)
	require.Zero(t, e.proxy.Stats().StreamsStarted)
}

func TestNewRejects(t *testing.T) {
	full := proto.Clone(bufferedFilter()).(*filterextproc.ExternalProcessor)
	full.ProcessingMode.ResponseBodyMode = filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
	fullAllow := proto.Clone(full).(*filterextproc.ExternalProcessor)
	fullAllow.ProcessingMode.ResponseTrailerMode = filterextproc.ProcessingMode_SEND
	fullAllow.FailureModeAllow = true
	for name, cfg := range map[string]proxy.Config{
		"no processors": {Upstream: "http://127.0.0.1:1"},
		"bad upstream":  {Processors: []string{"127.0.0.1:1"}, Upstream: "127.0.0.1:1"},
		// config.cc verifyProcessingModeConfig: FULL_DUPLEX_STREAMED needs trailer mode SEND…
		"FULL_DUPLEX_STREAMED without trailers SEND": {Processors: []string{"127.0.0.1:1"}, Upstream: "http://127.0.0.1:1", Filter: full},
		// … and no failure_mode_allow.
		"FULL_DUPLEX_STREAMED with failure_mode_allow": {Processors: []string{"127.0.0.1:1"}, Upstream: "http://127.0.0.1:1", Filter: fullAllow},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := proxy.New(cfg)
			require.Error(t, err)
		})
	}
}

// A BUFFERED response whose trailers come with no data before them, while its header call is
// answered, is held: ProcessorState::handleCompleteBodyAvailable sends no message and does not
// continue, so neither the trailers message nor the response goes on. The processor answers the
// response headers only once the upstream has sent its whole response, so that the trailers
// are there during the header call.
func TestEmptyBodyWithTrailersDuringHeadersStalls(t *testing.T) {
	f := bufferedFilter()
	f.ProcessingMode.ResponseTrailerMode = filterextproc.ProcessingMode_SEND
	var e *env
	afterUpstream := on("response_headers", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		for e.up.Active() > 0 {
			time.Sleep(time.Millisecond)
		}
		time.Sleep(300 * time.Millisecond) // the proxy reads what the upstream wrote, on a loaded machine too
		return st.Send(cont(req))
	})
	e = newEnv(t, f, afterUpstream, func(c *proxy.Config) { c.UpstreamTrailers, c.DownstreamTrailers = true, true })
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.proxy.URL()+"/grpcish", bytes.NewReader([]byte("x")))
	require.NoError(t, err)
	req.Header.Set("X-Test-Body-Bytes", "0")
	req.Header.Set("X-Test-Trailer-Grpc-Status", "0")
	resp, err := e.client.Do(req)
	if err == nil {
		_, err = io.ReadAll(resp.Body)
		resp.Body.Close()
	}
	require.ErrorIs(t, err, context.DeadlineExceeded, "held until the client gave up")
	require.Equal(t, []string{"request_headers", "request_body", "response_headers"}, kinds(e.proc.next(t).msgs))
}
