package redistest

import (
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

const (
	clusterSlots       = 16384
	clusterNodeTimeout = 2000 // milliseconds
	clusterTimeout     = 30 * time.Second
	manualFailoverWait = 6 * time.Second // a little more than Redis's 5 s manual-failover timeout
)

// Cluster is a Redis Cluster started by StartCluster. It is organised in shards, each one master
// and its replicas; shard i owns the i-th equal share of the 16384 slots. Its methods are safe for
// concurrent use but report failures through the testing.TB given to StartCluster.
type Cluster struct {
	t      testing.TB
	mu     sync.Mutex // guards shards
	shards []*shard
}

// shard is one master and its replicas, as last arranged by the Cluster.
type shard struct {
	master   *Server
	replicas []*Server
}

// StartCluster starts a cluster of masters shards, each a master with replicasPerMaster replicas,
// on free loopback ports whose cluster bus ports (port+10000) are free too. It assigns the slots
// evenly with CLUSTER ADDSLOTSRANGE, joins the nodes with CLUSTER MEET, attaches the replicas with
// CLUSTER REPLICATE, and returns once every node reports cluster_state:ok with all slots served,
// knows every other node in its expected role, and every replica's link to its master is up. The
// node timeout is 2 seconds. Every node is a Server whose cleanup is registered on t.
func StartCluster(t testing.TB, masters, replicasPerMaster int) *Cluster {
	t.Helper()
	if masters < 1 || replicasPerMaster < 0 {
		t.Fatalf("redistest: StartCluster needs at least one master and no negative replica count, got %d and %d", masters, replicasPerMaster)
	}
	bin := Require(t)
	opts := Options{Args: []string{
		"cluster-enabled yes",
		"cluster-config-file nodes.conf",
		"cluster-node-timeout " + strconv.Itoa(clusterNodeTimeout),
		"cluster-replica-validity-factor 0",
		"cluster-allow-replica-migration no",
	}}
	c := &Cluster{t: t}
	var nodes []*Server
	for range masters {
		sh := &shard{master: start(t, bin, opts, kindClusterNode)}
		nodes = append(nodes, sh.master)
		for range replicasPerMaster {
			r := start(t, bin, opts, kindClusterNode)
			sh.replicas = append(sh.replicas, r)
			nodes = append(nodes, r)
		}
		c.shards = append(c.shards, sh)
	}

	// Distinct config epochs avoid the slow collision resolution of nodes that all start at 0,
	// as redis-cli --cluster create does.
	for i, n := range nodes {
		c.must(n, "CLUSTER", "SET-CONFIG-EPOCH", i+1)
	}
	for i, sh := range c.shards {
		lo, hi := i*clusterSlots/masters, (i+1)*clusterSlots/masters-1
		c.must(sh.master, "CLUSTER", "ADDSLOTSRANGE", lo, hi)
	}
	for _, n := range nodes[1:] {
		c.must(nodes[0], "CLUSTER", "MEET", "127.0.0.1", n.Port())
	}
	waitFor(t, clusterTimeout, "all cluster nodes to know each other", func() error {
		for _, n := range nodes {
			view, err := clusterView(n)
			if err != nil {
				return err
			}
			if len(view) != len(nodes) {
				return fmt.Errorf("%s knows %d of %d nodes", n.Addr(), len(view), len(nodes))
			}
			for _, v := range view {
				if v.has("handshake") || v.has("noaddr") {
					return fmt.Errorf("%s sees %s as %s", n.Addr(), v.addr, v.flags)
				}
			}
		}
		return nil
	})
	for _, sh := range c.shards {
		id := c.nodeID(sh.master)
		for _, r := range sh.replicas {
			waitFor(t, clusterTimeout, "CLUSTER REPLICATE on "+r.Addr(), func() error {
				return r.do("CLUSTER", "REPLICATE", id).Err()
			})
		}
	}
	c.waitHealthy()
	return c
}

// Addrs returns the addresses of all nodes, masters first, which is a seed list for cluster
// clients.
func (c *Cluster) Addrs() []string {
	var addrs []string
	for _, s := range append(c.Masters(), c.Replicas()...) {
		addrs = append(addrs, s.Addr())
	}
	return addrs
}

// Masters returns the master of each shard, indexed by shard, as of the last StartCluster or
// FailoverReplicaOf; failovers that Redis performs on its own are not reflected.
func (c *Cluster) Masters() []*Server {
	c.mu.Lock()
	defer c.mu.Unlock()
	masters := make([]*Server, len(c.shards))
	for i, sh := range c.shards {
		masters[i] = sh.master
	}
	return masters
}

// Replicas returns the replicas of all shards, shard by shard, as of the last StartCluster or
// FailoverReplicaOf.
func (c *Cluster) Replicas() []*Server {
	c.mu.Lock()
	defer c.mu.Unlock()
	var replicas []*Server
	for _, sh := range c.shards {
		replicas = append(replicas, sh.replicas...)
	}
	return replicas
}

// FailoverReplicaOf promotes the first replica of shard i, with CLUSTER FAILOVER when the shard's
// master is running and CLUSTER FAILOVER TAKEOVER when it has been stopped or killed. It returns
// once every running node reports cluster_state:ok and sees the promoted node as a master, and the
// former master, if running, replicates from it with its link up; afterwards Masters()[i] is the
// promoted node and the former master is the first of the shard's replicas. A replica that Redis
// already promoted on its own is accepted as is.
func (c *Cluster) FailoverReplicaOf(i int) {
	c.t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	if i < 0 || i >= len(c.shards) || len(c.shards[i].replicas) == 0 {
		c.t.Fatalf("redistest: FailoverReplicaOf(%d): there is no shard %d with a replica", i, i)
	}
	sh := c.shards[i]
	replica, old := sh.replicas[0], sh.master
	id := c.nodeID(replica)

	var issued time.Time
	waitFor(c.t, clusterTimeout, "replica "+replica.Addr()+" to become master", func() error {
		info, err := replica.info("replication")
		if err != nil {
			return err
		}
		if infoField(info, "role") == "master" {
			return nil
		}
		if time.Since(issued) < manualFailoverWait {
			return fmt.Errorf("%s still has role %s", replica.Addr(), infoField(info, "role"))
		}
		issued = time.Now()
		args := []any{"CLUSTER", "FAILOVER"}
		if !old.Running() {
			args = append(args, "TAKEOVER")
		}
		err = replica.do(args...).Err()
		if err != nil && (strings.Contains(err.Error(), "FORCE") || strings.Contains(err.Error(), "TAKEOVER")) {
			// The master is up but the replica considers it failing.
			err = replica.do("CLUSTER", "FAILOVER", "TAKEOVER").Err()
		}
		if err != nil {
			return fmt.Errorf("%v on %s: %w", args, replica.Addr(), err)
		}
		return fmt.Errorf("%v issued on %s", args, replica.Addr())
	})

	sh.master = replica
	sh.replicas = append([]*Server{old}, sh.replicas[1:]...)
	c.waitHealthyLocked(id)
}

// AwaitFailoverOf waits until Redis has promoted one of shard i's replicas on its own, as it
// does once the shard's master is stopped or killed for longer than the node timeout (2 s): the
// replica with the most of the master's writes stands first. It returns once every running node
// reports cluster_state:ok and sees the promoted node as a master, and the shard's other running
// replicas replicate from it; afterwards Masters()[i] is the promoted node and the former master
// is the first of the shard's replicas. All of it takes at most 30 seconds or fails the test.
func (c *Cluster) AwaitFailoverOf(i int) {
	c.t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	if i < 0 || i >= len(c.shards) || len(c.shards[i].replicas) == 0 {
		c.t.Fatalf("redistest: AwaitFailoverOf(%d): there is no shard %d with a replica", i, i)
	}
	sh := c.shards[i]
	var promoted *Server
	waitFor(c.t, clusterTimeout, "a replica of shard "+strconv.Itoa(i)+" to become master", func() error {
		for _, r := range sh.replicas {
			if !r.Running() {
				continue
			}
			info, err := r.info("replication")
			if err == nil && infoField(info, "role") == "master" {
				promoted = r
				return nil
			}
		}
		return fmt.Errorf("no replica of %s has role master", sh.master.Addr())
	})
	id := c.nodeID(promoted)
	replicas := []*Server{sh.master}
	for _, r := range sh.replicas {
		if r != promoted {
			replicas = append(replicas, r)
		}
	}
	sh.master, sh.replicas = promoted, replicas
	c.waitHealthyLocked(id)
}

// waitHealthy waits until the cluster matches c.shards; see waitHealthyLocked.
func (c *Cluster) waitHealthy() {
	c.t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.waitHealthyLocked("")
}

// waitHealthyLocked waits until every running node reports cluster_state:ok with all slots served,
// every running node sees every running node of c.shards in its role (replicas with the right
// master) and without failure flags, and every running replica's master link is up. When promoted
// is not empty, the node with that id must additionally be seen as a master by every running node.
// c.mu must be held.
func (c *Cluster) waitHealthyLocked(promoted string) {
	c.t.Helper()
	ids := map[*Server]string{}
	for _, sh := range c.shards {
		for _, s := range append([]*Server{sh.master}, sh.replicas...) {
			if s.Running() {
				ids[s] = c.nodeID(s)
			}
		}
	}
	waitFor(c.t, clusterTimeout, "the cluster to be ok", func() error {
		for s := range ids {
			info, err := s.do("CLUSTER", "INFO").Text()
			if err != nil {
				return fmt.Errorf("CLUSTER INFO on %s: %w", s.Addr(), err)
			}
			if infoField(info, "cluster_state") != "ok" || infoField(info, "cluster_slots_ok") != strconv.Itoa(clusterSlots) {
				return fmt.Errorf("%s reports cluster_state:%s cluster_slots_ok:%s", s.Addr(),
					infoField(info, "cluster_state"), infoField(info, "cluster_slots_ok"))
			}
			view, err := clusterView(s)
			if err != nil {
				return err
			}
			for _, sh := range c.shards {
				masterID := ids[sh.master]
				for _, n := range append([]*Server{sh.master}, sh.replicas...) {
					id, ok := ids[n]
					if !ok {
						continue
					}
					v, ok := view[id]
					switch {
					case !ok:
						return fmt.Errorf("%s does not know %s", s.Addr(), n.Addr())
					case v.has("fail") || v.has("fail?"):
						return fmt.Errorf("%s sees %s as %s", s.Addr(), n.Addr(), v.flags)
					case n == sh.master && !v.has("master"):
						return fmt.Errorf("%s sees master %s as %s", s.Addr(), n.Addr(), v.flags)
					case n != sh.master && masterID != "" && (!v.has("slave") || v.master != masterID):
						return fmt.Errorf("%s sees %s as %s of %s, not as replica of %s", s.Addr(), n.Addr(), v.flags, v.master, sh.master.Addr())
					}
				}
			}
			if promoted != "" && !view[promoted].has("master") {
				return fmt.Errorf("%s does not see the promoted node as master", s.Addr())
			}
		}
		for _, sh := range c.shards {
			for _, r := range sh.replicas {
				if _, ok := ids[r]; !ok {
					continue
				}
				info, err := r.info("replication")
				if err != nil {
					return err
				}
				if infoField(info, "role") != "slave" || infoField(info, "master_link_status") != "up" {
					return fmt.Errorf("replica %s has role:%s master_link_status:%s", r.Addr(),
						infoField(info, "role"), infoField(info, "master_link_status"))
				}
			}
		}
		return nil
	})
}

// must runs a command on s and fails the test when it fails.
func (c *Cluster) must(s *Server, args ...any) {
	c.t.Helper()
	if err := s.do(args...).Err(); err != nil {
		c.t.Fatalf("redistest: %v on %s: %v", args, s.Addr(), err)
	}
}

// nodeID returns the cluster node id of s.
func (c *Cluster) nodeID(s *Server) string {
	c.t.Helper()
	id, err := s.do("CLUSTER", "MYID").Text()
	if err != nil {
		c.t.Fatalf("redistest: CLUSTER MYID on %s: %v", s.Addr(), err)
	}
	return id
}

// clusterNode is one line of CLUSTER NODES.
type clusterNode struct {
	addr   string
	flags  string
	master string // id of the master of a replica, "-" for masters
}

func (n clusterNode) has(flag string) bool {
	for f := range strings.SplitSeq(n.flags, ",") {
		if f == flag {
			return true
		}
	}
	return false
}

// clusterView returns the nodes s knows, by id, including itself.
func clusterView(s *Server) (map[string]clusterNode, error) {
	text, err := s.do("CLUSTER", "NODES").Text()
	if err != nil {
		return nil, fmt.Errorf("CLUSTER NODES on %s: %w", s.Addr(), err)
	}
	view := map[string]clusterNode{}
	for line := range strings.Lines(text) {
		f := strings.Fields(line)
		if len(f) < 8 {
			continue
		}
		view[f[0]] = clusterNode{addr: f[1], flags: f[2], master: f[3]}
	}
	return view, nil
}
