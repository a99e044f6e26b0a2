package cache_test

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/cache/seal"
	"github.com/idempotency-extproc/idempotency-extproc/cache/storetest"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// keyring parses a keyring of the given ids, the first active, each with a random key; the same
// id gets the same key throughout a test through keys.
func keyring(t *testing.T, keys map[string]string, ids ...string) *seal.Keyring {
	t.Helper()
	var b strings.Builder
	for _, id := range ids {
		if keys[id] == "" {
			keys[id] = base64.StdEncoding.EncodeToString([]byte(rand.Text() + rand.Text())[:32])
		}
		fmt.Fprintf(&b, "%s:%s\n", id, keys[id])
	}
	k, err := seal.ParseKeyring([]byte(b.String()))
	require.NoError(t, err)
	return k
}

// atRest is a store's records as the tests of sealing see them: stores on the same records with
// any keyring, and the raw bytes behind them.
type atRest struct {
	// store returns a store on the records that seals with ring (nil: none).
	store func(t *testing.T, ring *seal.Keyring) cache.Store
	// record returns every byte the store holds for key; response the stored response alone.
	record   func(t *testing.T, key string) []byte
	response func(t *testing.T, key string) []byte
	// setResponse replaces key's stored response with b, of the same length.
	setResponse func(t *testing.T, key string, b []byte)
	// move makes the record of key to a copy of the record of from: for Redis the whole value,
	// for memory the stored response.
	move func(t *testing.T, from, to string)
}

func memoryAtRest(t *testing.T) atRest {
	m, _ := newMemory(t, 0)
	return atRest{
		store: func(t *testing.T, ring *seal.Keyring) cache.Store {
			m.SetKeyring(ring)
			return m
		},
		record: func(t *testing.T, key string) []byte {
			b, err := m.StoredRecord(key)
			require.NoError(t, err)
			return b
		},
		response: func(t *testing.T, key string) []byte {
			b, err := m.StoredResponse(key)
			require.NoError(t, err)
			return b
		},
		setResponse: func(t *testing.T, key string, b []byte) {
			require.NoError(t, m.SetStoredResponse(key, b))
		},
		move: func(t *testing.T, from, to string) {
			// A record of the same length under to, then from's sealed response in it.
			b, err := m.StoredResponse(from)
			require.NoError(t, err)
			l, _, err := m.Acquire(t.Context(), to, testClaim)
			require.NoError(t, err)
			require.NoError(t, m.Complete(t.Context(), l, secretResponse(1)))
			require.NoError(t, m.SetStoredResponse(to, b))
		},
	}
}

// redisAtRest reads and writes the records of the stores open returns with raw, a client of
// its own.
func redisAtRest(open func(t *testing.T, ring *seal.Keyring) cache.Store, raw redis.UniversalClient) atRest {
	record := func(t *testing.T, key string) []byte {
		b, err := raw.Get(t.Context(), key).Bytes()
		require.NoError(t, err)
		return b
	}
	// The record layout of redis_record.go (layout 3): a header of 75 bytes whose last 8 are the
	// fingerprint's length in hexadecimal, the fingerprint, the route's length in 2 hexadecimal
	// digits, the route, the response.
	responseAt := func(t *testing.T, b []byte) int {
		require.Greater(t, len(b), 75)
		require.Equal(t, byte('3'), b[0], "record layout")
		n, err := strconv.ParseUint(string(b[67:75]), 16, 32)
		require.NoError(t, err)
		at := 75 + int(n)
		r, err := strconv.ParseUint(string(b[at:at+2]), 16, 16)
		require.NoError(t, err)
		return at + 2 + int(r)
	}
	return atRest{
		store: func(t *testing.T, ring *seal.Keyring) cache.Store {
			s := open(t, ring)
			t.Cleanup(func() { _ = s.Close() })
			return s
		},
		record: record,
		response: func(t *testing.T, key string) []byte {
			b := record(t, key)
			return b[responseAt(t, b):]
		},
		setResponse: func(t *testing.T, key string, resp []byte) {
			b := record(t, key)
			b = append(b[:responseAt(t, b)], resp...)
			require.NoError(t, raw.Set(t.Context(), key, b, redis.KeepTTL).Err())
		},
		move: func(t *testing.T, from, to string) {
			require.NoError(t, raw.Set(t.Context(), to, record(t, from), time.Hour).Err())
		},
	}
}

