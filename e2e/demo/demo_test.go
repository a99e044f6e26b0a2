package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/envoyconf"
	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/leakcheck"
	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// Every goroutine the demo starts has ended once run returns.
func TestMain(m *testing.M) {
	leakcheck.Main(m)
}

// The shipped files, from this directory.
var shippedArgs = []string{
	"-envoy", "../../envoy/envoy.yaml", "-policy", "../../envoy/policy.yaml",
	// The shipped message_timeout (0.5 s) is for a processor with cores of its own; here the
	// race-enabled processor, emulator, upstream and test share the machine, as in e2e/stack_test.go.
	"-message-timeout", "5s",
}

// wantReply is what one request of the recipe gets.
type wantReply struct {
	status   int
	replayed string // x-idempotency-replayed
	code     string // the problem's code; "" for the upstream's answer
	// execution is the upstream's count for the key, from its answer (a replay carries the count
	// of the execution it replays); 0 for a problem.
	execution int
	// outcome is idempotency= in the request's access-log line.
	outcome string
}

// wantRecipe is what each step of README.md's recipe gets, request by request in the order the
// step writes them.
var wantRecipe = []struct {
	title   string
	replies []wantReply
}{
	{"1. A first execution: the upstream runs", []wantReply{
		{status: 200, replayed: "false", execution: 1, outcome: "executed"},
	}},
	{"2. A replay: same key, same body", []wantReply{
		{status: 200, replayed: "true", execution: 1, outcome: "replayed"},
	}},
	{"3. The same key with another body: 422", []wantReply{
		{status: 422, replayed: "false", code: "idempotency-key-reused", outcome: "mismatch"},
	}},
	{"4. A duplicate while the first still runs: 409", []wantReply{
		{status: 200, replayed: "false", execution: 1, outcome: "executed"},
		{status: 409, replayed: "false", code: "request-in-progress", outcome: "in_progress"},
	}},
	{"5. Another caller with the same key: a record of its own", []wantReply{
		{status: 200, replayed: "false", execution: 2, outcome: "executed"},
	}},
}

// The emulator's access-log line of a request to /v1/payments, in envoy.yaml's format.
var accessLine = regexp.MustCompile(`(?m)^access +\[[0-9T:.Z-]+\] "POST /v1/payments HTTP/1.1" (\d{3}) .* route=default idempotency=(\S+) .*$`)

var (
	upstreamRuns     = regexp.MustCompile(`(?m)^upstream .*: running$`)
	requestsTotal    = regexp.MustCompile(`(?m)^idempotency_requests_total\{outcome="(\w+)",route="default"\} (\d+)$`)
	upstreamAnswered = regexp.MustCompile(`(?m)^upstream .*: answered \d+; executions with this Idempotency-Key: (\d+)$`)
)

// TestRecipe runs README.md's recipe against the demo and checks the outcome of each request:
// its status, replay header and problem code, the upstream's count for its key, and its line in
// the access log.
func TestRecipe(t *testing.T) {
	d := startDemo(t, shippedArgs...)
	require.Contains(t, d.out.String(), "idempotency-extproc over gRPC, memory store, ")
	checkRecipe(t, d)
	d.stop(t)
}

// TestRecipeOnRedis runs the recipe with -redis-url (as IDEMPOTENCY_REDIS_URL=… make demo does):
// the records are in Redis, under a prefix of the run's own, and a second run starts afresh.
func TestRecipeOnRedis(t *testing.T) {
	srv := redistest.Start(t, redistest.Options{Password: "demo-pass"})
	for run := range 2 {
		d := startDemo(t, append(slices.Clone(shippedArgs), "-redis-url", srv.URL())...)
		banner := d.out.String()
		require.Contains(t, banner, "idempotency-extproc over gRPC, Redis (keys under "+demoPrefix)
		require.NotContains(t, banner, "demo-pass")
		checkRecipe(t, d)
		d.stop(t)
		keys, err := srv.Client(t).Keys(t.Context(), "*").Result() // a test's own Redis
		require.NoError(t, err)
		require.NotEmpty(t, keys)
		prefixes := map[string]bool{}
		for _, k := range keys {
			require.True(t, strings.HasPrefix(k, demoPrefix), "%q under the demo's prefix", k)
			prefixes[strings.Join(strings.SplitN(k, ":", 3)[:2], ":")] = true
		}
		require.Len(t, prefixes, run+1, "one prefix per run: %v", keys)
	}
}

