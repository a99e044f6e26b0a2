package cache

import (
	"bufio"
	"context"
	"strconv"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// Replicated is a Store whose writes replicas can acknowledge (Claim.Replicas): Redis.
type Replicated interface {
	// Replicas returns how many replicas acknowledge the master's writes now: those attached and
	// in sync with it; under Cluster, the fewest any master has, since a durable claim waits on
	// the master of its key's slot. A durable claim asking for more than that cannot be confirmed.
	Replicas(ctx context.Context) (int, error)
}

var _ Replicated = (*Redis)(nil)

// Replicas implements [Replicated]: INFO replication's replicas in state online (the ones WAIT
// counts), or, where INFO is not allowed, what WAIT 0 0 counts.
func (r *Redis) Replicas(ctx context.Context) (int, error) {
	ctx, cancel := r.bound(ctx)
	defer cancel()
	cc, ok := r.client.(*redis.ClusterClient)
	if !ok {
		n, err := replicasOf(ctx, r.client)
		return n, redisError("replicas", err)
	}
	var mu sync.Mutex
	fewest := -1
	err := cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
		n, err := replicasOf(ctx, c)
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		if fewest < 0 || n < fewest {
			fewest = n
		}
		return nil
	})
	if err != nil {
		cc.ReloadState(ctx)
		return 0, redisError("replicas", err)
	}
	return max(fewest, 0), nil
}

// replicasOf counts the online replicas of the master c is connected to.
func replicasOf(ctx context.Context, c interface {
	Info(ctx context.Context, section ...string) *redis.StringCmd
	Do(ctx context.Context, args ...any) *redis.Cmd
}) (int, error) {
	info, err := c.Info(ctx, "replication").Result()
	if err != nil {
		if !strings.Contains(err.Error(), "NOPERM") {
			return 0, err
		}
		// An ACL user without INFO: WAIT with no replicas to wait for answers at once with
		// how many replicas acknowledged this connection's writes, every replica for a fresh one.
		n, err := c.Do(ctx, "wait", 0, 0).Int()
		return n, err
	}
	return onlineReplicas(info), nil
}

// onlineReplicas counts the replicas INFO replication lists in state online: lines such as
// slave0:ip=10.0.0.2,port=6379,state=online,offset=1234,lag=0. A replica (role:slave) has none.
func onlineReplicas(info string) int {
	n := 0
	sc := bufio.NewScanner(strings.NewReader(info))
	for sc.Scan() {
		name, fields, ok := strings.Cut(strings.TrimSpace(sc.Text()), ":")
		if !ok || !strings.HasPrefix(name, "slave") {
			continue
		}
		if _, err := strconv.Atoi(strings.TrimPrefix(name, "slave")); err != nil {
			continue
		}
		for f := range strings.SplitSeq(fields, ",") {
			if f == "state=online" {
				n++
			}
		}
	}
	return n
}
