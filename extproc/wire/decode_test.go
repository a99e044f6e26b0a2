package wire

import (
	"bytes"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-extproc/idempotency-extproc/internal/extproctest"
)

func mustStruct(t testing.TB, m map[string]any) *structpb.Struct {
	s, err := structpb.NewStruct(m)
	require.NoError(t, err)
	return s
}

// envoyMessages are a BUFFERED request's four messages as Envoy sends them with the shipped
// configuration (envoy/envoy.yaml: its attributes, those it yields without mTLS; the empty
// metadata_context it sends with every message), then the other phases, fields and values the
// hand decoder reads.
func envoyMessages(t testing.TB) []*extprocv3.ProcessingRequest {
	attrs := func(m map[string]any) map[string]*structpb.Struct {
		return map[string]*structpb.Struct{"envoy.filters.http.ext_proc": mustStruct(t, m)}
	}
	msgs := []*extprocv3.ProcessingRequest{
		{
			Request:    &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: extproctest.EnvoyRequestHeaders("k-000000000001", "6f1c2b1e-9a4d-4c1e-8b1a-000000000001", 33)}}},
			Attributes: attrs(map[string]any{"request.id": "6f1c2b1e-9a4d-4c1e-8b1a-000000000001", "xds.route_name": "default"}),
			ProtocolConfig: &extprocv3.ProtocolConfiguration{
				RequestBodyMode: filterextproc.ProcessingMode_BUFFERED, ResponseBodyMode: filterextproc.ProcessingMode_BUFFERED,
			},
		},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte(`{"amount":100,"currency":"EUR"}`), EndOfStream: true}}},
		{
			Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
				{Key: ":status", RawValue: []byte("201")}, {Key: "content-type", RawValue: []byte("application/json")},
				{Key: "content-length", RawValue: []byte("2")}, {Key: "date", RawValue: []byte("Mon, 07 Dec 2026 10:00:00 GMT")},
			}}}},
			Attributes: attrs(map[string]any{"response.code": 201, "response.code_details": "via_upstream", "response.flags": 0, "upstream.request_attempt_count": 1}),
		},
		{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: []byte("ok"), EndOfStream: true}}},
		// The other phases, fields and values.
		{
			Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
				{Key: "x-old", Value: "plain value"}, {Key: "empty"},
			}}}},
			ProtocolConfig: &extprocv3.ProtocolConfiguration{
				RequestBodyMode: filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED, ResponseBodyMode: filterextproc.ProcessingMode_STREAMED,
				SendBodyWithoutWaitingForHeaderResponse: true,
			},
		},
		{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{}}}},
		{
			Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{}},
			Attributes: attrs(map[string]any{
				"nested": map[string]any{"list": []any{1.5, "two", true, nil, map[string]any{}, []any{}}, "off": false},
			}),
		},
		{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{Trailers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: "grpc-status", RawValue: []byte("0")}}}}}},
		{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}},
		{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{EndOfStream: true}}, ObservabilityMode: true},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{}}},
		{
			Request:         &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte("x")}},
			MetadataContext: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy.filters.http.jwt_authn": mustStruct(t, map[string]any{"sub": "u-1"})}},
		},
	}
	// Envoy sends the forwarded metadata with every message, empty when it forwards none.
	for _, m := range msgs {
		if m.MetadataContext == nil {
			m.MetadataContext = &corev3.Metadata{}
		}
	}
	return msgs
}

// sameMessage fails unless a and b encode the same (deterministically: map keys sorted), which
// holds for messages that proto.Equal holds for, and for those with the same NaNs.
func sameMessage(t testing.TB, want, got proto.Message, msgAndArgs ...any) {
	t.Helper()
	opts := proto.MarshalOptions{Deterministic: true}
	w, err := opts.Marshal(want)
	require.NoError(t, err)
	g, err := opts.Marshal(got)
	require.NoError(t, err)
	require.Equal(t, w, g, msgAndArgs...)
}

// TestDecodeRequest: Envoy's messages decode by hand (no fallback) to what proto.Unmarshal
// gives.
func TestDecodeRequest(t *testing.T) {
	for i, m := range envoyMessages(t) {
		raw, err := proto.Marshal(m)
		require.NoError(t, err)
		var want extprocv3.ProcessingRequest
		require.NoError(t, proto.Unmarshal(raw, &want))

		var got extprocv3.ProcessingRequest
		require.True(t, (&decoder{buf: raw}).request(&got), "message %d: decoded by hand", i)
		sameMessage(t, &want, &got, "message %d", i)
	}
}

