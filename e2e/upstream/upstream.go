// Package upstream is a test HTTP upstream that counts executions per idempotency key and
// answers as the request's x-test-* headers ask, so end-to-end tests need no setup calls and can
// tell a replay (no new execution) from a re-execution.
//
// Request headers it understands:
//
//	x-test-status: 201        status code, 200–599 (default 200)
//	x-test-delay: 300ms       wait before answering; gives up if the client goes away
//	x-test-body-bytes: N      answer N bytes of deterministic binary data (every byte value
//	                          occurs), application/octet-stream, instead of the JSON summary
//	x-test-cookies: 3         add Set-Cookie: c1=v1 … c3=v3, in order
//	x-test-chunked: true      write the body in several flushed chunks, without content-length
//	x-test-chunk-size: 16384  the chunk size for x-test-chunked (default: a quarter of the body)
//	x-test-hang: true         never answer; return when the client goes away or on Close
//	x-test-header-<name>: v   add the response header <name>: v (each value, in order)
//	x-test-trailer-<name>: v  send the trailer <name>: v after the body (chunked, announced in
//	                          a Trailer header)
//
// The default body is a JSON Summary with Content-Type application/json.
package upstream

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// keyHeaders are the request headers whose first present value is the execution key, in order
// of precedence.
var keyHeaders = [...]string{"Idempotency-Key", "X-Idempotency-Key", "X-Idempotency"}

// headerPrefix marks request headers echoed as response headers, trailerPrefix those sent as
// trailers.
const (
	headerPrefix  = "X-Test-Header-"
	trailerPrefix = "X-Test-Trailer-"
)

// Summary is the default JSON body: enough to tell executions apart.
type Summary struct {
	// Execution is the number of executions seen for Key, this one included (1 for the first).
	Execution int `json:"execution"`
	// Key is the request's idempotency key, "" when it had none.
	Key string `json:"key"`
	// Method and Path are the request's method and path with query.
	Method string `json:"method"`
	Path   string `json:"path"`
	// BodySHA256 is the hex SHA-256 of the request body.
	BodySHA256 string `json:"body_sha256"`
}

// Request is what the upstream saw of one request.
type Request struct {
	// Key is the execution key (see Key).
	Key string
	// Method and Path are the method and the path with query.
	Method, Path string
	// Header is a copy of the request headers.
	Header http.Header
	// BodySHA256 is the hex SHA-256 of the body, "" until it has been read.
	BodySHA256 string
}

// Upstream is an http.Handler that counts executions per key. It is safe for concurrent use.
type Upstream struct {
	mu       sync.Mutex
	counts   map[string]int
	ran      map[string]int // requests whose whole body was read
	total    int
	active   int
	requests []Request

	srv       *httptest.Server
	done      chan struct{}
	closeOnce sync.Once
}

// New returns an Upstream that is not listening; serve it with httptest or http.Server, and
// call Close to release requests that hang.
func New() *Upstream {
	return &Upstream{counts: make(map[string]int), ran: make(map[string]int), done: make(chan struct{})}
}

// Start serves a new Upstream on 127.0.0.1 on a free port until the test ends.
func Start(t testing.TB) *Upstream {
	t.Helper()
	u := New()
	u.srv = httptest.NewServer(u)
	t.Cleanup(u.Close)
	return u
}

// URL returns the base URL of an Upstream made by Start, "" otherwise.
func (u *Upstream) URL() string {
	if u.srv == nil {
		return ""
	}
	return u.srv.URL
}

// Close releases hanging and delayed requests and, for an Upstream made by Start, stops the
// server. It is safe to call more than once.
func (u *Upstream) Close() {
	u.closeOnce.Do(func() {
		close(u.done)
		if u.srv != nil {
			u.srv.Close()
		}
	})
}

// Count returns the number of executions seen for key ("" counts requests without a key).
func (u *Upstream) Count(key string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.counts[key]
}

// Ran returns the number of requests for key whose whole body the upstream read: the executions
// of a handler that acts on a request once it has its body. It is below Count when requests
// arrived and were reset before their body ended, as a STREAMED request whose chunks the
// processor never let through.
func (u *Upstream) Ran(key string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.ran[key]
}

// Total returns the number of requests seen.
func (u *Upstream) Total() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.total
}

// Active returns the number of requests being handled, hanging and delayed ones included.
func (u *Upstream) Active() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.active
}

// Requests returns what the upstream saw of each request so far, in arrival order.
func (u *Upstream) Requests() []Request {
	u.mu.Lock()
	defer u.mu.Unlock()
	out := make([]Request, len(u.requests))
	for i, r := range u.requests {
		r.Header = r.Header.Clone()
		out[i] = r
	}
	return out
}

