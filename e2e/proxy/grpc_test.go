package proxy_test

import (
	"context"
	"encoding/binary"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
)

const unaryPath = "/grpc.testing.TestService/UnaryCall"

// grpcUpstream is a grpc-go TestService whose UnaryCall echoes the request's payload with a
// prefix, sends a header and a trailer, and counts its calls.
type grpcUpstream struct {
	testgrpc.UnimplementedTestServiceServer
	calls atomic.Int64
	addr  string
}

func (u *grpcUpstream) UnaryCall(ctx context.Context, req *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
	u.calls.Add(1)
	if err := grpc.SetHeader(ctx, metadata.Pairs("x-up-header", "h")); err != nil {
		return nil, err
	}
	if err := grpc.SetTrailer(ctx, metadata.Pairs("x-up-trailer", "t")); err != nil {
		return nil, err
	}
	return &testgrpc.SimpleResponse{Payload: &testgrpc.Payload{Body: append([]byte("echo:"), req.GetPayload().GetBody()...)}}, nil
}

func startGrpcUpstream(t *testing.T) *grpcUpstream {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	u := &grpcUpstream{addr: ln.Addr().String()}
	srv := grpc.NewServer()
	testgrpc.RegisterTestServiceServer(srv, u)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(ln)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return u
}

// grpcEnv is a grpc-go client, the proxy over h2c both ways, a fake processor and a grpc-go
// upstream.
type grpcEnv struct {
	proc   *fakeProcessor
	up     *grpcUpstream
	proxy  *proxy.Proxy
	client testgrpc.TestServiceClient
	recs   chan proxy.Record
}

func newGrpcEnv(t *testing.T, mode *filterextproc.ProcessingMode, h handler, opts ...func(*proxy.Config)) *grpcEnv {
	t.Helper()
	e := &grpcEnv{proc: startProcessor(t, h), up: startGrpcUpstream(t), recs: make(chan proxy.Record, 100)}
	cfg := proxy.Config{
		Filter:          &filterextproc.ExternalProcessor{ProcessingMode: mode, MessageTimeout: durationpb.New(5 * time.Second)},
		Processors:      []string{e.proc.addr},
		Upstream:        "http://" + e.up.addr,
		DownstreamHTTP2: true,
		UpstreamHTTP2:   true,
		AccessLog:       func(r proxy.Record) { e.recs <- r },
	}
	for _, o := range opts {
		o(&cfg)
	}
	e.proxy = proxy.Start(t, cfg)
	conn, err := grpc.NewClient(strings.TrimPrefix(e.proxy.URL(), "http://"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	e.client = testgrpc.NewTestServiceClient(conn)
	return e
}

// call makes one unary call with a deadline and returns the response, the header and trailer
// metadata and the status.
func (e *grpcEnv) call(t *testing.T, body string) (*testgrpc.SimpleResponse, metadata.MD, metadata.MD, *status.Status) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var hdr, trl metadata.MD
	resp, err := e.client.UnaryCall(ctx, &testgrpc.SimpleRequest{Payload: &testgrpc.Payload{Body: []byte(body)}}, grpc.Header(&hdr), grpc.Trailer(&trl))
	return resp, hdr, trl, status.Convert(err)
}

func (e *grpcEnv) record(t *testing.T) proxy.Record {
	t.Helper()
	select {
	case r := <-e.recs:
		return r
	case <-time.After(5 * time.Second):
		t.Fatal("no access log record within 5s")
		return proxy.Record{}
	}
}

// grpcFrame is one length-prefixed gRPC message (uncompressed).
func grpcFrame(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	require.NoError(t, err)
	out := make([]byte, 5, 5+len(b))
	binary.BigEndian.PutUint32(out[1:], uint32(len(b)))
	return append(out, b...)
}

func grpcMode(reqBody, respBody filterextproc.ProcessingMode_BodySendMode, trailers filterextproc.ProcessingMode_HeaderSendMode) *filterextproc.ProcessingMode {
	return &filterextproc.ProcessingMode{
		RequestHeaderMode: modeSEND, RequestBodyMode: reqBody, RequestTrailerMode: trailers,
		ResponseHeaderMode: modeSEND, ResponseBodyMode: respBody, ResponseTrailerMode: trailers,
	}
}

// A unary call passes through the proxy over HTTP/2 with its message, headers and trailers;
// with response_trailer_mode SEND the processor gets the trailers (grpc-status among them) and
// its answer's mutations reach the client (ProcessorState::handleTrailersResponse).
func TestGrpcUnaryPassesThrough(t *testing.T) {
	for _, respBody := range []filterextproc.ProcessingMode_BodySendMode{bodyNONE, bodySTR} {
		t.Run(respBody.String(), func(t *testing.T) {
			addTrailer := on("response_trailers", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
				return st.Send(answer(req, &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{
					SetHeaders: []*corev3.HeaderValueOption{setRaw("x-proc-trailer", "p", false)},
				}}))
			})
			e := newGrpcEnv(t, grpcMode(bodyNONE, respBody, modeSEND), addTrailer)
			resp, hdr, trl, st := e.call(t, "hi")
			require.Equal(t, codes.OK, st.Code(), st.Message())
			require.Equal(t, "echo:hi", string(resp.GetPayload().GetBody()))
			require.Equal(t, []string{"h"}, hdr.Get("x-up-header"))
			require.Equal(t, []string{"envoy"}, hdr.Get("server"))
			require.Equal(t, []string{"t"}, trl.Get("x-up-trailer"))
			require.Equal(t, []string{"p"}, trl.Get("x-proc-trailer"), "the trailers answer's mutation reaches the client")
			require.EqualValues(t, 1, e.up.calls.Load())

			msgs := e.proc.next(t).msgs
			want := []string{"request_headers", "response_headers"}
			if respBody == bodySTR {
				want = append(want, "response_body")
			}
			want = append(want, "response_trailers")
			require.Equal(t, want, kinds(msgs))
			rh := msgs[0].GetRequestHeaders().GetHeaders()
			require.Equal(t, []string{unaryPath}, values(t, rh, ":path"))
			require.Equal(t, []string{"application/grpc"}, values(t, rh, "content-type"))
			require.False(t, msgs[1].GetResponseHeaders().GetEndOfStream())
			if respBody == bodySTR {
				b := msgs[2].GetResponseBody()
				require.False(t, b.GetEndOfStream(), "gRPC responses end with trailers")
				require.Equal(t, grpcFrame(t, &testgrpc.SimpleResponse{Payload: &testgrpc.Payload{Body: []byte("echo:hi")}}), b.GetBody())
			}
			tr := msgs[len(msgs)-1].GetResponseTrailers().GetTrailers()
			require.Equal(t, []string{"0"}, values(t, tr, "grpc-status"))
			require.Equal(t, []string{"t"}, values(t, tr, "x-up-trailer"))
			require.Equal(t, "via_upstream", e.record(t).CodeDetails)
		})
	}
}

