package proxy_test

import (
	"net/http"
	"testing"

	accesslogv3 "github.com/envoyproxy/go-control-plane/envoy/config/accesslog/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
)

// Utility::prepareLocalReply builds the headers from :status alone, applies the processor's
// mutations, then sets content-length and adds text/plain only when no content-type is set; an
// empty body loses content-type and content-length (source/common/http/utility.cc). On the wire
// the HTTP/1
// codec adds content-length: 0 to a reply that ends with its headers.
func TestLocalReplyHeaderOrder(t *testing.T) {
	mut := func(set []*corev3.HeaderValueOption, remove ...string) *extprocv3.HeaderMutation {
		return &extprocv3.HeaderMutation{SetHeaders: set, RemoveHeaders: remove}
	}
	for _, tc := range []struct {
		name     string
		body     string
		m        *extprocv3.HeaderMutation
		wantCT   []string
		wantCL   string
		wantBody string
	}{
		{name: "content-type overwritten", body: `{"a":1}`,
			m:      mut([]*corev3.HeaderValueOption{setRaw("content-type", "application/json", false)}),
			wantCT: []string{"application/json"}, wantCL: "7", wantBody: `{"a":1}`},
		{name: "no content-type: text/plain", body: "hello",
			wantCT: []string{"text/plain"}, wantCL: "5", wantBody: "hello"},
		{name: "removing content-type does not stick", body: "hello", m: mut(nil, "content-type"),
			wantCT: []string{"text/plain"}, wantCL: "5", wantBody: "hello"},
		{name: "content-length is computed", body: "hello",
			m:      mut([]*corev3.HeaderValueOption{setRaw("content-length", "99", false), setRaw("content-type", "text/csv", false)}),
			wantCT: []string{"text/csv"}, wantCL: "5", wantBody: "hello"},
		{name: "empty body loses its content-type",
			m:      mut([]*corev3.HeaderValueOption{setRaw("content-type", "application/json", false), setRaw("content-length", "12", false)}),
			wantCT: nil, wantCL: "0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, bufferedFilter(), on("request_headers", sendOnce(immediate(typev3.StatusCode_OK, tc.body, tc.m, ""))))
			resp, got := e.do(t, http.MethodGet, "/x", nil)
			require.Equal(t, http.StatusOK, resp.StatusCode)
			require.Equal(t, tc.wantCT, resp.Header.Values("Content-Type"))
			require.Equal(t, tc.wantCL, resp.Header.Get("Content-Length"))
			require.Equal(t, tc.wantBody, string(got))
			e.proc.next(t)
		})
	}
}

// LocalReplyImpl::rewrite runs after the processor's mutations: a mapper's status, body and
// headers_to_add, then the body format, whose content-type wins when the body changed and the
// rewrite set none (prepareLocalReply).
func TestLocalReplyConfig(t *testing.T) {
	lrc := &hcmv3.LocalReplyConfig{
		Mappers: []*hcmv3.ResponseMapper{{
			Filter: &accesslogv3.AccessLogFilter{FilterSpecifier: &accesslogv3.AccessLogFilter_StatusCodeFilter{
				StatusCodeFilter: &accesslogv3.StatusCodeFilter{Comparison: &accesslogv3.ComparisonFilter{
					Op: accesslogv3.ComparisonFilter_EQ, Value: &corev3.RuntimeUInt32{DefaultValue: 409},
				}},
			}},
			StatusCode:   wrapperspb.UInt32(400),
			HeadersToAdd: []*corev3.HeaderValueOption{{Header: &corev3.HeaderValue{Key: "x-mapped", Value: "1"}}},
		}},
		BodyFormat: &corev3.SubstitutionFormatString{Format: &corev3.SubstitutionFormatString_JsonFormat{
			JsonFormat: &structpb.Struct{Fields: map[string]*structpb.Value{
				"code":    structpb.NewStringValue("%RESPONSE_CODE%"),
				"message": structpb.NewStringValue("%LOCAL_REPLY_BODY%"),
			}},
		}},
	}
	problem := &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{setRaw("content-type", "application/problem+json", false)}}
	h := func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		code := typev3.StatusCode_Conflict
		if values(t, req.GetRequestHeaders().GetHeaders(), ":path")[0] == "/other" {
			code = typev3.StatusCode_UnprocessableEntity
		}
		return st.Send(immediate(code, `{"code":"in-progress"}`, problem, ""))
	}
	e := newEnv(t, bufferedFilter(), on("request_headers", h), func(c *proxy.Config) { c.LocalReplyConfig = lrc })

	resp, got := e.do(t, http.MethodGet, "/x", nil)
	require.Equal(t, http.StatusBadRequest, resp.StatusCode, "the mapper rewrote 409")
	require.Equal(t, "1", resp.Header.Get("X-Mapped"))
	require.JSONEq(t, `{"code":400,"message":"{\"code\":\"in-progress\"}"}`, string(got))
	require.Equal(t, "application/json", resp.Header.Get("Content-Type"), "the body format's content-type replaces the processor's")
	e.proc.next(t)

	// No mapper matches 422, but the body format still rewrites the body.
	resp, got = e.do(t, http.MethodGet, "/other", nil)
	require.Equal(t, http.StatusUnprocessableEntity, resp.StatusCode)
	require.JSONEq(t, `{"code":422,"message":"{\"code\":\"in-progress\"}"}`, string(got))
	e.proc.next(t)
}