// checkRecipe runs the recipe against d and checks every request's outcome.
func checkRecipe(t *testing.T, d *demo) {
	t.Helper()
	banner := d.out.String()
	require.Contains(t, banner, "an emulator of Envoy's ext_proc filter")
	require.Contains(t, banner, "In production the processor runs behind Envoy, Istio or Envoy Gateway")

	steps, err := recipe(readme)
	require.NoError(t, err)
	var titles, wantTitles []string
	for _, st := range steps {
		titles = append(titles, st.title)
		// The banner prints the recipe with the demo's own address.
		for _, c := range st.commands {
			require.Contains(t, banner, strings.ReplaceAll(c, recipeURL, d.url))
		}
	}
	for _, w := range wantRecipe {
		wantTitles = append(wantTitles, w.title)
	}
	require.Equal(t, wantTitles, titles, "README.md's recipe and wantRecipe must list the same steps")

	var all []wantReply
	var first []byte // the first execution's body, which the replay must repeat
	for i, st := range steps {
		replies := d.runStep(t, st)
		want := wantRecipe[i].replies
		require.Len(t, replies, len(want), "step %q", st.title)
		for j, w := range want {
			r := replies[j]
			where := fmt.Sprintf("step %q, request %d: %s", st.title, j+1, r.body)
			require.Equal(t, w.status, r.status, where)
			require.Equal(t, w.replayed, r.header.Get("X-Idempotency-Replayed"), where)
			if w.code != "" {
				require.Equal(t, "application/problem+json", r.header.Get("Content-Type"), where)
				var p struct{ Code string }
				require.NoError(t, json.Unmarshal(r.body, &p), where)
				require.Equal(t, w.code, p.Code, where)
				if w.status == http.StatusConflict {
					require.Equal(t, "1", r.header.Get("Retry-After"), where)
				}
			} else {
				var s struct{ Execution int }
				require.NoError(t, json.Unmarshal(r.body, &s), where)
				require.Equal(t, w.execution, s.Execution, where)
			}
			if first == nil {
				first = r.body
			}
			if w.outcome == "replayed" {
				require.Equal(t, string(first), string(r.body), "a replay repeats the first answer byte for byte")
			}
		}
		all = append(all, want...)
	}

	// One access-log line per request (written once its response has gone out), each with the
	// status and the outcome the processor returned as dynamic metadata.
	logged := d.out.waitFor(t, fmt.Sprintf("%d access-log lines", len(all)), func(s string) bool {
		return len(accessLine.FindAllString(s, -1)) >= len(all)
	})
	var lines []string
	for _, m := range accessLine.FindAllStringSubmatch(logged, -1) {
		lines = append(lines, m[1]+" "+m[2])
	}
	var wantLines []string
	for _, w := range all {
		wantLines = append(wantLines, strconv.Itoa(w.status)+" "+w.outcome)
	}
	require.ElementsMatch(t, wantLines, lines, "access-log lines (status, idempotency=):\n%s", logged)

	// The upstream ran the executed requests only, never a replay or a refused duplicate, and
	// its log line says what its answer said.
	var wantRuns, runs []string
	for _, w := range all {
		if w.outcome == "executed" {
			wantRuns = append(wantRuns, strconv.Itoa(w.execution))
		}
	}
	for _, m := range upstreamAnswered.FindAllStringSubmatch(logged, -1) {
		runs = append(runs, m[1])
	}
	require.ElementsMatch(t, wantRuns, runs, logged)
	require.Len(t, upstreamRuns.FindAllString(logged, -1), len(wantRuns), logged)

	// No line about a request shows its key: the access log has a hash of it, the upstream's
	// lines and the processor's log neither.
	require.NotEmpty(t, d.keys)
	for _, line := range strings.Split(logged, "\n") {
		if strings.HasPrefix(line, "access ") || strings.HasPrefix(line, "upstream ") || strings.HasPrefix(line, "processor ") {
			for _, k := range d.keys {
				require.NotContains(t, line, k)
			}
		}
	}

	// The processor's metrics count the same outcomes.
	outcomes := map[string]int{}
	for _, w := range all {
		outcomes[w.outcome]++
	}
	resp, err := d.client.Get(d.metrics)
	require.NoError(t, err)
	metrics, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	counted := map[string]int{}
	for _, m := range requestsTotal.FindAllStringSubmatch(string(metrics), -1) {
		if n, _ := strconv.Atoi(m[2]); n > 0 {
			counted[m[1]] = n
		}
	}
	require.Equal(t, outcomes, counted, "idempotency_requests_total of route default")
}

