package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// recordsPolicy's store_timeout is far above a store call's time on a loaded machine: the test is
// of the records API, and a claim refused as store-unavailable would fail it for nothing.
const recordsPolicy = `
store_timeout: 5s
defaults: {lock_ttl: 30s}
routes:
  - {name: pay, match: {path_prefix: /v1/payments}, unknown_outcome: keep}
  - {name: unknown, match: {path_prefix: /v1/unknown}, unknown_outcome: record}
  - {name: other, match: {path_prefix: /v1/other}, key_prefix: "other:"}
`

// claimOn opens a stream that claims key with a bodiless POST to path; the request runs
// upstream until the stream ends.
func claimOn(t *testing.T, addr, path, key string) extprocv3.ExternalProcessor_ProcessClient {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	t.Cleanup(cancel)
	s, err := extprocv3.NewExternalProcessorClient(dial(t, addr)).Process(ctx)
	require.NoError(t, err)
	m := bodilessPost(key)
	m.GetRequestHeaders().Headers.Headers[1] = &corev3.HeaderValue{Key: ":path", RawValue: []byte(path)}
	require.NoError(t, s.Send(m))
	resp, err := s.Recv()
	require.NoError(t, err)
	require.NotNil(t, resp.GetRequestHeaders(), "claimed %s on %s: %v", key, path, resp)
	return s
}

// keyHashOf runs the key-hash subcommand.
func keyHashOf(t *testing.T, policyFile, path, key string) string {
	t.Helper()
	var out bytes.Buffer
	require.NoError(t, dispatch(t.Context(), []string{"key-hash", "--config", policyFile, "--path", path, "--key", key}, env(nil), &out, io.Discard))
	h, ok := strings.CutSuffix(out.String(), "\n")
	require.True(t, ok, "one line: %q", out.String())
	return h
}

// recordsCall runs the records subcommand and returns its output.
func recordsCall(t *testing.T, adminURL, tokenFile string, args ...string) (string, error) {
	t.Helper()
	var out bytes.Buffer
	err := dispatch(t.Context(), append(append([]string{"records"}, args...), "--admin-url", adminURL, "--token-file", tokenFile), env(nil), &out, io.Discard)
	return out.String(), err
}