// An ImmediateResponse to a gRPC request reaches a grpc-go client as the status it maps to, the
// body as the message (percent-encoded on the wire), the mutations as metadata: the trailers-only
// reply of Utility::prepareLocalReply, sent as one HEADERS frame on HTTP/2.
func TestGrpcImmediateResponseIsATrailersOnlyStatus(t *testing.T) {
	for _, tc := range []struct {
		name    string
		code    typev3.StatusCode
		grpc    *extprocv3.GrpcStatus
		body    string
		want    codes.Code
		wantMsg string
	}{
		{"429 maps to UNAVAILABLE", typev3.StatusCode_TooManyRequests, nil, "slow down", codes.Unavailable, "slow down"},
		{"403 maps to PERMISSION_DENIED", typev3.StatusCode_Forbidden, nil, "", codes.PermissionDenied, ""},
		{"500 maps to UNKNOWN", typev3.StatusCode_InternalServerError, nil, "boom", codes.Unknown, "boom"},
		{"grpc_status wins", typev3.StatusCode_Conflict, &extprocv3.GrpcStatus{Status: uint32(codes.FailedPrecondition)}, "50% used\nagain", codes.FailedPrecondition, "50% used\nagain"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ir := immediate(tc.code, tc.body, &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{setRaw("x-idempotency-code", "c", false)}}, "replied")
			ir.GetImmediateResponse().GrpcStatus = tc.grpc
			e := newGrpcEnv(t, grpcMode(bodyNONE, bodyNONE, modeSKIP), on("request_headers", sendOnce(ir)))
			resp, _, trl, st := e.call(t, "hi")
			require.Nil(t, resp)
			require.Equal(t, tc.want, st.Code())
			require.Equal(t, tc.wantMsg, st.Message())
			require.Equal(t, []string{"c"}, trl.Get("x-idempotency-code"))
			require.EqualValues(t, 0, e.up.calls.Load())
			rec := e.record(t)
			require.Equal(t, http.StatusOK, rec.Status, "a gRPC local reply is :status 200")
			require.Equal(t, "replied", rec.CodeDetails)
		})
	}
}

