package cache

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// DefaultRedisTimeout bounds each Redis call when RedisOptions.Timeout is zero.
const DefaultRedisTimeout = 100 * time.Millisecond

// pipelineSlots is how many batches of calls may be in flight at once; calls beyond wait and
// leave together (see pipeline). Two keep one batch filling while the other is on the wire.
const pipelineSlots = 2

// recordVersion is the value of the "v" field of every record hash this version writes.
const recordVersion = "1"

// Each record is one Redis hash under its key, so every operation touches one key and needs no
// hash tags under Cluster:
//
//	v    record layout version ("1")
//	st   "p" pending or "c" completed
//	tok  owner token (kept after completion so that a retried Complete succeeds)
//	fp   request fingerprint
//	ttl  lifetime of the completed record, in milliseconds
//	resp encoded response (completed only)
//
// The hash's own expiry is the lease while pending and the TTL once completed.
var (
	// acquireScript: KEYS[1] key; ARGV token, fingerprint, ttl ms, lock ms, version.
	// Returns {1} when the caller owns the key, else {0, v, st, fp, resp}.
	acquireScript = redis.NewScript(`
local cur = redis.call('HMGET', KEYS[1], 'v', 'st', 'fp', 'tok', 'resp')
if cur[1] then
  if cur[4] == ARGV[1] and cur[2] == 'p' then return {1} end
  return {0, cur[1], cur[2] or '', cur[3] or '', cur[5] or ''}
end
redis.call('HSET', KEYS[1], 'v', ARGV[5], 'st', 'p', 'tok', ARGV[1], 'fp', ARGV[2], 'ttl', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {1}
`)
	// renewScript: KEYS[1] key; ARGV token, lock ms. Returns 1 when renewed.
	renewScript = redis.NewScript(`
local cur = redis.call('HMGET', KEYS[1], 'tok', 'st')
if cur[1] == ARGV[1] and cur[2] == 'p' then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
`)
	// completeScript: KEYS[1] key; ARGV token, encoded response. Returns 1 when completed.
	completeScript = redis.NewScript(`
local cur = redis.call('HMGET', KEYS[1], 'tok', 'st', 'ttl')
if cur[1] ~= ARGV[1] then return 0 end
if cur[2] == 'c' then return 1 end
if cur[2] ~= 'p' then return 0 end
local ttl = tonumber(cur[3])
if not ttl or ttl <= 0 then return redis.error_reply('record has no valid ttl') end
redis.call('HSET', KEYS[1], 'st', 'c', 'resp', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ttl)
return 1
`)
	// releaseScript: KEYS[1] key; ARGV token. Returns 1 when deleted.
	releaseScript = redis.NewScript(`
local cur = redis.call('HMGET', KEYS[1], 'tok', 'st')
if cur[1] == ARGV[1] and cur[2] == 'p' then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
`)
)

// RedisOptions selects and configures a Redis deployment, following the command-line settings.
type RedisOptions struct {
	// URL is a redis:// or rediss:// (TLS) URL with optional user, password and database. For
	// Cluster and Sentinel, its user, password and TLS apply to the nodes and its host is ignored.
	URL string
	// ClusterAddrs, when set, selects Redis Cluster with these seed nodes.
	ClusterAddrs []string
	// SentinelAddrs, when set, selects a Sentinel-managed master named SentinelMaster.
	SentinelAddrs  []string
	SentinelMaster string
	// TLSConfig, when set, replaces the TLS configuration derived from a rediss:// URL (for
	// example to trust a private CA). It turns TLS on for any URL scheme.
	TLSConfig *tls.Config
	// Timeout bounds every call (default DefaultRedisTimeout).
	Timeout time.Duration
	// PoolSize is the connection pool size per node (default go-redis': 10 per CPU).
	PoolSize int
}

// Redis is a Store backed by Redis: standalone, Sentinel or Cluster. Each operation is one script
// call on one key, so it is atomic on the server and costs one round trip; under load,
// concurrent calls share round trips in pipelined batches. Scripts are sent by SHA (EVALSHA) and
// loaded on first use.
type Redis struct {
	client  redis.UniversalClient
	timeout time.Duration
	pipe    *pipeline
}

var _ Store = (*Redis)(nil)

