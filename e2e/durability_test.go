package e2e_test

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// The figure of durability: duplicate traffic on fresh keys through the binary, the Redis master
// SIGKILLed while its replicas lag behind it, and each key's executions counted at the upstream
// once a replica has taken over and every key has been sent again. A key none of whose requests
// got an answer other than 503 (the store was away) is sent again after figurePause, as a client
// retries a 503, so that the traffic goes on, on the keys it has, through an outage of any length.
// With durability.replicas: 1
// no key runs twice: a claim no replica holds is refused before the request runs. With
// replicas: 0 the writes the replicas had not received when the master died are lost, and the
// keys they claimed or completed run again: the test reports how many.
//
// The lag is made, not waited for: the replicas' links to the master are cut for lagFor before
// the master dies (cut), while the replicas keep answering everything else, so that the Sentinels
// and the Cluster still count them fit to take over. Whatever the master wrote meanwhile is lost
// with it, whichever replica takes over.

const (
	figureSeed    = 20261204
	figureWorkers = 6
	// figurePause: how long a worker waits before sending again a key that got only 503s. Shorter
	// than the Retry-After a client would honour, so that the service's return is seen within it.
	figurePause = 50 * time.Millisecond
	// figureBodyBytes: completions large enough to take the staged path of the Redis store.
	figureBodyBytes = 8 << 10
	figureLead      = time.Second // traffic before the lag
	lagFor          = time.Second // the replicas' lag when the master dies
	// figurePolicy: the wait for replicas is short, so that claims refused during the lag do not
	// hold the batcher for long; lock_ttl outlasts the test, so that a lease whose completion was
	// lost is not taken for a free key.
	figurePolicy       = "store_timeout: %v\ndurability: {replicas: %d, timeout: 100ms}\ndefaults:\n  lock_ttl: 60s\n"
	figureStoreTimeout = 500 * time.Millisecond
	// restoreWithin bounds the wait for a request to run once a replica has taken over: the
	// processor's next store call to the dead master fails within store_timeout and has go-redis
	// reload the slot map or ask the Sentinels, within its dial and read timeouts (5 s and 3 s,
	// its defaults), and the call after it goes to the new master. Three times that, for a
	// loaded machine; a run ends as soon as a request has run.
	restoreWithin = 3 * (2*figureStoreTimeout + 5*time.Second + 3*time.Second)
)

// figure is one run: a store, how to make its replicas lag, and how to fail its master over.
type figure struct {
	replicas int      // durability.replicas
	args     []string // the processor's store flags
	// lag makes the replicas that may take over lag and returns what lets them catch up.
	lag      func() (catchUp func())
	kill     func() // SIGKILLs the master
	failover func() // returns once a replica has taken over
	// policy is added to the defaults of figurePolicy.
	policy string
}

// figureKey is the idempotency key of a figure's i-th key.
func figureKey(i int) string { return "fig-" + itoa(i) }

// figureDups is how many concurrent duplicates of its i-th key a figure sends: 1 to 3, the same
// in every run.
func figureDups(i int) int { return 1 + rand.New(rand.NewPCG(figureSeed, uint64(i))).IntN(3) }

// figureResult is what a run saw.
type figureResult struct {
	// keys were sent, lagged of them first while the replicas lagged; doubles ran twice.
	keys, lagged, doubles int
	// failover is from the master's death to the failover's end; restored, to the first request
	// sent after the death that ran.
	failover, restored time.Duration
	first, second      map[int]int // statuses of the traffic, and of the keys sent again
	unconfirmed        [2]float64  // idempotency_durability_unconfirmed_total, claim and complete
	// unmet counts the requests refused without a store call because the readiness check had
	// counted fewer replicas than durability.replicas (outcome durability_unmet).
	unmet float64
}