// streamedReply sends a streamed immediate response: headers, one length-prefixed message, and
// trailers with grpc-status 0.
func streamedReply(st extprocv3.ExternalProcessor_ProcessServer, msg []byte) error {
	sir := func(r *extprocv3.StreamedImmediateResponse) *extprocv3.ProcessingResponse {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_StreamedImmediateResponse{StreamedImmediateResponse: r}}
	}
	hv := func(k, v string) *corev3.HeaderValue { return &corev3.HeaderValue{Key: k, RawValue: []byte(v)} }
	for _, r := range []*extprocv3.StreamedImmediateResponse{
		{Response: &extprocv3.StreamedImmediateResponse_HeadersResponse{HeadersResponse: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{hv(":status", "200"), hv("content-type", "application/grpc"), hv("x-replayed", "1")}},
		}}},
		{Response: &extprocv3.StreamedImmediateResponse_BodyResponse{BodyResponse: &extprocv3.StreamedBodyResponse{Body: msg}}},
		{Response: &extprocv3.StreamedImmediateResponse_TrailersResponse{TrailersResponse: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{hv("grpc-status", "0"), hv("x-replayed-trailer", "2")}}}},
	} {
		if err := st.Send(sir(r)); err != nil {
			return err
		}
	}
	return nil
}

// A streamed immediate response (headers, a length-prefixed message, trailers) reaches the
// grpc-go client as a normal unary response and the upstream never runs. With request body mode
// NONE it answers the request headers; under FULL_DUPLEX_STREAMED the processor holds that
// answer until the request's message has arrived, which the headers callback state allows
// (Filter::handleDataStreamedModeBase keeps it while body chunks go out).
func TestGrpcStreamedImmediateResponse(t *testing.T) {
	stored := &testgrpc.SimpleResponse{Payload: &testgrpc.Payload{Body: []byte("stored")}}
	duplexMode := filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
	for _, tc := range []struct {
		name    string
		reqBody filterextproc.ProcessingMode_BodySendMode
		// headersFirst sends the response's headers as the answer to the request headers and
		// the rest once the request's message arrived (the request body still goes to the
		// processor under FULL_DUPLEX_STREAMED: RequestWithBodyDuplexAndLocalResponseWithBody).
		headersFirst bool
	}{
		{"NONE", bodyNONE, false},
		{"FULL_DUPLEX_STREAMED/held", duplexMode, false},
		{"FULL_DUPLEX_STREAMED/headers first", duplexMode, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reqBody := tc.reqBody
			duplex := reqBody == duplexMode
			var seen []byte
			parts := func(st extprocv3.ExternalProcessor_ProcessServer, from int) error {
				all := []*extprocv3.ProcessingResponse{
					sirHeaders(false, ":status", "200", "content-type", "application/grpc", "x-replayed", "1"),
					sirBody(string(grpcFrame(t, stored)), false),
					sirTrailers("grpc-status", "0", "x-replayed-trailer", "2"),
				}
				for _, r := range all[from:] {
					if err := st.Send(r); err != nil {
						return err
					}
				}
				return nil
			}
			h := func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
				switch {
				case kind(req) == "request_headers" && !duplex:
					return parts(st, 0)
				case kind(req) == "request_headers" && tc.headersFirst:
					return st.Send(sirHeaders(false, ":status", "200", "content-type", "application/grpc", "x-replayed", "1"))
				case kind(req) == "request_body":
					seen = append(seen, req.GetRequestBody().GetBody()...)
					if req.GetRequestBody().GetEndOfStream() {
						if tc.headersFirst {
							return parts(st, 1)
						}
						return parts(st, 0)
					}
				}
				return nil
			}
			e := newGrpcEnv(t, grpcMode(reqBody, bodyNONE, modeSEND), h, func(c *proxy.Config) {
				if tc.headersFirst {
					// The message reaches the filter only after the headers' answer: it must
					// still go to the processor once the local response started.
					c.Shapes = func(*http.Request) proxy.Shapes {
						return proxy.Shapes{Request: proxy.BodyShape{DuringHeaders: proxy.Held}}
					}
				}
			})
			resp, hdr, trl, st := e.call(t, "hi")
			require.Equal(t, codes.OK, st.Code(), st.Message())
			require.Equal(t, "stored", string(resp.GetPayload().GetBody()))
			require.Equal(t, []string{"1"}, hdr.Get("x-replayed"))
			require.Equal(t, []string{"2"}, trl.Get("x-replayed-trailer"))
			require.EqualValues(t, 0, e.up.calls.Load(), "the upstream is never called")
			log := e.proc.next(t)
			if duplex {
				// grpc-go ends the request with an empty DATA frame of its own: a second body
				// message may carry only the end of stream.
				require.Equal(t, "request_headers", kind(log.msgs[0]))
				for _, m := range log.msgs[1:] {
					require.Equal(t, "request_body", kind(m))
				}
				require.Equal(t, grpcFrame(t, &testgrpc.SimpleRequest{Payload: &testgrpc.Payload{Body: []byte("hi")}}), seen)
			} else {
				require.Equal(t, []string{"request_headers"}, kinds(log.msgs), "the local response is not sent to the processor")
			}
			require.Equal(t, "ext_proc_local_response", e.record(t).CodeDetails)
			require.EqualValues(t, 1, e.proxy.Stats().StreamedImmediateResponses)
		})
	}
}

