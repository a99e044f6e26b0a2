package redistest

import (
	"context"
	"fmt"
	"strconv"
	"testing"

	"github.com/redis/go-redis/v9"
)

// StartReplicas starts n standalone replicas of master (replicaof, authenticating as the master's
// ACL user or with its password, which the replicas require of their own clients too) and returns
// them once each is in sync with master and master counts them all for WAIT, which takes a few
// seconds at most or fails the test.
// Every replica is a Server whose cleanup is registered on t. A master with TLS is refused.
func StartReplicas(t testing.TB, master *Server, n int) []*Server {
	t.Helper()
	if master.opts.TLS {
		t.Fatalf("redistest: StartReplicas: %s uses TLS, which replicas of it do not", master.Addr())
	}
	opts := Options{
		ACLUser: master.opts.ACLUser, ACLPassword: master.opts.ACLPassword, Password: master.opts.Password,
		Args: []string{"replicaof 127.0.0.1 " + strconv.Itoa(master.Port())},
	}
	switch {
	case master.opts.ACLUser != "":
		opts.Args = append(opts.Args, "masteruser "+quote(master.opts.ACLUser), "masterauth "+quote(master.opts.ACLPassword))
	case master.opts.Password != "":
		opts.Args = append(opts.Args, "masterauth "+quote(master.opts.Password))
	}
	replicas := make([]*Server, n)
	for i := range replicas {
		replicas[i] = start(t, master.bin, opts, kindStandalone)
	}
	for _, r := range replicas {
		waitFor(t, sentinelTimeout, "replica "+r.Addr()+" to sync with "+master.Addr(), func() error {
			return replicating(r, master)
		})
	}
	waitFor(t, sentinelTimeout, "master "+master.Addr()+" to count its replicas", func() error {
		return acknowledging(master, n)
	})
	return replicas
}

// acknowledging checks that master counts n replicas that acknowledge its writes, as WAIT does:
// a replica in sync is counted only once it has acknowledged the stream after its first sync. It
// writes a key of its own and deletes it, so that the keyspace is left as it was.
func acknowledging(master *Server, n int) error {
	ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
	defer cancel()
	c := redis.NewClient(master.adminOptions()) // one connection: WAIT follows its writes
	defer func() { _ = c.Close() }()
	var wait *redis.Cmd
	_, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
		p.Set(ctx, "redistest:acknowledging", "1", 0)
		p.Del(ctx, "redistest:acknowledging")
		wait = p.Do(ctx, "wait", n, 100)
		return nil
	})
	if err != nil {
		return err
	}
	if got, err := wait.Int(); err != nil || got < n {
		return fmt.Errorf("master %s counts %d of %d replicas acknowledging (%v)", master.Addr(), got, n, err)
	}
	return nil
}