// A gRPC request's local replies, ImmediateResponses included, become trailers-only gRPC
// responses: :status 200, content-type application/grpc, grpc-status from grpc_status or
// mapped from the HTTP status, the body percent-encoded into grpc-message, no body
// (prepareLocalReply with is_grpc).
func TestGrpcLocalReply(t *testing.T) {
	withStatus := immediate(typev3.StatusCode_Conflict, "in progress: 100%", nil, "")
	withStatus.GetImmediateResponse().GrpcStatus = &extprocv3.GrpcStatus{Status: 10}
	for _, tc := range []struct {
		name        string
		resp        *extprocv3.ProcessingResponse
		wantStatus  string
		wantMessage string
	}{
		{"mapped from the HTTP status", immediate(typev3.StatusCode_ServiceUnavailable, "busy", nil, ""), "14", "busy"},
		{"unknown for 409", immediate(typev3.StatusCode_Conflict, "dup", nil, ""), "2", "dup"},
		{"grpc_status wins", withStatus, "10", "in progress: 100%25"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, bufferedFilter(), on("request_headers", sendOnce(tc.resp)))
			resp, got := e.do(t, http.MethodPost, "/pkg.Svc/Method", []byte("\x00\x00\x00\x00\x00"), "Content-Type", "application/grpc")
			require.Equal(t, http.StatusOK, resp.StatusCode)
			require.Equal(t, "application/grpc", resp.Header.Get("Content-Type"))
			require.Equal(t, tc.wantStatus, resp.Header.Get("Grpc-Status"))
			require.Equal(t, tc.wantMessage, resp.Header.Get("Grpc-Message"))
			require.Empty(t, got)
			e.proc.next(t)
		})
	}
}

// The router's own replies go through the encoder filters on 1.37 (ext_proc included) and are
// converted for gRPC too.
func TestGrpcRouterReply(t *testing.T) {
	addr := closedAddr(t)
	e := newEnv(t, bufferedFilter(), nil, func(c *proxy.Config) { c.Upstream = "http://" + addr })
	resp, got := e.do(t, http.MethodPost, "/pkg.Svc/Method", []byte("x"), "Content-Type", "application/grpc+proto")
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, "14", resp.Header.Get("Grpc-Status"))
	require.Contains(t, resp.Header.Get("Grpc-Message"), "upstream connect error")
	require.Empty(t, got)
	log := e.proc.next(t)
	require.Equal(t, []string{"request_headers", "request_body", "response_headers"}, kinds(log.msgs),
		"a trailers-only reply has no body message")
	require.Equal(t, []string{"200"}, values(t, log.msgs[2].GetResponseHeaders().GetHeaders(), ":status"))
	require.True(t, log.msgs[2].GetResponseHeaders().GetEndOfStream())
}
