package redistest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const (
	sentinelMasterName = "mymaster"
	sentinelCount      = 3
	sentinelQuorum     = 2
	sentinelTimeout    = 20 * time.Second
	sentinelRetry      = 500 * time.Millisecond // between SENTINEL FAILOVER attempts that were refused
	sentinelFailedWait = 6 * time.Second        // after an accepted SENTINEL FAILOVER, before issuing it again
)

// Sentinel is a master, its replicas and three sentinels monitoring them, started by
// StartSentinel or StartSentinelReplicas. Its methods report failures through the testing.TB
// given to the function that started it.
type Sentinel struct {
	t         testing.TB
	nodes     []*Server // the data nodes; which one is master is the sentinels' business
	sentinels []*Server
}

// StartSentinel starts a master, one replica of it and three sentinels: StartSentinelReplicas
// with one replica.
func StartSentinel(t testing.TB) *Sentinel {
	t.Helper()
	return StartSentinelReplicas(t, 1)
}

// StartSentinelReplicas starts a master, replicas replicas of it (at least one) and three
// sentinels (redis-server --sentinel) monitoring the master as "mymaster" with quorum 2,
// down-after-milliseconds 1000, failover-timeout 5000 and parallel-syncs 1. It returns once the
// replicas are in sync and every sentinel reports the master, every replica with its link up,
// and the two other sentinels, which takes a few seconds. Every process is a Server whose cleanup
// is registered on t.
func StartSentinelReplicas(t testing.TB, replicas int) *Sentinel {
	t.Helper()
	if replicas < 1 {
		t.Fatalf("redistest: StartSentinelReplicas needs at least one replica, got %d", replicas)
	}
	Require(t)
	s := &Sentinel{t: t}
	master := Start(t, Options{})
	s.nodes = append([]*Server{master}, StartReplicas(t, master, replicas)...)

	name := sentinelMasterName
	for range sentinelCount {
		s.sentinels = append(s.sentinels, start(t, master.bin, Options{Args: []string{
			fmt.Sprintf("sentinel monitor %s 127.0.0.1 %d %d", name, master.Port(), sentinelQuorum),
			fmt.Sprintf("sentinel down-after-milliseconds %s 1000", name),
			fmt.Sprintf("sentinel failover-timeout %s 5000", name),
			fmt.Sprintf("sentinel parallel-syncs %s 1", name),
		}}, kindSentinel))
	}
	waitFor(t, sentinelTimeout, "every sentinel to know the master, its replicas and the other sentinels", func() error {
		for _, sn := range s.sentinels {
			if err := s.sees(sn, master, s.nodes[1:]); err != nil {
				return err
			}
		}
		return nil
	})
	return s
}

// MasterName returns the name the sentinels monitor the master under, "mymaster".
func (s *Sentinel) MasterName() string { return sentinelMasterName }

// Addrs returns the addresses of the three sentinels.
func (s *Sentinel) Addrs() []string {
	addrs := make([]string, len(s.sentinels))
	for i, sn := range s.sentinels {
		addrs[i] = sn.Addr()
	}
	return addrs
}

// Sentinels returns the three sentinel processes.
func (s *Sentinel) Sentinels() []*Server { return append([]*Server(nil), s.sentinels...) }

// Master returns the current master as every running sentinel reports it, waiting up to 10 seconds
// for them to agree.
func (s *Sentinel) Master() *Server {
	s.t.Helper()
	var master *Server
	waitFor(s.t, 10*time.Second, "the sentinels to agree on the master", func() error {
		var err error
		master, err = s.reportedMaster()
		return err
	})
	return master
}

// Replica returns the first data node, in the order they were started, that is not the current
// master (see Master).
func (s *Sentinel) Replica() *Server {
	s.t.Helper()
	return s.Replicas()[0]
}

// Replicas returns the data nodes that are not the current master (see Master), in the order
// they were started.
func (s *Sentinel) Replicas() []*Server {
	s.t.Helper()
	master := s.Master()
	var replicas []*Server
	for _, n := range s.nodes {
		if n != master {
			replicas = append(replicas, n)
		}
	}
	return replicas
}

