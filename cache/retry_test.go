package cache

import (
	"bufio"
	"context"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
	"github.com/stretchr/testify/require"
)

// replyServer is a stand-in Redis that answers every SET with one error reply and counts them.
type replyServer struct {
	lis      net.Listener
	reply    atomic.Value // string
	commands atomic.Int64
	wg       sync.WaitGroup
}

func startReplyServer(t *testing.T) *replyServer {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := &replyServer{lis: lis}
	s.wg.Go(func() {
		for {
			conn, err := lis.Accept()
			if err != nil {
				return
			}
			s.wg.Go(func() { s.serve(conn) })
		}
	})
	t.Cleanup(func() {
		_ = lis.Close()
		s.wg.Wait()
	})
	return s
}

// serve reads RESP arrays of bulk strings, the only commands go-redis sends, and answers each.
func (s *replyServer) serve(conn net.Conn) {
	defer conn.Close()
	r := bufio.NewReader(conn)
	line := func() (string, error) {
		l, err := r.ReadString('\n')
		return strings.TrimSuffix(l, "\r\n"), err
	}
	for {
		head, err := line()
		if err != nil || !strings.HasPrefix(head, "*") {
			return
		}
		n, _ := strconv.Atoi(head[1:])
		var name string
		for i := range n {
			size, err := line()
			if err != nil {
				return
			}
			k, _ := strconv.Atoi(strings.TrimPrefix(size, "$"))
			arg := make([]byte, k+2)
			if _, err := io.ReadFull(r, arg); err != nil {
				return
			}
			if i == 0 {
				name = strings.ToLower(string(arg[:k]))
			}
		}
		if name != "set" {
			// What go-redis sends on connecting (HELLO): it takes an error reply in its stride.
			if _, err := conn.Write([]byte("-ERR unknown command\r\n")); err != nil {
				return
			}
			continue
		}
		s.commands.Add(1)
		if _, err := conn.Write([]byte("-" + s.reply.Load().(string) + "\r\n")); err != nil {
			return
		}
	}
}

// TestRetriedRepliesFollowGoRedis checks retriedReply against what go-redis does: for each error
// reply Redis sends, a command that gets it is either retried by go-redis, and retriedReply says
// so, or it is not, and retriedReply says not. go-redis keeps its list private (shouldRetry), so
// this is the test that fails when an upgrade of go-redis changes it.
func TestRetriedRepliesFollowGoRedis(t *testing.T) {
	srv := startReplyServer(t)
	client := redis.NewClient(&redis.Options{
		Addr:     srv.lis.Addr().String(),
		Protocol: 2, // no HELLO on connect: every command the server sees is the test's
		// One retry, soon: a retried command reaches the server twice.
		MaxRetries:               1,
		MinRetryBackoff:          time.Millisecond,
		MaxRetryBackoff:          2 * time.Millisecond,
		DisableIdentity:          true,
		MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled},
	})
	t.Cleanup(func() { _ = client.Close() })
	// Every error reply of Redis 7 and 8 that a command on one key can get, by its first word,
	// and the forms they take (inside a script's error, with a detail).
	replies := []string{
		"ERR syntax error",
		"ERR max number of clients reached",
		"ERR Error running script (call to f_0123): @user_script:1: -READONLY You can't write against a read only replica.",
		"ERR Error running script (call to f_0123): @user_script:1: -LOADING Redis is loading the dataset in memory",
		"WRONGTYPE Operation against a key holding the wrong kind of value",
		"LOADING Redis is loading the dataset in memory",
		"READONLY You can't write against a read only replica.",
		"MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
		"CLUSTERDOWN The cluster is down",
		"TRYAGAIN Multiple keys request during rehashing of slot",
		"NOREPLICAS Not enough good replicas to write.",
		"MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
		"OOM command not allowed when used memory > 'maxmemory'.",
		"BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
		"NOSCRIPT No matching script. Please use EVAL.",
		"NOAUTH Authentication required.",
		"NOPERM User default has no permissions to run the 'set' command",
		"WRONGPASS invalid username-password pair or user is disabled.",
		"EXECABORT Transaction discarded because of previous errors.",
		"BUSYKEY Target key name already exists.",
		"UNBLOCKED client unblocked via CLIENT UNBLOCK",
		"MOVED 3999 127.0.0.1:6381",
		"ASK 3999 127.0.0.1:6381",
		"CROSSSLOT Keys in request don't hash to the same slot",
		"NOTBUSY No scripts in execution right now.",
		"NOPROTO unsupported protocol version",
	}
	for _, reply := range replies {
		srv.reply.Store(reply)
		before := srv.commands.Load()
		err := client.Do(context.Background(), "set", "k", "v").Err()
		require.Error(t, err, reply)
		var re redis.Error
		require.ErrorAs(t, err, &re, "%s: an error reply", reply)
		retried := srv.commands.Load()-before > 1
		require.Equal(t, retried, retriedReply(err), "%q: go-redis retried it: %v; retriedReply says %v", reply, retried, retriedReply(err))
		require.Equal(t, retried, unanswered(err), "%q", reply)
	}
}
