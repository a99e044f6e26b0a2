package extproctest_test

import (
	"net"
	"testing"

	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/idempotency-extproc/idempotency-extproc/internal/extproctest"
)

// The null processor answers every phase Envoy may send, trailers included, in kind.
func TestNullProcessorAnswersEveryPhase(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(srv, extproctest.NullProcessor{})
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	s, err := extprocv3.NewExternalProcessorClient(conn).Process(t.Context())
	require.NoError(t, err)
	for _, tc := range []struct {
		req  *extprocv3.ProcessingRequest
		want func(*extprocv3.ProcessingResponse) bool
	}{
		{&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{}}, func(r *extprocv3.ProcessingResponse) bool { return r.GetRequestHeaders() != nil }},
		{&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{}}, func(r *extprocv3.ProcessingResponse) bool { return r.GetRequestBody() != nil }},
		{&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{}}, func(r *extprocv3.ProcessingResponse) bool { return r.GetRequestTrailers() != nil }},
		{&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{}}, func(r *extprocv3.ProcessingResponse) bool { return r.GetResponseHeaders() != nil }},
		{&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{}}, func(r *extprocv3.ProcessingResponse) bool { return r.GetResponseBody() != nil }},
		{&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{}}, func(r *extprocv3.ProcessingResponse) bool { return r.GetResponseTrailers() != nil }},
	} {
		require.NoError(t, s.Send(tc.req))
		resp, err := s.Recv()
		require.NoError(t, err)
		require.True(t, tc.want(resp), "answer %v to %v", resp, tc.req)
	}

	// In FULL_DUPLEX_STREAMED each chunk goes back as it came.
	d, err := extprocv3.NewExternalProcessorClient(conn).Process(t.Context())
	require.NoError(t, err)
	duplex := filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
	require.NoError(t, d.Send(&extprocv3.ProcessingRequest{
		Request:        &extprocv3.ProcessingRequest_RequestHeaders{},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: duplex, ResponseBodyMode: duplex},
	}))
	_, err = d.Recv()
	require.NoError(t, err)
	for _, last := range []bool{false, true} {
		require.NoError(t, d.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
			RequestBody: &extprocv3.HttpBody{Body: []byte("chunk"), EndOfStream: last},
		}}))
		resp, err := d.Recv()
		require.NoError(t, err)
		sr := resp.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		require.Equal(t, []byte("chunk"), sr.GetBody())
		require.Equal(t, last, sr.GetEndOfStream())
	}
}