// TestDecodeRequestFallsBack: what the hand decoder does not read goes to proto.Unmarshal, with
// the same message or the same failure.
func TestDecodeRequestFallsBack(t *testing.T) {
	headers := mustMarshal(t, envoyMessages(t)[0])
	body := mustMarshal(t, envoyMessages(t)[1])
	withTyped := mustMarshal(t, &extprocv3.ProcessingRequest{
		Request:         &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte("x")}},
		MetadataContext: &corev3.Metadata{TypedFilterMetadata: map[string]*anypb.Any{"f": {TypeUrl: "type.googleapis.com/x"}}},
	})
	// corrupt encodes m and makes the string "zz" in it not UTF-8.
	corrupt := func(m *extprocv3.ProcessingRequest) []byte {
		raw := mustMarshal(t, m)
		i := bytes.Index(raw, []byte("zz"))
		require.GreaterOrEqual(t, i, 0)
		raw[i] = 0xff
		return raw
	}
	withAttrs := func(v map[string]any) *extprocv3.ProcessingRequest {
		return &extprocv3.ProcessingRequest{Attributes: map[string]*structpb.Struct{"envoy.filters.http.ext_proc": mustStruct(t, v)}}
	}
	deep := map[string]any{"leaf": 1}
	for range maxStructDepth + 2 {
		deep = map[string]any{"in": deep}
	}
	// An attributes entry "k" whose Struct's field "f" holds a Value with two kinds (bool, then
	// null).
	twice := varintField(varintField(nil, 4, 1), 1, 0)
	field := bytesField(nil, 1, bytesField(bytesField(nil, 1, []byte("f")), 2, twice))
	kindTwice := bytesField(nil, 9, bytesField(bytesField(nil, 1, []byte("k")), 2, field))
	for name, raw := range map[string][]byte{
		"an attribute's name that is not UTF-8":   corrupt(withAttrs(map[string]any{"zz": 1})),
		"an attribute's string that is not UTF-8": corrupt(withAttrs(map[string]any{"a": "zz"})),
		"an attributes' key that is not UTF-8":    corrupt(&extprocv3.ProcessingRequest{Attributes: map[string]*structpb.Struct{"zz": {}}}),
		"a header's value that is not UTF-8":      corrupt(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: "k", Value: "zz"}}}}}}),
		"a metadata namespace that is not UTF-8":  corrupt(&extprocv3.ProcessingRequest{MetadataContext: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"zz": {}}}}),
		"attributes nested deeper than the bound": mustMarshal(t, withAttrs(deep)),
		"a Value's kind twice":                    kindTwice,
		"typed metadata":                          withTyped,
		"an unknown field":                        protowire.AppendVarint(protowire.AppendTag(append([]byte(nil), body...), 99, protowire.VarintType), 7),
		"the oneof twice":                         append(append([]byte(nil), body...), body...),
		"the headers and a body":                  append(append([]byte(nil), headers...), body...),
		"a key that is not UTF-8":                 corrupt(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: "zz"}}}}}}),
		"cut short":                               headers[:len(headers)-3],
		"a group":                                 protowire.AppendTag(nil, 2, protowire.StartGroupType),
	} {
		var got extprocv3.ProcessingRequest
		require.False(t, (&decoder{buf: raw}).request(&got), "%s: left to proto.Unmarshal", name)
		var want extprocv3.ProcessingRequest
		wantErr := proto.Unmarshal(raw, &want)
		got.Reset()
		gotErr := DecodeRequest(raw, &got)
		if wantErr != nil {
			require.EqualError(t, gotErr, wantErr.Error(), name)
			continue
		}
		require.NoError(t, gotErr, name)
		sameMessage(t, &want, &got, name)
	}
}

func mustMarshal(t testing.TB, m proto.Message) []byte {
	raw, err := proto.Marshal(m)
	require.NoError(t, err)
	return raw
}

// varintField and bytesField append field num, a varint or a length-delimited value, to b.
func varintField(b []byte, num protowire.Number, v uint64) []byte {
	return protowire.AppendVarint(protowire.AppendTag(b, num, protowire.VarintType), v)
}

func bytesField(b []byte, num protowire.Number, v []byte) []byte {
	return protowire.AppendBytes(protowire.AppendTag(b, num, protowire.BytesType), v)
}

