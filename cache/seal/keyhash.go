package seal

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"fmt"
	"hash"
)

// MinSecretLen is the shortest key-hash secret NewKeyHasher accepts.
const MinSecretLen = 32

// NewKeyHasher returns a factory of HMAC-SHA256 hashes keyed with secret, to name records in
// place of plain SHA-256 (--key-hash-secret-file, docs/configuration.md): without the secret, someone who
// reads the store cannot test guesses of a scope and key against its record names. Each call of
// the factory returns a new hash, which like any hash.Hash serves one goroutine at a time; the
// factory itself is safe for concurrent use. Its sums are 32 bytes, as SHA-256's are.
//
// secret is the content of the secret file: ASCII whitespace around it (a trailing newline) is
// not part of it, and what remains is used as it is, not decoded, and must be at least
// MinSecretLen bytes (for example `head -c 32 /dev/urandom | base64`, 44 characters). The
// factory keeps its own copy.
//
// The secret names every record: changing it, or turning it on or off, gives every key a new
// record name, so the records written before are not found (a retry of a request that completed
// then runs again) and stay in the store until they expire.
//
// The error holds no part of the secret.
func NewKeyHasher(secret []byte) (func() hash.Hash, error) {
	key := bytes.Clone(bytes.TrimSpace(secret))
	if len(key) < MinSecretLen {
		return nil, fmt.Errorf("seal: the key hash secret has %d bytes, want at least %d (for example base64 of 32 random bytes)", len(key), MinSecretLen)
	}
	return func() hash.Hash { return hmac.New(sha256.New, key) }, nil
}