// Key returns the execution key of r: the first value of idempotency-key, x-idempotency-key
// or x-idempotency, in that order of precedence, "" when none is present.
func Key(r *http.Request) string {
	for _, name := range keyHeaders {
		if vs := r.Header.Values(name); len(vs) > 0 {
			return vs[0]
		}
	}
	return ""
}

// ServeHTTP counts the request as an execution when it arrives, then answers as its x-test-*
// headers ask.
func (u *Upstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := Key(r)
	u.mu.Lock()
	u.counts[key]++
	u.total++
	u.active++
	execution := u.counts[key]
	idx := len(u.requests)
	u.requests = append(u.requests, Request{Key: key, Method: r.Method, Path: r.URL.RequestURI(), Header: r.Header.Clone()})
	u.mu.Unlock()
	defer func() {
		u.mu.Lock()
		u.active--
		u.mu.Unlock()
	}()

	h := sha256.New()
	if r.Body != nil {
		if _, err := io.Copy(h, r.Body); err != nil {
			return // the client went away
		}
	}
	sum := hex.EncodeToString(h.Sum(nil))
	u.mu.Lock()
	u.requests[idx].BodySHA256 = sum
	u.ran[key]++
	u.mu.Unlock()

	if r.Header.Get("X-Test-Hang") == "true" {
		select {
		case <-r.Context().Done():
		case <-u.done:
		}
		return
	}
	if d := r.Header.Get("X-Test-Delay"); d != "" {
		delay, err := time.ParseDuration(d)
		if err != nil {
			http.Error(w, "bad x-test-delay", http.StatusBadRequest)
			return
		}
		t := time.NewTimer(delay)
		defer t.Stop()
		select {
		case <-t.C:
		case <-r.Context().Done():
			return
		case <-u.done:
			return
		}
	}

	code := http.StatusOK
	if s := r.Header.Get("X-Test-Status"); s != "" {
		c, err := strconv.Atoi(s)
		if err != nil || c < 200 || c > 599 {
			http.Error(w, "bad x-test-status", http.StatusBadRequest)
			return
		}
		code = c
	}

	var body []byte
	contentType := "application/json"
	if s := r.Header.Get("X-Test-Body-Bytes"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 0 {
			http.Error(w, "bad x-test-body-bytes", http.StatusBadRequest)
			return
		}
		body, contentType = Body(n), "application/octet-stream"
	} else {
		body, _ = json.Marshal(Summary{Execution: execution, Key: key, Method: r.Method, Path: r.URL.RequestURI(), BodySHA256: sum})
	}

	out := w.Header()
	out.Set("Content-Type", contentType)
	if s := r.Header.Get("X-Test-Cookies"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 0 {
			http.Error(w, "bad x-test-cookies", http.StatusBadRequest)
			return
		}
		for i := 1; i <= n; i++ {
			out.Add("Set-Cookie", fmt.Sprintf("c%d=v%d", i, i))
		}
	}
	for name, values := range r.Header {
		if rest, ok := strings.CutPrefix(name, headerPrefix); ok && rest != "" {
			out.Del(rest)
			for _, v := range values {
				out.Add(rest, v)
			}
		}
	}

	if code == http.StatusNoContent || code == http.StatusNotModified || r.Method == http.MethodHead {
		w.WriteHeader(code)
		return
	}
	trailers := map[string][]string{}
	for name, values := range r.Header {
		if rest, ok := strings.CutPrefix(name, trailerPrefix); ok && rest != "" {
			trailers[rest] = values
			out.Add("Trailer", rest)
		}
	}
	if len(trailers) > 0 {
		// Trailers need a chunked body: no content-length.
		defer func() {
			for name, values := range trailers {
				out[http.CanonicalHeaderKey(name)] = values
			}
		}()
	}
	if r.Header.Get("X-Test-Chunked") != "true" && len(trailers) == 0 {
		out.Set("Content-Length", strconv.Itoa(len(body)))
		w.WriteHeader(code)
		_, _ = w.Write(body)
		return
	}
	size := (len(body) + 3) / 4
	if s := r.Header.Get("X-Test-Chunk-Size"); s != "" {
		if n, err := strconv.Atoi(s); err == nil && n > 0 {
			size = n
		}
	}
	size = max(size, 1)
	w.WriteHeader(code)
	rc := http.NewResponseController(w)
	_ = rc.Flush()
	for len(body) > 0 {
		n := min(size, len(body))
		if _, err := w.Write(body[:n]); err != nil {
			return
		}
		_ = rc.Flush()
		body = body[n:]
	}
}

// Body returns the n bytes the upstream sends for x-test-body-bytes: n: a pseudo-random
// sequence seeded by n, so equal lengths give equal bodies and every byte value occurs.
func Body(n int) []byte {
	rng := rand.New(rand.NewPCG(uint64(n), 0x1de))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}
