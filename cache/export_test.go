package cache

// MappedBytes returns the bytes of m's segments mapped outside the Go heap, for the external
// tests that weigh a store.
func (m *Memory) MappedBytes() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	var n int64
	for s, b := range m.arena.segs {
		if m.arena.mapped[s] {
			n += int64(len(b))
		}
	}
	return n
}
