package cache

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache/seal"
)

// goldenKeyring is the keyring of testdata/response-v2-sealed.hex: the key 00 01 … 1f as
// "golden1".
func goldenKeyring(t testing.TB) *seal.Keyring {
	t.Helper()
	key := make([]byte, seal.KeySize)
	for i := range key {
		key[i] = byte(i)
	}
	k, err := seal.ParseKeyring([]byte("golden1:" + base64.StdEncoding.EncodeToString(key)))
	require.NoError(t, err)
	return k
}

// The sealed format is a contract with every later version, as v1 is. testdata/
// response-v2-sealed.hex was made once with crypto/cipher (format byte 2, then the envelope of
// testdata/response-v1.hex sealed under "idempotency:golden" with a fixed nonce) and is never
// regenerated.
func TestResponseFormatSealedGolden(t *testing.T) {
	raw, err := os.ReadFile("testdata/response-v2-sealed.hex")
	require.NoError(t, err)
	golden, err := hex.DecodeString(strings.TrimSpace(string(raw)))
	require.NoError(t, err)

	got, err := decodeStoredResponse(bytes.Clone(golden), goldenKeyring(t), "idempotency:golden")
	require.NoError(t, err)
	require.Equal(t, goldenResponse(), got)

	_, err = decodeStoredResponse(bytes.Clone(golden), goldenKeyring(t), "idempotency:other")
	require.ErrorIs(t, err, ErrUnreadable)
	require.ErrorIs(t, err, seal.ErrTampered)
}

func TestStoredResponseRoundTrip(t *testing.T) {
	ring := goldenKeyring(t)
	cases := []Response{
		goldenResponse(),
		{Status: 200},
		{Status: 200, Body: bytes.Repeat([]byte{0, 0xff}, 70_000)},
		{Status: 502, Headers: []Header{{Name: "h", Value: []byte("v")}}, BodyOmitted: true},
		{Status: 0, OutcomeUnknown: true, BodyOmitted: true},
	}
	for _, want := range cases {
		for _, r := range []*seal.Keyring{nil, ring} {
			b := appendStoredResponse([]byte("prefix"), want, r, []byte("idempotency:k"))
			require.Equal(t, "prefix", string(b[:6]))
			b = b[6:]
			require.Len(t, b, storedResponseSize(want, r))
			if r == nil {
				require.Equal(t, appendResponse(nil, want), b, "without a keyring, the plain encoding")
			} else {
				require.Equal(t, responseSealed, b[0])
			}
			got, err := decodeStoredResponse(b, r, "idempotency:k")
			require.NoError(t, err)
			require.Equal(t, want, got)
		}
	}
	// A plain record reads with a keyring (written before sealing was turned on).
	got, err := decodeStoredResponse(appendResponse(nil, goldenResponse()), ring, "idempotency:k")
	require.NoError(t, err)
	require.Equal(t, goldenResponse(), got)
}

func TestStoredResponseRefusals(t *testing.T) {
	ring := goldenKeyring(t)
	sealed := func() []byte { return appendStoredResponse(nil, goldenResponse(), ring, []byte("k")) }

	_, err := decodeStoredResponse(sealed(), nil, "k")
	require.ErrorIs(t, err, ErrUnreadable, "sealing turned off")
	require.ErrorIs(t, err, ErrCorrupt)
	require.Contains(t, err.Error(), "no keyring")

	b := sealed()
	b[len(b)-1] ^= 0x80
	_, err = decodeStoredResponse(b, ring, "k")
	require.ErrorIs(t, err, ErrUnreadable)
	require.ErrorIs(t, err, seal.ErrTampered)

	// A sealed response whose plaintext is not a response: authentic but corrupt, not unreadable.
	notAResponse := append([]byte{responseSealed}, ring.Seal(nil, []byte{responseSealed, 1, 2}, []byte("k"))...)
	_, err = decodeStoredResponse(notAResponse, ring, "k")
	require.ErrorIs(t, err, ErrCorrupt)
	require.NotErrorIs(t, err, ErrUnreadable)

	_, err = decodeStoredResponse([]byte{responseSealed}, ring, "k")
	require.ErrorIs(t, err, ErrUnreadable)
}

// TestMemorySealedCompletionCopiesOnce: sealing encrypts in place, so a sealed completion too
// big for a segment still allocates its encoding only, and a sealed one that fits allocates
// nothing.
func TestMemorySealedCompletionCopiesOnce(t *testing.T) {
	m, err := NewMemory(MemoryOptions{Keyring: goldenKeyring(t)})
	require.NoError(t, err)
	ctx := context.Background()
	const n = 50
	claim := internalClaim
	claim.Fingerprint = make([]byte, 32)
	for _, size := range []int{1024, 4 * m.maxInline} {
		leases := make([]Lease, n+1+10)
		for i := range leases {
			l, _, err := m.Acquire(ctx, "sealed-"+strconv.Itoa(size)+"-"+strconv.Itoa(i), claim)
			require.NoError(t, err)
			leases[i] = l
		}
		resp := Response{Status: 201, Headers: []Header{{Name: "content-type", Value: []byte("application/json")}}, Body: make([]byte, size)}
		next := 0
		for ; next < 10; next++ { // fill the pool
			require.NoError(t, m.Complete(ctx, leases[next], resp))
		}
		allocs := testing.AllocsPerRun(n, func() {
			resp.Body[0] = byte(next)
			if err := m.Complete(ctx, leases[next], resp); err != nil {
				t.Fatal(err)
			}
			next++
		})
		switch {
		case raceEnabled:
			// The race detector adds allocations of its own: `make allocs` counts without it.
			t.Logf("%.1f allocations per sealed completion of %d bytes, not counted under the race detector", allocs, size)
		case size == 1024:
			require.Less(t, allocs, 0.1, "allocations per sealed completion of 1 KiB")
		default:
			require.Equal(t, 1.0, allocs, "allocations per big sealed completion: its encoding only")
		}
		for i := 10; i < next; i++ {
			rec, err := lookup(m, "sealed-"+strconv.Itoa(size)+"-"+strconv.Itoa(i))
			require.NoError(t, err)
			require.Equal(t, byte(i), rec.Response.Body[0], "record %d keeps its own body", i)
			require.Len(t, rec.Response.Body, size)
			require.Equal(t, claim.Fingerprint, rec.Fingerprint)
		}
	}
	checkMemory(t, m)
}

