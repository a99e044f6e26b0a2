package seal_test

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache/seal"
)

// testKey returns a key whose bytes are all b, and its base64.
func testKey(b byte) ([]byte, string) {
	k := bytes.Repeat([]byte{b}, seal.KeySize)
	return k, base64.StdEncoding.EncodeToString(k)
}

// ring parses a keyring of the given ids, each with the key testKey(first byte of its id).
func ring(t testing.TB, ids ...string) *seal.Keyring {
	t.Helper()
	var b strings.Builder
	for _, id := range ids {
		_, k := testKey(id[0])
		fmt.Fprintf(&b, "%s:%s\n", id, k)
	}
	k, err := seal.ParseKeyring([]byte(b.String()))
	require.NoError(t, err)
	return k
}

func TestParseKeyring(t *testing.T) {
	_, a := testKey('a')
	_, b := testKey('b')
	raw := strings.TrimRight(a, "=")
	cases := []struct {
		name   string
		file   string
		active string
		ids    []string
	}{
		{"one key", "k1:" + a + "\n", "k1", []string{"k1"}},
		{"no final newline", "k1:" + a, "k1", []string{"k1"}},
		{"first is active", "new:" + b + "\nold:" + a + "\n", "new", []string{"new", "old"}},
		{"comments, blanks, spaces, CRLF", "# rotated 2024-05\r\n\r\n  k-2024.05_b : " + b + "  \r\n\t# old\r\nk1:" + a + "\r\n", "k-2024.05_b", []string{"k-2024.05_b", "k1"}},
		{"byte-order mark", "\ufeffk1:" + a + "\n", "k1", []string{"k1"}},
		{"unpadded base64", "k1:" + raw + "\n", "k1", []string{"k1"}},
		{"same key under two ids (renaming an id)", "new-name:" + a + "\nold-name:" + a + "\n", "new-name", []string{"new-name", "old-name"}},
		{"longest id", strings.Repeat("i", seal.MaxIDLen) + ":" + a, strings.Repeat("i", seal.MaxIDLen), []string{strings.Repeat("i", seal.MaxIDLen)}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			k, err := seal.ParseKeyring([]byte(c.file))
			require.NoError(t, err)
			require.Equal(t, c.active, k.ActiveID())
			require.Equal(t, c.ids, k.IDs())
		})
	}
}

func TestParseKeyringErrors(t *testing.T) {
	_, a := testKey('a')
	short := base64.StdEncoding.EncodeToString([]byte("sixteen byte key"))
	cases := []struct {
		name string
		file string
		want string
		// secrets must not appear in the error.
		secrets []string
	}{
		{"empty", "", "seal: no keys", nil},
		{"comments only", "# nothing yet\n\n", "seal: no keys", nil},
		{"no colon", "# keys\n" + a + "\n", "seal: line 2: want <id>:<base64 of 32 bytes>, found no ':'", []string{a, a[:8]}},
		{"reversed", "k1:" + a + "\n" + a + ":k2\n", "seal: line 2: the key id (44 characters before the ':') must be", []string{a[:8]}},
		{"empty id", ":" + a, "seal: line 1: the key id (0 characters", []string{a[:8]}},
		{"id too long", strings.Repeat("i", seal.MaxIDLen+1) + ":" + a, "seal: line 1: the key id (33 characters", []string{a[:8]}},
		{"id with a space", "my key:" + a, "seal: line 1: the key id (6 characters", []string{a[:8], "my key"}},
		{"duplicate id", "k1:" + a + "\n\nk1:" + a, `seal: line 3: key id "k1" is already on line 1`, []string{a[:8]}},
		{"not base64", "k1:not*base64*at*all*not*base64*at*all*abcd=", `seal: line 1: key "k1": the key is not valid standard base64`, []string{"not*base64"}},
		{"url alphabet", "k1:" + strings.ReplaceAll(strings.ReplaceAll(a, "+", "-"), "/", "_") + "x-_", `seal: line 1: key "k1": the key is not valid standard base64`, nil},
		{"short key", "k1:" + short, `seal: line 1: key "k1": the key decodes to 16 bytes, want 32 (AES-256)`, []string{short[:8]}},
		{"empty key", "k1:", `seal: line 1: key "k1": the key decodes to 0 bytes, want 32`, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			k, err := seal.ParseKeyring([]byte(c.file))
			require.Error(t, err)
			require.Nil(t, k)
			require.Contains(t, err.Error(), c.want)
			for _, s := range c.secrets {
				require.NotContains(t, err.Error(), s)
			}
		})
	}
}