// OpenRedis builds a client for the deployment opts describe and returns a Store on it. It does
// not connect: an unreachable Redis shows as errors from the Store's calls and from Ping, so a
// process can start and report itself unready until Redis answers.
func OpenRedis(opts RedisOptions) (*Redis, error) {
	client, err := newRedisClient(opts)
	if err != nil {
		return nil, err
	}
	return NewRedis(client, opts.Timeout), nil
}

// NewRedis returns a Store that uses client, bounding every call by timeout (default
// DefaultRedisTimeout). The Store owns the client: Close closes it.
func NewRedis(client redis.UniversalClient, timeout time.Duration) *Redis {
	if timeout <= 0 {
		timeout = DefaultRedisTimeout
	}
	return &Redis{client: client, timeout: timeout, pipe: newPipeline(client, timeout, pipelineSlots)}
}

func newRedisClient(opts RedisOptions) (redis.UniversalClient, error) {
	if len(opts.ClusterAddrs) > 0 && len(opts.SentinelAddrs) > 0 {
		return nil, errors.New("cache: redis: choose Cluster or Sentinel, not both")
	}
	url := opts.URL
	if url == "" {
		url = "redis://localhost:6379/0"
	}
	base, err := redis.ParseURL(url)
	if err != nil {
		return nil, fmt.Errorf("cache: redis url: %w", err)
	}
	if opts.TLSConfig != nil {
		base.TLSConfig = opts.TLSConfig
	}
	// Deadlines come from each call's context, which Redis methods always bound.
	base.ContextTimeoutEnabled = true
	// Every call is bounded far below go-redis' dial retry interval, so retries would only log.
	base.DialerRetries = 1
	// Redis before 7.2 knows neither CLIENT SETINFO nor CLIENT MAINT_NOTIFICATIONS, and neither
	// is needed: skip them on connect.
	base.DisableIdentity = true
	base.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
	if opts.PoolSize > 0 {
		base.PoolSize = opts.PoolSize
	}
	switch {
	case len(opts.ClusterAddrs) > 0:
		if base.DB != 0 {
			return nil, fmt.Errorf("cache: redis: Cluster has only database 0, the url selects %d", base.DB)
		}
		return redis.NewClusterClient(&redis.ClusterOptions{
			Addrs:                    opts.ClusterAddrs,
			Username:                 base.Username,
			Password:                 base.Password,
			TLSConfig:                base.TLSConfig,
			ContextTimeoutEnabled:    true,
			PoolSize:                 base.PoolSize,
			DialerRetries:            base.DialerRetries,
			DisableIdentity:          true,
			MaintNotificationsConfig: base.MaintNotificationsConfig,
		}), nil
	case len(opts.SentinelAddrs) > 0:
		master := opts.SentinelMaster
		if master == "" {
			master = "mymaster"
		}
		return redis.NewFailoverClient(&redis.FailoverOptions{
			MasterName:            master,
			SentinelAddrs:         opts.SentinelAddrs,
			Username:              base.Username,
			Password:              base.Password,
			DB:                    base.DB,
			TLSConfig:             base.TLSConfig,
			ContextTimeoutEnabled: true,
			PoolSize:              base.PoolSize,
			DialerRetries:         base.DialerRetries,
			DisableIdentity:       true,
		}), nil
	default:
		return redis.NewClient(base), nil
	}
}

// Acquire implements [Store.Acquire].
func (r *Redis) Acquire(ctx context.Context, key string, c Claim) (Lease, *Record, error) {
	if err := checkClaim(c); err != nil {
		return Lease{}, nil, err
	}
	ctx, cancel := r.bound(ctx)
	defer cancel()
	token := rand.Text()
	res, err := r.pipe.run(ctx, acquireScript, []string{key},
		token, c.Fingerprint, c.TTL.Milliseconds(), c.LockTTL.Milliseconds(), recordVersion).Slice()
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
			// The script may have run and only its reply been lost: free what it may have
			// created rather than block the key for a whole lease.
			go r.releaseOrphan(Lease{key: key, token: token})
		}
		return Lease{}, nil, redisError("acquire", err)
	}
	if len(res) == 0 {
		return Lease{}, nil, fmt.Errorf("%w: acquire returned nothing", ErrCorrupt)
	}
	if owned, _ := res[0].(int64); owned == 1 {
		return Lease{key: key, token: token}, nil, nil
	}
	rec, err := decodeRecord(res[1:])
	if err != nil {
		return Lease{}, nil, err
	}
	return Lease{}, rec, nil
}

