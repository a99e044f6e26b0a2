package extproc

import (
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/protobuf/proto"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

const codecPolicy = `
routes:
  - {name: plain, match: {path_prefix: /v1/payments}}
  - name: templated
    match: {path_prefix: /v1/orders}
    replay_header_fresh: false
    problems:
      request-in-progress: {status: 429, content_type: text/plain, body: "busy {{.Code}}"}
`

func codecServer(t testing.TB) *Server {
	p, err := policy.Parse([]byte(codecPolicy))
	require.NoError(t, err)
	store, err := cache.NewMemory(cache.MemoryOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	s, err := NewServer(Options{Store: store, Policy: p})
	require.NoError(t, err)
	return s
}

// Every answer the codec sends from its encoding made once decodes to the answer itself, and
// every other message is encoded as gRPC's protobuf codec encodes it.
func TestCodecSendsTheAnswers(t *testing.T) {
	s := codecServer(t)
	c := s.Codec()
	require.Equal(t, grpcproto.Name, c.Name(), "Envoy's stream is application/grpc+proto")
	var answers []*extprocv3.ProcessingResponse
	answers = append(answers, continues[:]...)
	answers = append(answers, passThroughRequestHeaders, noStoreResponseHeaders)
	for _, r := range s.routes {
		answers = append(answers, r.stored, r.notStored)
		for _, p := range problems {
			answers = append(answers, r.problems[p], r.grpcProblems[p])
		}
	}
	require.Len(t, s.fixed, len(answers), "each answer built at load, once")
	for _, a := range answers {
		out, err := c.Marshal(a)
		require.NoError(t, err)
		var got extprocv3.ProcessingResponse
		require.NoError(t, proto.Unmarshal(out.Materialize(), &got))
		require.True(t, proto.Equal(a, &got), "%v decodes as %v", a, &got)
		again, err := c.Marshal(a)
		require.NoError(t, err)
		require.Equal(t, out.Materialize(), again.Materialize(), "the same bytes on every send")
	}
	// The answers to a stored response's headers with its expiry: encoded once while their
	// second is current, then forgotten, and still sent right.
	r := s.routes[s.policy.Routes[0]]
	at := s.clock.Now()
	first := []*extprocv3.ProcessingResponse{r.freshHeaders(at, false), r.freshHeaders(at, true)}
	for _, a := range first {
		_, held := s.fresh.m.Load(a)
		require.True(t, held, "the second's answers are encoded once")
	}
	later := r.freshHeaders(at.Add(time.Second), false)
	_, held := s.fresh.m.Load(later)
	require.True(t, held)
	for _, a := range append(first, later) {
		if a != later {
			_, held := s.fresh.m.Load(a)
			require.False(t, held, "a past second's answers are forgotten")
		}
		out, err := c.Marshal(a)
		require.NoError(t, err)
		want, err := encoding.GetCodecV2(grpcproto.Name).Marshal(a)
		require.NoError(t, err)
		require.Equal(t, want.Materialize(), out.Materialize())
	}
	// An answer built for one request: encoded as gRPC's codec does.
	fresh := markResponseHeaders(s.policy.Routes[0], nil, s.clock.Now())
	out, err := c.Marshal(fresh)
	require.NoError(t, err)
	want, err := encoding.GetCodecV2(grpcproto.Name).Marshal(fresh)
	require.NoError(t, err)
	require.Equal(t, want.Materialize(), out.Materialize())
	require.NotContains(t, s.fixed, fresh)
}

// What encoding a first execution's four answers costs, on a route with the default
// expires_header: gRPC's protobuf codec against the server's codec, which sends the two
// CONTINUEs and the second's answer to the response headers from their encoding.
func BenchmarkAnswerEncoding(b *testing.B) {
	s := codecServer(b)
	r := s.routes[s.policy.Routes[0]]
	md := r.metadata.encode(Executed, "", string(make([]byte, 64)))
	answers := []*extprocv3.ProcessingResponse{
		continues[kindRequestHeaders], continues[kindRequestBody], r.freshHeaders(s.clock.Now().Add(time.Hour), false),
		withMetadata(continues[kindResponseBody], false, md),
	}
	for _, tc := range []struct {
		name  string
		codec encoding.CodecV2
	}{{"grpc", encoding.GetCodecV2(grpcproto.Name)}, {"server", s.Codec()}} {
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				for _, a := range answers {
					out, err := tc.codec.Marshal(a)
					if err != nil {
						b.Fatal(err)
					}
					out.Free()
				}
			}
		})
	}
}
