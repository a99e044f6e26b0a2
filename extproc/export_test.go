package extproc

import (
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// StoredKey returns the store key of a request to path carrying key and the given header pairs.
func StoredKey(p *policy.Policy, path string, key string, pairs ...string) string {
	var h headers
	for i := 0; i+1 < len(pairs); i += 2 {
		h = append(h, &corev3.HeaderValue{Key: pairs[i], RawValue: []byte(pairs[i+1])})
	}
	r, params := p.Match(string(splitPath([]byte(path))))
	k, _ := newDigest(nil).storeKey(r, scope{headers: h, params: params}, key)
	return k
}

// MaxUnknownRoutes is how many unknown route names a server remembers.
const MaxUnknownRoutes = maxUnknownRoutes

// UnknownRoutesRemembered returns how many unknown route names s remembers.
func UnknownRoutesRemembered(s *Server) int {
	s.unknownMu.Lock()
	defer s.unknownMu.Unlock()
	return len(s.unknownRoutes)
}

// SetCompletionLimits lowers how many completions s retries at once and the body bytes they keep.
func SetCompletionLimits(s *Server, count, bodyBytes int) {
	s.completions.mu.Lock()
	defer s.completions.mu.Unlock()
	s.completions.maxCount, s.completions.maxBodyBytes = count, bodyBytes
}
