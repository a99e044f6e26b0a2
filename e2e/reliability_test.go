package e2e_test

import (
	"bytes"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/envoyconf"
	"github.com/idempotency-extproc/idempotency-extproc/e2e/upstream"
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// These tests break things on purpose: many concurrent duplicates over two replicas, replicas
// killed or stopped mid-request, Redis stopped under load, Cluster and Sentinel failovers. The
// promise they hold the product to is "never twice": no key's upstream runs twice while the
// store is healthy, and no request runs without its client hearing about it.

func redisArgs(srv *redistest.Server) []string {
	return []string{"--store", "redis", "--redis-url", srv.URL()}
}

// outcome is what one request of a traffic run got.
type outcome struct {
	key      string
	status   int
	replayed string
	code     string
	err      error
	start    time.Time
	took     time.Duration
}

// disruption is a traffic run with something broken in its middle; see disruptTraffic.
type disruption struct {
	workers int
	prefix  string
	headers map[string]string
	lead    time.Duration // traffic before disrupt is called
	disrupt func()
	// Traffic goes on until minAfter requests that started settle after disrupt returned have
	// ended.
	settle   time.Duration
	minAfter int
}

// maxTraffic bounds how long a traffic run waits, once settled, for its requests after a
// disruption.
const maxTraffic = 30 * time.Second

// disruptTraffic sends requests with fresh keys from d.workers goroutines, calls d.disrupt after
// d.lead, and stops once d.minAfter requests that started d.settle after it returned have ended:
// a loaded machine can take several times longer to produce them than an idle one, so a fixed
// sleep would leave a test without evidence. It returns every outcome, and those that started
// after settling; it fails the test if there are fewer than d.minAfter within maxTraffic of
// settling.
func (s *stack) disruptTraffic(t *testing.T, d disruption) (all, after []outcome) {
	t.Helper()
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		seq      atomic.Int64
		settled  atomic.Int64 // unix nanoseconds from which requests count as after; 0 before
		counted  atomic.Int64
		stopOnce sync.Once
	)
	stop := make(chan struct{})
	halt := func() { stopOnce.Do(func() { close(stop) }) }
	for w := range d.workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				key := d.prefix + "-" + itoa(w) + "-" + itoa(int(seq.Add(1)))
				start := time.Now()
				r, err := s.try(call{key: key, headers: d.headers, body: `{"amount":1}`})
				o := outcome{key: key, status: r.status, replayed: r.header.Get(replayed), code: r.problemCode(), err: err, start: start, took: time.Since(start)}
				mu.Lock()
				all = append(all, o)
				mu.Unlock()
				if at := settled.Load(); at != 0 && start.UnixNano() > at && counted.Add(1) == int64(d.minAfter) {
					halt()
				}
			}
		}()
	}
	time.Sleep(d.lead)
	disrupted := false
	defer func() {
		if !disrupted { // disrupt failed the test: stop the traffic before the stack goes
			halt()
			wg.Wait()
		}
	}()
	d.disrupt()
	disrupted = true
	settledAt := time.Now().Add(d.settle)
	settled.Store(settledAt.UnixNano())
	deadline := time.AfterFunc(d.settle+maxTraffic, halt)
	defer deadline.Stop()
	wg.Wait()

	var slowest time.Duration
	for _, o := range all {
		if o.start.After(settledAt) {
			after = append(after, o)
			slowest = max(slowest, o.took)
		}
	}
	t.Logf("%d requests, %d of them after settling; the slowest of those took %v", len(all), len(after), slowest.Round(time.Millisecond))
	if len(after) < d.minAfter {
		t.Fatalf("only %d requests started %v after the disruption and ended within %v; want %d", len(after), d.settle, maxTraffic, d.minAfter)
	}
	return all, after
}

// requireNeverTwice checks the promise on a traffic run: the upstream ran each key at most
// once; a 2xx means it ran exactly once; a 503 store-unavailable means it did not run. It
// returns how many requests got each status.
func requireNeverTwice(t *testing.T, up *upstream.Upstream, out []outcome) map[int]int {
	t.Helper()
	statuses := map[int]int{}
	for _, o := range out {
		require.NoError(t, o.err, "every request gets an answer")
		statuses[o.status]++
		n := up.Count(o.key)
		require.LessOrEqual(t, n, 1, "key %s ran %d times", o.key, n)
		switch {
		case o.status >= 200 && o.status < 300:
			require.Equal(t, 1, n, "key %s: a success means it ran", o.key)
		case o.status == 503 && o.code == "store-unavailable":
			require.Equal(t, 0, n, "key %s: store-unavailable means it did not run", o.key)
		}
	}
	return statuses
}

