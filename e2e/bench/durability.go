package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// The targets of -mode costs' durability section, both on a Redis master with one replica: the
// Redis store as the others run it, and with durability.replicas: 1, which waits for the replica
// after each claim and each completion (WAIT).
const (
	targetRedisReplicated = "redis store, master with a replica"
	targetRedisDurable    = "redis store, replicas: 1"
)

// durablePolicy is benchPolicy with durability.replicas: 1. Its timeout, above the default 50 ms,
// changes nothing of what a confirmed write costs (WAIT returns once the replica acknowledges)
// and keeps a loaded machine's stall from failing a claim.
func durablePolicy() *policy.Policy {
	return mustPolicy("store_timeout: 2s\ndurability: {replicas: 1, timeout: 1s}\n" + benchRoutes)
}

// startReplicatedRedis starts a redis-server and a replica of it on loopback and returns the
// master's address once the master counts the replica for WAIT.
func startReplicatedRedis() (string, func(), error) {
	master, stopMaster, err := startRedis()
	if err != nil {
		return "", nil, err
	}
	host, port, _ := strings.Cut(master, ":")
	replica, stopReplica, err := startRedis("--replicaof", host, port)
	if err != nil {
		stopMaster()
		return "", nil, err
	}
	stop := func() {
		stopReplica()
		stopMaster()
	}
	if err := awaitReplica(master); err != nil {
		stop()
		return "", nil, fmt.Errorf("replica %s of %s: %w", replica, master, err)
	}
	return master, stop, nil
}

// awaitReplica waits until the master at addr counts one replica for WAIT after a write.
func awaitReplica(addr string) error {
	c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 1}) // one connection: WAIT follows the write
	defer c.Close()
	ctx := context.Background()
	for range 200 {
		var wait *redis.Cmd
		_, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
			p.Set(ctx, "bench:replica", "1", 0)
			p.Del(ctx, "bench:replica")
			wait = p.Do(ctx, "wait", 1, 100)
			return nil
		})
		if n, _ := wait.Int(); err == nil && n == 1 {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return errors.New("not acknowledging the master's writes after 30 s")
}

// replicaOf returns a client of master's replica (its first, as INFO lists them).
func replicaOf(ctx context.Context, master *redis.Client) (*redis.Client, error) {
	info := master.InfoMap(ctx, "replication")
	line := info.Item("Replication", "slave0") // ip=127.0.0.1,port=6380,state=online,…
	var ip, port string
	for _, f := range strings.Split(line, ",") {
		k, v, _ := strings.Cut(f, "=")
		switch k {
		case "ip":
			ip = v
		case "port":
			port = v
		}
	}
	if ip == "" || port == "" {
		return nil, fmt.Errorf("the master reports no replica: %q", line)
	}
	return redis.NewClient(&redis.Options{Addr: ip + ":" + port}), nil
}
