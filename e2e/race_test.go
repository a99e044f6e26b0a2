//go:build race

package e2e_test

// raceEnabled builds the processor with the race detector when the tests run with it.
const raceEnabled = true
