package leakcheck

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// A goroutine that ends within the wait passes; one that outlives it is reported.
func TestWait(t *testing.T) {
	current := goleak.IgnoreCurrent()
	find := func(opts ...goleak.Option) error { return goleak.Find(append(opts, current)...) }

	done := make(chan struct{})
	go func() { <-done }()
	time.AfterFunc(700*time.Millisecond, func() { close(done) }) // past goleak's own wait
	require.NoError(t, wait(find, 10*time.Second, 10*time.Millisecond))

	stop := make(chan struct{})
	go func() { <-stop }()
	require.Error(t, wait(find, 200*time.Millisecond, 10*time.Millisecond))
	close(stop)
}
