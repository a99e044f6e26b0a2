//go:build !race

package cache

// raceEnabled reports whether the race detector is on: it changes how sync.Pool keeps what it
// is given.
const raceEnabled = false
