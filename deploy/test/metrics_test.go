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
	"regexp"
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
	// operatingDoc documents every metric (one row of its metrics table each) and every alert
	// (one #### heading each, which the alert's runbook_url points to), from the repository root.
	operatingDoc = "docs/operating.md"
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

// Each alert has a severity, a summary, a description and a runbook: its runbook_url points to
// the alert's #### heading in docs/operating.md, which exists.
func TestAlertsHaveRunbooks(t *testing.T) {
	docs, err := os.ReadFile(filepath.Join(repoRoot, operatingDoc))
	require.NoError(t, err)
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
		require.True(t, strings.HasSuffix(r.Annotations["runbook_url"], "/"+operatingDoc+"#"+anchor), "%s runbook_url %s", r.Alert, r.Annotations["runbook_url"])
		require.True(t, bytes.Contains(docs, []byte("\n#### "+r.Alert+"\n")), "no runbook paragraph (#### %s) in %s", r.Alert, operatingDoc)
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

// scrape returns the metric families on the /metrics of the binary at adminAddr.
func scrape(t *testing.T, adminAddr string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get("http://" + adminAddr + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	tp := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := tp.TextToMetricFamilies(resp.Body)
	require.NoError(t, err)
	return fams
}

// exposedNames returns the names a query can select among fams: each family's name, and for
// histograms and summaries the _bucket, _sum and _count series.
func exposedNames(fams map[string]*dto.MetricFamily) map[string]bool {
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

// exercised starts the binary with the arguments and the policy the chart renders for the memory
// store (whose policy has an enforced, a shadow-mode and a json_rpc route) and the records API on, sends it
// traffic through the Envoy emulator configured with the chart's Istio filter, and returns its
// /metrics. Every labelled family then has a series.
func exercised(t *testing.T) map[string]*dto.MetricFamily {
	t.Helper()
	r := renderSet(t, "memory")
	_, c := r.deployment(t)
	var policyYAML string
	for _, cm := range find[*corev1.ConfigMap](r.objs, "v1/ConfigMap") {
		policyYAML = cm.Data["policy.yaml"]
	}
	require.Contains(t, policyYAML, "mode: shadow", "idempotency_shadow_total exists only with a shadow-mode route")
	require.Contains(t, policyYAML, "json_rpc: true", "idempotency_not_covered_total exists only with a json_rpc route")
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
	send := func(method, path, key, body string, headers map[string]string) int {
		req, err := http.NewRequest(method, px.URL()+path, strings.NewReader(body))
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
	require.Equal(t, http.StatusOK, send(http.MethodGet, "/orders", "", "", nil))                            // passthrough
	require.Equal(t, http.StatusOK, send(http.MethodPost, "/orders", "k1", `{"n":1}`, nil))                  // executed
	require.Equal(t, http.StatusOK, send(http.MethodPost, "/orders", "k1", `{"n":1}`, nil))                  // replayed
	require.Equal(t, http.StatusUnprocessableEntity, send(http.MethodPost, "/orders", "k1", `{"n":2}`, nil)) // mismatch
	require.Equal(t, http.StatusInternalServerError,
		send(http.MethodPost, "/orders", "k2", `{"n":1}`, map[string]string{"x-test-status": "500"})) // released: status
	require.Equal(t, http.StatusOK, send(http.MethodPost, "/shadow", "s1", `{"n":1}`, nil)) // shadow: executed
	require.Equal(t, http.StatusOK, send(http.MethodPost, "/shadow", "s1", `{"n":2}`, nil)) // shadow: would be a mismatch
	return scrape(t, proc.adminAddr)
}

// Every metric the dashboard and the alerting rules name is on the /metrics of the binary,
// started with the arguments and the policy the chart renders for the memory store, after
// traffic that gives every labelled family a series.
func TestQueriedMetricsExist(t *testing.T) {
	exposed := exposedNames(exercised(t))
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

// metricRow is one row of docs/operating.md's metrics table.
type metricRow struct {
	line      int
	name, typ string
	labels    []string
}

// metricsTable returns the rows of the table of md's "## Metrics" section whose header starts
// with "| metric |". A row whose first cell is not one metric name in backquotes is an error: a
// row names a metric.
func metricsTable(md string) ([]metricRow, error) {
	lines := strings.Split(md, "\n")
	start := slices.Index(lines, "## Metrics")
	if start < 0 {
		return nil, errors.New(`no "## Metrics" section`)
	}
	var rows []metricRow
	var errs []error
	inTable := false
	for i := start + 1; i < len(lines) && !strings.HasPrefix(lines[i], "## "); i++ {
		l := lines[i]
		switch {
		case strings.HasPrefix(l, "| metric |"):
			inTable = true
			continue
		case !inTable || strings.HasPrefix(l, "| ---"):
			continue
		case !strings.HasPrefix(l, "|"):
			inTable = false
			continue
		}
		cells := strings.Split(strings.ReplaceAll(strings.Trim(l, "|"), `\|`, "\x00"), "|")
		if len(cells) != 4 {
			errs = append(errs, fmt.Errorf("line %d: %d cells, want 4 (metric, type, labels, meaning): %s", i+1, len(cells), l))
			continue
		}
		m := metricName.FindStringSubmatch(strings.TrimSpace(cells[0]))
		if m == nil {
			errs = append(errs, fmt.Errorf("line %d: the first cell names no metric: %s", i+1, l))
			continue
		}
		row := metricRow{line: i + 1, name: m[1], typ: strings.TrimSpace(cells[1])}
		for _, lm := range backquoted.FindAllStringSubmatch(cells[2], -1) {
			row.labels = append(row.labels, lm[1])
		}
		rows = append(rows, row)
	}
	if len(rows) == 0 {
		errs = append(errs, errors.New(`no "| metric | type | labels | meaning |" table in "## Metrics"`))
	}
	return rows, errors.Join(errs...)
}

var (
	metricName = regexp.MustCompile("^`([a-zA-Z_:][a-zA-Z0-9_:]*)`$")
	backquoted = regexp.MustCompile("`([^`]+)`")
)

// familyLabels returns the label names of f's series, without a histogram's le.
func familyLabels(f *dto.MetricFamily) []string {
	var out []string
	for _, m := range f.GetMetric() {
		for _, lp := range m.GetLabel() {
			if n := lp.GetName(); n != "le" && !slices.Contains(out, n) {
				out = append(out, n)
			}
		}
	}
	sort.Strings(out)
	return out
}

// docs/operating.md's metrics table is the binary's: every idempotency_* family on /metrics is one
// row, and one row only, with its type and its labels, and every row is such a family. The binary
// runs as TestQueriedMetricsExist runs it (memory store, a shadow-mode route, the records API
// on), so every family the process can register is there, each with a series.
func TestMetricsTableMatchesTheBinary(t *testing.T) {
	md, err := os.ReadFile(filepath.Join(repoRoot, operatingDoc))
	require.NoError(t, err)
	rows, err := metricsTable(string(md))
	require.NoError(t, err, operatingDoc)

	fams := exercised(t)
	var problems []string
	seen := map[string]int{} // name -> line of its row
	for _, r := range rows {
		if l, ok := seen[r.name]; ok {
			problems = append(problems, fmt.Sprintf("%s: rows at lines %d and %d: one row per metric", r.name, l, r.line))
			continue
		}
		seen[r.name] = r.line
		f, ok := fams[r.name]
		if !ok {
			problems = append(problems, fmt.Sprintf("%s (line %d): the binary exposes no such metric: remove the row, or fix its name", r.name, r.line))
			continue
		}
		if typ := strings.ToLower(f.GetType().String()); r.typ != typ {
			problems = append(problems, fmt.Sprintf("%s (line %d): type %q, the binary's is %q", r.name, r.line, r.typ, typ))
		}
		got := slices.Sorted(slices.Values(r.labels))
		if want := familyLabels(f); !slices.Equal(got, want) {
			problems = append(problems, fmt.Sprintf("%s (line %d): labels %v, the binary's are %v", r.name, r.line, got, want))
		}
	}
	for name, f := range fams {
		if strings.HasPrefix(name, "idempotency_") && seen[name] == 0 {
			problems = append(problems, fmt.Sprintf("%s: exposed by the binary but not in the table: add the row | `%s` | %s | %s | (meaning) |",
				name, name, strings.ToLower(f.GetType().String()), strings.Join(quoted(familyLabels(f)), ", ")))
		}
	}
	sort.Strings(problems)
	require.Empty(t, problems, "%s's metrics table and the binary's /metrics differ", operatingDoc)
}

func quoted(ss []string) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = "`" + s + "`"
	}
	return out
}

// The table parser reads what a metrics table row says, and refuses a row that names no metric.
func TestMetricsTable(t *testing.T) {
	md := "# x\n## Metrics\n\n| metric | type | labels | meaning |\n| --- | --- | --- | --- |\n" +
		"| `a_total` | counter | `route`, `outcome` | what `b` means \\| more |\n" +
		"| `c` | gauge | | one |\n\nafter\n\n| other | table |\n| --- | --- |\n| `d` | x |\n## Next\n| `e` | counter | | |\n"
	rows, err := metricsTable(md)
	require.NoError(t, err)
	require.Len(t, rows, 2)
	require.Equal(t, "a_total", rows[0].name)
	require.Equal(t, "counter", rows[0].typ)
	require.Equal(t, []string{"route", "outcome"}, rows[0].labels)
	require.Equal(t, "c", rows[1].name)
	require.Empty(t, rows[1].labels)

	_, err = metricsTable("## Metrics\n| metric | type | labels | meaning |\n| --- | --- | --- | --- |\n| total requests | counter | | x |\n")
	require.ErrorContains(t, err, "names no metric")
	_, err = metricsTable("## Metrics\nno table\n")
	require.ErrorContains(t, err, "no \"| metric")
	_, err = metricsTable("# Operating\n")
	require.ErrorContains(t, err, "no \"## Metrics\" section")
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
