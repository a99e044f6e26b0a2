package main

import (
	"encoding/json"
	"io"
	"net/http"
	"os/exec"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// startServe runs the race-built binary's serve with args on free loopback ports and returns its
// log once it says it listens.
func startServe(t *testing.T, args ...string) (*logLines, map[string]any) {
	t.Helper()
	bin, err := binary()
	require.NoError(t, err)
	logs := newLogLines()
	cmd := exec.Command(bin, append([]string{"serve", "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"}, args...)...)
	cmd.Stderr = logs
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("serve log:\n%s", logs.String())
		}
	})
	return logs, logs.wait(t, "listening: waiting for the store to answer", 30*time.Second)
}

// getBody GETs url and returns its status and body.
func getBody(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Get(url)
	require.NoError(t, err)
	defer func() { _ = resp.Body.Close() }()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

// covered sends a covered bodiless POST with key to addr and returns the processor's first answer.
func covered(t *testing.T, addr, key string) *extprocv3.ProcessingResponse {
	t.Helper()
	s, err := extprocv3.NewExternalProcessorClient(dial(t, addr)).Process(t.Context())
	require.NoError(t, err)
	require.NoError(t, s.Send(bodilessPost(key)))
	resp, err := s.Recv()
	require.NoError(t, err)
	_ = s.CloseSend()
	return resp
}

// recoveryDeadline bounds how long the process takes to see a change of its store: a readiness
// check every readinessInterval, each bounded by maxPingTimeout, with room for a loaded machine.
const recoveryDeadline = 4*(readinessInterval+maxPingTimeout) + 5*time.Second

// With durability.replicas 1 and a Redis master without replicas, the process starts, warns
// naming the setting and the replicas it sees, is not ready (/readyz says why, the gauge shows
// 0), and answers covered requests 503 durability-unmet. Once a replica attaches it recovers,
// /readyz and requests both, without a restart.
func TestBinaryDurabilityUnmetUntilAReplicaAttaches(t *testing.T) {
	srv := redistest.Start(t, redistest.Options{})
	logs, listening := startServe(t, "--store", "redis", "--redis-url", srv.URL(),
		"--config", writeFile(t, "store_timeout: 1s\ndurability: {replicas: 1, timeout: 300ms}\n"))
	admin, grpcAddr := "http://"+listening["admin_addr"].(string), listening["grpc_addr"].(string)

	logs.wait(t, "ready", recoveryDeadline) // the store answered
	warned := logs.wait(t, "durability.replicas is above the replicas the store has in sync: not serving; covered requests of the routes that ask for more get 503 durability-unmet until replicas are attached", recoveryDeadline)
	require.Equal(t, "warn", warned["level"])
	require.Equal(t, 1.0, warned["durability_replicas"])
	require.Equal(t, 0.0, warned["replicas_seen"])

	code, body := getBody(t, admin+"/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Contains(t, body, "durability.replicas is 1 and the store has 0 replicas in sync")
	require.True(t, strings.HasSuffix(body, "\n"))
	require.Contains(t, scrape(t, admin+"/metrics"), "\nidempotency_store_replicas 0\n")
	require.Contains(t, scrape(t, admin+"/metrics"), "\nidempotency_ready 0\n")

	for _, key := range []string{"a", "b"} {
		resp := covered(t, grpcAddr, key).GetImmediateResponse()
		require.Equal(t, 503, int(resp.GetStatus().GetCode()), "%v", resp)
		var p map[string]any
		require.NoError(t, json.Unmarshal(resp.GetBody(), &p))
		require.Equal(t, "durability-unmet", p["code"])
		var retryAfter string
		for _, h := range resp.GetHeaders().GetSetHeaders() {
			if h.GetHeader().GetKey() == "retry-after" {
				retryAfter = string(h.GetHeader().GetRawValue())
			}
		}
		require.Equal(t, "1", retryAfter)
	}
	require.Empty(t, scanKeys(t, srv), "no store call")
	require.Equal(t, 1, strings.Count(logs.String(), "durability.replicas asks for more replicas than the store has"), "the cause, once per interval")

	redistest.StartReplicas(t, srv, 1)
	deadline := time.Now().Add(recoveryDeadline)
	for {
		code, _ := getBody(t, admin+"/readyz")
		if code == http.StatusOK {
			break
		}
		require.True(t, time.Now().Before(deadline), "/readyz still %d %v after the replica attached", code, recoveryDeadline)
		time.Sleep(50 * time.Millisecond)
	}
	require.NotNil(t, covered(t, grpcAddr, "c").GetRequestHeaders(), "a covered request runs again")
	require.Contains(t, scrape(t, admin+"/metrics"), "\nidempotency_store_replicas 1\n", "as /readyz counted them")
	// gRPC health and the ready gauge follow at the watcher's next check.
	logs.wait(t, "store is reachable: serving", recoveryDeadline)
	m := scrape(t, admin+"/metrics")
	require.Contains(t, m, "\nidempotency_ready 1\n")
	require.Contains(t, m, `idempotency_requests_total{outcome="durability_unmet",route="default"} 2`)
}

// scanKeys lists srv's keys.
func scanKeys(t *testing.T, srv *redistest.Server) []string {
	t.Helper()
	keys, _, err := srv.Client(t).Scan(t.Context(), 0, "*", 1000).Result()
	require.NoError(t, err)
	return keys
}

// With a wrong Redis password the process listens but is not ready: no ready line, /readyz
// says why. Once the store takes the password, it logs ready and serves, without a restart.
func TestBinaryWrongRedisPasswordIsNotReady(t *testing.T) {
	srv := redistest.Start(t, redistest.Options{Password: "right-pass"})
	url := strings.Replace(srv.URL(), "right-pass", "later-pass", 1)
	require.NotEqual(t, srv.URL(), url)
	logs, listening := startServe(t, "--store", "redis", "--redis-url", url)
	admin := "http://" + listening["admin_addr"].(string)

	logs.wait(t, "store is unreachable: not serving", recoveryDeadline)
	code, body := getBody(t, admin+"/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Contains(t, body, "not ready: store unavailable")
	require.Contains(t, body, "WRONGPASS")
	require.True(t, strings.HasSuffix(body, "\n"), "%q", body)
	require.NotContains(t, body, "later-pass", "never the password")
	require.NotContains(t, logs.String(), `"message":"ready"`, "no ready line before the store answers")
	require.NotContains(t, logs.String(), "later-pass")

	require.NoError(t, srv.Client(t).ConfigSet(t.Context(), "requirepass", "later-pass").Err())
	logs.wait(t, "ready", recoveryDeadline)
	code, _ = getBody(t, admin+"/readyz")
	require.Equal(t, http.StatusOK, code)
	require.NotNil(t, covered(t, listening["grpc_addr"].(string), "k").GetRequestHeaders())
}
