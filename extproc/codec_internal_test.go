package extproc

import (
	"bytes"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/mem"
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
		requireSameMessage(t, c, a)
	}
	// Answers built for one request: what Envoy decodes is what gRPC's codec would have sent.
	at = at.Truncate(time.Second)
	rec := &cache.Record{CreatedAt: at, ExpiresAt: at.Add(time.Hour), Response: cache.Response{
		Status: 201, Body: []byte(`{"id":"p_1"}`),
		Headers:  []cache.Header{{Name: "content-type", Value: []byte("application/json")}, {Name: "set-cookie", Value: []byte("a=1")}, {Name: "set-cookie", Value: []byte("b=2")}},
		Trailers: []cache.Header{{Name: "grpc-status", Value: []byte("0")}},
	}}
	md := r.metadata.encode(Replayed, "", string(make([]byte, 64)))
	perRequest := []*extprocv3.ProcessingResponse{
		replayResponse(rec, r.Route, "wait=5"),
		withMetadata(replayResponse(rec, r.Route, ""), true, md),
		withMetadata(continues[kindResponseBody], false, md),
		withMetadata(r.problems[problemInProgress], false, md),
		withMetadata(passThroughRequestHeaders, false, md),
		grpcReplayRefused(rec, r.Route),
		streamedBody(kindRequestBody, []byte("chunk"), true),
	}
	// A replay of 4 KiB: its encoding goes in a buffer of gRPC's pool.
	big := *rec
	big.Response.Body = bytes.Repeat([]byte("x"), 4<<10)
	pooled := replayResponse(&big, r.Route, "")
	require.False(t, mem.IsBelowBufferPoolingThreshold(proto.Size(pooled)))
	perRequest = append(perRequest, pooled)
	perRequest = append(perRequest, streamedReplay(rec, r.Route, "")...)
	perRequest = append(perRequest, markResponseHeaders(s.policy.Routes[0], nil, s.clock.Now()))
	for _, a := range perRequest {
		require.NotContains(t, s.fixed, a)
		requireSameMessage(t, c, a)
	}
}

// requireSameMessage requires that c's encoding of a decodes as gRPC's protobuf codec's does. The
// bytes may differ in the order of the fields: protobuf-go writes a oneof after the other fields,
// go-control-plane's generated encoder (built with -tags vtprotobuf) in field-number order.
func requireSameMessage(t *testing.T, c encoding.CodecV2, a *extprocv3.ProcessingResponse) {
	t.Helper()
	out, err := c.Marshal(a)
	require.NoError(t, err)
	want, err := encoding.GetCodecV2(grpcproto.Name).Marshal(a)
	require.NoError(t, err)
	var got, wanted extprocv3.ProcessingResponse
	require.NoError(t, proto.Unmarshal(out.Materialize(), &got))
	require.NoError(t, proto.Unmarshal(want.Materialize(), &wanted))
	require.True(t, proto.Equal(&wanted, &got), "%v decodes as %v", &wanted, &got)
	require.Len(t, out.Materialize(), len(want.Materialize()))
}

