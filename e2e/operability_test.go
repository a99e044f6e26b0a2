package e2e_test

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// health asks the processor's gRPC health service.
func (p *processor) health(t *testing.T) healthpb.HealthCheckResponse_ServingStatus {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+p.grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	resp, err := healthpb.NewHealthClient(conn).Check(t.Context(), &healthpb.HealthCheckRequest{Service: "envoy.service.ext_proc.v3.ExternalProcessor"})
	if err != nil {
		return healthpb.HealthCheckResponse_UNKNOWN
	}
	return resp.GetStatus()
}

// metric returns the value of one series in a Prometheus text exposition, 0 when absent.
func metric(exposition, series string) float64 {
	for _, line := range strings.Split(exposition, "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err == nil {
				return f
			}
		}
	}
	return 0
}

// within polls cond until it holds or d has passed since start, and reports how long it took.
func within(t *testing.T, start time.Time, d time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	for !cond() {
		if time.Since(start) > d {
			t.Fatalf("%s: not within %v", what, d)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return time.Since(start)
}

// TestRedisOutage stops a real Redis under both fail modes: readiness and gRPC health turn
// within 2 s, covered requests get 503 (closed) or pass (open) within the store deadline, the
// process stays up, and everything recovers without a restart once Redis is back.
func TestRedisOutage(t *testing.T) {
	// Not parallel: it times the fail-closed answers, which must not wait behind other tests'
	// load on two cores.
	srv := redistest.Start(t, redistest.Options{})
	closed := newStack(t, stackOptions{args: redisArgs(srv)})
	open := newStack(t, stackOptions{args: redisArgs(srv), policy: "fail_mode: open"})
	procs := []*processor{closed.procs[0], open.procs[0]}

	for _, p := range procs {
		within(t, time.Now(), 5*time.Second, "ready before the outage", func() bool {
			code, _ := p.admin("/readyz")
			return code == 200 && p.health(t) == healthpb.HealthCheckResponse_SERVING
		})
	}
	require.Equal(t, 200, closed.do(call{key: "before", body: `{}`}).status)

	srv.Stop()
	stopped := time.Now()
	for _, p := range procs {
		took := within(t, stopped, 2*time.Second, "/readyz 503 and NOT_SERVING", func() bool {
			code, _ := p.admin("/readyz")
			return code == 503 && p.health(t) == healthpb.HealthCheckResponse_NOT_SERVING
		})
		t.Logf("unready %v after Redis stopped", took)
		code, _ := p.admin("/healthz")
		require.Equal(t, 200, code, "the process is alive")
	}

	for i := range 5 {
		start := time.Now()
		r := closed.do(call{key: "during-" + itoa(i), body: `{}`})
		requireProblem(t, r, 503, "store-unavailable")
		require.Equal(t, "1", r.header.Get("Retry-After"))
		// Bounded by store_timeout (100 ms), not by the 5 s message_timeout: the margin is for
		// the other packages' tests on the same two cores.
		require.Less(t, time.Since(start), 2*time.Second, "store_timeout (100ms) plus a margin for a loaded machine")

		start = time.Now()
		r = open.do(call{key: "open-" + itoa(i), body: `{}`})
		require.Equal(t, 200, r.status, "fail open passes the request through")
		require.Equal(t, "false", r.header.Get(replayed), "untouched but for the replay header")
		require.Less(t, time.Since(start), 2*time.Second)
	}
	require.Equal(t, 0, closed.up.Count("during-0"), "fail closed never reaches the upstream")
	within(t, time.Now(), 2*time.Second, "fail-open requests counted as store_error", func() bool {
		_, metrics := open.procs[0].admin("/metrics")
		return strings.Contains(metrics, `idempotency_requests_total{outcome="store_error",route="default"} 5`)
	})

	srv.Restart()
	back := time.Now()
	for _, p := range procs {
		took := within(t, back, 5*time.Second, "ready again", func() bool {
			code, _ := p.admin("/readyz")
			return code == 200 && p.health(t) == healthpb.HealthCheckResponse_SERVING
		})
		t.Logf("ready %v after Redis came back", took)
	}
	within(t, back, 5*time.Second, "a new key executes", func() bool {
		return closed.do(call{key: "after", body: `{}`}).status == 200
	})
	r := closed.do(call{key: "after", body: `{}`})
	require.Equal(t, "true", r.header.Get(replayed))
	require.Equal(t, 1, closed.up.Count("after"))
	for _, p := range procs {
		require.Contains(t, p.logs.String(), `"message":"store is unreachable: not serving"`)
		require.Contains(t, p.logs.String(), `"op":"acquire"`)
	}
}

// TestProcessLogRedactsSecrets runs the binary at debug level and checks that a distinctive
// key, authorization value, cookie and body never reach its output.
func TestProcessLogRedactsSecrets(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t, redistest.Options{ACLUser: "svc", ACLPassword: "REDIS-PASSWORD-3391"})
	s := newStack(t, stackOptions{args: append(redisArgs(srv), "--log-level", "debug")})
	const (
		key  = "KEY-c0ffee-distinctive"
		auth = "Bearer TOKEN-9d1e77"
		body = `{"pan":"BODY-5500005555555559"}`
	)
	h := map[string]string{"Authorization": auth, "Cookie": "sid=COOKIE-44aa", "X-Test-Cookies": "2"}
	for range 2 {
		require.Equal(t, 200, s.do(call{key: key, headers: h, body: body}).status)
	}
	requireProblem(t, s.do(call{key: key, headers: h, body: body + " "}), 422, "idempotency-key-reused")
	srv.Stop()
	requireProblem(t, s.do(call{key: key + "-2", headers: h, body: body}), 503, "store-unavailable")

	out := s.procs[0].logs.String()
	require.Contains(t, out, `"level":"debug"`, "debug logging is on")
	require.Contains(t, out, `"outcome":"replayed"`)
	for _, secret := range []string{"c0ffee", "TOKEN-9d1e77", "COOKIE-44aa", "5500005555555559", "REDIS-PASSWORD-3391", "c1=v1"} {
		require.False(t, strings.Contains(out, secret), "the log contains %q:\n%s", secret, out)
	}
}
