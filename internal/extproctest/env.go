package extproctest

import "strings"

// ConfiguresProgram reports whether the environment variable name is one the program reads
// (IDEMPOTENCY_*, OTEL_*): a test that runs the program as it says leaves such variables of the
// shell out.
func ConfiguresProgram(name string) bool {
	return strings.HasPrefix(name, "IDEMPOTENCY_") || strings.HasPrefix(name, "OTEL_")
}
