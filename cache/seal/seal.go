// Package seal protects stored responses at rest: AES-256-GCM sealing under a keyring of named
// keys, and keyed record names (HMAC-SHA256). docs/guarantees.md#stored-responses-at-rest says
// what that promises.
//
// A [Keyring] seals with its active key and opens with any of its keys, so keys rotate by adding
// a new active key in front of the old ones and dropping an old key once no record it sealed can
// still be alive. Everything here is built on crypto/aes, crypto/cipher, crypto/hmac and
// crypto/sha256; the package adds only the file format and the envelope.
//
// The package does not depend on package cache: it seals and opens bytes.
package seal

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"unsafe"
)

// Errors of Open. Both are returned wrapped, with what was wrong; test them with errors.Is.
var (
	// ErrUnknownKey means the envelope names a key id that is not in the keyring: it was sealed
	// with a key since dropped, or with another keyring altogether.
	ErrUnknownKey = errors.New("seal: sealed with a key that is not in the keyring")
	// ErrTampered means the envelope is malformed or fails authentication: its bytes changed, it
	// was cut short, or it is opened with other associated data than it was sealed with (a
	// record copied to another key).
	ErrTampered = errors.New("seal: sealed data is malformed or fails authentication")
)

// Sizes of the envelope.
const (
	// KeySize is the length of every key: AES-256.
	KeySize = 32
	// NonceSize is the length of the random nonce of every envelope: 96 bits, GCM's standard.
	NonceSize = 12
	// TagSize is the length of the authentication tag at the end of every envelope.
	TagSize = 16
	// MaxIDLen is the longest key id.
	MaxIDLen = 32
)

// envelopeVersion is the first byte of every envelope this version writes. A later layout writes
// another byte and keeps opening this one.
const envelopeVersion byte = 1

// Keyring holds the keys that seal and open records: the active key, which seals, and any number
// of older ones, which only open. It never changes once parsed and is safe for concurrent use by
// any number of goroutines.
//
// An envelope is
//
//	offset   bytes  field
//	0        1      envelope version: 1
//	1        1      key id length n, 1 to MaxIDLen
//	2        n      key id
//	2+n      12     nonce
//	14+n     m+16   AES-256-GCM ciphertext of the m plaintext bytes, then its tag
//
// The associated data given to Seal and Open is authenticated with the ciphertext but not stored:
// an envelope opens only with the associated data it was sealed with. The version and key id are
// not authenticated, and need not be: a changed id selects another key, or none, and the tag
// fails under it.
//
// Nonces are random: each Seal draws 96 bits from crypto/rand. NIST SP 800-38D bounds a key used
// with random 96-bit nonces at 2^32 seals, where the chance that any two share a nonce is about
// 2^-33 (a repeated nonce would expose the XOR of two plaintexts and allow forgeries under that
// key). The bound counts every seal of a key over its life, across replicas, not the records
// alive: it is one seal per first execution, so 2^32 is 136 years at 1 completion per second and
// 50 days at 1,000 per second. Rotating the active key (see docs) restarts the count; deployments
// that complete more than about 1,000 requests per second should rotate at least monthly.
type Keyring struct {
	active *ringKey
	keys   map[string]*ringKey
	order  []string // ids in file order, the active one first
}

type ringKey struct {
	// header is the envelope's first bytes under this key: version, id length and id.
	header []byte
	aead   cipher.AEAD
}

