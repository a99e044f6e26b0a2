package cache

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Only the replicas in state online count: those WAIT counts.
func TestOnlineReplicas(t *testing.T) {
	for _, tc := range []struct {
		info string
		want int
	}{
		{"# Replication\r\nrole:master\r\nconnected_slaves:0\r\nmaster_repl_offset:0\r\n", 0},
		{"# Replication\r\nrole:master\r\nconnected_slaves:2\r\nslave0:ip=127.0.0.1,port=6380,state=online,offset=42,lag=0\r\nslave1:ip=127.0.0.1,port=6381,state=wait_bgsave,offset=0,lag=0\r\n", 1},
		{"role:master\nslave0:ip=a,port=1,state=online,offset=1,lag=0\nslave1:ip=b,port=2,state=online,offset=1,lag=1\nslave_read_repl_offset:1\n", 2},
		{"# Replication\r\nrole:slave\r\nmaster_host:127.0.0.1\r\nslave_priority:100\r\nslave_read_only:1\r\nconnected_slaves:0\r\n", 0},
	} {
		require.Equal(t, tc.want, onlineReplicas(tc.info), "%q", tc.info)
	}
}
