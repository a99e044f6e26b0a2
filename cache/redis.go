package cache

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/idempotency-extproc/idempotency-extproc/cache/seal"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

// DefaultRedisTimeout bounds each Redis call when RedisOptions.Timeout is zero.
const DefaultRedisTimeout = 100 * time.Millisecond

// pipelineSlots is how many batches of calls may be in flight at once; calls beyond wait and
// leave together (see pipeline). One batch is on the wire while the next fills: with two, a call
// arriving during a round trip took the second slot and went alone, so under load a first
// execution made 0.45 round trips instead of 0.25 and cost the processor 25.6 µs more CPU,
// with latency the same within the benchmark's noise (docs/runs/27-a2c2781-redis-one-batch.txt).
const pipelineSlots = 1

// A completed record of at least stagedRecordBytes is not sent through its script: its bytes go
// first to a staging key of the same slot, in a plain SET, and the script, once it has checked
// the owner, renames that key onto the record's (see Complete). A script's arguments and writes
// are copied in and out of Lua, which cost redis-server 4 to 7 times a plain SET of the bytes
// from 64 KiB to 1 MiB; staged, a first execution costs 1.0 to 1.2 times a SET plus the small
// commands (BenchmarkRedisFirstExecutionCPU). One completion sent alone, redis-server's CPU
// (INFO cpu) staged against through the script, three rounds each: 17-19 against 18-28 µs at
// 1 KiB, 21-24 against 26-36 at 2 KiB, 22-27 against 29-32 at 4 KiB; at 300 B the script's
// 16-17 against 21-26 staged, the staging key's SET and RENAME costing more than the bytes.
const stagedRecordBytes = 2 << 10

// stagingTTL is the least TTL a completed record is staged with: the staging key then holds the
// record's own TTL, which RENAME carries onto the record, so that the script sets none (no
// PEXPIRE). A record with a shorter TTL is staged for stagingTTL, long enough for its script to
// find it, and the script sets its TTL. So the staged bytes of a completion whose script never
// ran (the round trip broke between the two commands) linger for the record's TTL, or
// stagingTTL when that is shorter.
const stagingTTL = time.Minute

// luaOwned starts every owner-checked script below: it reads the first bytes of the record at
// KEYS[1], whatever its size, into head, sets owned when the record has a known layout and
// ARGV[1] as its token, and st to its state. The offsets come from the constants in
// redis_record.go (Lua counts from 1).
var luaOwned = fmt.Sprintf(`
local head = redis.call('GETRANGE', KEYS[1], 0, %d)
local layout = string.sub(head, 1, 1)
local owned = (layout == '%c' or layout == '%c') and string.sub(head, 3, %d) == ARGV[1]
local st = string.sub(head, 2, 2)
`, ownerLen-1, recordLayout, layout2, ownerLen)

// luaCompletedAgain defines completedAgain, which a completion script returns when the caller's
// record is completed already (a retried Complete): it sets the record's expiry to what it is,
// which changes nothing but is a write, and returns 2. A durable Complete's WAIT then confirms the
// earlier write too, whatever connection carried it: replicas apply writes in the order the
// master made them, so one that acknowledged this write holds every write before it.
const luaCompletedAgain = `
local function completedAgain()
  local at = redis.call('PEXPIRETIME', KEYS[1])
  if at > 0 then redis.call('PEXPIREAT', KEYS[1], at) end
  return 2
end
`