// TestRacesAcrossReplicas does not run in parallel: its thousand concurrent requests keep both
// cores and this process' scheduler busy for seconds (a 5 ms ticker here then fires up to
// 0.7 s late), which stalls the requests of the tests that time a failover, a restart or a
// drain. Go runs it before the parallel tests start. Each message may wait behind a thousand
// others, for longer than the 5 s message_timeout of the other tests on a busy machine (a key
// once got 504 so): the timer is the route's timeout, since what is asserted is that every key
// ran once and answered, not how soon.
func TestRacesAcrossReplicas(t *testing.T) {
	srv := redistest.Start(t, redistest.Options{})
	s := newStack(t, stackOptions{replicas: 2, args: redisArgs(srv), policy: "store_timeout: 3s", envoy: withMessageTimeoutOfRoute})

	t.Run("200 duplicates", func(t *testing.T) {
		const n = 200
		statuses := s.burst(n, func(int) call {
			// In flight for 1 s: long enough that each replica meets duplicates while it runs,
			// however slowly a loaded machine sends the burst.
			return call{key: "dup-200", headers: map[string]string{"X-Test-Delay": "1s"}, body: `{"a":1}`}
		})
		counts := map[int]int{}
		for _, st := range statuses {
			counts[st]++
		}
		require.Equal(t, 1, s.up.Count("dup-200"), "exactly one execution across both replicas: %v", counts)
		require.Equal(t, n, counts[200]+counts[409], "each got the result, a replay or 409: %v", counts)
		// Both replicas served traffic. A request is counted when its stream ends, just after
		// the client has its answer.
		for _, p := range s.procs {
			within(t, time.Now(), 5*time.Second, "replica "+p.grpcAddr+" answered duplicates", func() bool {
				_, metrics := p.admin("/metrics")
				return metric(metrics, `idempotency_requests_total{outcome="in_progress",route="default"}`) > 0
			})
		}
		r := s.do(call{key: "dup-200", body: `{"a":1}`})
		require.Equal(t, "true", r.header.Get(replayed))
		require.Equal(t, 1, s.up.Count("dup-200"))
	})

	t.Run("1000 distinct keys at once", func(t *testing.T) {
		const n = 1000
		statuses := s.burst(n, func(i int) call { return call{key: "distinct-" + itoa(i), body: `{"a":1}`} })
		for i := range n {
			require.Equal(t, 200, statuses[i], "key %d", i)
			require.Equal(t, 1, s.up.Count("distinct-"+itoa(i)), "key %d ran once", i)
		}
	})
}

// withMessageTimeoutOfRoute sets ext_proc's message_timeout to the "/" route's timeout, which
// bounds the whole request anyway.
func withMessageTimeoutOfRoute(b *bootstrapv3.Bootstrap) error {
	var timeout *durationpb.Duration
	err := envoyconf.MutateHCM(b, func(hcm *hcmv3.HttpConnectionManager) error {
		for _, vh := range hcm.GetRouteConfig().GetVirtualHosts() {
			for _, r := range vh.GetRoutes() {
				if r.GetMatch().GetPrefix() == "/" {
					timeout = r.GetRoute().GetTimeout()
				}
			}
		}
		if timeout.AsDuration() <= 0 {
			return errors.New(`the "/" route has no timeout`)
		}
		return nil
	})
	if err != nil {
		return err
	}
	return envoyconf.MutateExtProc(b, func(f *filterextproc.ExternalProcessor) { f.MessageTimeout = timeout })
}

