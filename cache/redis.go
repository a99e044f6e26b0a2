package cache

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/idempotency-extproc/idempotency-extproc/cache/seal"
)

// DefaultRedisTimeout bounds each Redis call when RedisOptions.Timeout is zero.
const DefaultRedisTimeout = 100 * time.Millisecond

// pipelineSlots is how many batches of calls may be in flight at once; calls beyond wait and
// leave together (see pipeline). Two keep one batch filling while the other is on the wire.
const pipelineSlots = 2

// Each record is one Redis string under its key, so that every operation touches one key (no
// hash tags under Cluster), a claim is one native command, and the server stores one value:
//
//	offset  bytes  field
//	0       1      layout version: recordLayout
//	1       1      state: 'p' pending or 'c' completed
//	2       26     owner token (kept after completion so that a retried Complete succeeds)
//	28      13     lifetime of the completed record in milliseconds, decimal, zero-padded
//	41      8      fingerprint length, hexadecimal
//	49      n      fingerprint
//	49+n           encoded response (completed only; sealed under the key with a Keyring, see sealed.go)
//
// The key's own expiry is the lease while pending and the TTL once completed. The scripts below
// read the same offsets, built from these constants.
const (
	recordLayout = '2'
	tokenLen     = 26
	ttlDigits    = 13 // any time.Duration in milliseconds
	fpLenDigits  = 8
	headerLen    = 2 + tokenLen + ttlDigits + fpLenDigits
)

// luaOwned starts every script below: it reads the record at KEYS[1] into cur and sets owned
// when the record has this layout and ARGV[1] as its token. The offsets come from the constants
// above (Lua counts from 1).
var luaOwned = fmt.Sprintf(`
local cur = redis.call('GET', KEYS[1])
local owned = cur and string.sub(cur, 1, 1) == '%c' and string.sub(cur, 3, %d) == ARGV[1]
`, recordLayout, 2+tokenLen)

