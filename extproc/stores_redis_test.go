package extproc_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// The outcome tests also run against a real redis-server started for each test. Without
// redis-server on PATH they skip and say so; CI requires it.
func init() {
	stores["redis"] = func(t *testing.T) testStore {
		srv := redistest.Start(t, redistest.Options{})
		// As long as the longest store_timeout a test sets: the store applies its own bound too.
		s, err := cache.OpenRedis(cache.RedisOptions{URL: srv.URL(), Timeout: 5 * time.Second})
		require.NoError(t, err)
		return testStore{store: s, advance: time.Sleep}
	}
}
