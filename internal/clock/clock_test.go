package clock_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

func TestFakeRunsDueFunctionsInOrder(t *testing.T) {
	start := time.Unix(0, 0)
	c := clock.NewFake(start)
	var got []string
	var at []time.Duration
	record := func(name string) func() {
		return func() { got = append(got, name); at = append(at, c.Now().Sub(start)) }
	}
	c.AfterFunc(3*time.Second, record("c"))
	c.AfterFunc(time.Second, record("a"))
	stopped := c.AfterFunc(2*time.Second, record("never"))
	// A function may schedule another, which runs in the same Advance when due.
	c.AfterFunc(2*time.Second, func() { c.AfterFunc(500*time.Millisecond, record("b")) })
	require.True(t, stopped.Stop())
	require.False(t, stopped.Stop())

	c.Advance(5 * time.Second)
	require.Equal(t, []string{"a", "b", "c"}, got)
	require.Equal(t, []time.Duration{time.Second, 2500 * time.Millisecond, 3 * time.Second}, at)
	require.Equal(t, 5*time.Second, c.Now().Sub(start))
	require.Equal(t, 0, c.Pending())
}

func TestRealClock(t *testing.T) {
	done := make(chan struct{})
	clock.Real{}.AfterFunc(time.Millisecond, func() { close(done) })
	<-done
	require.WithinDuration(t, time.Now(), clock.Real{}.Now(), time.Second)
}