func TestSealOpenRoundTrip(t *testing.T) {
	k := ring(t, "k1")
	aad := []byte("idempotency:tenant:key")
	for _, n := range []int{0, 1, 15, 16, 17, 1024, 1 << 20} {
		pt := make([]byte, n)
		_, _ = rand.Read(pt)
		prefix := []byte("prefix")
		sealed := k.Seal(bytes.Clone(prefix), pt, aad)
		require.Len(t, sealed, len(prefix)+k.SealedLen(n))
		require.Equal(t, prefix, sealed[:len(prefix)], "Seal appends")
		env := sealed[len(prefix):]
		if n >= 16 {
			require.False(t, bytes.Contains(env, pt[:16]), "the plaintext shows in the envelope")
		}
		got, err := k.Open(env, aad)
		require.NoError(t, err)
		require.True(t, bytes.Equal(pt, got), "%d bytes", n)

		before := bytes.Clone(env)
		got, err = k.OpenInPlace(bytes.Clone(env), aad)
		require.NoError(t, err)
		require.True(t, bytes.Equal(pt, got), "%d bytes in place", n)
		require.Equal(t, before, env, "Open leaves its input alone")
	}
}

func TestSealInPlace(t *testing.T) {
	k := ring(t, "k1")
	aad := []byte("key")
	pt := []byte("status, headers and body, encoded straight into the envelope's buffer")
	h := k.HeaderLen()
	buf := make([]byte, 3, 3+k.SealedLen(len(pt)))
	copy(buf, "abc")
	at := buf[3+h : 3+h+len(pt)]
	copy(at, pt)
	sealed := k.Seal(buf, at, aad)
	require.Equal(t, &buf[0], &sealed[0], "sealed in the buffer given")
	got, err := k.Open(sealed[3:], aad)
	require.NoError(t, err)
	require.Equal(t, pt, got)

	// Any other overlap with the output is copied first, not garbled.
	for _, off := range []int{0, 1, h - 1, h + 1, h + 20} {
		buf := make([]byte, 0, k.SealedLen(len(pt))+32)
		src := buf[off : off+len(pt)]
		copy(src, pt)
		sealed := k.Seal(buf, src, aad)
		got, err := k.Open(sealed, aad)
		require.NoError(t, err, "offset %d", off)
		require.Equal(t, pt, got, "offset %d", off)
	}
}

func TestSealNoncesDiffer(t *testing.T) {
	k := ring(t, "k1")
	seen := map[string]bool{}
	for range 1000 {
		env := k.Seal(nil, []byte("same"), []byte("aad"))
		nonce := string(env[k.HeaderLen()-seal.NonceSize : k.HeaderLen()])
		require.False(t, seen[nonce], "nonce repeated")
		seen[nonce] = true
	}
}

// TestEnvelopeLayout builds an envelope by hand with crypto/cipher, as the Keyring doc describes
// it, and opens it; and opens what Seal makes by hand.
func TestEnvelopeLayout(t *testing.T) {
	key, _ := testKey('k')
	k := ring(t, "k1")
	block, err := aes.NewCipher(key)
	require.NoError(t, err)
	gcm, err := cipher.NewGCM(block)
	require.NoError(t, err)
	nonce := make([]byte, seal.NonceSize)
	_, _ = rand.Read(nonce)
	pt, aad := []byte("a response"), []byte("idempotency:a")

	env := append([]byte{1, 2, 'k', '1'}, nonce...)
	env = gcm.Seal(env, nonce, pt, aad)
	got, err := k.Open(env, aad)
	require.NoError(t, err)
	require.Equal(t, pt, got)

	sealed := k.Seal(nil, pt, aad)
	require.Equal(t, []byte{1, 2, 'k', '1'}, sealed[:4])
	got, err = gcm.Open(nil, sealed[4:4+seal.NonceSize], sealed[4+seal.NonceSize:], aad)
	require.NoError(t, err)
	require.Equal(t, pt, got)
}

