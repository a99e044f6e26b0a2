package seal_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"hash"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache/seal"
)

// TestKeyHasherRFC4231 checks the hasher against the HMAC-SHA256 vectors of RFC 4231 whose keys
// are long enough for a secret (test cases 6 and 7, a 131-byte key).
func TestKeyHasherRFC4231(t *testing.T) {
	key := bytes.Repeat([]byte{0xaa}, 131)
	cases := []struct{ data, sum string }{
		{"Test Using Larger Than Block-Size Key - Hash Key First", "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
		{"This is a test using a larger than block-size key and a larger than block-size data. The key needs to be hashed before being used by the HMAC algorithm.", "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
	}
	newHash, err := seal.NewKeyHasher(key)
	require.NoError(t, err)
	h := newHash()
	require.Equal(t, sha256.Size, h.Size())
	for _, c := range cases {
		h.Reset()
		_, _ = h.Write([]byte(c.data))
		require.Equal(t, c.sum, hex.EncodeToString(h.Sum(nil)))
	}
}

func sum(h hash.Hash, s string) string {
	h.Reset()
	_, _ = h.Write([]byte(s))
	return hex.EncodeToString(h.Sum(nil))
}

func TestKeyHasherNames(t *testing.T) {
	secret := []byte("bXkgc2VjcmV0IGtleSBoYXNoIHNlY3JldCwgMzIgYnl0ZXMh")
	newHash, err := seal.NewKeyHasher(secret)
	require.NoError(t, err)
	name := "tenant-a\x00order-42"
	keyed := sum(newHash(), name)

	require.NotEqual(t, sum(sha256.New(), name), keyed, "HMAC names differ from SHA-256 names")
	require.Equal(t, keyed, sum(newHash(), name), "stable across hashes")
	again, err := seal.NewKeyHasher(append(append([]byte(" \n"), secret...), "\r\n"...))
	require.NoError(t, err)
	require.Equal(t, keyed, sum(again(), name), "whitespace around the secret is not part of it")
	other, err := seal.NewKeyHasher(append(bytes.Clone(secret), 'x'))
	require.NoError(t, err)
	require.NotEqual(t, keyed, sum(other(), name), "another secret gives other names")

	// The factory keeps its own copy of the secret.
	mutable := bytes.Clone(secret)
	mine, err := seal.NewKeyHasher(mutable)
	require.NoError(t, err)
	mutable[0] ^= 1
	require.Equal(t, keyed, sum(mine(), name))

	// Hashes from one factory are independent: one per goroutine.
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			h := newHash()
			for range 100 {
				if got := sum(h, name); got != keyed {
					t.Errorf("got %s", got)
					return
				}
			}
		})
	}
	wg.Wait()
}

func TestKeyHasherRefusesShortSecrets(t *testing.T) {
	for _, s := range []string{"", "\n", "short secret", " 0123456789012345678901234567890 \n"} {
		_, err := seal.NewKeyHasher([]byte(s))
		require.Error(t, err, "%q", s)
		require.Contains(t, err.Error(), "want at least 32")
		if len(s) > 4 {
			require.NotContains(t, err.Error(), s[1:5])
		}
	}
	_, err := seal.NewKeyHasher([]byte("01234567890123456789012345678901\n"))
	require.NoError(t, err)
}