// TestDecodeRequestLikeProtobuf: what the hand decoder reads where protobuf has a rule of its
// own: a scalar repeated (the last one counts), an enum or a null beyond its values (kept as
// the number, cut to 32 bits), a header map with no header (nil headers, not an empty slice).
func TestDecodeRequestLikeProtobuf(t *testing.T) {
	null := bytesField(nil, 1, []byte("k"))
	null = bytesField(null, 2, varintField(nil, 1, 1<<33+7))
	for name, raw := range map[string][]byte{
		"observability_mode twice":    varintField(varintField(nil, 10, 1), 10, 0),
		"end_of_stream twice":         bytesField(nil, 4, varintField(varintField(nil, 2, 0), 2, 1)),
		"a body mode beyond its enum": bytesField(nil, 11, varintField(varintField(nil, 1, 1<<40+3), 2, 99)),
		"a null beyond its enum":      bytesField(nil, 9, bytesField(bytesField(nil, 1, []byte("a")), 2, bytesField(nil, 1, null))),
		"no header":                   bytesField(nil, 2, bytesField(nil, 1, nil)),
	} {
		var want, got extprocv3.ProcessingRequest
		require.NoError(t, proto.Unmarshal(raw, &want), name)
		require.True(t, (&decoder{buf: raw}).request(&got), "%s: decoded by hand", name)
		sameMessage(t, &want, &got, name)
		if name == "no header" {
			require.NotNil(t, got.GetRequestHeaders().GetHeaders())
			require.Nil(t, got.GetRequestHeaders().GetHeaders().Headers, "as protobuf decodes it")
		}
	}
}

// TestDecodedBytesCapped: a body or raw header value points into the message's copy, and an
// append to it reallocates instead of writing over the fields that follow it.
func TestDecodedBytesCapped(t *testing.T) {
	det := proto.MarshalOptions{Deterministic: true}
	raw, err := det.Marshal(envoyMessages(t)[0])
	require.NoError(t, err)
	var m extprocv3.ProcessingRequest
	require.NoError(t, DecodeRequest(raw, &m))
	hs := m.GetRequestHeaders().GetHeaders().GetHeaders()
	first := hs[0].RawValue
	require.Equal(t, len(first), cap(first))
	_ = append(first, "xxxxxxxx"...)
	require.Equal(t, ":path", hs[1].Key)
	require.Equal(t, "/v1/payments", string(hs[1].RawValue))
	want, err := det.Marshal(envoyMessages(t)[0])
	require.NoError(t, err)
	require.Equal(t, want, raw, "the message's bytes are unchanged")
}

// FuzzDecodeRequest: on any bytes, the codec's decoding gives what proto.Unmarshal gives: the
// same message, or a failure where it fails.
func FuzzDecodeRequest(f *testing.F) {
	for _, m := range envoyMessages(f) {
		raw, err := proto.Marshal(m)
		require.NoError(f, err)
		f.Add(raw)
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		var want, got extprocv3.ProcessingRequest
		wantErr := proto.Unmarshal(raw, &want)
		gotErr := DecodeRequest(append([]byte(nil), raw...), &got)
		if wantErr != nil {
			require.Error(t, gotErr)
			return
		}
		require.NoError(t, gotErr)
		sameMessage(t, &want, &got)
	})
}

// BenchmarkRequestDecoding decodes a BUFFERED request's four messages as Envoy sends them with
// the shipped configuration's attributes: protobuf's decoder, as gRPC's codec runs it, against
// DecodeRequest after the copy the server's codec makes of each message.
func BenchmarkRequestDecoding(b *testing.B) {
	msgs := envoyMessages(b)[:4]
	raws := make([][]byte, len(msgs))
	for i, m := range msgs {
		var err error
		raws[i], err = proto.Marshal(m)
		require.NoError(b, err)
	}
	for _, c := range []struct {
		name   string
		decode func([]byte, *extprocv3.ProcessingRequest) error
	}{
		{"protobuf", func(raw []byte, m *extprocv3.ProcessingRequest) error { return proto.Unmarshal(raw, m) }},
		{"wire", func(raw []byte, m *extprocv3.ProcessingRequest) error {
			return DecodeRequest(append([]byte(nil), raw...), m)
		}},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				for _, raw := range raws {
					var m extprocv3.ProcessingRequest
					if err := c.decode(raw, &m); err != nil {
						b.Fatal(err)
					}
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/1000, "µs/request")
		})
	}
}