func (r figureResult) String() string {
	return fmt.Sprintf("%d keys, %d of them first sent while the replicas lagged; %d ran twice; failover took %v, service restored %v after the kill; statuses %v, sent again %v; unconfirmed claims %v, completions %v; refused for missing replicas %v",
		r.keys, r.lagged, r.doubles, r.failover.Round(time.Millisecond), r.restored.Round(time.Millisecond), r.first, r.second, r.unconfirmed[0], r.unconfirmed[1], r.unmet)
}

// cut returns a figure's lag for the replicas of master: it cuts their links and keeps them from
// coming back (a wrong masterauth, refused by a master without passwords), and what it returns
// lets them follow a master again.
func cut(t *testing.T, master *redistest.Server, replicas []*redistest.Server) func() func() {
	return func() func() {
		for _, r := range replicas {
			require.NoError(t, r.Client(t).ConfigSet(t.Context(), "masterauth", "no-such-password").Err())
		}
		require.NoError(t, master.Client(t).Do(t.Context(), "client", "kill", "type", "replica").Err())
		return func() {
			for _, r := range replicas {
				require.NoError(t, r.Client(t).ConfigSet(t.Context(), "masterauth", "").Err())
			}
		}
	}
}

func (f figure) run(t *testing.T) figureResult {
	t.Helper()
	s := newStack(t, stackOptions{args: f.args, policy: fmt.Sprintf(figurePolicy, figureStoreTimeout, f.replicas) + f.policy})
	key := figureKey
	headers := map[string]string{"X-Test-Body-Bytes": itoa(figureBodyBytes), "X-Test-Delay": "5ms"}

	var (
		mu       sync.Mutex
		res      = figureResult{first: map[int]int{}, second: map[int]int{}}
		killedAt time.Time
		next     int
		stop     = make(chan struct{})
		wg       sync.WaitGroup
	)
	stopped := func() bool {
		select {
		case <-stop:
			return true
		default:
			return false
		}
	}
	take := func() (int, bool) {
		mu.Lock()
		defer mu.Unlock()
		if stopped() {
			return 0, false
		}
		next++
		return next - 1, true
	}
	// send sends key i's duplicates at once and reports whether any got an answer but 503.
	send := func(i int) (answered bool) {
		var each sync.WaitGroup
		for range figureDups(i) {
			each.Go(func() {
				sent := time.Now()
				r, err := s.try(call{key: key(i), headers: headers, body: `{"amount":1}`})
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					res.first[0]++
					return
				}
				res.first[r.status]++
				answered = answered || r.status != 503
				if !killedAt.IsZero() && sent.After(killedAt) && r.status == 200 && r.header.Get(replayed) == "false" && res.restored == 0 {
					res.restored = time.Since(killedAt)
				}
			})
		}
		each.Wait()
		return answered
	}
	for range figureWorkers {
		wg.Go(func() {
			for {
				i, ok := take()
				if !ok {
					return
				}
				for !send(i) && !stopped() {
					time.Sleep(figurePause)
				}
			}
		})
	}

	time.Sleep(figureLead)
	mu.Lock()
	lagFrom := next
	mu.Unlock()
	catchUp := f.lag()
	time.Sleep(lagFor)
	f.kill()
	mu.Lock()
	killedAt = time.Now()
	lagTo := next
	mu.Unlock()
	catchUp()
	f.failover()
	res.failover = time.Since(killedAt)
	// Traffic goes on until a request sent after the kill has run, or for restoreWithin.
	deadline := time.Now().Add(restoreWithin)
	for {
		mu.Lock()
		restored := res.restored
		mu.Unlock()
		if restored > 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	res.keys = next
	require.Positive(t, res.restored, "a request sent after the failover ran within %v: %v", restoreWithin, res.first)

	// Every key once more, after the failover: a key whose record was lost runs again. A store
	// failure is tried again, for a while: the request did not run.
	jobs := make(chan int)
	for range figureWorkers {
		wg.Go(func() {
			for i := range jobs {
				var r reply
				var err error
				for try := 0; try < 50; try++ {
					r, err = s.try(call{key: key(i), headers: headers, body: `{"amount":1}`})
					if err == nil && !(r.status == 503 && (r.problemCode() == "store-unavailable" || r.problemCode() == "durability-unmet")) {
						break
					}
					time.Sleep(100 * time.Millisecond)
				}
				mu.Lock()
				if err != nil {
					res.second[0]++
				} else {
					res.second[r.status]++
				}
				mu.Unlock()
			}
		})
	}
	for i := range res.keys {
		jobs <- i
	}
	close(jobs)
	wg.Wait()

	res.lagged = lagTo - lagFrom
	for i := range res.keys {
		if s.up.Count(key(i)) > 1 {
			res.doubles++
		}
	}
	_, m := s.procs[0].admin("/metrics")
	res.unconfirmed = [2]float64{
		metric(m, `idempotency_durability_unconfirmed_total{op="claim"}`),
		metric(m, `idempotency_durability_unconfirmed_total{op="complete"}`),
	}
	res.unmet = metric(m, `idempotency_requests_total{outcome="durability_unmet",route="default"}`)
	return res
}