// The v1 envelope is a contract with every later version: records sealed today must open
// tomorrow. testdata/envelope-v1.hex was made once with crypto/cipher from the key 00 01 … 1f
// (id "golden1") and is never regenerated.
func TestEnvelopeV1Golden(t *testing.T) {
	raw, err := os.ReadFile("testdata/envelope-v1.hex")
	require.NoError(t, err)
	env, err := hex.DecodeString(strings.TrimSpace(string(raw)))
	require.NoError(t, err)
	key := make([]byte, seal.KeySize)
	for i := range key {
		key[i] = byte(i)
	}
	k, err := seal.ParseKeyring([]byte("golden1:" + base64.StdEncoding.EncodeToString(key)))
	require.NoError(t, err)
	got, err := k.Open(env, []byte("idempotency:golden"))
	require.NoError(t, err)
	require.Equal(t, "status, headers and body of a stored response", string(got))
}

func TestRotation(t *testing.T) {
	aad := []byte("idempotency:k")
	a := ring(t, "a")
	byA := a.Seal(nil, []byte("sealed by a"), aad)

	rotated := ring(t, "b", "a")
	require.Equal(t, "b", rotated.ActiveID())
	got, err := rotated.Open(byA, aad)
	require.NoError(t, err, "a key still listed opens")
	require.Equal(t, "sealed by a", string(got))
	byB := rotated.Seal(nil, []byte("sealed by b"), aad)
	require.Equal(t, "b", string(byB[2:2+byB[1]]), "the new active key seals")

	dropped := ring(t, "b")
	_, err = dropped.Open(byA, aad)
	require.ErrorIs(t, err, seal.ErrUnknownKey)
	require.Contains(t, err.Error(), `key id "a"`)
	require.NotErrorIs(t, err, seal.ErrTampered)
	got, err = dropped.Open(byB, aad)
	require.NoError(t, err)
	require.Equal(t, "sealed by b", string(got))

	// The same id with another key is not the same key.
	impostor, err := seal.ParseKeyring([]byte("a:" + base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{'z'}, 32))))
	require.NoError(t, err)
	_, err = impostor.Open(byA, aad)
	require.ErrorIs(t, err, seal.ErrTampered)
}

func TestOpenRejects(t *testing.T) {
	k := ring(t, "k1", "k2")
	aad := []byte("idempotency:one")
	env := k.Seal(nil, []byte("status, headers and body"), aad)

	_, err := k.Open(env, []byte("idempotency:two"))
	require.ErrorIs(t, err, seal.ErrTampered, "other associated data: a record moved to another key")
	_, err = k.Open(env, nil)
	require.ErrorIs(t, err, seal.ErrTampered)

	// Every single-bit change anywhere is refused: in the id it names another key or none, in the
	// nonce, ciphertext or tag authentication fails.
	for i := range env {
		for bit := range 8 {
			b := bytes.Clone(env)
			b[i] ^= 1 << bit
			for _, open := range []func([]byte, []byte) ([]byte, error){k.Open, k.OpenInPlace} {
				_, err := open(b, aad)
				require.Error(t, err, "byte %d bit %d", i, bit)
				require.True(t, errors.Is(err, seal.ErrTampered) || errors.Is(err, seal.ErrUnknownKey), "byte %d bit %d: %v", i, bit, err)
			}
		}
	}
	// Every truncation is refused.
	for n := range len(env) {
		_, err := k.Open(env[:n], aad)
		require.ErrorIs(t, err, seal.ErrTampered, "%d bytes", n)
	}
	// A longer id than any is malformed, not unknown.
	b := bytes.Clone(env)
	b[1] = seal.MaxIDLen + 1
	_, err = k.Open(b, aad)
	require.ErrorIs(t, err, seal.ErrTampered)
	// An id of bytes no valid id has is malformed, and not quoted.
	b = bytes.Clone(env)
	b[2], b[3] = 0xff, '\n'
	_, err = k.Open(b, aad)
	require.ErrorIs(t, err, seal.ErrTampered)
	// A well-formed unknown id is named.
	b = bytes.Clone(env)
	b[3] = '9'
	_, err = k.Open(b, aad)
	require.ErrorIs(t, err, seal.ErrUnknownKey)
	require.Contains(t, err.Error(), `key id "k9"`)
	// Wrapped, they still match.
	require.ErrorIs(t, fmt.Errorf("cache: %w", err), seal.ErrUnknownKey)
}