func miniredisAtRest(t *testing.T) atRest {
	mr := miniredis.RunT(t)
	raw := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = raw.Close() })
	return redisAtRest(func(t *testing.T, ring *seal.Keyring) cache.Store {
		s, err := cache.OpenRedis(cache.RedisOptions{URL: "redis://" + mr.Addr() + "/0", Keyring: ring})
		require.NoError(t, err)
		return s
	}, raw)
}

func realRedisAtRest(t *testing.T) atRest {
	srv := redistest.Start(t, redistest.Options{})
	return redisAtRest(func(t *testing.T, ring *seal.Keyring) cache.Store {
		s, err := cache.OpenRedis(cache.RedisOptions{URL: srv.URL(), Timeout: 5 * time.Second, Keyring: ring})
		require.NoError(t, err)
		return s
	}, srv.Client(t))
}

func clusterAtRest(t *testing.T) atRest {
	cl := redistest.StartCluster(t, 3, 0)
	raw := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs()})
	t.Cleanup(func() { _ = raw.Close() })
	return redisAtRest(func(t *testing.T, ring *seal.Keyring) cache.Store {
		s, err := cache.OpenRedis(cache.RedisOptions{ClusterAddrs: cl.Addrs(), Timeout: 5 * time.Second, Keyring: ring})
		require.NoError(t, err)
		return s
	}, raw)
}

// secretResponse returns a response whose body, header names and header values are random text
// found nowhere else, with a body of size bytes.
func secretResponse(size int) cache.Response {
	body := make([]byte, size)
	for i := 0; i < size; i += 26 {
		copy(body[i:], rand.Text())
	}
	return cache.Response{
		Status: 201,
		Headers: []cache.Header{
			{Name: "content-type", Value: []byte("application/json")},
			{Name: "set-cookie", Value: []byte("session=" + rand.Text() + "; HttpOnly")},
			{Name: "set-cookie", Value: []byte("refresh=" + rand.Text())},
			{Name: "x-vended-credential-" + strings.ToLower(rand.Text()[:8]), Value: []byte(rand.Text() + rand.Text())},
		},
		Body: body,
	}
}

// requireNoPart fails if raw holds any 8 bytes in a row of resp's body, header names or header
// values (all of them for short ones, a thousand spread over long ones).
func requireNoPart(t *testing.T, raw []byte, resp cache.Response) {
	t.Helper()
	parts := [][]byte{resp.Body}
	for _, h := range resp.Headers {
		parts = append(parts, []byte(h.Name), h.Value)
	}
	for _, p := range parts {
		step := max(1, (len(p)-8)/1000)
		for i := 0; i+8 <= len(p); i += step {
			require.False(t, bytes.Contains(raw, p[i:i+8]), "the stored bytes hold %q", p[i:i+8])
		}
	}
}

// replay acquires key, which must hold a completed record, and returns its response.
func replay(t *testing.T, s cache.Store, key string) cache.Response {
	t.Helper()
	l, rec, err := s.Acquire(t.Context(), key, testClaim)
	require.NoError(t, err)
	require.False(t, l.Held(), "the key was free")
	require.Equal(t, cache.Completed, rec.State)
	return rec.Response
}

// requireUnreadable checks that key's record cannot be opened, with want as the reason, and
// that it stays so: the key is never handed out to run again.
func requireUnreadable(t *testing.T, s cache.Store, key string, want error) {
	t.Helper()
	for range 2 {
		l, rec, err := s.Acquire(t.Context(), key, testClaim)
		require.ErrorIs(t, err, cache.ErrUnreadable)
		require.ErrorIs(t, err, cache.ErrCorrupt, "the lead maps ErrCorrupt to 409 response-not-replayable")
		if want != nil {
			require.ErrorIs(t, err, want)
		}
		require.False(t, l.Held(), "an unreadable record must not be run again")
		require.Nil(t, rec)
	}
}

