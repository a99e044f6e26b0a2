package seal_test

import (
	"crypto/sha256"
	"hash"
	"strconv"
	"testing"

	"github.com/idempotency-extproc/idempotency-extproc/cache/seal"
)

// BenchmarkSealOpen measures sealing and opening a record's bytes (1 KiB and 1 MiB) with the
// buffers reused, as stores use them: Seal into a buffer with room, OpenInPlace on a copy.
func BenchmarkSealOpen(b *testing.B) {
	k := ring(b, "k1")
	aad := []byte("idempotency:tenant-a:7c9e6679-7425-40de-944b-e07fc1f90ae7")
	for _, size := range []int{1 << 10, 1 << 20} {
		pt := make([]byte, size)
		name := strconv.Itoa(size>>10) + "KiB"
		buf := make([]byte, 0, k.SealedLen(size))
		b.Run("seal/"+name, func(b *testing.B) {
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				buf = k.Seal(buf[:0], pt, aad)
			}
		})
		sealed := k.Seal(nil, pt, aad)
		work := make([]byte, len(sealed))
		b.Run("open/"+name, func(b *testing.B) {
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				copy(work, sealed)
				if _, err := k.OpenInPlace(work, aad); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run("open-new/"+name, func(b *testing.B) {
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := k.Open(sealed, aad); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkKeyHasher compares a record name's hash, HMAC-SHA256 against plain SHA-256, over the
// bytes of a usual scope and key, with the hash reused as the request digest reuses it.
func BenchmarkKeyHasher(b *testing.B) {
	newHash, err := seal.NewKeyHasher([]byte("0123456789abcdef0123456789abcdef0123456789ab"))
	if err != nil {
		b.Fatal(err)
	}
	data := []byte("tenant-a\x00POST\x00/v1/payments\x007c9e6679-7425-40de-944b-e07fc1f90ae7")
	var sum [32]byte
	for _, c := range []struct {
		name string
		h    hash.Hash
	}{{"sha256", sha256.New()}, {"hmac-sha256", newHash()}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				c.h.Reset()
				c.h.Write(data)
				c.h.Sum(sum[:0])
			}
		})
	}
}