// TestMemorySealedStub: a completed record too big for the store keeps a stub, sealed too.
func TestMemorySealedStub(t *testing.T) {
	m, err := NewMemory(MemoryOptions{MaxBytes: 4096, Keyring: goldenKeyring(t)})
	require.NoError(t, err)
	l, _, err := m.Acquire(t.Context(), "too-big", internalClaim)
	require.NoError(t, err)
	require.NoError(t, m.Complete(t.Context(), l, Response{Status: 299, Body: make([]byte, 8192)}))
	b, err := m.StoredResponse("too-big")
	require.NoError(t, err)
	require.Equal(t, responseSealed, b[0])
	rec, err := lookup(m, "too-big")
	require.NoError(t, err)
	require.Equal(t, Response{Status: 299, BodyOmitted: true}, rec.Response)
	checkMemory(t, m)
}

// FuzzDecodeSealedResponse checks that no stored response panics the decoder with a keyring,
// that it refuses with ErrCorrupt only, and that what it decodes re-encodes, sealed, to an
// equivalent response.
func FuzzDecodeSealedResponse(f *testing.F) {
	ring := goldenKeyring(f)
	raw, err := os.ReadFile("testdata/response-v2-sealed.hex")
	require.NoError(f, err)
	golden, err := hex.DecodeString(strings.TrimSpace(string(raw)))
	require.NoError(f, err)
	f.Add(golden, "idempotency:golden")
	f.Add(appendStoredResponse(nil, Response{Status: 200, BodyOmitted: true}, ring, []byte("k")), "k")
	f.Add(appendResponse(nil, goldenResponse()), "k")
	f.Add([]byte{responseSealed, 1, 7}, "k")
	f.Fuzz(func(t *testing.T, b []byte, key string) {
		r, err := decodeStoredResponse(bytes.Clone(b), ring, key)
		if err != nil {
			require.ErrorIs(t, err, ErrCorrupt)
			return
		}
		again, err := decodeStoredResponse(appendStoredResponse(nil, r, ring, []byte(key)), ring, key)
		require.NoError(t, err)
		require.Equal(t, r.Status, again.Status)
		require.Equal(t, r.BodyOmitted, again.BodyOmitted)
		require.Equal(t, len(r.Headers), len(again.Headers))
		require.True(t, bytes.Equal(r.Body, again.Body))
	})
}

// BenchmarkStoredResponse measures what sealing adds to a record: encoding and decoding a
// response as stores do, plain and sealed, for bodies of 1 KiB and 1 MiB. The difference
// between the sealed and plain ns/op is the CPU sealing costs per record (one seal when it is
// stored, one open per replay).
func BenchmarkStoredResponse(b *testing.B) {
	ring := goldenKeyring(b)
	key := "idempotency:tenant-a:7c9e6679-7425-40de-944b-e07fc1f90ae7"
	for _, size := range []int{1 << 10, 1 << 20} {
		resp := Response{
			Status: 201,
			Headers: []Header{
				{Name: "content-type", Value: []byte("application/json")},
				{Name: "set-cookie", Value: []byte("session=0123456789abcdef; HttpOnly; Secure")},
				{Name: "x-request-id", Value: []byte("7c9e6679-7425-40de-944b-e07fc1f90ae7")},
			},
			Body: bytes.Repeat([]byte("x"), size),
		}
		for _, mode := range []struct {
			name string
			ring *seal.Keyring
		}{{"plain", nil}, {"sealed", ring}} {
			name := mode.name + "/" + strconv.Itoa(size>>10) + "KiB"
			buf := make([]byte, 0, storedResponseSize(resp, mode.ring))
			b.Run("encode/"+name, func(b *testing.B) {
				b.SetBytes(int64(size))
				b.ReportAllocs()
				for b.Loop() {
					buf = appendStoredResponse(buf[:0], resp, mode.ring, []byte(key))
				}
			})
			stored := appendStoredResponse(nil, resp, mode.ring, []byte(key))
			work := make([]byte, len(stored))
			b.Run("decode/"+name, func(b *testing.B) {
				b.SetBytes(int64(size))
				b.ReportAllocs()
				for b.Loop() {
					// Stores decode a copy of their bytes; decoding opens it in place.
					copy(work, stored)
					if _, err := decodeStoredResponse(work, mode.ring, key); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
