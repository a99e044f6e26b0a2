package cache

import (
	"fmt"
	"slices"

	"github.com/idempotency-extproc/idempotency-extproc/cache/seal"
)

// ErrUnreadable means a stored response is sealed and cannot be opened: it names a key that is
// not in the store's keyring, it fails authentication (its bytes changed, or it was copied from
// another key), or the store has no keyring at all. It wraps ErrCorrupt. A duplicate of such a
// record must not run again: it cannot be replayed.
var ErrUnreadable = fmt.Errorf("%w: a sealed response cannot be opened", ErrCorrupt)

// appendStoredResponse appends r as a store keeps it to dst: its encoding (appendResponse) when
// ring is nil, else the sealed format byte and the envelope of that encoding sealed with ring
// under aad, the record's stored key. r is encoded straight into the envelope's buffer, which is
// then encrypted in place: sealing allocates nothing when dst has room for
// storedResponseSize(r, ring) more bytes.
func appendStoredResponse(dst []byte, r Response, ring *seal.Keyring, aad []byte) []byte {
	if ring == nil {
		return appendResponse(dst, r)
	}
	dst = slices.Grow(append(dst, responseSealed), ring.SealedLen(encodedResponseSize(r)))
	at := len(dst) + ring.HeaderLen()
	plain := appendResponse(dst[at:at], r)
	return ring.Seal(dst, plain, aad)
}

// sealedAAD returns the associated data appendStoredResponse needs for a record stored under
// key: the key when ring is set, else nothing (and no allocation).
func sealedAAD(ring *seal.Keyring, key string) []byte {
	if ring == nil {
		return nil
	}
	return []byte(key)
}

// storedResponseSize returns len(appendStoredResponse(nil, r, ring, aad)) without encoding.
func storedResponseSize(r Response, ring *seal.Keyring) int {
	n := encodedResponseSize(r)
	if ring == nil {
		return n
	}
	return 1 + ring.SealedLen(n)
}

// decodeStoredResponse decodes what appendStoredResponse wrote for the record stored under key:
// a plain encoding whether or not ring is set (records written before sealing was turned on), or
// a sealed one, which it opens in place, in b. Header values and the body share memory with b.
// A sealed response that cannot be opened yields an error wrapping ErrUnreadable (and so
// ErrCorrupt) and the seal package's reason; any other malformed input an error wrapping
// ErrCorrupt.
func decodeStoredResponse(b []byte, ring *seal.Keyring, key string) (Response, error) {
	if len(b) == 0 || b[0] != responseSealed {
		return decodeResponse(b)
	}
	if ring == nil {
		return Response{}, fmt.Errorf("%w: the store has no keyring (sealing was turned off)", ErrUnreadable)
	}
	plain, err := ring.OpenInPlace(b[1:], []byte(key))
	if err != nil {
		return Response{}, fmt.Errorf("%w: %w", ErrUnreadable, err)
	}
	return decodeResponse(plain) // which refuses a sealed response inside
}