// In a BUFFERED request body mode a streamed immediate response that announces a body fails the
// request with status_on_error and Envoy's details; the gRPC client sees the 500 as UNKNOWN.
func TestGrpcStreamedImmediateResponseNeedsNoneOrDuplex(t *testing.T) {
	stored := &testgrpc.SimpleResponse{Payload: &testgrpc.Payload{Body: []byte("stored")}}
	e := newGrpcEnv(t, grpcMode(bodyBUF, bodyNONE, modeSEND), on("request_headers", func(st extprocv3.ExternalProcessor_ProcessServer, _ *extprocv3.ProcessingRequest) error {
		return streamedReply(st, grpcFrame(t, stored))
	}))
	resp, _, _, st := e.call(t, "hi")
	require.Nil(t, resp)
	require.Equal(t, codes.Unknown, st.Code(), "500 maps to UNKNOWN (Grpc::Utility::httpToGrpcStatus)")
	require.EqualValues(t, 0, e.up.calls.Load())
	require.Equal(t, "streaming_local_response_body_is_only_supported_in_NONE_or_FULL_DUPLEX_STREAMED_modes", e.record(t).CodeDetails)
	require.EqualValues(t, 1, e.proxy.Stats().Spurious)
	require.Zero(t, e.proxy.Stats().StreamedImmediateResponses)
}

// A reset on HTTP/2 is an RST_STREAM of the one stream: here a spurious answer after a streamed
// local response started (always fail-closed then, and with the headers downstream the local
// reply becomes a reset).
func TestGrpcResetIsAnRSTStream(t *testing.T) {
	var streams atomic.Int64
	e := newGrpcEnv(t, grpcMode(bodyNONE, bodyNONE, modeSEND), on("request_headers", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		if streams.Add(1) > 1 {
			return st.Send(cont(req))
		}
		if err := st.Send(sirHeaders(false, ":status", "200", "content-type", "application/grpc")); err != nil {
			return err
		}
		return st.Send(cont(req)) // spurious: the request headers were answered
	}))
	resp, _, _, st := e.call(t, "hi")
	require.Nil(t, resp)
	require.Equal(t, codes.Internal, st.Code())
	require.Contains(t, st.Message(), "RST_STREAM", "the stream is reset, not ended without trailers")
	require.EqualValues(t, 1, e.proxy.Stats().Resets)
	require.EqualValues(t, 0, e.up.calls.Load())

	// The connection survives the reset: the next call on it works.
	resp, _, _, st = e.call(t, "again")
	require.Equal(t, codes.OK, st.Code(), st.Message())
	require.Equal(t, "echo:again", string(resp.GetPayload().GetBody()))
}

// An upstream's trailers-only answer (here UNIMPLEMENTED) reaches the processor as response
// headers with end_of_stream and grpc-status among them (Filter::encodeHeaders), and the client
// as its status.
func TestGrpcUpstreamTrailersOnly(t *testing.T) {
	e := newGrpcEnv(t, grpcMode(bodyNONE, bodySTR, modeSEND), nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := e.client.EmptyCall(ctx, &testgrpc.Empty{})
	require.Equal(t, codes.Unimplemented, status.Code(err))
	msgs := e.proc.next(t).msgs
	require.Equal(t, []string{"request_headers", "response_headers"}, kinds(msgs))
	rh := msgs[1].GetResponseHeaders()
	require.True(t, rh.GetEndOfStream(), "a trailers-only response ends at its headers")
	require.Equal(t, []string{"12"}, values(t, rh.GetHeaders(), "grpc-status"))
}