// ParseKeyring parses a keys file: one key per line as <id>:<base64 of 32 bytes>, the first the
// active key. Blank lines and lines starting with '#' are skipped; spaces around the id and the
// key are ignored, as are a byte-order mark and CRLF line ends. Ids are 1 to MaxIDLen characters
// of A-Z a-z 0-9 '.' '_' '-', each listed once. The key is standard base64, padded or not, of
// exactly KeySize bytes (for example the output of `head -c 32 /dev/urandom | base64`).
//
// Its errors name the line and what is wrong with it; they never hold any part of a key, nor of
// an id that is not valid (which could be a misplaced key).
func ParseKeyring(data []byte) (*Keyring, error) {
	data = bytes.TrimPrefix(data, []byte("\ufeff"))
	k := &Keyring{keys: make(map[string]*ringKey)}
	lineOf := make(map[string]int)
	for n, line := range strings.Split(string(data), "\n") {
		n++
		line = strings.TrimSpace(line)
		if line == "" || line[0] == '#' {
			continue
		}
		id, b64, ok := strings.Cut(line, ":")
		if !ok {
			return nil, fmt.Errorf("seal: line %d: want <id>:<base64 of %d bytes>, found no ':'", n, KeySize)
		}
		id, b64 = strings.TrimSpace(id), strings.TrimSpace(b64)
		if !validID(id) {
			return nil, fmt.Errorf("seal: line %d: the key id (%d characters before the ':') must be 1 to %d characters of A-Z a-z 0-9 . _ -", n, len(id), MaxIDLen)
		}
		if first, dup := lineOf[id]; dup {
			return nil, fmt.Errorf("seal: line %d: key id %q is already on line %d", n, id, first)
		}
		key, err := decodeKey(b64)
		if err != nil {
			return nil, fmt.Errorf("seal: line %d: key %q: %w", n, id, err)
		}
		block, err := aes.NewCipher(key)
		if err != nil {
			return nil, fmt.Errorf("seal: line %d: key %q: %w", n, id, err)
		}
		aead, err := cipher.NewGCM(block)
		if err != nil {
			return nil, fmt.Errorf("seal: line %d: key %q: %w", n, id, err)
		}
		rk := &ringKey{header: append([]byte{envelopeVersion, byte(len(id))}, id...), aead: aead}
		if k.active == nil {
			k.active = rk
		}
		k.keys[id] = rk
		k.order = append(k.order, id)
		lineOf[id] = n
	}
	if k.active == nil {
		return nil, fmt.Errorf("seal: no keys: want one line <id>:<base64 of %d bytes> per key, the active one first", KeySize)
	}
	return k, nil
}

// decodeKey decodes the base64 of a key. Its errors hold no part of b64.
func decodeKey(b64 string) ([]byte, error) {
	enc := base64.StdEncoding
	if !strings.HasSuffix(b64, "=") {
		enc = base64.RawStdEncoding
	}
	key, err := enc.Strict().DecodeString(b64)
	if err != nil {
		return nil, errors.New("the key is not valid standard base64")
	}
	if len(key) != KeySize {
		return nil, fmt.Errorf("the key decodes to %d bytes, want %d (AES-256)", len(key), KeySize)
	}
	return key, nil
}

func validID(id string) bool {
	if len(id) == 0 || len(id) > MaxIDLen {
		return false
	}
	for i := range len(id) {
		switch c := id[i]; {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9', c == '.', c == '_', c == '-':
		default:
			return false
		}
	}
	return true
}

// ActiveID returns the id of the key that seals.
func (k *Keyring) ActiveID() string { return k.order[0] }

// IDs returns the ids of every key, the active one first, in the file's order.
func (k *Keyring) IDs() []string { return append([]string(nil), k.order...) }

// String describes k by its key ids only, so that printing a Keyring shows no key material.
func (k *Keyring) String() string {
	if k == nil {
		return "seal.Keyring(nil)"
	}
	return fmt.Sprintf("seal.Keyring{active %q, ids %q}", k.ActiveID(), k.order)
}

// GoString is String: %#v shows no key material either.
func (k *Keyring) GoString() string { return k.String() }

// HeaderLen returns the bytes an envelope sealed now has before its ciphertext: the version, the
// active key's id and the nonce.
func (k *Keyring) HeaderLen() int { return len(k.active.header) + NonceSize }

// SealedLen returns the length of the envelope Seal makes of n plaintext bytes.
func (k *Keyring) SealedLen(n int) int { return k.HeaderLen() + n + TagSize }