// The records API on each store: behind its token, it shows a record in each state
// and purges it whatever its state; a purged stuck lease lets the next retry run. The CLI drives
// it against the running program.
func TestRecordsAPI(t *testing.T) {
	backends := map[string]func(t *testing.T) []string{
		"memory": func(*testing.T) []string { return []string{"--store", "memory"} },
		"redis": func(t *testing.T) []string {
			return []string{"--store", "redis", "--redis-url", redistest.Start(t, redistest.Options{}).URL()}
		},
		"cluster": func(t *testing.T) []string {
			c := redistest.StartCluster(t, 3, 0)
			return []string{"--store", "redis", "--redis-cluster-addrs", strings.Join(c.Addrs(), ",")}
		},
	}
	for name, backend := range backends {
		t.Run(name, func(t *testing.T) {
			const token = "adm-7f3c-token"
			tokenFile := writeNamed(t, "token", token+"\n")
			policyFile := writeFile(t, recordsPolicy)
			logs := newLogLines()
			ctx, cancel := context.WithCancel(context.Background())
			t.Cleanup(cancel)
			done := make(chan error, 1)
			args := append(backend(t), "--config", policyFile, "--admin-token-file", tokenFile, "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0")
			go func() { done <- runWith(ctx, args, env(nil), logs, runOptions{drainTimeout: 200 * time.Millisecond}) }()
			ready := logs.wait(t, "ready", 20*time.Second)
			grpcAddr, adminURL := ready["grpc_addr"].(string), "http://"+ready["admin_addr"].(string)

			// A stuck pending key: its stream ended before any response, and unknown_outcome: keep
			// leaves the lease to expire. (While the stream lived, its own replica would answer a
			// duplicate 409 without the store, purged or not.)
			require.NoError(t, claimOn(t, grpcAddr, "/v1/payments", "stuck").CloseSend())
			require.Eventually(t, func() bool {
				return strings.Contains(scrape(t, adminURL+"/metrics"), "\nidempotency_inflight 0\n")
			}, 10*time.Second, 10*time.Millisecond, "the stream has ended")
			stuck := keyHashOf(t, policyFile, "/v1/payments", "stuck")
			require.Len(t, stuck, 64)

			// Authorization: missing, wrong, right.
			recordURL := adminURL + "/v1/records/" + stuck
			for _, auth := range []string{"", "Bearer wrong", "Basic " + token, "Bearer " + token + "x"} {
				req, _ := http.NewRequest(http.MethodGet, recordURL, nil)
				if auth != "" {
					req.Header.Set("Authorization", auth)
				}
				resp, err := http.DefaultClient.Do(req)
				require.NoError(t, err)
				body, _ := io.ReadAll(resp.Body)
				_ = resp.Body.Close()
				require.Equal(t, http.StatusUnauthorized, resp.StatusCode, "%q", auth)
				require.Equal(t, "application/problem+json", resp.Header.Get("Content-Type"))
				require.NotContains(t, string(body), token)
			}
			out, err := recordsCall(t, adminURL, writeNamed(t, "wrong", "nope"), "get", stuck)
			require.ErrorContains(t, err, "refused the token (401)")
			require.Empty(t, out)

			out, err = recordsCall(t, adminURL, tokenFile, "get", stuck)
			require.NoError(t, err)
			var view map[string]any
			require.NoError(t, json.Unmarshal([]byte(out), &view))
			require.Equal(t, stuck, view["key_hash"])
			require.Equal(t, "pay", view["route"])
			require.Equal(t, "pending", view["state"])
			created, err := time.Parse(time.RFC3339, view["created_at"].(string))
			require.NoError(t, err)
			require.WithinDuration(t, time.Now(), created, time.Minute)
			expires, err := time.Parse(time.RFC3339, view["expires_at"].(string))
			require.NoError(t, err)
			require.WithinDuration(t, time.Now().Add(30*time.Second), expires, 10*time.Second, "the lease's end")

			// A duplicate gets 409 until the stuck key is purged; then the retry runs.
			dup, err := extprocv3.NewExternalProcessorClient(dial(t, grpcAddr)).Process(t.Context())
			require.NoError(t, err)
			require.NoError(t, dup.Send(bodilessPost("stuck")))
			resp, err := dup.Recv()
			require.NoError(t, err)
			require.Equal(t, 409, int(resp.GetImmediateResponse().GetStatus().GetCode()))
			out, err = recordsCall(t, adminURL, tokenFile, "purge", stuck)
			require.NoError(t, err)
			require.Equal(t, "purged "+stuck+"\n", out)
			claimOn(t, grpcAddr, "/v1/payments", "stuck") // runs again

			// Completed.
			s := claimOn(t, grpcAddr, "/v1/payments", "done")
			require.NoError(t, s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
				Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte("201")}}},
			}}}))
			_, err = s.Recv()
			require.NoError(t, err)
			require.NoError(t, s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: []byte("0123456789"), EndOfStream: true}}}))
			_, err = s.Recv()
			require.NoError(t, err)
			out, err = recordsCall(t, adminURL, tokenFile, "get", keyHashOf(t, policyFile, "/v1/payments", "done"))
			require.NoError(t, err)
			require.NoError(t, json.Unmarshal([]byte(out), &view))
			require.Equal(t, "completed", view["state"])
			require.Equal(t, 201.0, view["status"])
			require.Equal(t, 10.0, view["body_bytes"])

			// Outcome unknown: the stream ends before any response, under unknown_outcome: record.
			amb := claimOn(t, grpcAddr, "/v1/unknown", "amb")
			_ = amb.CloseSend()
			ambHash := keyHashOf(t, policyFile, "/v1/unknown", "amb")
			require.Eventually(t, func() bool {
				out, err := recordsCall(t, adminURL, tokenFile, "get", ambHash)
				return err == nil && strings.Contains(out, `"outcome_unknown"`) && strings.Contains(out, `"unknown"`)
			}, 10*time.Second, 20*time.Millisecond)

			// The list: every record, under each key prefix, a page at a time.
			claimOn(t, grpcAddr, "/v1/other", "elsewhere")
			doneHash, otherHash := keyHashOf(t, policyFile, "/v1/payments", "done"), keyHashOf(t, policyFile, "/v1/other", "elsewhere")
			states := map[string]string{stuck: "pending pay", doneHash: "completed pay", ambHash: "outcome_unknown unknown", otherHash: "pending other"}
			for _, limit := range []int{1, 2, 100} {
				seen := map[string]string{}
				cursor, pages := "", 0
				for {
					page := listPage(t, adminURL, token, fmt.Sprintf("limit=%d&cursor=%s", limit, url.QueryEscape(cursor)))
					require.LessOrEqual(t, len(page.Records), limit+10, "about limit records a page")
					for _, r := range page.Records {
						require.NotContains(t, seen, r.KeyHash, "listed once")
						seen[r.KeyHash] = r.State + " " + r.Route
					}
					pages++
					require.Less(t, pages, 100, "the cursor moves on")
					if cursor = page.Cursor; cursor == "" {
						break
					}
				}
				require.Equal(t, states, seen, "limit %d", limit)
			}
			out, err = recordsCall(t, adminURL, tokenFile, "list")
			require.NoError(t, err)
			lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
			require.Len(t, lines, 5, "a header and four records:\n%s", out)
			require.Regexp(t, `^KEY_HASH +ROUTE +STATE +STATUS +BODY_BYTES +CREATED_AT +EXPIRES_AT$`, lines[0])
			require.Regexp(t, `(?m)^`+doneHash+` +pay +completed +201 +10 +\S+Z +\S+Z$`, out)
			require.Regexp(t, `(?m)^`+stuck+` +pay +pending +- +0 +\S+Z +\S+Z$`, out)
			out, err = recordsCall(t, adminURL, tokenFile, "list", "--route", "pay")
			require.NoError(t, err)
			require.Equal(t, 3, strings.Count(out, "\n"), "the header and pay's two records:\n%s", out)
			require.Contains(t, out, stuck)
			require.Contains(t, out, doneHash)
			out, err = recordsCall(t, adminURL, tokenFile, "list", "--limit", "3")
			require.NoError(t, err)
			require.Equal(t, 4, strings.Count(out, "\n"), "the header and three records:\n%s", out)
			for _, bad := range []string{"limit=0", "limit=1001", "limit=x", "cursor=9.-", "cursor=zz", "cursor=0.notacursor"} {
				req, _ := http.NewRequest(http.MethodGet, adminURL+"/v1/records?"+bad, nil)
				req.Header.Set("Authorization", "Bearer "+token)
				resp, err := http.DefaultClient.Do(req)
				require.NoError(t, err)
				_ = resp.Body.Close()
				require.Equal(t, http.StatusBadRequest, resp.StatusCode, bad)
			}

			_, err = recordsCall(t, adminURL, tokenFile, "purge", ambHash)
			require.NoError(t, err)

			// 404s.
			_, err = recordsCall(t, adminURL, tokenFile, "get", strings.Repeat("0", 64))
			require.ErrorContains(t, err, "no record")
			_, err = recordsCall(t, adminURL, tokenFile, "purge", ambHash)
			require.ErrorContains(t, err, "no record", "purged already")

			m := scrape(t, adminURL+"/metrics")
			require.Contains(t, m, `idempotency_admin_requests_total{op="get",result="unauthorized"} 5`)
			require.Contains(t, m, `idempotency_admin_requests_total{op="purge",result="ok"} 2`)
			require.Contains(t, m, `idempotency_admin_requests_total{op="get",result="not_found"} 1`)
			require.Contains(t, logs.String(), `"message":"records API call"`)
			require.Contains(t, logs.String(), `"key_hash":"`+stuck+`"`)
			require.NotContains(t, logs.String(), token, "the token is never logged")
			cancel()
			require.NoError(t, <-done)
		})
	}
}

