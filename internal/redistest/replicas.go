package redistest

import (
	"strconv"
	"testing"
)

// StartReplicas starts n standalone replicas of master (replicaof, authenticating as the master's
// ACL user or with its password, which the replicas require of their own clients too) and returns
// them once each is in sync with master, which takes a few seconds at most or fails the test.
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
	return replicas
}
