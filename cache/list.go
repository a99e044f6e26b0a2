package cache

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// Lister is a Store that can list the keys it holds, a page at a time: the records API's list.
type Lister interface {
	// Keys returns keys of live records that begin with prefix, from cursor ("" for the first
	// page), and the cursor of the next page, "" after the last. A page holds about count keys:
	// fewer, or a few more, as Redis' SCAN gives them. A record live from the first page to the
	// last is listed once at least (and, but for Redis rehashing its table, once); one created
	// or removed meanwhile may or may not be. It never blocks the store for longer than one
	// page's work. A cursor is opaque, good for the store that gave it; a bad one is an error.
	Keys(ctx context.Context, prefix, cursor string, count int) (keys []string, next string, err error)
}

var (
	_ Lister = (*Redis)(nil)
	_ Lister = (*Memory)(nil)
)

// ErrBadCursor means a listing cursor was not one the store gave.
var ErrBadCursor = errors.New("cache: not a listing cursor of this store")

// maxKeysPage bounds count.
const maxKeysPage = 10000

// Keys implements [Lister] with SCAN MATCH prefix* (never KEYS, which blocks Redis for the whole
// keyspace), calling it until the page holds count keys or the scan ends, within the store's
// timeout. Under Cluster it scans each master in turn, in the order of their addresses; the
// cursor says which one and where.
func (r *Redis) Keys(ctx context.Context, prefix, cursor string, count int) ([]string, string, error) {
	count = min(max(count, 1), maxKeysPage)
	ctx, cancel := r.bound(ctx)
	defer cancel()
	match := globEscape(prefix) + "*"
	cc, ok := r.client.(*redis.ClusterClient)
	if !ok {
		pos, err := parseScanCursor(cursor)
		if err != nil {
			return nil, "", err
		}
		keys, pos, err := scanPage(ctx, r.client, match, pos, count)
		if err != nil {
			return nil, "", redisError("scan", err)
		}
		if pos == 0 {
			return keys, "", nil
		}
		return keys, strconv.FormatUint(pos, 10), nil
	}
	// A cluster cursor is the master's address, '/', its SCAN cursor.
	masters, err := clusterMasters(ctx, cc)
	if err != nil {
		return nil, "", redisError("scan", err)
	}
	at, pos := 0, uint64(0)
	if cursor != "" {
		addr, c, ok := strings.Cut(cursor, "/")
		at = slices.Index(masters, addr)
		// 0 starts the master's scan, as a page that ended another master's leaves it.
		if pos, err = strconv.ParseUint(c, 10, 64); !ok || at < 0 || err != nil {
			return nil, "", fmt.Errorf("%w: %q (its master %s may have left the cluster)", ErrBadCursor, cursor, addr)
		}
	}
	var keys []string
	for at < len(masters) && len(keys) < count {
		var page []string
		err := cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
			if c.Options().Addr != masters[at] {
				return nil
			}
			var err error
			page, pos, err = scanPage(ctx, c, match, pos, count-len(keys))
			return err
		})
		if err != nil {
			return nil, "", redisError("scan", err)
		}
		keys = append(keys, page...)
		if pos == 0 {
			at++
		}
	}
	if at == len(masters) {
		return keys, "", nil
	}
	return keys, masters[at] + "/" + strconv.FormatUint(pos, 10), nil
}

// scanPage calls SCAN from pos until it has count keys or the scan ends (pos 0).
func scanPage(ctx context.Context, c redis.Cmdable, match string, pos uint64, count int) ([]string, uint64, error) {
	var keys []string
	for {
		page, next, err := c.Scan(ctx, pos, match, int64(count)).Result()
		if err != nil {
			return nil, 0, err
		}
		keys, pos = append(keys, page...), next
		if pos == 0 || len(keys) >= count {
			return keys, pos, nil
		}
	}
}

// clusterMasters returns the addresses of the cluster's masters, sorted.
func clusterMasters(ctx context.Context, cc *redis.ClusterClient) ([]string, error) {
	var mu sync.Mutex
	var addrs []string
	err := cc.ForEachMaster(ctx, func(_ context.Context, c *redis.Client) error {
		mu.Lock()
		defer mu.Unlock()
		addrs = append(addrs, c.Options().Addr)
		return nil
	})
	slices.Sort(addrs)
	return addrs, err
}

func parseScanCursor(s string) (uint64, error) {
	if s == "" {
		return 0, nil
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil || n == 0 {
		return 0, fmt.Errorf("%w: %q", ErrBadCursor, s)
	}
	return n, nil
}

// globEscape escapes the characters MATCH patterns give a meaning to.
func globEscape(s string) string {
	var b strings.Builder
	for _, c := range []byte(s) {
		switch c {
		case '*', '?', '[', ']', '\\', '^', '-':
			b.WriteByte('\\')
		}
		b.WriteByte(c)
	}
	return b.String()
}

// Keys implements [Lister]: it walks the store's slots from the cursor's, under the lock for at
// most about count live records (or 16 times count slots, empty ones included).
func (m *Memory) Keys(ctx context.Context, prefix, cursor string, count int) ([]string, string, error) {
	if err := ctx.Err(); err != nil {
		return nil, "", err
	}
	count = min(max(count, 1), maxKeysPage)
	from := int32(1) // slot 0 is the lru list's head
	if cursor != "" {
		n, err := strconv.ParseInt(cursor, 10, 32)
		if err != nil || n < 1 {
			return nil, "", fmt.Errorf("%w: %q", ErrBadCursor, cursor)
		}
		from = int32(n)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil, "", ErrClosed
	}
	now := m.now()
	var keys []string
	i, end := from, m.entries.Len()
	for budget := 16 * count; i < end && len(keys) < count && budget > 0; i, budget = i+1, budget-1 {
		e := m.entry(i)
		if e.state == 0 || e.deadline <= now {
			continue
		}
		if k := m.keyOf(i); strings.HasPrefix(string(k), prefix) {
			keys = append(keys, string(k))
		}
	}
	if i >= end {
		return keys, "", nil
	}
	return keys, strconv.FormatInt(int64(i), 10), nil
}