// TestStopsWithRequestsInFlight cancels the demo (as Ctrl-C and SIGTERM do through main) while
// the upstream holds a request: run cuts it and returns, every goroutine ended (TestMain).
func TestStopsWithRequestsInFlight(t *testing.T) {
	d := startDemo(t, shippedArgs...)
	got := make(chan error, 1)
	go func() {
		req, err := http.NewRequest(http.MethodPost, d.url+"/v1/payments", strings.NewReader("{}"))
		if err != nil {
			got <- err
			return
		}
		req.Header.Set("Idempotency-Key", "hang-1")
		req.Header.Set("X-Test-Hang", "true")
		resp, err := d.client.Do(req)
		if err == nil {
			_, err = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
		}
		got <- err
	}()
	d.out.waitFor(t, "the upstream running the request", func(s string) bool {
		return upstreamRuns.MatchString(s)
	})
	d.stop(t)
	select {
	case <-got: // an error or a local reply: either way the client is not left waiting
	case <-time.After(10 * time.Second):
		t.Fatal("the client's request still hangs after the demo stopped")
	}
}

func TestRunRejects(t *testing.T) {
	dir := t.TempDir()
	badPolicy := filepath.Join(dir, "policy.yaml")
	require.NoError(t, os.WriteFile(badPolicy, []byte("defaults:\n  ttl: soon\n"), 0o600))
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer taken.Close()

	for _, tc := range []struct {
		name string
		args []string
		want []string // in the error
	}{
		{"listen beyond loopback", []string{"-listen", "0.0.0.0:10000"}, []string{"-listen", `"0.0.0.0:10000"`, "loopback"}},
		{"upstream beyond loopback", []string{"-upstream", "192.0.2.1:80"}, []string{"-upstream", "loopback"}},
		{"address without port", []string{"-metrics", "127.0.0.1"}, []string{"-metrics", "host:port"}},
		{"argument", []string{"extra"}, []string{"unexpected arguments", "extra"}},
		{"unknown flag", []string{"-store", "redis"}, []string{"flag provided but not defined: -store"}},
		{"missing envoy file", []string{"-envoy", filepath.Join(dir, "none.yaml")}, []string{"none.yaml", "no such file", "from the repository root, or give the file with -envoy"}},
		{"missing policy file", []string{"-envoy", "../../envoy/envoy.yaml"}, []string{"envoy/policy.yaml", "no such file", "-policy"}},
		{"bad policy", []string{"-envoy", "../../envoy/envoy.yaml", "-policy", badPolicy}, []string{"policy file " + badPolicy, "defaults.ttl", "line 2"}},
		{"port taken", append([]string{"-listen", taken.Addr().String()}, shippedArgs...), []string{"-listen " + taken.Addr().String(), "address already in use"}},
		{"redis not answering", append([]string{"-redis-url", "redis://:secret-pass@" + taken.Addr().String() + "/0"}, shippedArgs...), []string{"-redis-url: Redis does not answer"}},
		{"redis url", append([]string{"-redis-url", "http://localhost/"}, shippedArgs...), []string{"-redis-url", "invalid URL scheme"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out strings.Builder
			err := run(context.Background(), tc.args, &out)
			require.Error(t, err)
			for _, w := range tc.want {
				require.Contains(t, err.Error(), w)
			}
			require.NotContains(t, err.Error(), "secret-pass")
		})
	}
}

