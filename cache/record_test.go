package cache

import (
	"bytes"
	"encoding/hex"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func goldenResponse() Response {
	return Response{
		Status: 201,
		Headers: []Header{
			{Name: "content-type", Value: []byte("application/json")},
			{Name: "set-cookie", Value: []byte("a=1")},
			{Name: "set-cookie", Value: []byte("b=2")},
		},
		Body: []byte(`{"id":"tx_1"}`),
	}
}

// The v1 encoding is a contract with every later version: records written today must decode
// tomorrow. testdata/response-v1.hex is never regenerated; a change that breaks this test breaks
// stored records.
func TestResponseFormatV1Golden(t *testing.T) {
	raw, err := os.ReadFile("testdata/response-v1.hex")
	require.NoError(t, err)
	golden, err := hex.DecodeString(strings.TrimSpace(string(raw)))
	require.NoError(t, err)

	require.Equal(t, golden, appendResponse(nil, goldenResponse()), "this version must still write v1 byte for byte")
	got, err := decodeResponse(golden)
	require.NoError(t, err)
	require.Equal(t, goldenResponse(), got)
}

func TestResponseRoundTrip(t *testing.T) {
	cases := []Response{
		{Status: 200},
		{Status: 204, Headers: []Header{{Name: "x-empty"}}},
		{Status: 200, Body: bytes.Repeat([]byte{0, 0xff}, 70_000)},
		{Status: 200, Headers: []Header{{Name: "h", Value: []byte("v")}}, BodyOmitted: true},
		{Status: 999, Headers: []Header{{Name: strings.Repeat("n", 300), Value: bytes.Repeat([]byte{0x80}, 20_000)}}},
		// A gRPC response: its message framed, its status in the trailers.
		{Status: 200, Headers: []Header{{Name: "content-type", Value: []byte("application/grpc")}},
			Body: []byte{0, 0, 0, 0, 2, 8, 1}, Trailers: []Header{{Name: "grpc-status", Value: []byte("0")}, {Name: "grpc-message"}}},
		{Status: 200, Trailers: []Header{{Name: "grpc-status", Value: []byte("0")}}, BodyOmitted: true},
	}
	for _, want := range cases {
		b := appendResponse(nil, want)
		require.Len(t, b, encodedResponseSize(want))
		got, err := decodeResponse(b)
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
}

func TestDecodeResponseRejectsMalformed(t *testing.T) {
	valid := appendResponse(nil, goldenResponse())
	cases := map[string][]byte{
		"empty":            nil,
		"unknown format":   append([]byte{2}, valid[1:]...),
		"status too small": appendResponse(nil, Response{Status: 99}),
		"unknown flags":    {1, 200, 1, 0x80, 0},
		"truncated status": {1, 0xc8},
		"huge count":       {1, 0xc8, 0x01, 0, 0xff, 0xff, 0xff, 0xff, 0x0f},
		"truncated header": valid[:12],
		"overlong varint":  {1, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01},
		"omitted but body": {1, 0xc8, 0x01, 1, 0, 0, 'x'},
		// flagTrailers (4) with a count of 0, and with outcome unknown (3).
		"trailers flagged, none":     {1, 0xc8, 0x01, 4, 0, 0},
		"trailers of an unknown one": {1, 0, 4 | 3, 0, 1, 1, 'a', 1, 'b'},
		"huge trailer count":         {1, 0xc8, 0x01, 4, 0, 0xff, 0xff, 0xff, 0xff, 0x0f},
	}
	for name, b := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := decodeResponse(b)
			require.ErrorIs(t, err, ErrCorrupt)
		})
	}
}

// FuzzDecodeResponse checks that no input panics the decoder and that whatever decodes
// re-encodes to an equivalent response.
func FuzzDecodeResponse(f *testing.F) {
	f.Add(appendResponse(nil, goldenResponse()))
	f.Add(appendResponse(nil, Response{Status: 200, BodyOmitted: true}))
	f.Add([]byte{1, 0xc8, 0x01, 0})
	f.Add(appendResponse(nil, Response{Status: 200, Body: []byte{0, 0, 0, 0, 0}, Trailers: []Header{{Name: "grpc-status", Value: []byte("0")}}}))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := decodeResponse(b)
		if err != nil {
			require.ErrorIs(t, err, ErrCorrupt)
			return
		}
		again, err := decodeResponse(appendResponse(nil, r))
		require.NoError(t, err)
		require.Equal(t, r.Status, again.Status)
		require.Equal(t, r.BodyOmitted, again.BodyOmitted)
		require.Equal(t, len(r.Headers), len(again.Headers))
		require.Equal(t, len(r.Trailers), len(again.Trailers))
		require.True(t, bytes.Equal(r.Body, again.Body))
	})
}
