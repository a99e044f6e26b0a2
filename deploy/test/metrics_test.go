package deploytest

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/envoyconf"
	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
	"github.com/idempotency-extproc/idempotency-extproc/e2e/upstream"
)

const (
	dashboardFile = chartDir + "/files/grafana-dashboard.json"
	alertsFile    = chartDir + "/files/prometheus-alerts.yaml"
)

// query is one PromQL expression and where it comes from.
type query struct {
	where, expr string
}

// grafanaVars are the interval variables Grafana substitutes before a query reaches Prometheus.
var grafanaVars = strings.NewReplacer("$__rate_interval", "5m", "$__interval", "1m", "$__range", "1h")

// labelValues matches Grafana's label_values(selector, label) variable query.
var labelValuesPrefix = "label_values("

// dashboard is the part of the Grafana dashboard model the tests read.
type dashboard struct {
	UID        string  `json:"uid"`
	Panels     []panel `json:"panels"`
	Templating struct {
		List []struct {
			Name  string `json:"name"`
			Type  string `json:"type"`
			Query any    `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

type panel struct {
	ID         int    `json:"id"`
	Type       string `json:"type"`
	Title      string `json:"title"`
	Datasource *struct {
		UID string `json:"uid"`
	} `json:"datasource"`
	GridPos struct{ H, W, X, Y int } `json:"gridPos"`
	Targets []struct {
		Expr  string `json:"expr"`
		RefID string `json:"refId"`
	} `json:"targets"`
	Panels []panel `json:"panels"` // a collapsed row's panels
}

func readDashboard(t *testing.T) dashboard {
	t.Helper()
	data, err := os.ReadFile(dashboardFile)
	require.NoError(t, err)
	var d dashboard
	require.NoError(t, json.Unmarshal(data, &d))
	return d
}

// dashboardQueries returns every PromQL expression of the dashboard: each target's, and the
// selector of each label_values variable query.
func dashboardQueries(t *testing.T) []query {
	t.Helper()
	d := readDashboard(t)
	var qs []query
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			for _, tg := range p.Targets {
				qs = append(qs, query{fmt.Sprintf("dashboard panel %q target %s", p.Title, tg.RefID), grafanaVars.Replace(tg.Expr)})
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		q, _ := v.Query.(string)
		if m, ok := v.Query.(map[string]any); ok {
			q, _ = m["query"].(string)
		}
		inner, ok := strings.CutPrefix(q, labelValuesPrefix)
		require.True(t, ok, "variable %s: only label_values(selector, label) queries are checked, got %q", v.Name, q)
		i := strings.LastIndex(inner, ",")
		require.Positive(t, i, "variable %s: %q", v.Name, q)
		qs = append(qs, query{"dashboard variable " + v.Name, inner[:i]})
	}
	return qs
}

// readAlerts decodes the rule file strictly into the Prometheus Operator's PrometheusRuleSpec,
// the same groups a plain Prometheus loads.
func readAlerts(t *testing.T) monitoringv1.PrometheusRuleSpec {
	t.Helper()
	data, err := os.ReadFile(alertsFile)
	require.NoError(t, err)
	js, err := yaml.YAMLToJSONStrict(data)
	require.NoError(t, err)
	var spec monitoringv1.PrometheusRuleSpec
	require.NoError(t, strict(js, &spec))
	return spec
}

func alertQueries(t *testing.T) []query {
	t.Helper()
	var qs []query
	for _, g := range readAlerts(t).Groups {
		for _, r := range g.Rules {
			qs = append(qs, query{"alert " + r.Alert, r.Expr.String()})
		}
	}
	return qs
}

// metricNames returns the metric names an expression selects. A selector without a plain name
// (a regex on __name__) is an error: its metrics could not be checked.
func metricNames(expr string) ([]string, error) {
	ast, err := parser.NewParser(parser.Options{}).ParseExpr(expr)
	if err != nil {
		return nil, err
	}
	var names []string
	var errs []error
	parser.Inspect(ast, func(n parser.Node, _ []parser.Node) error {
		vs, ok := n.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		name := vs.Name
		for _, m := range vs.LabelMatchers {
			if m.Name == model.MetricNameLabel {
				if m.Type != labels.MatchEqual {
					errs = append(errs, fmt.Errorf("selector %s matches __name__ with %s", vs, m.Type))
				}
				name = m.Value
			}
		}
		if name == "" {
			errs = append(errs, fmt.Errorf("selector %s has no metric name", vs))
		}
		names = append(names, name)
		return nil
	})
	return names, errors.Join(errs...)
}

// Every expression of the dashboard and of the alerting rules parses, and selects metrics by name.
func TestQueriesParse(t *testing.T) {
	qs := append(dashboardQueries(t), alertQueries(t)...)
	require.Greater(t, len(qs), 20)
	for _, q := range qs {
		names, err := metricNames(q.expr)
		require.NoError(t, err, "%s: %s", q.where, q.expr)
		require.NotEmpty(t, names, "%s: %s", q.where, q.expr)
	}
}

// The expression checks catch what they should.
func TestMetricNames(t *testing.T) {
	names, err := metricNames(`histogram_quantile(0.99, sum by (le) (rate(a_bucket{job="x"}[5m]))) / on() b or {__name__="c"}`)
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"a_bucket", "b", "c"}, names)
	_, err = metricNames(`rate(a[$__rate_interval])`)
	require.Error(t, err, "an unsubstituted Grafana variable is not PromQL")
	_, err = metricNames(`{__name__=~"idempotency_.*"}`)
	require.ErrorContains(t, err, "matches __name__")
	_, err = metricNames(`sum(rate(a[5m])`)
	require.Error(t, err)
}

// The dashboard is well formed: unique panel ids, every panel on the dashboard's data source
// variable, inside Grafana's 24 columns.
func TestDashboardModel(t *testing.T) {
	d := readDashboard(t)
	require.Equal(t, "idempotency-extproc", d.UID)
	ids := map[int]bool{}
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			require.False(t, ids[p.ID], "panel id %d used twice", p.ID)
			ids[p.ID] = true
			require.LessOrEqual(t, p.GridPos.X+p.GridPos.W, 24, "panel %q", p.Title)
			if p.Type != "row" {
				require.NotNil(t, p.Datasource, "panel %q", p.Title)
				require.Equal(t, "${datasource}", p.Datasource.UID, "panel %q", p.Title)
				require.NotEmpty(t, p.Targets, "panel %q", p.Title)
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
}

// Each alert has a severity, a summary, a description and a runbook, whose paragraph exists in
// the README text (docs/notes/deploy.md until it is placed in README.md).
func TestAlertsHaveRunbooks(t *testing.T) {
	var docs []byte
	for _, p := range []string{"README.md", "docs/notes/deploy.md"} {
		data, err := os.ReadFile(filepath.Join(repoRoot, p))
		if err == nil {
			docs = append(docs, data...)
		}
	}
	spec := readAlerts(t)
	require.Len(t, spec.Groups, 1)
	seen := map[string]bool{}
	for _, r := range spec.Groups[0].Rules {
		require.NotEmpty(t, r.Alert)
		require.False(t, seen[r.Alert], "alert %s twice", r.Alert)
		seen[r.Alert] = true
		require.Contains(t, []string{"warning", "critical"}, r.Labels["severity"], r.Alert)
		require.NotEmpty(t, r.Annotations["summary"], r.Alert)
		require.NotEmpty(t, r.Annotations["description"], r.Alert)
		anchor := strings.ToLower(r.Alert)
		require.True(t, strings.HasSuffix(r.Annotations["runbook_url"], "#"+anchor), "%s runbook_url %s", r.Alert, r.Annotations["runbook_url"])
		require.True(t, bytes.Contains(docs, []byte("\n#### "+r.Alert+"\n")), "no runbook paragraph (#### %s) in README.md or docs/notes/deploy.md", r.Alert)
		if r.For != nil {
			_, err := model.ParseDuration(string(*r.For))
			require.NoError(t, err, r.Alert)
		}
	}
	for _, want := range []string{"IdempotencyStoreErrors", "IdempotencyStoreLatencyHigh", "IdempotencyFailOpenTraffic",
		"IdempotencyEnvoyMisconfigured", "IdempotencyNoReadyReplicas"} {
		require.True(t, seen[want], "alert %s", want)
	}

	// The chart's PrometheusRule carries the same groups.
	r := renderSet(t, "redis-full")
	pr := the[*monitoringv1.PrometheusRule](t, r, "monitoring.coreos.com/v1/PrometheusRule")
	require.Equal(t, spec, pr.Spec)
	// And its dashboard ConfigMap the same JSON.
	raw, err := os.ReadFile(dashboardFile)
	require.NoError(t, err)
	var found bool
	for _, cm := range find[*corev1.ConfigMap](r.objs, "v1/ConfigMap") {
		if data, ok := cm.Data["idempotency-extproc.json"]; ok {
			require.JSONEq(t, string(raw), data)
			require.Equal(t, "1", cm.Labels["grafana_dashboard"])
			found = true
		}
	}
	require.True(t, found, "no dashboard ConfigMap")
}

// exposedNames scrapes /metrics and returns the names a query can select: each family's name,
// and for histograms and summaries the _bucket, _sum and _count series.
func exposedNames(t *testing.T, adminAddr string) map[string]bool {
	t.Helper()
	resp, err := http.Get("http://" + adminAddr + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	tp := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := tp.TextToMetricFamilies(resp.Body)
	require.NoError(t, err)
	names := map[string]bool{}
	for name, f := range fams {
		switch f.GetType() {
		case dto.MetricType_HISTOGRAM, dto.MetricType_GAUGE_HISTOGRAM:
			names[name+"_bucket"], names[name+"_sum"], names[name+"_count"] = true, true, true
		case dto.MetricType_SUMMARY:
			names[name], names[name+"_sum"], names[name+"_count"] = true, true, true
		default:
			names[name] = true
		}
	}
	return names
}

// Every metric the dashboard and the alerting rules name is on the /metrics of the binary,
// started with the arguments and the policy the chart renders for the memory store, after
// traffic that gives every labelled family a series.
func TestQueriedMetricsExist(t *testing.T) {
	r := renderSet(t, "memory")
	_, c := r.deployment(t)
	var policyYAML string
	for _, cm := range find[*corev1.ConfigMap](r.objs, "v1/ConfigMap") {
		policyYAML = cm.Data["policy.yaml"]
	}
	// The records API's series exist once it is on (the chart turns it on with an admin token
	// Secret, which the memory set leaves off).
	token := filepath.Join(t.TempDir(), "admin-token")
	require.NoError(t, os.WriteFile(token, []byte("metrics-test-token\n"), 0o600))
	proc := startBinary(t, append(slices.Clone(c.Args), "--admin-token-file="+token), policyYAML)

	meshes := renderSet(t, "meshes")
	filter, err := envoyconf.IstioExtProc(writeDocs(t, meshes, "networking.istio.io/v1alpha3/EnvoyFilter"))
	require.NoError(t, err)
	up := upstream.Start(t)
	px := proxy.Start(t, proxy.Config{Filter: filter, Processors: []string{proc.grpcAddr}, Upstream: up.URL()})
	send := func(method, key, body string, headers map[string]string) int {
		req, err := http.NewRequest(method, px.URL()+"/orders", strings.NewReader(body))
		require.NoError(t, err)
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		for k, v := range headers {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	require.Equal(t, http.StatusOK, send(http.MethodGet, "", "", nil))                            // passthrough
	require.Equal(t, http.StatusOK, send(http.MethodPost, "k1", `{"n":1}`, nil))                  // executed
	require.Equal(t, http.StatusOK, send(http.MethodPost, "k1", `{"n":1}`, nil))                  // replayed
	require.Equal(t, http.StatusUnprocessableEntity, send(http.MethodPost, "k1", `{"n":2}`, nil)) // mismatch
	require.Equal(t, http.StatusInternalServerError,
		send(http.MethodPost, "k2", `{"n":1}`, map[string]string{"x-test-status": "500"})) // released: status

	exposed := exposedNames(t, proc.adminAddr)
	used := map[string][]string{} // name -> where
	for _, q := range append(dashboardQueries(t), alertQueries(t)...) {
		names, err := metricNames(q.expr)
		require.NoError(t, err, "%s: %s", q.where, q.expr)
		for _, n := range names {
			if !slices.Contains(used[n], q.where) {
				used[n] = append(used[n], q.where)
			}
		}
	}
	var missing []string
	for n, where := range used {
		if !exposed[n] {
			missing = append(missing, fmt.Sprintf("%s (%s)", n, strings.Join(where, "; ")))
		}
	}
	sort.Strings(missing)
	require.Empty(t, missing, "metrics the dashboard or the alerts name but the binary does not expose")
}

// binary is one running idempotency-extproc.
type binary struct {
	grpcAddr, adminAddr string
}

// startBinary builds ./cmd/idempotency-extproc from the repository's own module (its go.mod,
// not this one's), writes the policy to a file and runs the binary with the chart's arguments,
// the config path and the listeners replaced (free loopback ports). It returns once the ready
// line names the listeners; the process is stopped when the test ends.
func startBinary(t *testing.T, chartArgs []string, policyYAML string) binary {
	t.Helper()
	dir := t.TempDir()
	bin := filepath.Join(dir, "idempotency-extproc")
	build := exec.Command("go", "build", "-o", bin, "./cmd/idempotency-extproc")
	build.Dir = repoRoot
	out, err := build.CombinedOutput()
	require.NoError(t, err, "go build:\n%s", out)
	cfg := filepath.Join(dir, "policy.yaml")
	require.NoError(t, os.WriteFile(cfg, []byte(policyYAML), 0o600))

	var args []string
	for _, a := range chartArgs {
		name, _, _ := strings.Cut(a, "=")
		switch name {
		case "--config":
			a = "--config=" + cfg
		case "--grpc-addr", "--admin-addr":
			a = name + "=127.0.0.1:0"
		case "--log-format":
			a = "--log-format=json" // the ready line is read as JSON
		}
		args = append(args, a)
	}
	cmd := exec.Command(bin, args...)
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())

	var mu sync.Mutex
	var logs bytes.Buffer
	ready := make(chan map[string]any, 1)
	scanned := make(chan struct{})
	go func() {
		defer close(scanned)
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			mu.Lock()
			logs.Write(sc.Bytes())
			logs.WriteByte('\n')
			mu.Unlock()
			var line map[string]any
			if json.Unmarshal(sc.Bytes(), &line) == nil && line["message"] == "ready" {
				select {
				case ready <- line:
				default:
				}
			}
		}
	}()
	exited := make(chan error, 1)
	go func() {
		<-scanned // Wait closes the pipe: read it to the end first
		exited <- cmd.Wait()
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			mu.Lock()
			t.Logf("idempotency-extproc %v log:\n%s", args, logs.String())
			mu.Unlock()
		}
	})
	select {
	case line := <-ready:
		g, _ := line["grpc_addr"].(string)
		a, _ := line["admin_addr"].(string)
		require.NotEmpty(t, g)
		require.NotEmpty(t, a)
		return binary{grpcAddr: g, adminAddr: a}
	case err := <-exited:
		mu.Lock()
		defer mu.Unlock()
		t.Fatalf("idempotency-extproc %v exited before it was ready (%v):\n%s", args, err, logs.String())
	case <-time.After(60 * time.Second):
		t.Fatalf("idempotency-extproc %v not ready after 60s", args)
	}
	return binary{}
}
