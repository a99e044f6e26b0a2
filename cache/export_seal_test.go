package cache

import (
	"fmt"

	"github.com/idempotency-extproc/idempotency-extproc/cache/seal"
)

// The external tests of sealing (sealed_test.go) read and alter what a Memory store holds
// through these, as they read and alter Redis with a client of their own.

// SetKeyring replaces m's keyring: a restart with another keys file that kept the records,
// which a Memory store cannot do otherwise.
func (m *Memory) SetKeyring(k *seal.Keyring) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.ring = k
}

// StoredRecord returns a copy of every byte m holds for key's record: its key, its stored
// response and its fingerprint.
func (m *Memory) StoredRecord(key string) ([]byte, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	i, _, ok := m.find(key)
	if !ok {
		return nil, fmt.Errorf("no record for %q", key)
	}
	return append([]byte(nil), m.bytesOf(i)...), nil
}

// StoredResponse returns a copy of the stored response of key's completed record.
func (m *Memory) StoredResponse(key string) ([]byte, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	b, err := m.storedResponse(key)
	return append([]byte(nil), b...), err
}

// SetStoredResponse overwrites the stored response of key's completed record with b, which must
// have its length.
func (m *Memory) SetStoredResponse(key string, b []byte) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	cur, err := m.storedResponse(key)
	if err != nil {
		return err
	}
	if len(b) != len(cur) {
		return fmt.Errorf("a stored response of %d bytes cannot be replaced by %d", len(cur), len(b))
	}
	copy(cur, b)
	return nil
}

func (m *Memory) storedResponse(key string) ([]byte, error) {
	i, _, ok := m.find(key)
	if !ok || m.entry(i).state != Completed {
		return nil, fmt.Errorf("no completed record for %q", key)
	}
	e := m.entry(i)
	return m.bytesOf(i)[e.keyLen : e.keyLen+e.respLen], nil
}