var (
	// renewScript: KEYS[1] key; ARGV token, lock ms. Returns 1 when renewed.
	renewScript = redis.NewScript(luaOwned + `
if owned and string.sub(cur, 2, 2) == 'p' then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
`)
	// completeScript: KEYS[1] key; ARGV token, encoded response. Returns 1 when completed; a
	// completed record stays completed, so a retried Complete succeeds.
	completeScript = redis.NewScript(luaOwned + fmt.Sprintf(`
if not owned then return 0 end
local st = string.sub(cur, 2, 2)
if st == 'c' then return 1 end
if st ~= 'p' then return 0 end
local ttl = tonumber(string.sub(cur, %d, %d))
if not ttl or ttl <= 0 then return redis.error_reply('record has no valid ttl') end
redis.call('SET', KEYS[1], '%cc' .. string.sub(cur, 3) .. ARGV[2], 'PX', ttl)
return 1
`, 3+tokenLen, 2+tokenLen+ttlDigits, recordLayout))
	// releaseScript: KEYS[1] key; ARGV token. Returns 1 when deleted.
	releaseScript = redis.NewScript(luaOwned + `
if owned and string.sub(cur, 2, 2) == 'p' then
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
	// Keyring, when set, seals every response the store keeps (status, headers and body) with
	// its active key, bound to the record's key, and opens them on Acquire (SPEC §12). Responses
	// stored without a keyring still read; one that cannot be opened (its key is not in the
	// keyring, it was altered or moved, or the store has no keyring) gives ErrUnreadable.
	Keyring *seal.Keyring
}

// Redis is a Store backed by Redis 7.0 or later (or Valkey): standalone, Sentinel or Cluster.
// Each operation is one command on one key, so it is atomic on the server and costs one round
// trip; under load, concurrent calls share round trips in pipelined batches. Acquire is a native
// SET NX GET; the owner-checked operations are scripts, sent by SHA (EVALSHA) and loaded on first
// use.
type Redis struct {
	client  redis.UniversalClient
	timeout time.Duration
	pipe    *pipeline
	orphans *orphans
	ring    *seal.Keyring // seals responses, when set
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
	r := NewRedis(client, opts.Timeout)
	r.ring = opts.Keyring
	return r, nil
}

// NewRedis returns a Store that uses client, bounding every call by timeout (default
// DefaultRedisTimeout). The Store owns the client: Close closes it.
func NewRedis(client redis.UniversalClient, timeout time.Duration) *Redis {
	if timeout <= 0 {
		timeout = DefaultRedisTimeout
	}
	r := &Redis{client: client, timeout: timeout, pipe: newPipeline(client, timeout, pipelineSlots), orphans: newOrphans()}
	go r.orphans.run(r.releaseOrphans, timeout)
	return r
}

// CheckRedisOptions reports what OpenRedis would refuse in opts, without connecting: a URL that
// does not parse, Cluster and Sentinel together, a database other than 0 for Cluster. Its
// errors never hold the URL's password.
func CheckRedisOptions(opts RedisOptions) error {
	c, err := newRedisClient(opts)
	if err != nil {
		return err
	}
	return c.Close()
}

// parseRedisURL is redis.ParseURL with errors that never hold raw's password. net/url quotes
// the URL, or a piece of it, in its errors, and a password with an unescaped '#' or '/' is a
// common way to get one: such a URL gets a message of its own instead.
func parseRedisURL(raw string) (*redis.Options, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, errors.New("cache: redis url: not a valid URL (a user or password with '#', '/', '@', ':' or '%' must be percent-encoded)")
	}
	o, err := redis.ParseURL(raw)
	if err == nil {
		return o, nil
	}
	// go-redis ends its messages with the value it refused (a scheme, a path, a database), and
	// a password with an unescaped '/' parses as part of the path: keep only what it refused.
	msg, _, _ := strings.Cut(strings.TrimPrefix(err.Error(), "redis: "), ": ")
	if msg == "invalid URL scheme" {
		msg += fmt.Sprintf(" %q (want redis or rediss)", u.Scheme)
	}
	return nil, fmt.Errorf("cache: redis url: %s", msg)
}

func newRedisClient(opts RedisOptions) (redis.UniversalClient, error) {
	if len(opts.ClusterAddrs) > 0 && len(opts.SentinelAddrs) > 0 {
		return nil, errors.New("cache: redis: choose Cluster or Sentinel, not both")
	}
	raw := opts.URL
	if raw == "" {
		raw = "redis://localhost:6379/0"
	}
	base, err := parseRedisURL(raw)
	if err != nil {
		return nil, err
	}
	if len(opts.ClusterAddrs) > 0 && base.DB != 0 {
		return nil, fmt.Errorf("cache: redis: Cluster has only database 0, the url selects %d", base.DB)
	}
	switch {
	case opts.TLSConfig != nil:
		base.TLSConfig = opts.TLSConfig
	case base.TLSConfig != nil && (len(opts.ClusterAddrs) > 0 || len(opts.SentinelAddrs) > 0):
		// ParseURL names the URL's host as the certificate to expect; under Cluster and Sentinel
		// that host is not dialled, and each node is checked against the address it is dialled at.
		base.TLSConfig = base.TLSConfig.Clone()
		base.TLSConfig.ServerName = ""
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

// Acquire implements [Store.Acquire]. It is one SET NX PX GET: Redis creates the pending record
// if the key is free and answers with the record it found otherwise.
func (r *Redis) Acquire(ctx context.Context, key string, c Claim) (Lease, *Record, error) {
	if err := checkClaim(c); err != nil {
		return Lease{}, nil, err
	}
	ctx, cancel := r.bound(ctx)
	defer cancel()
	token := newToken()
	pending := appendPending(make([]byte, 0, headerLen+len(c.Fingerprint)), token, c)
	lease := Lease{key: key, token: token}
	found, err := r.pipe.run(ctx, &call{
		args: []any{"set", key, pending, "nx", "px", c.LockTTL.Milliseconds(), "get"},
		// The SET may have run while this caller never learned it: free what it may have
		// created rather than block the key for a whole lease.
		undo: func(*redis.Cmd) { r.orphans.add(lease, c.LockTTL) },
	}).Text()
	switch {
	case errors.Is(err, redis.Nil):
		return lease, nil, nil
	case err == nil:
	case redis.HasErrorPrefix(err, "WRONGTYPE"):
		return Lease{}, nil, fmt.Errorf("cache: redis acquire: %w: the key holds another type than a record of layout %c", ErrCorrupt, recordLayout)
	case redis.HasErrorPrefix(err, "syntax error"):
		// Redis before 7.0 refuses NX and GET together.
		return Lease{}, nil, fmt.Errorf("cache: redis acquire: the server needs to be Redis 7.0 or later (SET NX GET): %w", err)
	default:
		return Lease{}, nil, redisError("acquire", err)
	}
	rec, owner, err := decodeRecord(found, r.ring, key)
	if err != nil {
		return Lease{}, nil, err
	}
	if rec.State == Pending && owner == token {
		// go-redis retried a SET whose first reply was lost: the record is the caller's own.
		return lease, nil, nil
	}
	return Lease{}, rec, nil
}

// newToken returns 128 random bits as tokenLen base32 characters.
func newToken() string {
	t := rand.Text()
	if len(t) != tokenLen {
		panic(fmt.Sprintf("cache: rand.Text returned %d characters, the record layout holds %d", len(t), tokenLen))
	}
	return t
}

// appendPending appends the pending record of c owned by token to b.
func appendPending(b []byte, token string, c Claim) []byte {
	b = append(b, recordLayout, 'p')
	b = append(b, token...)
	b = appendPadded(b, uint64(c.TTL.Milliseconds()), 10, ttlDigits)
	b = appendPadded(b, uint64(len(c.Fingerprint)), 16, fpLenDigits)
	return append(b, c.Fingerprint...)
}

// appendPadded appends n in base, left-padded with zeros to width digits.
func appendPadded(b []byte, n uint64, base, width int) []byte {
	var digits [20]byte
	d := strconv.AppendUint(digits[:0], n, base)
	for range width - len(d) {
		b = append(b, '0')
	}
	return append(b, d...)
}

// bound gives ctx the store's timeout, unless it already has an earlier deadline.
func (r *Redis) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if d, ok := ctx.Deadline(); ok && time.Until(d) <= r.timeout {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, r.timeout)
}

// decodeRecord decodes the record stored under key, opening its response with ring, and returns
// it with its owner token.
func decodeRecord(v string, ring *seal.Keyring, key string) (*Record, string, error) {
	if len(v) < headerLen {
		return nil, "", fmt.Errorf("%w: a record of %d bytes", ErrCorrupt, len(v))
	}
	if v[0] != recordLayout {
		return nil, "", fmt.Errorf("%w: record layout %q is not supported by this version", ErrCorrupt, v[0])
	}
	token := v[2 : 2+tokenLen]
	n, err := strconv.ParseUint(v[headerLen-fpLenDigits:headerLen], 16, 32)
	if err != nil || n > uint64(len(v)-headerLen) {
		return nil, "", fmt.Errorf("%w: record fingerprint length %q", ErrCorrupt, v[headerLen-fpLenDigits:headerLen])
	}
	// One copy of the fingerprint and the response, each capped at its own end.
	b := []byte(v[headerLen:])
	rec := &Record{}
	if n > 0 {
		rec.Fingerprint = b[:n:n]
	}
	switch v[1] {
	case 'p':
		rec.State = Pending
	case 'c':
		rec.State = Completed
		resp, err := decodeStoredResponse(b[n:], ring, key)
		if err != nil {
			return nil, "", err
		}
		rec.Response = resp
	default:
		return nil, "", fmt.Errorf("%w: record state %q", ErrCorrupt, v[1])
	}
	return rec, token, nil
}

// Renew implements [Store.Renew].
func (r *Redis) Renew(ctx context.Context, l Lease, d time.Duration) error {
	if err := checkRenewal(d); err != nil {
		return err
	}
	return r.owned(ctx, "renew", renewScript, l, d.Milliseconds())
}

// Complete implements [Store.Complete].
func (r *Redis) Complete(ctx context.Context, l Lease, resp Response) error {
	resp = resp.normalized()
	blob := appendStoredResponse(make([]byte, 0, storedResponseSize(resp, r.ring)), resp, r.ring, sealedAAD(r.ring, l.key))
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
	n, err := r.pipe.script(ctx, s, []string{l.key}, append([]any{l.token}, args...)...).Int64()
	if err != nil {
		return redisError(op, err)
	}
	if n != 1 {
		return ErrLeaseLost
	}
	return nil
}

// releaseOrphans releases leases whose Acquire may have run unbeknown to their callers (see
// orphans), in one pipelined round trip on one connection. It goes outside the pipeline and the
// store timeout, with a deadline of at least a second: it matters most while Redis answers
// slower than the store timeout.
func (r *Redis) releaseOrphans(ls []Lease) []error {
	ctx, cancel := context.WithTimeout(context.Background(), max(r.timeout, time.Second))
	defer cancel()
	calls := make([]*call, len(ls))
	for i, l := range ls {
		calls[i] = &call{script: releaseScript, keys: []string{l.key}, args: []any{l.token}}
	}
	cmds := sendBatch(ctx, r.client, calls)
	errs := make([]error, len(ls))
	for i, cmd := range cmds {
		n, err := cmd.Int64()
		switch {
		case err != nil:
			errs[i] = redisError("release", err)
		case n != 1:
			errs[i] = ErrLeaseLost
		}
	}
	return errs
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
	r.orphans.stop()
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
