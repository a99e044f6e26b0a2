package upstream_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/upstream"
	"github.com/idempotency-extproc/idempotency-extproc/internal/leakcheck"
)

func TestMain(m *testing.M) {
	leakcheck.Main(m)
}

func client(t *testing.T) *http.Client {
	tr := &http.Transport{DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

func do(t *testing.T, c *http.Client, ctx context.Context, method, url string, body []byte, hdr ...string) (*http.Response, []byte, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(body))
	require.NoError(t, err)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Add(hdr[i], hdr[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, nil, err
	}
	defer func() { _ = resp.Body.Close() }()
	b, err := io.ReadAll(resp.Body)
	return resp, b, err
}

func TestSummaryAndCounts(t *testing.T) {
	u := upstream.Start(t)
	c := client(t)
	body := []byte(`{"amount":10}`)
	sum := sha256.Sum256(body)
	for i, key := range []string{"idempotency-key", "x-idempotency-key", "x-idempotency"} {
		resp, got, err := do(t, c, context.Background(), http.MethodPost, u.URL()+"/pay?x=1", body, key, "k")
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.Equal(t, "application/json", resp.Header.Get("Content-Type"))
		var s upstream.Summary
		require.NoError(t, json.Unmarshal(got, &s))
		require.Equal(t, upstream.Summary{Execution: i + 1, Key: "k", Method: "POST", Path: "/pay?x=1", BodySHA256: hex.EncodeToString(sum[:])}, s)
	}
	_, _, err := do(t, c, context.Background(), http.MethodGet, u.URL()+"/", nil)
	require.NoError(t, err)
	require.Equal(t, 3, u.Count("k"))
	require.Equal(t, 1, u.Count(""))
	require.Equal(t, 4, u.Total())
	reqs := u.Requests()
	require.Len(t, reqs, 4)
	require.Equal(t, hex.EncodeToString(sum[:]), reqs[0].BodySHA256)
	require.Equal(t, "k", reqs[2].Header.Get("X-Idempotency"))
}

func TestBehaviourHeaders(t *testing.T) {
	u := upstream.Start(t)
	c := client(t)
	tests := []struct {
		name  string
		hdr   []string
		check func(t *testing.T, resp *http.Response, body []byte)
	}{
		{"status", []string{"X-Test-Status", "201"}, func(t *testing.T, resp *http.Response, _ []byte) {
			require.Equal(t, http.StatusCreated, resp.StatusCode)
		}},
		{"bad status", []string{"X-Test-Status", "99"}, func(t *testing.T, resp *http.Response, _ []byte) {
			require.Equal(t, http.StatusBadRequest, resp.StatusCode)
		}},
		{"no content", []string{"X-Test-Status", "204"}, func(t *testing.T, resp *http.Response, body []byte) {
			require.Equal(t, http.StatusNoContent, resp.StatusCode)
			require.Empty(t, body)
		}},
		{"body bytes", []string{"X-Test-Body-Bytes", "70000"}, func(t *testing.T, resp *http.Response, body []byte) {
			require.Equal(t, "application/octet-stream", resp.Header.Get("Content-Type"))
			require.Equal(t, int64(70000), resp.ContentLength)
			require.Equal(t, upstream.Body(70000), body)
			seen := map[byte]bool{}
			for _, b := range body {
				seen[b] = true
			}
			require.Len(t, seen, 256, "every byte value occurs")
		}},
		{"cookies", []string{"X-Test-Cookies", "3"}, func(t *testing.T, resp *http.Response, _ []byte) {
			require.Equal(t, []string{"c1=v1", "c2=v2", "c3=v3"}, resp.Header.Values("Set-Cookie"))
		}},
		{"chunked", []string{"X-Test-Chunked", "true", "X-Test-Body-Bytes", "1000", "X-Test-Chunk-Size", "100"}, func(t *testing.T, resp *http.Response, body []byte) {
			require.Equal(t, int64(-1), resp.ContentLength)
			require.Equal(t, []string{"chunked"}, resp.TransferEncoding)
			require.Equal(t, upstream.Body(1000), body)
		}},
		{"echoed headers", []string{"X-Test-Header-X-Custom", "a", "X-Test-Header-X-Custom", "b", "X-Test-Header-Content-Type", "text/csv"}, func(t *testing.T, resp *http.Response, _ []byte) {
			require.Equal(t, []string{"a", "b"}, resp.Header.Values("X-Custom"))
			require.Equal(t, "text/csv", resp.Header.Get("Content-Type"))
		}},
		{"trailers", []string{"X-Test-Trailer-Grpc-Status", "0", "X-Test-Body-Bytes", "1000"}, func(t *testing.T, resp *http.Response, body []byte) {
			require.Equal(t, int64(-1), resp.ContentLength, "trailers need a chunked body")
			require.Equal(t, upstream.Body(1000), body)
			require.Equal(t, "0", resp.Trailer.Get("Grpc-Status"), "sent after the body")
		}},
		{"delay", []string{"X-Test-Delay", "100ms"}, func(t *testing.T, resp *http.Response, _ []byte) {
			require.Equal(t, http.StatusOK, resp.StatusCode)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			start := time.Now()
			resp, body, err := do(t, c, context.Background(), http.MethodPost, u.URL()+"/", nil, tt.hdr...)
			require.NoError(t, err)
			tt.check(t, resp, body)
			if tt.name == "delay" {
				require.GreaterOrEqual(t, time.Since(start), 100*time.Millisecond)
			}
		})
	}
}

func TestDelayAndHangRespectCancellation(t *testing.T) {
	u := upstream.Start(t)
	c := client(t)
	for _, hdr := range [][]string{{"X-Test-Delay", "1m"}, {"X-Test-Hang", "true"}} {
		t.Run(hdr[0], func(t *testing.T) {
			before := u.Total()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			// Counted on arrival, before the wait: the client goes away once it is.
			go func() {
				for u.Total() == before && ctx.Err() == nil {
					time.Sleep(time.Millisecond)
				}
				cancel()
			}()
			start := time.Now()
			_, _, err := do(t, c, ctx, http.MethodPost, u.URL()+"/", nil, append(hdr, "Idempotency-Key", "slow")...)
			require.ErrorIs(t, err, context.Canceled, "the client left, the upstream did not answer")
			require.Less(t, time.Since(start), 10*time.Second)
			require.Equal(t, before+1, u.Total())
			// Released when the client goes away.
			require.Eventually(t, func() bool { return u.Active() == 0 }, 5*time.Second, time.Millisecond)
		})
	}
}

func TestCloseReleasesHangingRequests(t *testing.T) {
	u := upstream.New()
	srvDone := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		req, _ := http.NewRequest(http.MethodGet, "/", nil)
		req.Header.Set("X-Test-Hang", "true")
		u.ServeHTTP(discard{}, req)
		close(srvDone)
	}()
	require.Eventually(t, func() bool { return u.Total() == 1 }, time.Second, time.Millisecond)
	u.Close()
	u.Close()
	<-srvDone
	wg.Wait()
}

func TestConcurrentCounts(t *testing.T) {
	u := upstream.Start(t)
	c := client(t)
	var wg sync.WaitGroup
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _, err := do(t, c, context.Background(), http.MethodPost, u.URL()+"/", nil, "Idempotency-Key", "same")
			if err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	require.Equal(t, 20, u.Count("same"))
}

func TestBodyIsDeterministic(t *testing.T) {
	require.Equal(t, upstream.Body(1000), upstream.Body(1000))
	require.NotEqual(t, upstream.Body(1000)[:999], upstream.Body(999))
	require.Empty(t, upstream.Body(0))
}

type discard struct{}

func (discard) Header() http.Header         { return http.Header{} }
func (discard) Write(b []byte) (int, error) { return len(b), nil }
func (discard) WriteHeader(int)             {}
