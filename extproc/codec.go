package extproc

import (
	"sync"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/wire"
)

// The answers that never vary (answer.go: the CONTINUE answers, the pass-through, and each route's
// answers to response headers and its problems, built at load) are encoded once too, and so are
// the answers to a stored response's headers with its expiry, built once a second. gRPC's
// protobuf codec sizes and encodes every message it sends, and three of a first execution's four
// answers are such answers (what it saves: docs/performance.md, the answers' encoding).

// codec is gRPC's protobuf codec, except that an answer built once is sent as its encoding, made
// once, and that Envoy's messages are decoded by package wire. It tells those answers by their
// address: a shared answer is never changed. It names itself as the codec it embeds.
type codec struct {
	encoding.CodecV2
	fixed map[*extprocv3.ProcessingResponse]mem.Buffer
	fresh *encodings
}

// encodings holds the encodings of the answers that are built once a second (route.freshHeaders)
// while they are current.
type encodings struct{ m sync.Map } // *extprocv3.ProcessingResponse → mem.Buffer

// add encodes resps and holds their encodings; an answer it cannot encode is left to the codec.
func (e *encodings) add(resps ...*extprocv3.ProcessingResponse) {
	for _, resp := range resps {
		if b, err := proto.Marshal(resp); err == nil {
			e.m.Store(resp, mem.SliceBuffer(b))
		}
	}
}

// remove forgets the encodings of resps, which are no longer current.
func (e *encodings) remove(resps ...*extprocv3.ProcessingResponse) {
	for _, resp := range resps {
		e.m.Delete(resp)
	}
}

// Codec returns the gRPC codec to serve s with (grpc.ForceServerCodecV2): gRPC's protobuf codec,
// sending the answers s built at load as their encoding, made once, instead of encoding them
// again for each request (the same bytes), and the others through go-control-plane's generated
// encoder when the binary is built with -tags vtprotobuf (the same message; a oneof may come
// first). It decodes Envoy's messages with package wire (the same message), others as gRPC's
// protobuf codec does.
func (s *Server) Codec() encoding.CodecV2 {
	return codec{CodecV2: encoding.GetCodecV2(grpcproto.Name), fixed: s.fixed, fresh: &s.fresh}
}

// Unmarshal decodes v, an ext_proc request, with package wire, from a copy of data (gRPC gives
// data's buffers back to its pool once Unmarshal returns, and the request keeps its bytes);
// anything else as gRPC's protobuf codec does.
func (c codec) Unmarshal(data mem.BufferSlice, v any) error {
	m, ok := v.(*extprocv3.ProcessingRequest)
	if !ok {
		return c.CodecV2.Unmarshal(data, v)
	}
	return wire.DecodeRequest(data.Materialize(), m)
}

func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	if m, ok := v.(*extprocv3.ProcessingResponse); ok {
		// A SliceBuffer is never written to or given back to a pool: its Free does nothing.
		if b, ok := c.fixed[m]; ok {
			return mem.BufferSlice{b}, nil
		}
		if b, ok := c.fresh.m.Load(m); ok {
			return mem.BufferSlice{b.(mem.Buffer)}, nil
		}
	}
	m, ok := v.(vtMessage)
	if !ok {
		return c.CodecV2.Marshal(v)
	}
	// As gRPC's protobuf codec places a message: in a buffer of its own when it is small, else in
	// one of gRPC's pool.
	size := m.SizeVT()
	if mem.IsBelowBufferPoolingThreshold(size) {
		buf := make([]byte, size)
		if _, err := m.MarshalToSizedBufferVTStrict(buf); err != nil {
			return nil, err
		}
		return mem.BufferSlice{mem.SliceBuffer(buf)}, nil
	}
	pool := mem.DefaultBufferPool()
	buf := pool.Get(size)
	if _, err := m.MarshalToSizedBufferVTStrict((*buf)[:size]); err != nil {
		pool.Put(buf)
		return nil, err
	}
	return mem.BufferSlice{mem.NewBuffer(buf, pool)}, nil
}

// vtMessage is a message with the encoder go-control-plane generates beside protobuf's
// (vtprotobuf, built with -tags vtprotobuf): it sizes and writes the message without protobuf's
// reflection, unknown fields included; a oneof may come before other fields, where protobuf-go
// writes it after them.
type vtMessage interface {
	SizeVT() int
	MarshalToSizedBufferVTStrict(dAtA []byte) (int, error)
}

// fixedAnswers encodes the answers that never vary: the shared ones of answer.go and those of
// each route.
func fixedAnswers(routes map[*policy.Route]*route) (map[*extprocv3.ProcessingResponse]mem.Buffer, error) {
	all := append([]*extprocv3.ProcessingResponse{passThroughRequestHeaders, noStoreResponseHeaders}, continues[:]...)
	for _, r := range routes {
		all = append(all, r.stored, r.notStored)
		for _, resp := range r.problems {
			all = append(all, resp)
		}
		for _, resp := range r.grpcProblems {
			all = append(all, resp)
		}
	}
	fixed := make(map[*extprocv3.ProcessingResponse]mem.Buffer, len(all))
	for _, resp := range all {
		b, err := proto.Marshal(resp)
		if err != nil {
			return nil, err
		}
		fixed[resp] = mem.SliceBuffer(b)
	}
	return fixed, nil
}
