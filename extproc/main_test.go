package extproc_test

import (
	"testing"

	"github.com/idempotency-extproc/idempotency-extproc/internal/leakcheck"
)

// TestMain fails the package if any test leaves a goroutine behind: a stream handler, a lease
// renewal or a store call that outlives its stream.
func TestMain(m *testing.M) {
	leakcheck.Main(m)
}