// What encoding a request's answers costs, on a route with the default expires_header: a first
// execution's four and a replay's one (a stored 201 with two headers and a 33-byte body), through
// gRPC's protobuf codec and through the server's codec.
func BenchmarkAnswerEncoding(b *testing.B) {
	s := codecServer(b)
	r := s.routes[s.policy.Routes[0]]
	md := r.metadata.encode(Executed, "", string(make([]byte, 64)))
	now := s.clock.Now()
	rec := &cache.Record{CreatedAt: now, ExpiresAt: now.Add(time.Hour), Response: cache.Response{
		Status: 201, Body: []byte(`{"amount":100,"currency":"EUR"}xx`),
		Headers: []cache.Header{{Name: "content-type", Value: []byte("application/json")}, {Name: "location", Value: []byte("/v1/payments/p_1")}},
	}}
	loads := []struct {
		name    string
		answers []*extprocv3.ProcessingResponse
	}{
		{"first", []*extprocv3.ProcessingResponse{
			continues[kindRequestHeaders], continues[kindRequestBody], r.freshHeaders(now.Add(time.Hour), false),
			withMetadata(continues[kindResponseBody], false, md),
		}},
		{"replay", []*extprocv3.ProcessingResponse{
			withMetadata(replayResponse(rec, r.Route, ""), true, r.metadata.encode(Replayed, "", string(make([]byte, 64)))),
		}},
	}
	for _, l := range loads {
		for _, tc := range []struct {
			name  string
			codec encoding.CodecV2
		}{{"grpc", encoding.GetCodecV2(grpcproto.Name)}, {"server", s.Codec()}} {
			b.Run(l.name+"/"+tc.name, func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					for _, a := range l.answers {
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
}

// Concurrent requests whose expiries fall in different seconds, some behind the latest: each
// gets the answer of its own second, with the body phase as asked, and once they stop the codec holds the encodings of the
// latest second's two answers only, each its own answer's.
func TestFreshEncodingsFollowTheLatestSecond(t *testing.T) {
	s := codecServer(t)
	r := s.routes[s.policy.Routes[0]]
	base := s.clock.Now().Truncate(time.Second)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 3000 {
				at := base.Add(time.Duration((i+g)%3+i/1000) * time.Second)
				resp := r.freshHeaders(at, i%2 == 0)
				var date string
				for _, h := range resp.GetResponseHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
					if h.GetHeader().GetKey() == r.ExpiresHeader {
						date = string(h.GetHeader().GetRawValue())
					}
				}
				if date != string(httpDate(at)) {
					t.Errorf("an expiry of %s answered with %q", at, date)
					return
				}
				if noBody := resp.GetModeOverride() != nil; noBody != (i%2 == 0) {
					t.Errorf("an expiry of %s, body phase off %v, answered with the body phase off %v", at, i%2 == 0, noBody)
					return
				}
			}
		})
	}
	wg.Wait()
	latest := r.fresh.Load()
	require.Equal(t, base.Add(4*time.Second).Unix(), latest.second)
	held := map[*extprocv3.ProcessingResponse]bool{}
	s.fresh.m.Range(func(k, v any) bool {
		resp := k.(*extprocv3.ProcessingResponse)
		held[resp] = true
		var got extprocv3.ProcessingResponse
		require.NoError(t, proto.Unmarshal(v.(mem.Buffer).ReadOnlyData(), &got))
		require.True(t, proto.Equal(resp, &got), "an encoding held is its own answer's")
		return true
	})
	require.Equal(t, map[*extprocv3.ProcessingResponse]bool{latest.resp: true, latest.noStore: true}, held,
		"the encodings held are the latest second's two answers'")
}

// TestCodecDecodesRequests: the codec decodes an ext_proc request with package wire from buffers
// gRPC may take back once it returns (the request keeps none of them), as protobuf does; other
// messages as gRPC's protobuf codec does.
func TestCodecDecodesRequests(t *testing.T) {
	c := codecServer(t).Codec()
	req := &extprocv3.ProcessingRequest{
		Request:         &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte(`{"amount":1}`), EndOfStream: true}},
		MetadataContext: &corev3.Metadata{},
	}
	raw, err := proto.Marshal(req)
	require.NoError(t, err)
	for _, data := range []mem.BufferSlice{
		{mem.SliceBuffer(bytes.Clone(raw))},
		{mem.SliceBuffer(bytes.Clone(raw[:5])), mem.SliceBuffer(bytes.Clone(raw[5:]))},
	} {
		var got extprocv3.ProcessingRequest
		require.NoError(t, c.Unmarshal(data, &got))
		for _, b := range data {
			clear(b.ReadOnlyData()) // as if the pool gave the buffers to another message
		}
		require.True(t, proto.Equal(req, &got), "decoded from %d buffers: %v", len(data), &got)
		// By package wire, which caps the body at its length; protobuf's copy of 12 bytes has room
		// for 16.
		body := got.GetRequestBody().GetBody()
		require.Equal(t, len(body), cap(body), "decoded by package wire")
	}

	health, err := proto.Marshal(&healthpb.HealthCheckRequest{Service: "x"})
	require.NoError(t, err)
	var h healthpb.HealthCheckRequest
	require.NoError(t, c.Unmarshal(mem.BufferSlice{mem.SliceBuffer(health)}, &h))
	require.Equal(t, "x", h.GetService())
}