// Without --admin-token-file the records paths answer 404, and the CLI says how to turn them on.
func TestRecordsAPIOffWithoutAToken(t *testing.T) {
	logs := newLogLines()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	done := make(chan error, 1)
	go func() {
		done <- runWith(ctx, []string{"--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"}, env(nil), logs, runOptions{})
	}()
	ready := logs.wait(t, "ready", 10*time.Second)
	adminURL := "http://" + ready["admin_addr"].(string)
	require.Equal(t, http.StatusNotFound, get(t, adminURL+"/v1/records/"+strings.Repeat("a", 64)))
	_, err := recordsCall(t, adminURL, writeNamed(t, "tok", "t"), "get", strings.Repeat("a", 64))
	require.ErrorContains(t, err, "start the server with --admin-token-file")
	m := scrape(t, adminURL+"/metrics")
	require.NotContains(t, m, "idempotency_admin_requests_total")
	require.Contains(t, m, "\nidempotency_fail_open 0\n", "fail_mode closed by default")
	cancel()
	require.NoError(t, <-done)
}

// listPage GETs a page of /v1/records with query.
func listPage(t *testing.T, adminURL, token, query string) recordsPage {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, adminURL+"/v1/records?"+query, nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer func() { _ = resp.Body.Close() }()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", body)
	require.Equal(t, "application/json", resp.Header.Get("Content-Type"))
	var page recordsPage
	require.NoError(t, json.Unmarshal(body, &page))
	return page
}

func scrape(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer func() { _ = resp.Body.Close() }()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(b)
}

