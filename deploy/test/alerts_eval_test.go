package deploytest

import (
	"testing"
	"time"

	"github.com/prometheus/prometheus/model/histogram"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql"
	"github.com/prometheus/prometheus/storage"
	"github.com/prometheus/prometheus/tsdb/chunkenc"
	"github.com/prometheus/prometheus/tsdb/chunks"
	"github.com/prometheus/prometheus/util/annotations"
	"github.com/stretchr/testify/require"
)

// alertExpr returns the expression of the chart's alert named name.
func alertExpr(t *testing.T, name string) string {
	t.Helper()
	for _, g := range readAlerts(t).Groups {
		for _, r := range g.Rules {
			if r.Alert == name {
				return r.Expr.String()
			}
		}
	}
	t.Fatalf("the chart has no alert %s", name)
	return ""
}

// IdempotencyCompletionsAbandoned fires on every reason a completion is given up, lease_lost
// included: its expression, evaluated by Prometheus' engine over the counter a replica exposes
// (at 0 from its start, as every reason is, then 1 after a lease lost while its request ran,
// as e2e's TestFlushWhileARequestRuns scrapes from the binary), has a sample for that reason,
// and none for a reason that did not move.
func TestAbandonedAlertFiresOnEveryReason(t *testing.T) {
	expr := alertExpr(t, "IdempotencyCompletionsAbandoned")
	engine := promql.NewEngine(promql.EngineOpts{MaxSamples: 10_000, Timeout: time.Minute})
	for _, reason := range []string{"lease_lost", "capacity", "expired", "shutdown"} {
		t.Run(reason, func(t *testing.T) {
			series := func(reason string, values ...float64) storage.Series {
				lset := labels.FromStrings("__name__", "idempotency_completions_abandoned_total",
					"namespace", "shop", "job", "idempotency-extproc", "instance", "a", "reason", reason)
				var ss []chunks.Sample
				for i, v := range values {
					ss = append(ss, fsample{t: int64(i) * time.Minute.Milliseconds(), f: v})
				}
				return storage.NewListSeries(lset, ss)
			}
			db := queryable{series(reason, 0, 0, 1, 1), series("other", 0, 0, 0, 0)}
			q, err := engine.NewInstantQuery(t.Context(), db, nil, expr, time.UnixMilli(3*time.Minute.Milliseconds()))
			require.NoError(t, err)
			res := q.Exec(t.Context())
			require.NoError(t, res.Err)
			v, err := res.Vector()
			require.NoError(t, err)
			require.Len(t, v, 1, "%s: %v", expr, v)
			require.Equal(t, reason, v[0].Metric.Get("reason"))
			require.Positive(t, v[0].F)
		})
	}
}

// queryable holds a few series in memory, for the engine.
type queryable []storage.Series

func (q queryable) Querier(int64, int64) (storage.Querier, error) {
	return &storage.MockQuerier{SelectMockFunction: func(_ bool, _ *storage.SelectHints, ms ...*labels.Matcher) storage.SeriesSet {
		out := &seriesSet{}
		for _, s := range q {
			if matchesAll(s.Labels(), ms) {
				out.series = append(out.series, s)
			}
		}
		return out
	}}, nil
}

func matchesAll(l labels.Labels, ms []*labels.Matcher) bool {
	for _, m := range ms {
		if !m.Matches(l.Get(m.Name)) {
			return false
		}
	}
	return true
}

// seriesSet yields its series in order.
type seriesSet struct {
	series []storage.Series
	at     int
}

func (s *seriesSet) Next() bool                        { s.at++; return s.at <= len(s.series) }
func (s *seriesSet) At() storage.Series                { return s.series[s.at-1] }
func (s *seriesSet) Err() error                        { return nil }
func (s *seriesSet) Warnings() annotations.Annotations { return nil }

// fsample is one float sample.
type fsample struct {
	t int64
	f float64
}

func (s fsample) T() int64                      { return s.t }
func (s fsample) ST() int64                     { return 0 }
func (s fsample) F() float64                    { return s.f }
func (s fsample) H() *histogram.Histogram       { return nil }
func (s fsample) FH() *histogram.FloatHistogram { return nil }
func (s fsample) Type() chunkenc.ValueType      { return chunkenc.ValFloat }
func (s fsample) Copy() chunks.Sample           { return s }

// IdempotencyGrpcTrailersMissing fires on a sustained share of a route's covered requests that
// are gRPC calls without trailers (a route withholding them: every call on it counts, however
// small its share of all the traffic), and not on the trickle of calls that clients cancel or
// upstreams reset: its expression, evaluated by Prometheus' engine after 30 minutes of 10
// covered requests a second on the gRPC route, has a sample only when the counter grows with a
// large enough share of that route's requests.
func TestGrpcTrailersMissingAlertNeedsASustainedShare(t *testing.T) {
	expr := alertExpr(t, "IdempotencyGrpcTrailersMissing")
	engine := promql.NewEngine(promql.EngineOpts{MaxSamples: 10_000, Timeout: time.Minute})
	const minutes, coveredPerMinute = 30, 600
	series := func(name string, perMinute float64, extra ...string) storage.Series {
		lset := labels.FromStrings(append([]string{"__name__", name, "namespace", "shop", "job", "idempotency-extproc", "instance", "a"}, extra...)...)
		var ss []chunks.Sample
		for i := range minutes + 1 {
			ss = append(ss, fsample{t: int64(i) * time.Minute.Milliseconds(), f: perMinute * float64(i)})
		}
		return storage.NewListSeries(lset, ss)
	}
	for _, tc := range []struct {
		name             string
		missingPerMinute float64
		// otherPerMinute are the covered requests of an HTTP route beside the gRPC one.
		otherPerMinute float64
		fires          bool
	}{
		{"none", 0, coveredPerMinute, false},
		{"a trickle of cancelled calls (1%)", 6, coveredPerMinute, false},
		{"every call of the gRPC route", coveredPerMinute, coveredPerMinute, true},
		{"every call of a gRPC route that is a hundredth of the covered traffic", coveredPerMinute, 99 * coveredPerMinute, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			db := queryable{
				series("idempotency_requests_total", coveredPerMinute, "route", "charge", "outcome", "executed"),
				series("idempotency_requests_total", tc.otherPerMinute, "route", "orders", "outcome", "executed"),
				series("idempotency_requests_total", 6000, "route", "health", "outcome", "passthrough"),
				series("idempotency_grpc_trailers_missing_total", tc.missingPerMinute, "route", "charge"),
				series("idempotency_grpc_trailers_missing_total", 0, "route", "orders"),
			}
			q, err := engine.NewInstantQuery(t.Context(), db, nil, expr, time.UnixMilli(minutes*time.Minute.Milliseconds()))
			require.NoError(t, err)
			res := q.Exec(t.Context())
			require.NoError(t, res.Err)
			v, err := res.Vector()
			require.NoError(t, err)
			if !tc.fires {
				require.Empty(t, v, "%s: %v", expr, v)
				return
			}
			require.Len(t, v, 1, "%s: %v", expr, v)
			require.InDelta(t, 1.0, v[0].F, 0.01, "the share of the route's covered requests")
			require.Equal(t, "charge", v[0].Metric.Get("route"))
		})
	}
}
