package proxy_test

import (
	"io"
	"net/http"
	"strings"
	"testing"

	mutationrulesv3 "github.com/envoyproxy/go-control-plane/envoy/config/common/mutation_rules/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
)

func sirHeaders(eos bool, kv ...string) *extprocv3.ProcessingResponse {
	m := &corev3.HeaderMap{}
	for i := 0; i+1 < len(kv); i += 2 {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_StreamedImmediateResponse{StreamedImmediateResponse: &extprocv3.StreamedImmediateResponse{
		Response: &extprocv3.StreamedImmediateResponse_HeadersResponse{HeadersResponse: &extprocv3.HttpHeaders{Headers: m, EndOfStream: eos}},
	}}}
}

func sirBody(body string, eos bool) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_StreamedImmediateResponse{StreamedImmediateResponse: &extprocv3.StreamedImmediateResponse{
		Response: &extprocv3.StreamedImmediateResponse_BodyResponse{BodyResponse: &extprocv3.StreamedBodyResponse{Body: []byte(body), EndOfStream: eos}},
	}}}
}

func sirTrailers(kv ...string) *extprocv3.ProcessingResponse {
	m := &corev3.HeaderMap{}
	for i := 0; i+1 < len(kv); i += 2 {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_StreamedImmediateResponse{StreamedImmediateResponse: &extprocv3.StreamedImmediateResponse{
		Response: &extprocv3.StreamedImmediateResponse_TrailersResponse{TrailersResponse: m},
	}}}
}

// sendAll answers request_headers with the given responses, in order, and CONTINUEs the rest.
func sendAll(resps ...*extprocv3.ProcessingResponse) handler {
	return on("request_headers", func(st extprocv3.ExternalProcessor_ProcessServer, _ *extprocv3.ProcessingRequest) error {
		for _, r := range resps {
			if err := st.Send(r); err != nil {
				return err
			}
		}
		return nil
	})
}