// Seal appends to dst the envelope of plaintext sealed with the active key and a fresh random
// nonce, authenticating aad with it, and returns the extended slice. It cannot fail: crypto/rand
// does not return errors.
//
// plaintext may sit exactly where its ciphertext goes, at dst[len(dst)+k.HeaderLen():] within
// dst's capacity, and is then encrypted in place (so a caller can encode straight into the
// envelope's buffer); any other overlap with dst's spare capacity is handled by copying it
// first. aad must not overlap the output.
func (k *Keyring) Seal(dst, plaintext, aad []byte) []byte {
	key := k.active
	h := len(key.header)
	ret, out := grow(dst, h+NonceSize+len(plaintext)+TagSize)
	ct := out[h+NonceSize:]
	if anyOverlap(out, plaintext) && !sameStart(ct, plaintext) {
		plaintext = append([]byte(nil), plaintext...)
	}
	copy(out, key.header)
	nonce := out[h : h+NonceSize]
	_, _ = rand.Read(nonce) // never fails (crypto/rand documents that it crashes instead)
	key.aead.Seal(ct[:0], nonce, plaintext, aad)
	return ret
}

// Open returns the plaintext of an envelope made by Seal with the same associated data, in a new
// slice; sealed is not modified. The error wraps ErrUnknownKey when the envelope's key id is not
// in k, and ErrTampered when the envelope is malformed or fails authentication.
func (k *Keyring) Open(sealed, aad []byte) ([]byte, error) {
	key, nonce, ct, err := k.parse(sealed)
	if err != nil {
		return nil, err
	}
	pt, err := key.aead.Open(nil, nonce, ct, aad)
	if err != nil {
		return nil, fmt.Errorf("%w: authentication failed", ErrTampered)
	}
	return pt, nil
}

// OpenInPlace is Open without a new slice: the plaintext is written over the envelope's
// ciphertext, and the result shares sealed's memory. Whether it succeeds or fails, sealed's bytes
// are no longer the envelope. aad must not overlap sealed.
func (k *Keyring) OpenInPlace(sealed, aad []byte) ([]byte, error) {
	key, nonce, ct, err := k.parse(sealed)
	if err != nil {
		return nil, err
	}
	pt, err := key.aead.Open(ct[:0], nonce, ct, aad)
	if err != nil {
		return nil, fmt.Errorf("%w: authentication failed", ErrTampered)
	}
	return pt, nil
}

// parse splits an envelope into its key, nonce and ciphertext with tag.
func (k *Keyring) parse(sealed []byte) (*ringKey, []byte, []byte, error) {
	if len(sealed) < 2 {
		return nil, nil, nil, fmt.Errorf("%w: an envelope of %d bytes", ErrTampered, len(sealed))
	}
	if sealed[0] != envelopeVersion {
		return nil, nil, nil, fmt.Errorf("%w: envelope version %d is not supported by this version", ErrTampered, sealed[0])
	}
	n := int(sealed[1])
	if n == 0 || n > MaxIDLen || len(sealed) < 2+n+NonceSize+TagSize {
		return nil, nil, nil, fmt.Errorf("%w: an envelope of %d bytes with a key id of %d", ErrTampered, len(sealed), n)
	}
	id := sealed[2 : 2+n]
	key, ok := k.keys[string(id)]
	if !ok {
		if !validID(string(id)) {
			return nil, nil, nil, fmt.Errorf("%w: the key id is not a valid id", ErrTampered)
		}
		return nil, nil, nil, fmt.Errorf("%w: key id %q (the keyring has %q)", ErrUnknownKey, id, k.order)
	}
	rest := sealed[2+n:]
	return key, rest[:NonceSize:NonceSize], rest[NonceSize:], nil
}

// grow extends dst by n bytes, reusing its capacity when it suffices, and returns the whole slice
// and the new part.
func grow(dst []byte, n int) (whole, tail []byte) {
	if total := len(dst) + n; cap(dst) >= total {
		whole = dst[:total]
	} else {
		whole = make([]byte, total)
		copy(whole, dst)
	}
	return whole, whole[len(dst):]
}

// anyOverlap reports whether x and y share memory, as crypto/cipher's own check does (GCM
// refuses an output that overlaps its input other than exactly).
func anyOverlap(x, y []byte) bool {
	return len(x) > 0 && len(y) > 0 &&
		uintptr(unsafe.Pointer(&x[0])) <= uintptr(unsafe.Pointer(&y[len(y)-1])) &&
		uintptr(unsafe.Pointer(&y[0])) <= uintptr(unsafe.Pointer(&x[len(x)-1]))
}

// sameStart reports whether x and y start at the same byte.
func sameStart(x, y []byte) bool {
	return len(x) > 0 && len(y) > 0 && &x[0] == &y[0]
}
