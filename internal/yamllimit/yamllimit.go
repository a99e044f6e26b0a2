// Package yamllimit bounds what decoding YAML may cost. The YAML decoder keeps every value of a
// document as a node of about 170 bytes, so a file of short values ("[a,a,a,…]") costs some 80
// times its size once decoded, and the code that reads the nodes walks them recursively. Before
// a file is decoded, Screen estimates its values from its bytes; once a document is decoded,
// Check measures its nesting and what its aliases expand to. Both refuse what is beyond their
// bounds with an *Error, so that the caller spends no more on it.
package yamllimit

import (
	"fmt"
)

const (
	// BytesPerValue is the size of input each YAML value is allowed: a file of maxBytes may hold
	// maxBytes/BytesPerValue values. Hand-written and generated YAML (Envoy bootstraps,
	// Kubernetes objects) holds about one value per 12 to 20 bytes, with indentation; the bound
	// is met only by files of short values that are not configuration.
	BytesPerValue = 32
	// MaxDepth is how deeply collections (mappings and sequences) may nest. The deepest field
	// of an Envoy bootstrap, an Istio EnvoyFilter or an Envoy Gateway policy is about 20 levels
	// down.
	MaxDepth = 100
	// MaxKeys is how many keys one mapping may hold. The YAML decoder compares each key of a
	// mapping it decodes with every other, so a mapping's cost grows with the square of its
	// keys; configuration has mappings of tens of keys.
	MaxKeys = 5000
)

// Error is an input beyond a bound, at Line (0 when it is about the whole input).
type Error struct {
	Line    int
	Problem string
}

func (e *Error) Error() string {
	if e.Line > 0 {
		return fmt.Sprintf("line %d: %s", e.Line, e.Problem)
	}
	return e.Problem
}

// MaxValues is the number of values an input of maxBytes may hold.
func MaxValues(maxBytes int64) int {
	return int(max(maxBytes/BytesPerValue, 1))
}

// Values estimates, without parsing, how many nodes the YAML decoder makes of data: the tokens
// it holds (each run of text that follows a space, a line break or a flow indicator) and the
// empty values an indicator may stand for ("a:", "- ", "? ", "{a, b}"). It counts the text of comments,
// quoted strings and block scalars too, so it never falls much below the decoder's count, and
// exceeds it on files of long strings.
func Values(data []byte) int {
	n := 0
	prev := byte('\n')
	for i, c := range data {
		if !isSpace(c) {
			if startsToken(prev) {
				n++
			}
			switch {
			case c == ',' || c == '}':
				n++ // a flow mapping's key may go without its value: {a, b}
			case (c == ':' || c == '-' || c == '?') && (i+1 == len(data) || endsIndicator(data[i+1])):
				n++ // an indicator that may stand for an empty value
			}
		}
		prev = c
	}
	return n
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func startsToken(prev byte) bool {
	switch prev {
	case '[', ']', '{', '}', ',', ':':
		return true
	}
	return isSpace(prev)
}

func endsIndicator(next byte) bool {
	switch next {
	case ',', ']', '}':
		return true
	}
	return isSpace(next)
}

// Screen refuses data that Values estimates to hold more values than an input of maxBytes may
// (MaxValues). It reads data once and allocates nothing.
func Screen(data []byte, maxBytes int64) error {
	if limit := MaxValues(maxBytes); Values(data) > limit {
		return &Error{Problem: fmt.Sprintf("more than the %d YAML values an input of %s may hold (one per %d bytes): this is not a configuration file, or it needs a larger bound",
			limit, byteSize(maxBytes), BytesPerValue)}
	}
	return nil
}

// byteSize writes a bound in KiB or MiB.
func byteSize(n int64) string {
	if n >= 1<<20 && n%(1<<20) == 0 {
		return fmt.Sprintf("%d MiB", n>>20)
	}
	if n >= 1<<10 && n%(1<<10) == 0 {
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d bytes", n)
}