var (
	// renewScript: KEYS[1] key; ARGV token, lock ms, the lease's new end (Unix ms, padded).
	// Returns 1 when renewed.
	renewScript = redis.NewScript(luaOwned + fmt.Sprintf(`
if owned and st == 'p' then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if layout == '%c' then redis.call('SETRANGE', KEYS[1], %d, ARGV[3]) end
  return 1
end
return 0
`, recordLayout, expiresOffset))
	// reassertScript: KEYS[1] key; ARGV token, lock ms, the lease's new end (Unix ms, padded),
	// the pending record to write back. Renews the caller's own pending record, as renewScript,
	// and returns 1; writes the record where the key holds none and returns 3; returns 0, and
	// changes nothing, when the key holds any other record.
	reassertScript = redis.NewScript(luaOwned + fmt.Sprintf(`
if owned and st == 'p' then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if layout == '%c' then redis.call('SETRANGE', KEYS[1], %d, ARGV[3]) end
  return 1
end
if head == '' and redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[2])
  return 3
end
return 0
`, recordLayout, expiresOffset))
	// completeScript: KEYS[1] key; ARGV token, the completed record, TTL ms. Returns 1 when
	// completed; a completed record stays completed, so a retried Complete succeeds, with 2 (see
	// luaCompletedAgain).
	completeScript = redis.NewScript(luaOwned + luaCompletedAgain + `
if not owned then return 0 end
if st == 'c' then return completedAgain() end
if st ~= 'p' then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
`)
	// completeStagedScript: KEYS[1] key, KEYS[2] the staging key holding the completed record;
	// ARGV token, then the TTL in ms when the staging key does not hold it already (see
	// stagingTTL). Returns 1 when completed, or 2, as completeScript; the staged bytes are gone
	// either way. RENAME, the script's first write, fails on a missing staging key, and that
	// failure is the script's answer: no EXISTS before it.
	completeStagedScript = redis.NewScript(luaOwned + luaCompletedAgain + `
if owned and st == 'p' then
  if redis.pcall('RENAME', KEYS[2], KEYS[1])['err'] then return redis.error_reply('ERR idempotency: staged record missing') end
  if ARGV[2] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
  return 1
end
redis.call('DEL', KEYS[2])
if owned and st == 'c' then return completedAgain() end
return 0
`)
	// releaseScript: KEYS[1] key; ARGV token. Returns 1 when deleted.
	releaseScript = redis.NewScript(luaOwned + `
if owned and st == 'p' then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
`)
)

// RedisOptions selects and configures a Redis deployment, following the command-line settings,
// and the store on it. OpenRedis uses every field; NewRedis, given a client, only the store's
// (Timeout, DisableBatching, Clock).
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
	// PoolSize is the connection pool size per node (default go-redis': 10 per CPU).
	PoolSize int

	// Timeout bounds every call of the store, from its start to its reply (default
	// DefaultRedisTimeout): the one deadline a store call gets (see Store).
	Timeout time.Duration
	// DisableBatching sends every call in a round trip of its own instead of sharing round trips
	// among concurrent calls in pipelined batches (see pipeline), which measure better under load
	// and are on by default.
	DisableBatching bool
	// Clock gives the times stored in records (CreatedAt, ExpiresAt) and paces the background
	// release of orphaned leases (default the wall clock). Deadlines are on the wall clock.
	Clock clock.Clock
	// Keyring, when set, seals every response the store keeps (status, headers and body) with
	// its active key, bound to the record's key, and opens them on Acquire (docs/guarantees.md#stored-responses-at-rest). Responses
	// stored without a keyring still read; one that cannot be opened (its key is not in the
	// keyring, it was altered or moved, or the store has no keyring) gives ErrUnreadable.
	Keyring *seal.Keyring
}

// Redis is a Store backed by Redis 7.0 or later (or Valkey): standalone, Sentinel or Cluster.
// Each operation is one command or script on one key, so it is atomic on the server and costs
// one round trip; by default, concurrent calls share round trips in pipelined batches. Acquire is
// a native SET NX GET; the owner-checked operations are scripts, sent by SHA (EVALSHA) and loaded
// on first use. Completing a large record stages its bytes in a second key of the same slot for
// the length of one round trip, then renames it onto the record in the owner-checked script.
//
// The claims and completions of a durable claim (Claim.Replicas) end their round trip with WAIT,
// on the connection that carried them (under Cluster, one to the master of the key's slot), and
// are judged by its count: see sendBatch.
type Redis struct {
	client    redis.UniversalClient
	timeout   time.Duration
	deadlines *deadlines
	clock     clock.Clock
	send      sender
	// durable sends the calls of durable claims, which end their round trips with a WAIT:
	// batched apart from the others, so that no other call waits for replicas.
	durable sender
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
	return NewRedis(client, opts), nil
}

// NewRedis returns a Store that uses client, configured by the store's fields of opts (Timeout,
// DisableBatching, Clock, Keyring); the others are OpenRedis'. The Store owns the client: Close closes it.
func NewRedis(client redis.UniversalClient, opts RedisOptions) *Redis {
	if opts.Timeout <= 0 {
		opts.Timeout = DefaultRedisTimeout
	}
	if opts.Clock == nil {
		opts.Clock = clock.Real{}
	}
	var send, durable sender = newPipeline(client, pipelineSlots), newPipeline(client, pipelineSlots)
	if opts.DisableBatching {
		send, durable = direct{client: client}, direct{client: client}
	}
	r := &Redis{client: client, timeout: opts.Timeout, deadlines: newDeadlines(opts.Timeout), clock: opts.Clock, send: send, durable: durable, orphans: newOrphans(opts.Clock), ring: opts.Keyring}
	go r.orphans.run(r.releaseOrphans, opts.Timeout)
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
	base, err := redisBaseOptions(opts)
	if err != nil {
		return nil, err
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
			Protocol:                 base.Protocol,
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
			Protocol:              base.Protocol,
		}), nil
	default:
		return redis.NewClient(base), nil
	}
}