func TestSIGKILLedReplicaFreesItsKeyWithinLockTTL(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t, redistest.Options{})
	s := newStack(t, stackOptions{replicas: 2, args: redisArgs(srv), policy: "defaults: {lock_ttl: 2s}"})

	done := make(chan reply, 1)
	go func() {
		r, _ := s.try(call{key: "crash-1", headers: map[string]string{"X-Test-Delay": "3s"}, body: `{}`})
		done <- r
	}()
	require.Eventually(t, func() bool { return s.up.Count("crash-1") == 1 }, 10*time.Second, 5*time.Millisecond)
	var holder, other *processor
	for _, p := range s.procs {
		if _, m := p.admin("/metrics"); metric(m, "idempotency_inflight") == 1 {
			holder = p
		} else {
			other = p
		}
	}
	require.NotNil(t, holder, "one replica holds the lease")
	<-holder.signal(syscall.SIGKILL)
	killed := time.Now()

	// The lease of the dead replica still blocks the key: the other replica answers 409.
	requireProblem(t, s.do(call{key: "crash-1", body: `{}`}), 409, "request-in-progress")
	// The time that counts is when the request that found the key free was sent: how long it
	// then took depends on the other tests' load on two cores.
	var (
		r    reply
		sent time.Duration
	)
	within(t, killed, 2*time.Second+3*time.Second, "the key is free after lock_ttl", func() bool {
		sent = time.Since(killed)
		r = s.do(call{key: "crash-1", body: `{}`})
		return r.status == 200
	})
	require.Equal(t, "false", r.header.Get(replayed))
	t.Logf("key found free by a request sent %v after the kill (lock_ttl 2s)", sent.Round(10*time.Millisecond))
	require.Less(t, sent, 2*time.Second+3*time.Second)
	require.Equal(t, 2, s.up.Count("crash-1"), "the first run's outcome was unknown: the retry ran again (docs/guarantees.md#ambiguous-outcomes)")
	// A request is counted when its stream ends, just after the client has its answer.
	within(t, time.Now(), 5*time.Second, "the other replica served the retry", func() bool {
		_, m := other.admin("/metrics")
		return metric(m, `idempotency_requests_total{outcome="executed",route="default"}`) == 1
	})
	require.NotEqual(t, 200, (<-done).status, "the client of the killed replica's request did not get a success")
}

func TestSIGTERMDuringTraffic(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t, redistest.Options{})
	s := newStack(t, stackOptions{replicas: 2, args: redisArgs(srv), policy: "store_timeout: 1s"})
	victim := s.procs[0]

	out, _ := s.disruptTraffic(t, disruption{
		workers: 8, prefix: "term", headers: map[string]string{"X-Test-Delay": "150ms"}, lead: time.Second,
		disrupt: func() {
			_, before := victim.admin("/metrics")
			require.Positive(t, metric(before, `idempotency_requests_total{outcome="executed",route="default"}`), "the replica took traffic before SIGTERM")
			exited := victim.signal(syscall.SIGTERM)
			termed := time.Now()
			select {
			case <-exited:
			case <-time.After(20 * time.Second):
				t.Fatal("the replica did not exit after draining")
			}
			require.NoError(t, victim.exitErr, "exit status 0 after draining")
			victim.waitLog("stopped", time.Second)
			t.Logf("drained and exited %v after SIGTERM", time.Since(termed).Round(time.Millisecond))
		},
		minAfter: 20, // traffic goes on with one replica
	})

	// Every request succeeded: open streams finished, and new ones, at least minAfter of them
	// sent after the replica left, went to the other replica.
	statuses := requireNeverTwice(t, s.up, out)
	require.Equal(t, len(out), statuses[200], "every request succeeded: %v", statuses)
	// No lease is left behind: every key replays; none answers 409.
	for _, o := range out {
		r := s.do(call{key: o.key, body: `{"amount":1}`})
		require.Equal(t, 200, r.status, "key %s", o.key)
		require.Equal(t, "true", r.header.Get(replayed), "key %s", o.key)
	}
}

func TestRedisRestartUnderLoad(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t, redistest.Options{})
	// store_timeout 1s: after the restart, a loaded machine may take longer than the default
	// 100 ms for a store call, which the requests sent then must not fail on.
	s := newStack(t, stackOptions{replicas: 2, args: redisArgs(srv), policy: "store_timeout: 1s"})

	out, after := s.disruptTraffic(t, disruption{
		workers: 6, prefix: "restart", headers: map[string]string{"X-Test-Delay": "20ms"}, lead: 700 * time.Millisecond,
		disrupt: func() {
			srv.Stop()
			time.Sleep(time.Second)
			srv.Restart()
		},
		settle: 2 * time.Second, minAfter: 20,
	})

	statuses := requireNeverTwice(t, s.up, out)
	t.Logf("statuses %v", statuses)
	require.Positive(t, statuses[503], "the outage was seen")
	require.Positive(t, statuses[200])
	for _, o := range out {
		require.Contains(t, []int{200, 503}, o.status, "key %s: success, or store-unavailable", o.key)
	}
	// It recovers by itself: the requests sent from 2 s after the restart all succeed.
	for _, o := range after {
		require.Equal(t, 200, o.status, "key %s, sent after Redis came back", o.key)
	}
}