func TestHelp(t *testing.T) {
	var out strings.Builder
	require.NoError(t, run(context.Background(), []string{"-h"}, &out))
	require.Contains(t, out.String(), "-listen")
	require.Contains(t, out.String(), "127.0.0.1:10000")
}

func TestRecipeParse(t *testing.T) {
	for _, tc := range []struct {
		name, md string
		want     []step
		err      string
	}{
		{"steps", "# x\n```sh\nnot a step\n```\n## The recipe\ntext\n### 1. a\n```sh\ncurl a\n\ncurl b &\n```\n```text\nout\n```\n### 2. b\n```sh\nwait\n```\n## Later\n### 3. c\n```sh\nnot a step\n```\n",
			[]step{{"1. a", []string{"curl a", "curl b &"}}, {"2. b", []string{"wait"}}}, ""},
		{"no steps", "## The recipe\ntext\n", nil, `no steps: "### " headings under "## The recipe"`},
		{"step without sh", "## The recipe\n### 1. a\n```text\nx\n```\n", nil, `step "1. a" has no sh block`},
		{"two sh blocks", "## The recipe\n### 1. a\n```sh\nx\n```\n```sh\ny\n```\n", nil, `line 6: step "1. a" has a second sh block`},
		{"unclosed", "## The recipe\n### 1. a\n```sh\nx\n", nil, "line 3: code block not closed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := recipe(tc.md)
			if tc.err != "" {
				require.EqualError(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

// TestAccessLogLine renders records with envoy.yaml's access-log format.
func TestAccessLogLine(t *testing.T) {
	b, err := envoyconf.Load("../../envoy/envoy.yaml")
	require.NoError(t, err)
	format, err := accessLogFormat(b, "idempotency")
	require.NoError(t, err)
	md, err := structpb.NewStruct(map[string]any{"outcome": "replayed", "route": "default", "key_hash": "ab12", "replayed": true})
	require.NoError(t, err)
	end := time.Date(2026, 1, 2, 3, 4, 5, 600e6, time.UTC)

	for _, tc := range []struct {
		name string
		rec  proxy.Record
		want string
	}{
		{"replay", proxy.Record{RequestID: "id-1", Method: "POST", Path: "/v1/payments", Route: "default", Status: 200,
			CodeDetails: "idempotency_replayed", ResponseFlags: "-", DynamicMetadata: map[string]*structpb.Struct{"idempotency": md}, Duration: 1500 * time.Microsecond},
			`[2026-01-02T03:04:05.598Z] "POST /v1/payments HTTP/1.1" 200 - idempotency_replayed - - 1 "id-1" "-" route=default idempotency=replayed policy_route=default key_hash=ab12 replayed=true release_reason=-` + "\n"},
		{"upstream, no metadata", proxy.Record{RequestID: "id-2", Method: "GET", Path: "/healthz", Route: "healthz", Status: 200,
			CodeDetails: "via_upstream", ResponseFlags: "-", Attempts: 1, Duration: 20 * time.Millisecond},
			`[2026-01-02T03:04:05.580Z] "GET /healthz HTTP/1.1" 200 - via_upstream - - 20 "id-2" "127.0.0.1:8080" route=healthz idempotency=- policy_route=- key_hash=- replayed=- release_reason=-` + "\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, format.line(tc.rec, "127.0.0.1:8080", end))
		})
	}
}

// demo is a running demo.
type demo struct {
	url     string
	metrics string   // the processor's /metrics
	keys    []string // the Idempotency-Keys sent
	out     *output
	client  *http.Client
	cancel  context.CancelFunc
	done    chan error
}

// startDemo runs the demo on free loopback ports and waits for its banner.
func startDemo(t *testing.T, args ...string) *demo {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	tr := &http.Transport{DisableCompression: true}
	d := &demo{out: newOutput(), client: &http.Client{Transport: tr}, cancel: cancel, done: make(chan error, 1)}
	go func() { d.done <- run(ctx, append([]string{"-listen", "127.0.0.1:0"}, args...), d.out) }()
	t.Cleanup(func() {
		cancel()
		tr.CloseIdleConnections()
		if t.Failed() {
			t.Logf("demo output:\n%s", d.out.String())
		}
	})
	started := regexp.MustCompile(`Send requests to (http://\S+)\. `)
	s := d.out.waitFor(t, "the banner", started.MatchString)
	d.url = started.FindStringSubmatch(s)[1]
	d.metrics = regexp.MustCompile(`(?m)^  metrics +(http://\S+)$`).FindStringSubmatch(s)[1]
	return d
}

// stop cancels the demo and waits for run to return.
func (d *demo) stop(t *testing.T) {
	t.Helper()
	d.cancel()
	select {
	case err := <-d.done:
		require.NoError(t, err)
	case <-time.After(15 * time.Second):
		t.Fatal("run did not return after its context was cancelled")
	}
	d.client.CloseIdleConnections()
	require.True(t, strings.HasSuffix(d.out.String(), "stopped\n"), "the last line says it stopped")
}

// reply is what curl printed for one request.
type reply struct {
	status int
	header http.Header
	body   []byte
}

// runStep runs a step's shell lines as a shell would: curl in the foreground or, with a trailing
// &, in the background; wait joins the background ones. The test does not sleep: in place of the
// step's sleep it waits until the upstream runs the request it sent to the background, which is
// what the sleep is for.
func (d *demo) runStep(t *testing.T, st step) []reply {
	t.Helper()
	type sent struct {
		line  string
		reply reply
		err   error
	}
	var (
		requests []*sent
		bg       sync.WaitGroup
		waited   = true
	)
	for _, line := range st.commands {
		words, err := shellWords(line)
		require.NoError(t, err, line)
		if len(words) == 0 || strings.HasPrefix(words[0], "#") {
			continue
		}
		switch words[0] {
		case "curl":
			background := words[len(words)-1] == "&"
			if background {
				words = words[:len(words)-1]
			}
			req, err := curlRequest(words[1:], d.url)
			require.NoError(t, err, line)
			if k := req.Header.Get("Idempotency-Key"); k != "" {
				d.keys = append(d.keys, k)
			}
			s := &sent{line: line}
			requests = append(requests, s)
			if !background {
				s.reply, s.err = d.do(req)
				require.NoError(t, s.err, line)
				continue
			}
			runs := len(upstreamRuns.FindAllString(d.out.String(), -1))
			waited = false
			bg.Go(func() { s.reply, s.err = d.do(req) })
			d.out.waitFor(t, "upstream run of "+line, func(s string) bool {
				return len(upstreamRuns.FindAllString(s, -1)) > runs
			})
		case "sleep":
		case "wait":
			bg.Wait()
			waited = true
		default:
			t.Fatalf("step %q: the test runs curl, sleep and wait, not %q", st.title, line)
		}
	}
	require.True(t, waited, "step %q leaves a request in the background: end it with wait", st.title)
	var replies []reply
	for _, s := range requests {
		require.NoError(t, s.err, s.line)
		replies = append(replies, s.reply)
	}
	return replies
}

func (d *demo) do(req *http.Request) (reply, error) {
	resp, err := d.client.Do(req)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return reply{status: resp.StatusCode, header: resp.Header, body: body}, err
}

// curlRequest builds the request of curl's arguments args, for the options the recipe uses: -s,
// -i (and -si), -X, -H, -d and one URL, whose http://127.0.0.1:10000 becomes base. As curl does,
// -d makes a POST with Content-Type application/x-www-form-urlencoded unless -H sets one.
func curlRequest(args []string, base string) (*http.Request, error) {
	var (
		method, url string
		headers     [][2]string
		body        *string
	)
	for i := 0; i < len(args); i++ {
		a := args[i]
		value := func() (string, error) {
			if i+1 >= len(args) {
				return "", fmt.Errorf("curl %s needs a value", a)
			}
			i++
			return args[i], nil
		}
		switch {
		case a == "-s" || a == "-i" || a == "-si" || a == "-is":
		case a == "-X":
			v, err := value()
			if err != nil {
				return nil, err
			}
			method = v
		case a == "-H":
			v, err := value()
			if err != nil {
				return nil, err
			}
			name, val, ok := strings.Cut(v, ":")
			if !ok {
				return nil, fmt.Errorf("curl -H %q is not Name: value", v)
			}
			headers = append(headers, [2]string{name, strings.TrimSpace(val)})
		case a == "-d" || a == "--data":
			v, err := value()
			if err != nil {
				return nil, err
			}
			body = &v
		case strings.HasPrefix(a, "-"):
			return nil, fmt.Errorf("curl option %s is not one the test knows", a)
		case url != "":
			return nil, fmt.Errorf("curl with two URLs: %s and %s", url, a)
		default:
			url = a
		}
	}
	rest, ok := strings.CutPrefix(url, recipeURL)
	if !ok {
		return nil, fmt.Errorf("curl URL %q does not start with %s", url, recipeURL)
	}
	if method == "" {
		method = http.MethodGet
		if body != nil {
			method = http.MethodPost
		}
	}
	var r io.Reader
	if body != nil {
		r = strings.NewReader(*body)
	}
	req, err := http.NewRequest(method, base+rest, r)
	if err != nil {
		return nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	for _, h := range headers {
		req.Header.Set(h[0], h[1])
	}
	return req, nil
}

// shellWords splits a line as a POSIX shell would for the recipe's needs: words separated by
// blanks, 'single-quoted' and "double-quoted" parts (with \" and \\ inside), and & as a word of
// its own at the end.
func shellWords(line string) ([]string, error) {
	var (
		words []string
		cur   strings.Builder
		in    bool // inside a word
	)
	for i := 0; i < len(line); i++ {
		c := line[i]
		switch {
		case c == ' ' || c == '\t':
			if in {
				words, in = append(words, cur.String()), false
				cur.Reset()
			}
		case c == '\'':
			end := strings.IndexByte(line[i+1:], '\'')
			if end < 0 {
				return nil, errors.New("unclosed '")
			}
			cur.WriteString(line[i+1 : i+1+end])
			i, in = i+1+end, true
		case c == '"':
			in = true
			for i++; ; i++ {
				if i >= len(line) {
					return nil, errors.New(`unclosed "`)
				}
				if line[i] == '\\' && i+1 < len(line) && (line[i+1] == '"' || line[i+1] == '\\') {
					i++
				} else if line[i] == '"' {
					break
				}
				cur.WriteByte(line[i])
			}
		case c == '&' && !in && strings.TrimSpace(line[i+1:]) == "":
			words = append(words, "&")
			return words, nil
		default:
			cur.WriteByte(c)
			in = true
		}
	}
	if in {
		words = append(words, cur.String())
	}
	return words, nil
}

func TestShellWords(t *testing.T) {
	for _, tc := range []struct {
		line string
		want []string
		err  string
	}{
		{`curl -si http://x/a -H 'Idempotency-Key: k 1' -d '{"amount": 1}' &`, []string{"curl", "-si", "http://x/a", "-H", "Idempotency-Key: k 1", "-d", `{"amount": 1}`, "&"}, ""},
		{`a "b \"c\" d"e  f`, []string{"a", `b "c" de`, "f"}, ""},
		{`a&b`, []string{"a&b"}, ""},
		{`a 'b`, nil, "unclosed '"},
		{`a "b`, nil, `unclosed "`},
	} {
		got, err := shellWords(tc.line)
		if tc.err != "" {
			require.EqualError(t, err, tc.err, tc.line)
			continue
		}
		require.NoError(t, err, tc.line)
		require.Equal(t, tc.want, got, tc.line)
	}
}

// output collects what run prints and wakes whoever waits for a line.
type output struct {
	mu      sync.Mutex
	buf     strings.Builder
	changed chan struct{} // closed at the next write
}

func newOutput() *output { return &output{changed: make(chan struct{})} }

func (o *output) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.buf.Write(p)
	close(o.changed)
	o.changed = make(chan struct{})
	return len(p), nil
}

func (o *output) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.buf.String()
}

// waitFor returns the output once ok accepts it, or fails t after 30 s.
func (o *output) waitFor(t *testing.T, what string, ok func(string) bool) string {
	t.Helper()
	deadline := time.After(30 * time.Second)
	for {
		o.mu.Lock()
		s, changed := o.buf.String(), o.changed
		o.mu.Unlock()
		if ok(s) {
			return s
		}
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("no %s in the demo's output after 30s:\n%s", what, s)
		}
	}
}