// redisBaseOptions returns the client options opts gives, from its URL: the single server's
// whole options, and the user, password, database, TLS and pool settings of Cluster's and
// Sentinel's nodes.
func redisBaseOptions(opts RedisOptions) (*redis.Options, error) {
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
	// RESP2 unless the URL asks for another (?protocol=3): the store reads no RESP3 type and
	// subscribes to no push notification, which go-redis looks for before every RESP3 reply it
	// reads (some 2 µs of CPU per first execution under load, docs/performance.md).
	if base.Protocol == 0 {
		base.Protocol = 2
	}
	base.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
	if opts.PoolSize > 0 {
		base.PoolSize = opts.PoolSize
	}
	return base, nil
}

// Acquire implements [Store.Acquire]. It is one SET NX PX GET: Redis creates the pending record
// if the key is free and answers with the record it found otherwise. A durable claim's SET is
// followed by its WAIT on the same connection, in the same round trip (see sendBatch); an
// unconfirmed claim is withdrawn by the release script, in a second round trip.
func (r *Redis) Acquire(ctx context.Context, key string, c Claim) (Lease, *Record, error) {
	if err := checkClaim(c); err != nil {
		return Lease{}, nil, err
	}
	// The record's times are in milliseconds: the lease carries the same instant.
	now := time.UnixMilli(r.clock.Now().UnixMilli())
	token := newToken()
	c.Route = routeOf(c.Route)
	pending := appendPending(make([]byte, 0, headerLen+len(c.Fingerprint)+routeLenDigits+len(c.Route)), token, c, now)
	// The lease keeps a fingerprint of its own: a lease left to the orphan releases outlives
	// the caller.
	lc := c
	lc.Fingerprint = bytes.Clone(c.Fingerprint)
	lease := Lease{key: key, token: token, claim: lc, created: now}
	set := &call{
		// The SET may have run while this caller never learned it: free what it may have
		// created rather than block the key for a whole lease.
		undo:     func(*redis.Cmd) { r.orphans.add(lease, lease.claim.LockTTL) },
		replicas: c.Replicas,
		wait:     c.ReplicaTimeout,
	}
	set.args = append(set.argv[:0], "set", key, pending, "nx", "px", c.LockTTL.Milliseconds(), "get")
	found, err := r.run(ctx, set).Text()
	switch {
	case errors.Is(err, redis.Nil) && set.unconfirmed != nil:
		return r.withdraw(ctx, set.deadline, lease, c.LockTTL, set.unconfirmed)
	case errors.Is(err, redis.Nil):
		return lease, nil, nil
	case err == nil:
	case redis.HasErrorPrefix(err, "WRONGTYPE"):
		return Lease{}, nil, fmt.Errorf("cache: redis acquire: %w: the key holds another type than a record", ErrCorrupt)
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
		if c.Replicas > 0 {
			// It was written by the lost attempt, on a connection whose WAIT never came back,
			// and this WAIT, after a SET that wrote nothing, does not cover it.
			return r.withdraw(ctx, set.deadline, lease, c.LockTTL, fmt.Errorf("%w: the claim was written by an attempt whose reply was lost", ErrUnconfirmed))
		}
		return lease, nil, nil
	}
	return Lease{}, rec, nil
}

// withdraw releases the pending record of a durable claim that replicas did not confirm and
// returns Acquire's answer: why, and no lease. The release runs until the claim's own deadline,
// so that Acquire takes no longer than the store's timeout; one that fails or does not fit is
// retried in the background as an orphan's, and the record expires after lockTTL otherwise.
func (r *Redis) withdraw(ctx context.Context, deadline time.Time, l Lease, lockTTL time.Duration, why error) (Lease, *Record, error) {
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	if err := r.Release(ctx, l); err != nil && !errors.Is(err, ErrLeaseLost) {
		r.orphans.add(l, lockTTL)
	}
	return Lease{}, nil, fmt.Errorf("cache: redis acquire: %w", why)
}

// sender returns the sender of c: the durable one for a call that waits for replicas.
func (r *Redis) sender(c *call) sender {
	if c.replicas > 0 {
		return r.durable
	}
	return r.send
}

// newToken returns 128 random bits as tokenLen base32 characters.
func newToken() string {
	t := rand.Text()
	if len(t) != tokenLen {
		panic(fmt.Sprintf("cache: rand.Text returned %d characters, the record layout holds %d", len(t), tokenLen))
	}
	return t
}