func TestKeyringPrintsNoKeyMaterial(t *testing.T) {
	key, b64 := testKey('s')
	k := ring(t, "s1", "t2")
	for _, s := range []string{fmt.Sprint(k), fmt.Sprintf("%v %+v %#v %s", k, k, k, k)} {
		require.Contains(t, s, `"s1"`)
		require.NotContains(t, s, b64[:8])
		require.NotContains(t, s, string(key[:8]))
	}
}

// FuzzOpen checks that no envelope panics Open or OpenInPlace, that both agree, that every
// refusal is ErrTampered or ErrUnknownKey, and that what opens is what was sealed (the seeds:
// forging an envelope is the fuzzer's only other way).
func FuzzOpen(f *testing.F) {
	k := ring(f, "k1", "old")
	older := ring(f, "old")
	f.Add(k.Seal(nil, []byte("status, headers and body"), []byte("idempotency:a")), []byte("idempotency:a"))
	f.Add(k.Seal(nil, nil, nil), []byte{})
	f.Add(older.Seal(nil, []byte("sealed by the old key"), []byte("k")), []byte("k"))
	f.Add(ring(f, "gone").Seal(nil, []byte("x"), []byte("k")), []byte("k"))
	f.Add([]byte{1, 2, 'k', '1'}, []byte("k"))
	f.Add([]byte{1, 0}, []byte("k"))
	f.Add([]byte{2, 2, 'k', '1', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, []byte("k"))
	f.Fuzz(func(t *testing.T, sealed, aad []byte) {
		pt, err := k.Open(sealed, aad)
		pt2, err2 := k.OpenInPlace(bytes.Clone(sealed), aad)
		require.Equal(t, err == nil, err2 == nil)
		if err != nil {
			require.True(t, errors.Is(err, seal.ErrTampered) || errors.Is(err, seal.ErrUnknownKey), "%v", err)
			return
		}
		require.True(t, bytes.Equal(pt, pt2))
		require.Len(t, sealed, 2+int(sealed[1])+seal.NonceSize+len(pt)+seal.TagSize)
	})
}

// FuzzParseKeyring checks that no file panics the parser and that no error holds the text after
// the ':' of any line (a key, or part of one), unless that text is also a valid id listed in the
// file, which errors may name.
// inAnID reports whether s is part of one of the ids, which the messages may name: a key that is
// a piece of its own line's id (0000000:000000) is no secret the message could leak.
func inAnID(ids map[string]bool, s string) bool {
	for id := range ids {
		if strings.Contains(id, s) {
			return true
		}
	}
	return false
}

func FuzzParseKeyring(f *testing.F) {
	_, a := testKey('a')
	f.Add([]byte("k1:" + a + "\n"))
	f.Add([]byte("# c\r\n\r\nb: " + a + " \r\nk1:" + a))
	f.Add([]byte(a + ":k1\n"))
	f.Add([]byte("k1:" + a + "\nk1:" + a))
	f.Add([]byte("k1:" + a[:20]))
	f.Fuzz(func(t *testing.T, data []byte) {
		k, err := seal.ParseKeyring(data)
		if err == nil {
			require.NotEmpty(t, k.ActiveID())
			require.Equal(t, k.ActiveID(), k.IDs()[0])
			return
		}
		// What the messages say besides line numbers, lengths and valid ids.
		const wording = `seal: no keys: want one line <id>:<base64 of 32 bytes> per key, the active one first
seal: line : want <id>:<base64 of 32 bytes>, found no ':'
seal: line : the key id ( characters before the ':') must be 1 to 32 characters of A-Z a-z 0-9 . _ -
seal: line : key id "" is already on line
seal: line : key "": the key is not valid standard base64
seal: line : key "": the key decodes to  bytes, want 32 (AES-256)`
		ids := map[string]bool{}
		for _, line := range strings.Split(string(data), "\n") {
			id, _, _ := strings.Cut(line, ":")
			ids[strings.TrimSpace(id)] = true
		}
		for _, line := range strings.Split(string(data), "\n") {
			_, secret, ok := strings.Cut(line, ":")
			secret = strings.TrimSpace(secret)
			if !ok || len(secret) < 6 || ids[secret] || strings.Contains(wording, secret) || inAnID(ids, secret) {
				continue
			}
			require.NotContains(t, err.Error(), secret)
		}
	})
}
