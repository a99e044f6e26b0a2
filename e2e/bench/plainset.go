package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/redis/go-redis/v9"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/extproctest"
)

// The large-record target compares what a first execution costs redis-server with what a plain
// SET of the record's bytes plus the small commands cost it. redis-benchmark's SETs measure the
// second on an otherwise idle machine; the first executions run while the load generator, the
// processor and redis-server share the machine's two cores, where the same SET costs
// redis-server about twice as much CPU (docs/runs/history.md, run 22). The plain SETs target is that
// baseline under the same load: the null processor, writing to Redis what a store without an
// owner check would, where the processor's store calls are: at the claim, a SET of a value the
// size of the pending record, and once the response has ended, a SET of a value the size of the
// completed record, each in a round trip of its own.
const targetRedisPlain = "null processor, plain SETs"

// envPlainSizes gives the plain SETs target the sizes of the values it writes: "pending,overhead",
// the pending record's bytes and the completed record's bytes beyond the response body, as
// recordSizes measured them through the Redis target.
const envPlainSizes = "IDEMPOTENCY_BENCH_PLAIN_SIZES"

// recordKeys matches the processor's records in Redis: the policy's default key_prefix.
const recordKeys = "idempotency:*"

// plainKeyPrefix starts the plain SETs target's keys, so that the records' sizes are read apart
// from its values.
const plainKeyPrefix = "plain:"

// plainSets is the plain SETs target's processor.
type plainSets struct {
	rdb      *redis.Client
	pending  []byte // the claim's value
	overhead int    // the completed value's bytes beyond the response body
}

// newPlainSets returns the plain SETs target on the Redis at addr, its value sizes from
// envPlainSizes's format.
func newPlainSets(addr, sizes string) (*plainSets, error) {
	p, o, ok := strings.Cut(sizes, ",")
	pending, err1 := strconv.Atoi(p)
	overhead, err2 := strconv.Atoi(o)
	if !ok || err1 != nil || err2 != nil || pending <= 0 || overhead < 0 {
		return nil, fmt.Errorf("%s=%q: want the pending record's bytes and the completed record's overhead, \"pending,overhead\"", envPlainSizes, sizes)
	}
	return &plainSets{rdb: redis.NewClient(&redis.Options{Addr: addr}), pending: bytes.Repeat([]byte("p"), pending), overhead: overhead}, nil
}

// Process implements [extprocv3.ExternalProcessorServer.Process]: the null processor's answers,
// with the SETs made as the messages arrive, before each is answered.
func (p *plainSets) Process(s extprocv3.ExternalProcessor_ProcessServer) error {
	return extproctest.NullProcessor{}.Process(&plainSetStream{ExternalProcessor_ProcessServer: s, p: p})
}

// plainSetStream is one stream of the plain SETs target: its Recv makes the stream's SETs.
type plainSetStream struct {
	extprocv3.ExternalProcessor_ProcessServer
	p   *plainSets
	key string // the request's, once its headers have come; empty without an Idempotency-Key
}

func (s *plainSetStream) Recv() (*extprocv3.ProcessingRequest, error) {
	req, err := s.ExternalProcessor_ProcessServer.Recv()
	if err != nil {
		return req, err
	}
	ctx := s.Context()
	switch {
	case req.GetRequestHeaders() != nil:
		for _, h := range req.GetRequestHeaders().GetHeaders().GetHeaders() {
			if h.GetKey() == "idempotency-key" {
				// A key of the length the processor's scoped keys have (a prefix and a SHA-256).
				sum := sha256.Sum256(h.GetRawValue())
				s.key = plainKeyPrefix + hex.EncodeToString(sum[:])
			}
		}
		if s.key != "" {
			err = s.p.rdb.Set(ctx, s.key, s.p.pending, policy.DefaultLockTTL).Err()
		}
	case req.GetResponseBody().GetEndOfStream() && s.key != "":
		body := req.GetResponseBody().GetBody()
		v := make([]byte, s.p.overhead+len(body))
		copy(v[s.p.overhead:], body)
		err = s.p.rdb.Set(ctx, s.key, v, policy.DefaultTTL).Err()
	}
	if err != nil {
		// The null processor ends the stream on a failed Recv: the benchmark sees it fail.
		return nil, fmt.Errorf("plain SETs: %w", err)
	}
	return req, nil
}

// recordSizes runs one first execution of 1 KiB bodies through the Redis target, on an emptied
// Redis, and returns the pending record's bytes (read while the request is on its way upstream)
// and the completed record's bytes beyond its response body: the sizes the plain SETs target
// writes. Redis is emptied again after.
func recordSizes(ctx context.Context, client extprocv3.ExternalProcessorClient, admin *redis.Client) (pending, overhead int, err error) {
	if err := admin.FlushAll(ctx).Err(); err != nil {
		return 0, 0, err
	}
	sh := sized(1 << 10)
	var errPending error
	err = requestShaped(ctx, client, workloadFirst, seq.Add(1), sh, "", func() { pending, errPending = longestValue(ctx, admin, recordKeys) })
	if err = errors.Join(err, errPending); err != nil {
		return 0, 0, fmt.Errorf("a first execution's record sizes: %w", err)
	}
	record, err := longestValue(ctx, admin, recordKeys)
	if err != nil {
		return 0, 0, err
	}
	if record <= len(sh.resp) {
		return 0, 0, fmt.Errorf("a first execution's record of %d B for a %d B response", record, len(sh.resp))
	}
	return pending, record - len(sh.resp), admin.FlushAll(ctx).Err()
}