// bound limits ctx to the store's timeout from now, unless it ends earlier. It is for the calls
// that go to go-redis directly (Lookup, Ping, Keys, Replicas); the calls of the senders are
// bounded by boundCall.
func (r *Redis) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	deadline := time.Now().Add(r.timeout)
	if d, ok := ctx.Deadline(); ok && !d.After(deadline) {
		return ctx, noCancel
	}
	return context.WithDeadline(ctx, deadline)
}

// boundCall limits ctx to the store's timeout from now, unless it ends earlier, for c, which a
// sender runs: the one place a sent call's deadline is set (c.deadline; the batcher runs each
// batch until the latest deadline among its calls). The deadline is a shared slot's
// (deadlines), a little earlier than the timeout from now, and the context returned carries it
// with the caller's values and ends at it (callCtx), without a timer of its own; the senders
// watch the caller's own cancellation apart (callerDone, callerErr), and a call that runs alone
// on its caller's goroutine runs under the caller's own context (alone).
func (r *Redis) boundCall(ctx context.Context, c *call) context.Context {
	now := time.Now()
	if d, ok := ctx.Deadline(); ok && !d.After(now.Add(r.timeout)) {
		c.deadline, c.until = d, nil
		return ctx
	}
	s := r.deadlines.slot(now)
	c.deadline, c.until = s.at, s.ctx
	c.ctx = callCtx{Context: ctx, slot: s}
	return &c.ctx
}

func noCancel() {}

// run sends one call bounded by the store's timeout.
func (r *Redis) run(ctx context.Context, c *call) *redis.Cmd {
	return r.sender(c).run(r.boundCall(ctx, c), c)
}

// Lookup implements [Store.Lookup]. It reads the record and the key's expiry in one transaction
// (MULTI GET PTTL EXEC), one round trip; the expiry fills ExpiresAt for a record of layout 2,
// which does not carry it.
func (r *Redis) Lookup(ctx context.Context, key string) (*Record, error) {
	ctx, cancel := r.bound(ctx)
	defer cancel()
	var get *redis.StringCmd
	var pttl *redis.DurationCmd
	_, err := r.client.TxPipelined(ctx, func(p redis.Pipeliner) error {
		get, pttl = p.Get(ctx, key), p.PTTL(ctx, key)
		return nil
	})
	now := r.clock.Now()
	if get != nil && errors.Is(get.Err(), redis.Nil) {
		return nil, ErrNotFound
	}
	switch {
	case get != nil && redis.HasErrorPrefix(get.Err(), "WRONGTYPE"):
		return nil, fmt.Errorf("cache: redis lookup: %w: the key holds another type than a record", ErrCorrupt)
	case err != nil:
		return nil, redisError("lookup", err)
	}
	rec, _, err := decodeRecord(get.Val(), r.ring, key)
	if err != nil {
		return nil, err
	}
	if d := pttl.Val(); rec.ExpiresAt.IsZero() && d > 0 {
		rec.ExpiresAt = now.Add(d)
	}
	return rec, nil
}

// Renew implements [Store.Renew].
func (r *Redis) Renew(ctx context.Context, l Lease, d time.Duration) error {
	if err := checkRenewal(d); err != nil {
		return err
	}
	end := appendMillis(nil, r.clock.Now().Add(d))
	return r.owned(ctx, "renew", &call{script: renewScript, keys: []string{l.key}, args: []any{l.token, d.Milliseconds(), end}}, l)
}

// Reassert implements [Store.Reassert]: one script on the lease's key, which renews the caller's
// pending record or, where the key holds none, writes back the one Acquire wrote (the lease
// carries its token, fingerprint, route, TTL and CreatedAt), with a fresh lease.
func (r *Redis) Reassert(ctx context.Context, l Lease) (bool, error) {
	if l.token == "" {
		return false, ErrLeaseLost
	}
	c := l.claim // checked by Acquire, the only maker of a lease that holds one
	end := r.clock.Now().Add(c.LockTTL)
	pending := appendRecord(make([]byte, 0, headerLen+len(c.Fingerprint)+routeLenDigits+len(c.Route)),
		'p', l.token, c.TTL, l.created, end, c.Fingerprint, c.Route)
	n, err := r.run(ctx, &call{script: reassertScript, keys: []string{l.key},
		args: []any{l.token, c.LockTTL.Milliseconds(), appendMillis(nil, end), pending}}).Int64()
	switch {
	case err != nil:
		return false, redisError("reassert", err)
	case n == 3:
		return true, nil
	case n == 1:
		return false, nil
	}
	return false, ErrLeaseLost
}