// failoverUnderTraffic runs traffic, calls failover in the middle, and checks that no key ran
// twice and that the service works again afterwards.
func failoverUnderTraffic(t *testing.T, s *stack, failover func()) {
	out, after := s.disruptTraffic(t, disruption{
		workers: 4, prefix: "failover", lead: 700 * time.Millisecond, disrupt: failover,
		settle: 1500 * time.Millisecond, minAfter: 20,
	})
	statuses := requireNeverTwice(t, s.up, out)
	t.Logf("statuses %v", statuses)
	for _, o := range after {
		require.Equal(t, 200, o.status, "key %s: the service continues after the failover", o.key)
	}
	r := s.do(call{key: "after-failover", body: `{}`})
	require.Equal(t, 200, r.status)
	require.Equal(t, "true", s.do(call{key: "after-failover", body: `{}`}).header.Get(replayed))
}

func TestRedisClusterFailover(t *testing.T) {
	t.Parallel()
	cl := redistest.StartCluster(t, 3, 1)
	s := newStack(t, stackOptions{args: []string{"--store", "redis", "--redis-cluster-addrs", strings.Join(cl.Addrs(), ",")}, policy: "store_timeout: 500ms"})
	failoverUnderTraffic(t, s, func() {
		cl.FailoverReplicaOf(0) // a manual failover
		cl.Masters()[1].Kill()  // a master dies; its replica takes over
		cl.FailoverReplicaOf(1)
	})
}

func TestRedisSentinelFailover(t *testing.T) {
	t.Parallel()
	sn := redistest.StartSentinel(t)
	s := newStack(t, stackOptions{args: []string{"--store", "redis", "--redis-sentinel-addrs", strings.Join(sn.Addrs(), ","), "--redis-sentinel-master", sn.MasterName()}, policy: "store_timeout: 500ms"})
	failoverUnderTraffic(t, s, sn.Failover)
}

func TestRedisTLSAndACLThroughTheBinary(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t, redistest.Options{TLS: true, ACLUser: "extproc", ACLPassword: "tls-acl-pass"})
	// The binary trusts the test's CA the way any Go program does: SSL_CERT_FILE.
	s := newStack(t, stackOptions{args: redisArgs(srv), env: []string{"SSL_CERT_FILE=" + srv.CAFile()}})
	within(t, time.Now(), 5*time.Second, "ready over TLS", func() bool {
		code, _ := s.procs[0].admin("/readyz")
		return code == 200
	})
	require.Equal(t, "false", s.do(call{key: "tls-1", body: `{}`}).header.Get(replayed))
	require.Equal(t, "true", s.do(call{key: "tls-1", body: `{}`}).header.Get(replayed))
	require.Equal(t, 1, s.up.Count("tls-1"))

	// Without the CA, or with a wrong password, the store is unreachable: fail closed.
	cases := []struct {
		name string
		env  []string
		url  string
	}{
		{"untrusted certificate", nil, srv.URL()},
		{"wrong password", []string{"SSL_CERT_FILE=" + srv.CAFile()}, strings.Replace(srv.URL(), "tls-acl-pass", "wrong", 1)},
	}
	for _, c := range cases {
		p := startListening(t, c.env, "--store", "redis", "--redis-url", c.url)
		p.waitLog("store is unreachable: not serving", 30*time.Second)
		code, body := p.admin("/readyz")
		require.Equal(t, 503, code, c.name)
		require.Contains(t, body, "not ready: store unavailable", c.name)
		require.NotContains(t, p.logs.String(), `"message":"ready"`, "%s: no ready line before the store answers", c.name)
	}
}

func TestOversizedInput(t *testing.T) {
	t.Parallel()
	s := newStack(t, stackOptions{})
	r := s.do(call{key: "big-body", body: string(bytes.Repeat([]byte("x"), 2<<20))})
	require.Equal(t, 413, r.status, "Envoy's buffer limit answers a body over it")
	require.Equal(t, 0, s.up.Count("big-body"))
	requireProblem(t, s.do(call{key: strings.Repeat("k", 300), body: `{}`}), 400, "invalid-idempotency-key")
	requireProblem(t, s.do(call{key: "ttl", headers: map[string]string{"X-TTL": "1e9"}, body: `{}`}), 400, "invalid-ttl")
	r = s.do(call{key: "huge-ttl", headers: map[string]string{"X-TTL": strings.Repeat("9", 4000)}, body: `{}`})
	require.Equal(t, 200, r.status, "a TTL too large to represent is capped at max_ttl")
	big := strings.Repeat("a", 8000)
	r = s.do(call{key: "long-scope", headers: map[string]string{"Authorization": "Bearer " + big}, body: `{}`})
	require.Equal(t, 200, r.status, "long scope values are hashed like any other")
}
