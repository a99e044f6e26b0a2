package extproc

import (
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

var keyHeaderNames = []string{"idempotency-key", "x-idempotency-key", "x-idempotency", "authorization", "x-ttl"}

// FuzzParseKey feeds header maps built from arbitrary bytes to the key and TTL parsers: they
// never panic, a key they accept is 1 to 255 visible ASCII characters, and a TTL is positive
// and capped.
func FuzzParseKey(f *testing.F) {
	f.Add("\x00abc\n\x01abc")
	f.Add("\x00\"quoted\"\n\x02 \"quoted\" ")
	f.Add("\x00\"a\\\"b\"")
	f.Add("\x00\"bad\\escape\"\n\x04 99999999999999999999999")
	f.Add("\x04 60 \n\x00k")
	f.Fuzz(func(t *testing.T, spec string) {
		var h headers
		for _, line := range strings.Split(spec, "\n") {
			if line == "" {
				continue
			}
			name := keyHeaderNames[int(line[0])%len(keyHeaderNames)]
			h = append(h, &corev3.HeaderValue{Key: name, RawValue: []byte(line[1:])})
		}
		key, present, err := parseKey(h, keyHeaderNames[:3])
		if err == nil && present {
			require.NotEmpty(t, key)
			require.LessOrEqual(t, len(key), MaxKeyLength)
			for i := 0; i < len(key); i++ {
				require.True(t, key[i] >= 0x21 && key[i] <= 0x7e, "byte %#x in key %q", key[i], key)
			}
		}
		if v := h.get("x-ttl"); v != nil {
			if ttl, err := parseTTL(v, time.Hour); err == nil {
				require.Positive(t, ttl)
				require.LessOrEqual(t, ttl, time.Hour)
			}
		}
		d := newDigest(nil)
		stored, keyHash := d.storeKey(policy.Default().Default, requestInfo{headers: h}, nil, key)
		require.True(t, strings.HasPrefix(stored, "idempotency:"))
		require.Len(t, keyHash, 64, "the whole hex SHA-256: logs and metadata carry it in full")
		require.Equal(t, "idempotency:"+keyHash, stored)
	})
}