// The rules of a streamed immediate response on an HTTP/1 request, from
// Filter::handleStreamingImmediateResponse and the unit tests of
// filter_local_reply_streaming_test.cc: headers first, a body only in request body modes NONE and
// FULL_DUPLEX_STREAMED, anything out of order spurious (status_on_error with Envoy's details, or
// the upstream under failure_mode_allow while no local response started), and the :status kept
// whatever the mutation rules say.
func TestStreamedImmediateResponseRules(t *testing.T) {
	for _, tc := range []struct {
		name      string
		reqBody   filterextproc.ProcessingMode_BodySendMode
		resps     []*extprocv3.ProcessingResponse
		fma       bool
		rules     *mutationrulesv3.HeaderMutationRules
		status    int
		body      string
		details   string
		upstream  int
		spurious  int64
		header    string // x-replayed downstream
		noSecret  bool
		streamed  int64
		trailerOK bool
		before137 bool // proxy.Behaviour.NoStreamedImmediateResponse
	}{
		{name: "headers and body in NONE", reqBody: bodyNONE,
			resps:  []*extprocv3.ProcessingResponse{sirHeaders(false, ":status", "201", "x-replayed", "1"), sirBody("hello ", false), sirBody("world", true)},
			status: 201, body: "hello world", details: "ext_proc_local_response", header: "1", streamed: 1},
		{name: "headers only in BUFFERED", reqBody: bodyBUF,
			resps:  []*extprocv3.ProcessingResponse{sirHeaders(true, ":status", "204", "x-replayed", "1")},
			status: 204, details: "ext_proc_local_response", header: "1", streamed: 1},
		{name: "a body in STREAMED", reqBody: bodySTR,
			resps:  []*extprocv3.ProcessingResponse{sirHeaders(false, ":status", "200"), sirBody("x", true)},
			status: 500, details: "streaming_local_response_body_is_only_supported_in_NONE_or_FULL_DUPLEX_STREAMED_modes", spurious: 1},
		{name: "a body in BUFFERED_PARTIAL", reqBody: bodyPART,
			resps:  []*extprocv3.ProcessingResponse{sirHeaders(false, ":status", "200"), sirBody("x", true)},
			status: 500, details: "streaming_local_response_body_is_only_supported_in_NONE_or_FULL_DUPLEX_STREAMED_modes", spurious: 1},
		{name: "body before headers", reqBody: bodyNONE,
			resps:  []*extprocv3.ProcessingResponse{sirBody("x", true)},
			status: 500, details: "local_response_body_received_before_headers", spurious: 1},
		{name: "trailers before headers", reqBody: bodyNONE,
			resps:  []*extprocv3.ProcessingResponse{sirTrailers("grpc-status", "0")},
			status: 500, details: "local_response_trailers_received_before_headers", spurious: 1},
		{name: "body before headers fails open", reqBody: bodyNONE, fma: true,
			resps:  []*extprocv3.ProcessingResponse{sirBody("x", true)},
			status: 200, details: "via_upstream", upstream: 1, spurious: 1},
		{name: "an empty message is an error, not spurious", reqBody: bodyNONE, fma: true,
			resps: []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_StreamedImmediateResponse{
				StreamedImmediateResponse: &extprocv3.StreamedImmediateResponse{}}}},
			status: 500, details: "Invalid_local_response_headers_continue"},
		{name: "mutation rules apply, :status stays", reqBody: bodyNONE,
			rules: &mutationrulesv3.HeaderMutationRules{
				DisallowSystem:     wrapperspb.Bool(true),
				DisallowExpression: &matcherv3.RegexMatcher{Regex: "x-secret"},
			},
			resps:  []*extprocv3.ProcessingResponse{sirHeaders(true, ":status", "202", "x-secret", "s", "x-replayed", "1")},
			status: 202, details: "ext_proc_local_response", header: "1", noSecret: true, streamed: 1},
		{name: "unknown before 1.37: spurious", reqBody: bodyNONE, before137: true,
			resps:  []*extprocv3.ProcessingResponse{sirHeaders(true, ":status", "200", "x-replayed", "1")},
			status: 500, details: "unhandled_message", spurious: 1},
		{name: "unknown before 1.37: fails open to the upstream", reqBody: bodyNONE, before137: true, fma: true,
			resps:  []*extprocv3.ProcessingResponse{sirHeaders(true, ":status", "200", "x-replayed", "1")},
			status: 200, details: "via_upstream", upstream: 1, spurious: 1},
		{name: "trailers end the response", reqBody: bodyNONE,
			resps:  []*extprocv3.ProcessingResponse{sirHeaders(false, ":status", "200"), sirBody("b", false), sirTrailers("x-t", "v")},
			status: 200, body: "b", details: "ext_proc_local_response", streamed: 1, trailerOK: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := bufferedFilter()
			f.ProcessingMode = fullMode(tc.reqBody, modeSEND, bodyNONE)
			f.FailureModeAllow = tc.fma
			f.MutationRules = tc.rules
			e := newEnv(t, f, sendAll(tc.resps...), func(c *proxy.Config) {
				c.DownstreamTrailers = true
				c.Envoy.NoStreamedImmediateResponse = tc.before137
			})
			resp, got := e.do(t, http.MethodPost, "/k", []byte("req"))
			require.Equal(t, tc.status, resp.StatusCode)
			if tc.body != "" {
				require.Equal(t, tc.body, string(got))
			}
			require.Equal(t, tc.header, resp.Header.Get("X-Replayed"))
			if tc.noSecret {
				require.Empty(t, resp.Header.Values("X-Secret"), "the mutation rules drop it")
			}
			if tc.trailerOK {
				require.Equal(t, "v", resp.Trailer.Get("X-T"))
			}
			require.Equal(t, tc.details, e.record(t).CodeDetails)
			require.Equal(t, tc.upstream, e.up.Total())
			require.Equal(t, tc.spurious, e.proxy.Stats().Spurious)
			require.Equal(t, tc.streamed, e.proxy.Stats().StreamedImmediateResponses)
		})
	}
}

// Once a streamed local response started, a spurious answer fails the request even under
// failure_mode_allow (Filter::onReceiveMessage: localResponseStarted), and with the headers
// downstream that is a reset.
func TestStreamedImmediateResponseSpuriousAfterStartResets(t *testing.T) {
	f := bufferedFilter()
	f.ProcessingMode = fullMode(bodyNONE, modeSEND, bodyNONE)
	f.FailureModeAllow = true
	e := newEnv(t, f, on("request_headers", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		if err := st.Send(sirHeaders(false, ":status", "200")); err != nil {
			return err
		}
		if err := st.Send(sirBody("part", false)); err != nil {
			return err
		}
		return st.Send(cont(req)) // a second answer to the request headers
	}))
	req, err := http.NewRequest(http.MethodGet, e.proxy.URL()+"/k", nil)
	require.NoError(t, err)
	resp, err := e.client.Do(req)
	require.NoError(t, err)
	defer func() { _ = resp.Body.Close() }()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	b, err := io.ReadAll(resp.Body)
	require.Error(t, err, "the response is cut short")
	require.True(t, strings.HasPrefix("part", string(b)))
	require.Equal(t, "spurious_message", e.record(t).CodeDetails)
	require.EqualValues(t, 1, e.proxy.Stats().Spurious)
	require.EqualValues(t, 1, e.proxy.Stats().Resets)
	require.Zero(t, e.up.Total())
}