// check holds a run to the promise: none of its keys ran twice with replicas: 1. With replicas:
// 0 it only reports the window.
func (f figure) check(t *testing.T, res figureResult) {
	t.Helper()
	t.Logf("durability.replicas: %d: %v", f.replicas, res)
	if f.replicas == 0 {
		return
	}
	require.Zero(t, res.doubles, "with durability.replicas: %d no key runs twice", f.replicas)
	// Claims are refused for the lag: by WAIT, or, once the readiness check has counted the
	// replicas gone, before any store call (durability-unmet).
	require.Positive(t, res.unconfirmed[0]+res.unmet, "the lag was seen: claims were refused")
}

// TestDurabilityFailoverSentinel runs the figure on a Sentinel-managed master with two replicas:
// the Sentinels promote the one with the most writes.
func TestDurabilityFailoverSentinel(t *testing.T) {
	t.Parallel()
	for _, replicas := range []int{0, 1} {
		t.Run(fmt.Sprintf("replicas=%d", replicas), func(t *testing.T) {
			t.Parallel()
			sn := redistest.StartSentinelReplicas(t, 2)
			master := sn.Master()
			f := figure{
				replicas: replicas,
				args:     []string{"--store", "redis", "--redis-sentinel-addrs", strings.Join(sn.Addrs(), ","), "--redis-sentinel-master", sn.MasterName()},
				lag:      cut(t, master, sn.Replicas()),
				kill:     master.Kill,
				failover: sn.Failover,
			}
			f.check(t, f.run(t))
		})
	}
}

// TestDurabilityFailoverCluster runs the figure on Redis Cluster, three masters with two replicas
// each: the replicas of the shard that holds the figure's keys lag, its master dies, and Redis
// promotes one of them on its own (the one with the most writes stands first). The stored keys
// are hashes, spread over every shard; a key_prefix with a hash tag puts them all on one.
func TestDurabilityFailoverCluster(t *testing.T) {
	t.Parallel()
	for _, replicas := range []int{0, 1} {
		t.Run(fmt.Sprintf("replicas=%d", replicas), func(t *testing.T) {
			t.Parallel()
			cl := redistest.StartCluster(t, 3, 2)
			slot, err := cl.Masters()[0].Client(t).ClusterKeySlot(t.Context(), "{fig}").Result()
			require.NoError(t, err)
			shard := int(slot) * 3 / 16384 // StartCluster gives shard i the i-th third of the slots
			master := cl.Masters()[shard]
			f := figure{
				replicas: replicas,
				args:     []string{"--store", "redis", "--redis-cluster-addrs", strings.Join(cl.Addrs(), ",")},
				policy:   "  key_prefix: 'idempotency:{fig}:'\n",
				lag:      cut(t, master, cl.Replicas()[2*shard:2*shard+2]),
				kill:     master.Kill,
				failover: func() { cl.AwaitFailoverOf(shard) },
			}
			f.check(t, f.run(t))
		})
	}
}