func completeWith(t *testing.T, s cache.Store, key string, resp cache.Response) {
	t.Helper()
	c := testClaim
	sum := sha256.Sum256([]byte(key))
	c.Fingerprint = sum[:]
	l, rec, err := s.Acquire(t.Context(), key, c)
	require.NoError(t, err)
	require.Nil(t, rec, "key %s", key)
	require.NoError(t, s.Complete(t.Context(), l, resp))
}

var atRestBackends = []struct {
	name string
	make func(t *testing.T) atRest
}{
	{"memory", memoryAtRest},
	{"miniredis", miniredisAtRest},
	{"redis", realRedisAtRest},
	{"cluster", clusterAtRest},
}

// TestSealedAtRest runs each scenario of sealed records on the memory store, miniredis, a real
// redis-server and a real Redis Cluster of three masters, each on records of its own.
func TestSealedAtRest(t *testing.T) {
	for _, b := range atRestBackends {
		t.Run(b.name, func(t *testing.T) {
			if b.name != "memory" && b.name != "miniredis" {
				t.Parallel()
			}
			r := b.make(t)
			t.Run("no plaintext at rest", func(t *testing.T) { testNoPlaintext(t, r) })
			t.Run("rotation", func(t *testing.T) { testRotation(t, r) })
			t.Run("tampered", func(t *testing.T) { testTampered(t, r) })
			t.Run("moved", func(t *testing.T) { testMoved(t, r) })
			t.Run("turned on and off", func(t *testing.T) { testTurnedOnAndOff(t, r) })
		})
	}
}

func testNoPlaintext(t *testing.T, r atRest) {
	keys := map[string]string{}
	sealed := r.store(t, keyring(t, keys, "k1"))
	for _, size := range []int{0, 1024, 1 << 20} {
		key := "idempotency:plaintext:" + strconv.Itoa(size)
		resp := secretResponse(size)
		completeWith(t, sealed, key, resp)
		requireNoPart(t, r.record(t, key), resp)
		got := replay(t, sealed, key)
		require.Equal(t, resp.Status, got.Status)
		require.Equal(t, resp.Headers, got.Headers, "replayed byte for byte")
		require.True(t, bytes.Equal(resp.Body, got.Body), "replayed byte for byte")
		require.False(t, got.BodyOmitted)
	}
	// A response that is not replayed keeps its secrets too: its headers.
	omitted := secretResponse(64)
	omitted.BodyOmitted = true
	completeWith(t, sealed, "idempotency:plaintext:omitted", omitted)
	requireNoPart(t, r.record(t, "idempotency:plaintext:omitted"), omitted)
	got := replay(t, sealed, "idempotency:plaintext:omitted")
	require.True(t, got.BodyOmitted)
	require.Equal(t, omitted.Headers, got.Headers)

	// The check sees plaintext where there is some: the same response stored unsealed.
	plain := r.store(t, nil)
	resp := secretResponse(1024)
	completeWith(t, plain, "idempotency:plaintext:unsealed", resp)
	raw := r.record(t, "idempotency:plaintext:unsealed")
	require.True(t, bytes.Contains(raw, resp.Body))
	require.True(t, bytes.Contains(raw, resp.Headers[1].Value))
}

func testRotation(t *testing.T, r atRest) {
	keys := map[string]string{}
	a := r.store(t, keyring(t, keys, "a"))
	byA := secretResponse(100)
	completeWith(t, a, "idempotency:rotation:a", byA)

	// B becomes active, A stays listed: A's records open, new ones are sealed with B.
	ba := r.store(t, keyring(t, keys, "b", "a"))
	require.Equal(t, byA.Body, replay(t, ba, "idempotency:rotation:a").Body)
	byB := secretResponse(100)
	completeWith(t, ba, "idempotency:rotation:b", byB)
	require.Equal(t, byB.Body, replay(t, ba, "idempotency:rotation:b").Body)
	onlyA := r.store(t, keyring(t, keys, "a"))
	requireUnreadable(t, onlyA, "idempotency:rotation:b", seal.ErrUnknownKey)

	// A dropped: its records no longer open, B's do.
	onlyB := r.store(t, keyring(t, keys, "b"))
	requireUnreadable(t, onlyB, "idempotency:rotation:a", seal.ErrUnknownKey)
	require.Equal(t, byB.Body, replay(t, onlyB, "idempotency:rotation:b").Body)

	// Another keyring altogether, with an id of the same name: not the same key.
	other := r.store(t, keyring(t, map[string]string{}, "b"))
	requireUnreadable(t, other, "idempotency:rotation:b", seal.ErrTampered)
}

