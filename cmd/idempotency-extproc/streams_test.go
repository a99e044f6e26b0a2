package main

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
)

// Each HTTP/2 connection to the gRPC listener is told its bounds in the server's SETTINGS: at
// most maxStreamsPerConn streams (an Envoy opens another connection beyond them) and
// maxHeaderListSize bytes of headers a stream.
func TestRunBoundsEachConnection(t *testing.T) {
	logs := newLogLines()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"}, env(nil), logs)
	}()
	defer func() {
		cancel()
		require.NoError(t, <-done)
	}()
	ready := logs.wait(t, "ready", 10*time.Second)

	conn, err := net.Dial("tcp", ready["grpc_addr"].(string))
	require.NoError(t, err)
	defer conn.Close()
	require.NoError(t, conn.SetDeadline(time.Now().Add(10*time.Second)))
	_, err = conn.Write([]byte(http2.ClientPreface))
	require.NoError(t, err)
	fr := http2.NewFramer(conn, conn)
	require.NoError(t, fr.WriteSettings())
	got := map[http2.SettingID]uint32{}
	for {
		f, err := fr.ReadFrame()
		require.NoError(t, err)
		if s, ok := f.(*http2.SettingsFrame); ok && !s.IsAck() {
			require.NoError(t, s.ForeachSetting(func(s http2.Setting) error {
				got[s.ID] = s.Val
				return nil
			}))
			break
		}
	}
	require.Equal(t, uint32(maxStreamsPerConn), got[http2.SettingMaxConcurrentStreams])
	require.Equal(t, uint32(maxHeaderListSize), got[http2.SettingMaxHeaderListSize])
	require.Equal(t, uint32(4096), got[http2.SettingMaxConcurrentStreams], "above Envoy's default circuit breaker of 1,024 streams")
}