// Failover asks a sentinel to fail over (SENTINEL FAILOVER, repeated while the sentinel refuses,
// for example because it does not yet consider a replica fit) and returns once every running
// sentinel reports another data node as master and that node has role:master. The sentinels
// choose it: the replica with the most of the master's writes, among those that answer. If the
// former master is running, Failover then makes it a replica of the new master itself (REPLICAOF
// and CONFIG REWRITE, as the sentinels would after several seconds), and it waits until every
// running data node replicates the new master, so that the nodes are ready for the next
// Failover. All of it takes at most 20 seconds or fails the test.
func (s *Sentinel) Failover() {
	s.t.Helper()
	old := s.Master()
	deadline := time.Now().Add(sentinelTimeout)
	var (
		next     time.Time
		promoted *Server
	)
	waitFor(s.t, sentinelTimeout, "the sentinels to report another node than "+old.Addr()+" as master", func() error {
		reported, err := s.reportedMaster()
		if err == nil && reported != old {
			info, err := reported.info("replication")
			if err != nil {
				return err
			}
			if role := infoField(info, "role"); role != "master" {
				return fmt.Errorf("%s reported as master but has role:%s", reported.Addr(), role)
			}
			promoted = reported
			return nil
		}
		if time.Now().Before(next) {
			if err != nil {
				return err
			}
			return fmt.Errorf("sentinels still report %s as master", reported.Addr())
		}
		next = time.Now().Add(sentinelRetry)
		var failover error
		for _, sn := range s.sentinels {
			if !sn.Running() {
				continue
			}
			failover = sn.do("SENTINEL", "FAILOVER", sentinelMasterName).Err()
			if failover == nil {
				next = time.Now().Add(sentinelFailedWait)
			}
			break
		}
		return fmt.Errorf("SENTINEL FAILOVER: %v", failover)
	})

	if old.Running() {
		for _, cmd := range [][]any{
			{"REPLICAOF", "127.0.0.1", promoted.Port()},
			{"CONFIG", "REWRITE"},
		} {
			if err := old.do(cmd...).Err(); err != nil {
				s.t.Fatalf("redistest: %v on former master %s: %v", cmd, old.Addr(), err)
			}
		}
	}
	// The sentinels point the other replicas at the new master themselves.
	for _, n := range s.nodes {
		if n == promoted || !n.Running() {
			continue
		}
		waitFor(s.t, time.Until(deadline), "data node "+n.Addr()+" to sync with "+promoted.Addr(), func() error {
			return replicating(n, promoted)
		})
	}
}

// reportedMaster returns the data node all running sentinels report as master.
func (s *Sentinel) reportedMaster() (*Server, error) {
	var addr string
	for _, sn := range s.sentinels {
		if !sn.Running() {
			continue
		}
		r, err := sn.do("SENTINEL", "GET-MASTER-ADDR-BY-NAME", sentinelMasterName).StringSlice()
		if err != nil {
			return nil, fmt.Errorf("SENTINEL GET-MASTER-ADDR-BY-NAME on %s: %w", sn.Addr(), err)
		}
		if len(r) != 2 {
			return nil, fmt.Errorf("SENTINEL GET-MASTER-ADDR-BY-NAME on %s: %q", sn.Addr(), r)
		}
		a := r[0] + ":" + r[1]
		if addr != "" && a != addr {
			return nil, fmt.Errorf("sentinels disagree: %s and %s", addr, a)
		}
		addr = a
	}
	if addr == "" {
		return nil, errors.New("no sentinel is running")
	}
	for _, n := range s.nodes {
		if n.Addr() == addr {
			return n, nil
		}
	}
	return nil, fmt.Errorf("sentinels report unknown master %s", addr)
}

// sees checks that sentinel sn reports master as master with replicas in sync and knows the other
// sentinels.
func (s *Sentinel) sees(sn, master *Server, replicas []*Server) error {
	ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
	defer cancel()
	c := redis.NewSentinelClient(sn.adminOptions())
	defer func() { _ = c.Close() }()
	m, err := c.Master(ctx, sentinelMasterName).Result()
	if err != nil {
		return fmt.Errorf("SENTINEL MASTER on %s: %w", sn.Addr(), err)
	}
	if m["port"] != strconv.Itoa(master.Port()) || m["flags"] != "master" ||
		m["num-slaves"] != strconv.Itoa(len(replicas)) || m["num-other-sentinels"] != strconv.Itoa(sentinelCount-1) {
		return fmt.Errorf("sentinel %s reports master port %s flags %s with %s replicas and %s other sentinels",
			sn.Addr(), m["port"], m["flags"], m["num-slaves"], m["num-other-sentinels"])
	}
	reported, err := c.Replicas(ctx, sentinelMasterName).Result()
	if err != nil {
		return fmt.Errorf("SENTINEL REPLICAS on %s: %w", sn.Addr(), err)
	}
	for _, replica := range replicas {
		if !slices.ContainsFunc(reported, func(r map[string]string) bool {
			return r["port"] == strconv.Itoa(replica.Port()) && r["flags"] == "slave" && r["master-link-status"] == "ok"
		}) {
			return fmt.Errorf("sentinel %s does not report replica %s in sync: %v", sn.Addr(), replica.Addr(), reported)
		}
	}
	return nil
}

// replicating checks that replica is a replica of master with its link up and no sync in progress.
func replicating(replica, master *Server) error {
	info, err := replica.info("replication")
	if err != nil {
		return err
	}
	want := map[string]string{
		"role":                    "slave",
		"master_host":             "127.0.0.1",
		"master_port":             strconv.Itoa(master.Port()),
		"master_link_status":      "up",
		"master_sync_in_progress": "0",
	}
	var wrong []string
	for k, v := range want {
		if got := infoField(info, k); got != v {
			wrong = append(wrong, fmt.Sprintf("%s:%s (want %s)", k, got, v))
		}
	}
	if len(wrong) > 0 {
		return fmt.Errorf("replica %s has %s", replica.Addr(), strings.Join(wrong, " "))
	}
	return nil
}