func testTampered(t *testing.T, r atRest) {
	keys := map[string]string{}
	s := r.store(t, keyring(t, keys, "k1"))
	resp := secretResponse(300)
	for name, at := range map[string]func(n int) int{
		"last byte (the tag)":       func(n int) int { return n - 1 },
		"a byte of the ciphertext":  func(n int) int { return n / 2 },
		"a byte of the nonce":       func(int) int { return 1 + 1 + 1 + 2 + 3 },
		"the key id (another name)": func(int) int { return 1 + 1 + 1 + 1 },
	} {
		key := "idempotency:tampered:" + name
		completeWith(t, s, key, resp)
		b := r.response(t, key)
		b[at(len(b))] ^= 0x01
		r.setResponse(t, key, b)
		requireUnreadable(t, s, key, nil)
	}
	// A changed id is a key not in the ring ("k1" to "k0").
	requireUnreadable(t, s, "idempotency:tampered:the key id (another name)", seal.ErrUnknownKey)
	requireUnreadable(t, s, "idempotency:tampered:last byte (the tag)", seal.ErrTampered)
}

func testMoved(t *testing.T, r atRest) {
	keys := map[string]string{}
	s := r.store(t, keyring(t, keys, "k1"))
	completeWith(t, s, "idempotency:moved:one", secretResponse(1))
	r.move(t, "idempotency:moved:one", "idempotency:moved:two")
	requireUnreadable(t, s, "idempotency:moved:two", seal.ErrTampered)
	require.Equal(t, cache.Completed, func() cache.State {
		l, rec, err := s.Acquire(t.Context(), "idempotency:moved:one", testClaim)
		require.NoError(t, err)
		require.False(t, l.Held())
		return rec.State
	}(), "the original still opens")
}

func testTurnedOnAndOff(t *testing.T, r atRest) {
	keys := map[string]string{}
	// Records written before sealing was turned on still read.
	before := secretResponse(200)
	completeWith(t, r.store(t, nil), "idempotency:onoff:before", before)
	sealed := r.store(t, keyring(t, keys, "k1"))
	got := replay(t, sealed, "idempotency:onoff:before")
	require.Equal(t, before.Headers, got.Headers)
	require.Equal(t, before.Body, got.Body)
	completeWith(t, sealed, "idempotency:onoff:sealed", secretResponse(200))

	// Turned off: sealed records cannot be read, and are never handed out to run again.
	requireUnreadable(t, r.store(t, nil), "idempotency:onoff:sealed", nil)
}

// TestSealedConformance runs the Store contract on sealing stores.
func TestSealedConformance(t *testing.T) {
	keys := map[string]string{}
	t.Run("memory", func(t *testing.T) {
		storetest.Run(t, func(t *testing.T) storetest.Harness {
			clk := clock.NewFake(time.Unix(1_700_000_000, 0))
			m, err := cache.NewMemory(cache.MemoryOptions{Clock: clk, Keyring: keyring(t, keys, "k1")})
			require.NoError(t, err)
			return storetest.Harness{Store: m, Advance: clk.Advance, Now: clk.Now}
		})
	})
	t.Run("miniredis", func(t *testing.T) {
		storetest.Run(t, func(t *testing.T) storetest.Harness {
			mr := miniredis.RunT(t)
			s, err := cache.OpenRedis(cache.RedisOptions{URL: "redis://" + mr.Addr() + "/0", Timeout: 500 * time.Millisecond, Keyring: keyring(t, keys, "k1")})
			require.NoError(t, err)
			return storetest.Harness{Store: s, Advance: mr.FastForward}
		})
	})
}