// The records API takes the Bearer scheme in any case (RFC 9110 section 11.1) and only the exact
// token. A refused call is counted but logged only at debug: anyone who reaches the listener can
// make one as often as they like; an accepted one is logged at info.
func TestRecordsAPIAuthorization(t *testing.T) {
	const token = "adm-7f3c-token"
	mem, err := cache.NewMemory(cache.MemoryOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = mem.Close() })
	logs := newLogLines()
	reg := prometheus.NewRegistry()
	api, err := newRecordsAPI(mem, []byte(token), []string{"idem:"}, time.Second, zerolog.New(logs).Level(zerolog.DebugLevel), reg)
	require.NoError(t, err)
	mux := http.NewServeMux()
	api.register(mux)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	url := srv.URL + "/v1/records/" + strings.Repeat("a", 64)
	for i, tc := range []struct {
		auth   string
		status int
		level  string
	}{
		{"Bearer " + token, http.StatusNotFound, "info"}, // accepted: no such record
		{"bearer " + token, http.StatusNotFound, "info"},
		{"BEARER " + token, http.StatusNotFound, "info"},
		{"bEaReR  " + token, http.StatusNotFound, "info"},
		{"", http.StatusUnauthorized, "debug"},
		{"Bearer", http.StatusUnauthorized, "debug"},
		{"Bearer wrong", http.StatusUnauthorized, "debug"},
		{"Bearer " + token + "x", http.StatusUnauthorized, "debug"},
		{"Basic " + token, http.StatusUnauthorized, "debug"},
		{"Bearer" + token, http.StatusUnauthorized, "debug"},
		{"Token " + token, http.StatusUnauthorized, "debug"},
	} {
		req, err := http.NewRequest(http.MethodGet, url, nil)
		require.NoError(t, err)
		if tc.auth != "" {
			req.Header.Set("Authorization", tc.auth)
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		_ = resp.Body.Close()
		require.Equal(t, tc.status, resp.StatusCode, "%q", tc.auth)
		line := logs.all()[i] // the handler logs before the answer is written
		require.Equal(t, tc.level, line["level"], "%q", tc.auth)
		require.Equal(t, "records API call", line["message"])
	}
	require.NotContains(t, logs.String(), token)
	counts := map[string]float64{}
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		for _, m := range f.GetMetric() {
			labels := f.GetName()
			for _, l := range m.GetLabel() {
				labels += " " + l.GetName() + "=" + l.GetValue()
			}
			counts[labels] = m.GetCounter().GetValue()
		}
	}
	require.Equal(t, 4.0, counts["idempotency_admin_requests_total op=get result=not_found"])
	require.Equal(t, 7.0, counts["idempotency_admin_requests_total op=get result=unauthorized"], "refused calls are counted")
}

// Every body the admin listener writes ends with a newline: the health and readiness answers,
// the metrics, the records API's records, pages and problems, and net/http's own 404 and 405.
func TestAdminBodiesEndWithANewline(t *testing.T) {
	const token = "adm-nl-token"
	tokenFile := writeNamed(t, "token", token)
	logs := newLogLines()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	done := make(chan error, 1)
	go func() {
		done <- runWith(ctx, []string{"--admin-token-file", tokenFile, "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"}, env(nil), logs, runOptions{drainTimeout: 200 * time.Millisecond})
	}()
	ready := logs.wait(t, "ready", 10*time.Second)
	admin := "http://" + ready["admin_addr"].(string)
	claimOn(t, ready["grpc_addr"].(string), "/v1/payments", "nl")
	hash := keyHashOf(t, writeFile(t, "{}"), "/v1/payments", "nl")
	for _, tc := range []struct {
		method, path, auth string
		status             int
	}{
		{"GET", "/healthz", "", 200},
		{"GET", "/readyz", "", 200},
		{"GET", "/metrics", "", 200},
		{"GET", "/nothing", "", 404},
		{"POST", "/healthz", "", 405},
		{"GET", "/v1/records/" + hash, token, 200},
		{"GET", "/v1/records", token, 200},
		{"GET", "/v1/records?limit=0", token, 400},
		{"GET", "/v1/records/" + strings.Repeat("0", 64), token, 404},
		{"GET", "/v1/records/nothex", token, 400},
		{"GET", "/v1/records/" + hash, "wrong", 401},
		{"DELETE", "/v1/records/" + strings.Repeat("0", 64), token, 404},
	} {
		req, err := http.NewRequest(tc.method, admin+tc.path, nil)
		require.NoError(t, err)
		if tc.auth != "" {
			req.Header.Set("Authorization", "Bearer "+tc.auth)
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		_ = resp.Body.Close()
		require.Equal(t, tc.status, resp.StatusCode, "%s %s: %s", tc.method, tc.path, body)
		require.NotEmpty(t, body, "%s %s", tc.method, tc.path)
		require.Equal(t, byte('\n'), body[len(body)-1], "%s %s: %q", tc.method, tc.path, body)
	}
	cancel()
	require.NoError(t, <-done)
}