// Complete implements [Store.Complete]. The record is built whole here, from the lease, so that
// Redis stores the bytes it is sent without splicing them in Lua; one of at least
// stagedRecordBytes goes to a staging key in a plain SET, pipelined with the script that checks
// the owner and renames it onto the record's key, so that its bytes never pass through Lua; the
// staging key holds the record's TTL, which the rename carries, when that is at least stagingTTL.
// The staging key's name holds the lease's token, so that two leases never share one, and is in
// the record's slot (stagingKey).
func (r *Redis) Complete(ctx context.Context, l Lease, resp Response) error {
	if l.token == "" {
		return ErrLeaseLost
	}
	resp = resp.normalized()
	rec := appendCompleted(make([]byte, 0, completedSize(l, resp, r.ring)), l, r.clock.Now().Add(l.claim.TTL), resp, r.ring)
	ttl := l.claim.TTL.Milliseconds()
	c := &call{script: completeScript}
	staging, staged := "", len(rec) >= stagedRecordBytes
	if staged {
		staging, staged = stagingKey(l.key, l.token)
	}
	switch {
	case !staged:
		c.keys, c.args = append(c.keyv[:0], l.key), append(c.argv[:0], l.token, rec, ttl)
	case l.claim.TTL >= stagingTTL:
		// The stage takes argv[2:7], the script's arguments argv[:2].
		c.script, c.stagedBytes = completeStagedScript, len(rec)
		c.keys, c.args = append(c.keyv[:0], l.key, staging), append(c.argv[:0:2], l.token)
		c.stage = append(c.argv[2:2], "set", staging, rec, "px", ttl)
	default:
		c.script, c.stagedBytes = completeStagedScript, len(rec)
		c.keys, c.args = append(c.keyv[:0], l.key, staging), append(c.argv[:0:2], l.token, ttl)
		c.stage = append(c.argv[2:2], "set", staging, rec, "px", stagingTTL.Milliseconds())
	}
	c.replicas, c.wait = l.claim.Replicas, l.claim.ReplicaTimeout
	return r.owned(ctx, "complete", c, l)
}

// stagingKey returns the key a large completion of key by token stages its bytes in: a name that
// starts with key, so that ACL key patterns that admit the record admit it, and that is in key's
// Cluster slot. Cluster hashes only the part of a name within its first {…} when that part is not
// empty, else the whole name. A key with such a part keeps it first; a key with no brace at all
// is put in one at the name's end. Any other key (a brace without such a part, the empty key)
// has no such name: stagingKey reports false, and the completion goes through its script.
func stagingKey(key, token string) (string, bool) {
	open := strings.IndexByte(key, '{')
	switch {
	case open >= 0:
		if end := strings.IndexByte(key[open+1:], '}'); end > 0 {
			return key + ":staged:" + token, true
		}
		return "", false
	case key == "" || strings.IndexByte(key, '}') >= 0:
		return "", false
	}
	return key + ":staged:" + token + "{" + key + "}", true
}

// Release implements [Store.Release].
func (r *Redis) Release(ctx context.Context, l Lease) error {
	return r.owned(ctx, "release", &call{script: releaseScript, keys: []string{l.key}, args: []any{l.token}}, l)
}

// Purge implements [Store.Purge]: one DEL. A lease on the purged record is lost as any other:
// its token is gone with the record.
func (r *Redis) Purge(ctx context.Context, key string) error {
	n, err := r.run(ctx, &call{args: []any{"del", key}}).Int64()
	switch {
	case err != nil:
		return redisError("purge", err)
	case n == 0:
		return ErrNotFound
	}
	return nil
}

// owned runs an owner-checked script call for l that answers 1 on success (2 when the
// completion script finds the record completed before, by this lease) and 0 when the lease is
// lost. A write the replicas did not confirm (durability) is done, and reported as such.
func (r *Redis) owned(ctx context.Context, op string, c *call, l Lease) error {
	if l.token == "" {
		return ErrLeaseLost
	}
	n, err := r.run(ctx, c).Int64()
	switch {
	case err != nil:
		return redisError(op, err)
	case n != 1 && n != 2:
		return ErrLeaseLost
	case c.unconfirmed != nil:
		return fmt.Errorf("cache: redis %s: %w", op, c.unconfirmed)
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
	r.send.close()
	r.durable.close()
	err := r.client.Close()
	r.deadlines.close()
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
	case redis.HasErrorPrefix(err, "OOM"):
		return fmt.Errorf("cache: redis %s: %w: %w", op, ErrFull, err)
	}
	return fmt.Errorf("cache: redis %s: %w", op, err)
}