// bound gives ctx the store's timeout, unless it already has an earlier deadline.
func (r *Redis) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if d, ok := ctx.Deadline(); ok && time.Until(d) <= r.timeout {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, r.timeout)
}

// decodeRecord decodes {v, st, fp, resp} as returned by the acquire script.
func decodeRecord(f []any) (*Record, error) {
	if len(f) != 4 {
		return nil, fmt.Errorf("%w: %d fields", ErrCorrupt, len(f))
	}
	v, _ := f[0].(string)
	st, _ := f[1].(string)
	fp, _ := f[2].(string)
	resp, _ := f[3].(string)
	if v != recordVersion {
		return nil, fmt.Errorf("%w: record version %q is not supported by this version", ErrCorrupt, v)
	}
	rec := &Record{Fingerprint: []byte(fp)}
	switch st {
	case "p":
		rec.State = Pending
	case "c":
		rec.State = Completed
		r, err := decodeResponse([]byte(resp))
		if err != nil {
			return nil, err
		}
		rec.Response = r
	default:
		return nil, fmt.Errorf("%w: record state %q", ErrCorrupt, st)
	}
	if len(rec.Fingerprint) == 0 {
		rec.Fingerprint = nil
	}
	return rec, nil
}

// Renew implements [Store.Renew].
func (r *Redis) Renew(ctx context.Context, l Lease, d time.Duration) error {
	if d < time.Millisecond {
		return fmt.Errorf("cache: renew: lease duration must be at least 1ms, got %v", d)
	}
	return r.owned(ctx, "renew", renewScript, l, d.Milliseconds())
}

// Complete implements [Store.Complete].
func (r *Redis) Complete(ctx context.Context, l Lease, resp Response) error {
	if resp.BodyOmitted {
		resp.Body = nil
	}
	blob := appendResponse(make([]byte, 0, encodedResponseSize(resp)), resp)
	return r.owned(ctx, "complete", completeScript, l, blob)
}

// Release implements [Store.Release].
func (r *Redis) Release(ctx context.Context, l Lease) error {
	return r.owned(ctx, "release", releaseScript, l)
}

// owned runs an owner-checked script that answers 1 on success and 0 when the lease is lost.
func (r *Redis) owned(ctx context.Context, op string, s *redis.Script, l Lease, args ...any) error {
	if l.token == "" {
		return ErrLeaseLost
	}
	ctx, cancel := r.bound(ctx)
	defer cancel()
	n, err := r.pipe.run(ctx, s, []string{l.key}, append([]any{l.token}, args...)...).Int64()
	if err != nil {
		return redisError(op, err)
	}
	if n != 1 {
		return ErrLeaseLost
	}
	return nil
}

// releaseOrphan releases a lease whose Acquire failed after it may have been sent. The release is
// owner-checked, so it deletes nothing if the script never ran.
func (r *Redis) releaseOrphan(l Lease) {
	ctx, cancel := context.WithTimeout(context.Background(), max(r.timeout, time.Second))
	defer cancel()
	_ = r.owned(ctx, "release", releaseScript, l)
}

// Ping implements [Store.Ping]. For Cluster it pings every known master and, when one does not
// answer, reloads the slot map so that a failover is noticed without waiting for a MOVED reply.
func (r *Redis) Ping(ctx context.Context) error {
	ctx, cancel := r.bound(ctx)
	defer cancel()
	cc, ok := r.client.(*redis.ClusterClient)
	if !ok {
		return redisError("ping", r.client.Ping(ctx).Err())
	}
	err := cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
		return c.Ping(ctx).Err()
	})
	if err != nil {
		cc.ReloadState(ctx)
	}
	return redisError("ping", err)
}

// Close implements [Store.Close].
func (r *Redis) Close() error {
	r.pipe.close()
	err := r.client.Close()
	if errors.Is(err, redis.ErrClosed) {
		return nil
	}
	return err
}

// Client returns the underlying client, for instrumentation such as hooks.
func (r *Redis) Client() redis.UniversalClient { return r.client }

// redisError wraps err with the operation, translating go-redis sentinels so that they never
// escape this package.
func redisError(op string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, redis.Nil):
		return fmt.Errorf("cache: redis %s: %w: unexpected nil reply", op, ErrCorrupt)
	case errors.Is(err, redis.ErrClosed):
		return fmt.Errorf("cache: redis %s: %w", op, ErrClosed)
	}
	return fmt.Errorf("cache: redis %s: %w", op, err)
}
