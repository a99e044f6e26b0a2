package slowlink_test

import (
	"bufio"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/internal/slowlink"
)

// echo serves lines back to their sender.
func echo(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadBytes('\n')
					if err != nil {
						return
					}
					if _, err := c.Write(line); err != nil {
						return
					}
				}
			}()
		}
	}()
	return l.Addr().String()
}

func TestRepliesComeLateAndInOrder(t *testing.T) {
	var delay atomic.Int64
	delay.Store(int64(100 * time.Millisecond))
	c, err := net.Dial("tcp", slowlink.Start(t, echo(t), &delay))
	require.NoError(t, err)
	defer c.Close()
	start := time.Now()
	_, err = c.Write([]byte("a\nb\n"))
	require.NoError(t, err)
	r := bufio.NewReader(c)
	for _, want := range []string{"a\n", "b\n"} {
		got, err := r.ReadString('\n')
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
	require.GreaterOrEqual(t, time.Since(start), 100*time.Millisecond, "held by the delay")

	// A delay longer than the test: a peer that vanished. The proxy still closes with the test.
	delay.Store(int64(time.Hour))
	_, err = c.Write([]byte("c\n"))
	require.NoError(t, err)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(200*time.Millisecond)))
	_, err = r.ReadString('\n')
	var ne net.Error
	require.ErrorAs(t, err, &ne)
	require.True(t, ne.Timeout(), "no reply while it is held: %v", err)
}
