package extproc

import (
	"context"
	"slices"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

// Messages for the table walk.
func hdrs(method, key string, eos bool, mode filterextproc.ProcessingMode_BodySendMode) *extprocv3.ProcessingRequest {
	h := []*corev3.HeaderValue{{Key: ":method", RawValue: []byte(method)}, {Key: ":path", RawValue: []byte("/v1/payments")}}
	if key != "" {
		h = append(h, &corev3.HeaderValue{Key: "idempotency-key", RawValue: []byte(key)})
	}
	return &extprocv3.ProcessingRequest{
		Request:        &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: h}, EndOfStream: eos}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: mode, ResponseBodyMode: filterextproc.ProcessingMode_BUFFERED},
	}
}

func reqBody(b string, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte(b), EndOfStream: eos}}}
}

func respHdrs(status string, eos bool, details string, attempts float64) *extprocv3.ProcessingRequest {
	attrs, _ := structpb.NewStruct(map[string]any{attrCodeDetails: details, attrAttemptCount: attempts})
	return &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte(status)}}}, EndOfStream: eos,
		}},
		Attributes: map[string]*structpb.Struct{extProcAttributes: attrs},
	}
}

func respBody(b string) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: []byte(b), EndOfStream: true}}}
}

// downStore is a store whose Acquire fails.
type downStore struct{ cache.Store }

func (downStore) Acquire(context.Context, string, cache.Claim) (cache.Lease, *cache.Record, error) {
	return cache.Lease{}, nil, context.DeadlineExceeded
}

// transitionScenario drives a stream into a row's from state and sends the row's message.
type transitionScenario struct {
	name   string
	policy string
	down   bool                           // the store fails
	prior  []*extprocv3.ProcessingRequest // sent first on another stream, left open
	setup  []*extprocv3.ProcessingRequest
	move   *extprocv3.ProcessingRequest // the row's message; nil: the stream ends
	from   state
	to     state
}

// transitionScenarios name each row of the table by the messages Envoy sends.
func transitionScenarios() []transitionScenario {
	const buffered, streamed = filterextproc.ProcessingMode_BUFFERED, filterextproc.ProcessingMode_STREAMED
	return []transitionScenario{
		{"not covered", "", false, nil, nil, hdrs("GET", "", true, buffered), stateStart, statePass},
		{"400 at the headers", "", false, nil, nil, hdrs("POST", "bad key", false, buffered), stateStart, stateSettled},
		{"the body is needed", "", false, nil, nil, hdrs("POST", "k1", false, buffered), stateStart, stateCollect},
		{"claimed at the headers", "", false, nil, nil, hdrs("POST", "k2", true, buffered), stateStart, stateRunning},
		{"store down, fail open, at the headers", "fail_mode: open", true, nil, nil, hdrs("POST", "k3", true, buffered), stateStart, stateUnprotected},
		{"shadow: would answer at the body", "defaults: {mode: shadow}", false, []*extprocv3.ProcessingRequest{hdrs("POST", "k4", true, buffered)}, []*extprocv3.ProcessingRequest{hdrs("POST", "k4", false, streamed)}, reqBody("x", true), stateCollect, statePass},
		{"413 at the body", "defaults: {max_request_bytes: 1}", false, nil, []*extprocv3.ProcessingRequest{hdrs("POST", "k5", false, streamed)}, reqBody("xx", true), stateCollect, stateSettled},
		{"claimed at the body", "", false, nil, []*extprocv3.ProcessingRequest{hdrs("POST", "k6", false, buffered)}, reqBody("x", true), stateCollect, stateRunning},
		{"store down, fail open, at the body", "fail_mode: open", true, nil, []*extprocv3.ProcessingRequest{hdrs("POST", "k7", false, buffered)}, reqBody("x", true), stateCollect, stateUnprotected},
		{"storable, body follows", "", false, nil, []*extprocv3.ProcessingRequest{hdrs("POST", "k8", true, buffered)}, respHdrs("201", false, "via_upstream", 1), stateRunning, stateCapture},
		{"released at the response headers", "", false, nil, []*extprocv3.ProcessingRequest{hdrs("POST", "k9", true, buffered)}, respHdrs("500", false, "via_upstream", 1), stateRunning, stateSettled},
		{"the body's end", "", false, nil, []*extprocv3.ProcessingRequest{hdrs("POST", "k10", true, buffered), respHdrs("201", false, "via_upstream", 1)}, respBody("ok"), stateCapture, stateSettled},
		{"unprotected response", "fail_mode: open", true, nil, []*extprocv3.ProcessingRequest{hdrs("POST", "k11", true, buffered)}, respHdrs("201", false, "via_upstream", 1), stateUnprotected, stateSettled},
		{"the stream ends while running", "", false, nil, []*extprocv3.ProcessingRequest{hdrs("POST", "k12", true, buffered)}, nil, stateRunning, stateSettled},
		{"the stream ends during the capture", "", false, nil, []*extprocv3.ProcessingRequest{hdrs("POST", "k13", true, buffered), respHdrs("201", false, "via_upstream", 1)}, nil, stateCapture, stateSettled},
	}
}

// walk runs sc and returns the states before and after its message, and how many moves not in
// the table the stream was asked for.
func (sc transitionScenario) walk(t *testing.T) (from, to state, illegal float64) {
	t.Helper()
	p, err := policy.Parse([]byte(sc.policy))
	require.NoError(t, err)
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	mem, err := cache.NewMemory(cache.MemoryOptions{Clock: clk})
	require.NoError(t, err)
	var store cache.Store = mem
	if sc.down {
		store = downStore{mem}
	}
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	require.NoError(t, err)
	s, err := NewServer(Options{Store: store, Policy: p, Clock: clk, Metrics: m})
	require.NoError(t, err)
	if sc.prior != nil {
		first := newStream(s, t.Context(), nil)
		defer first.finish()
		for _, msg := range sc.prior {
			_, ok := first.handle(msg)
			require.True(t, ok)
		}
	}
	st := newStream(s, t.Context(), nil)
	defer st.finish()
	for _, msg := range sc.setup {
		_, ok := st.handle(msg)
		require.True(t, ok)
	}
	from = st.state
	if sc.move == nil {
		st.finish()
	} else {
		_, ok := st.handle(sc.move)
		require.True(t, ok)
	}
	return from, st.state, testutil.ToFloat64(m.internalErrors.WithLabelValues(internalIllegalTransition))
}

// TestTransitionTable walks every row of the stream's transition table with the messages Envoy
// sends, checking the state before and after the row's message, that no move outside the table
// was asked for, and that no row is left unwalked. Each (from, to) pair appears once in the
// table, so the states name the row.
func TestTransitionTable(t *testing.T) {
	walked := map[[2]state]bool{}
	for _, sc := range transitionScenarios() {
		t.Run(sc.name, func(t *testing.T) {
			from, to, illegal := sc.walk(t)
			require.Equal(t, sc.from, from, "before the row's message")
			require.Equal(t, sc.to, to, "after it")
			require.Zero(t, illegal, "no move outside the table")
			eventOf(t, sc.from, sc.to) // the move is a row of the table
			walked[[2]state{sc.from, sc.to}] = true
		})
	}
	for _, row := range transitions {
		require.True(t, walked[[2]state{row.from, row.to}], "row %v --%v--> %v is walked", row.from, row.on, row.to)
	}
	// A move not in the table is counted, and settles the stream.
	for _, bad := range []struct {
		from state
		on   event
	}{{stateSettled, evRun}, {statePass, evStore}} {
		m, err := NewMetrics(prometheus.NewRegistry())
		require.NoError(t, err)
		mem, err := cache.NewMemory(cache.MemoryOptions{})
		require.NoError(t, err)
		s, err := NewServer(Options{Store: mem, Metrics: m})
		require.NoError(t, err)
		st := newStream(s, t.Context(), nil)
		st.req.route, st.state = s.routes[s.policy.Default], bad.from
		st.move(bad.on, nil)
		require.Equal(t, stateSettled, st.state, "%v --%v-->", bad.from, bad.on)
		require.Equal(t, 1.0, testutil.ToFloat64(m.internalErrors.WithLabelValues(internalIllegalTransition)), "%v --%v--> is counted", bad.from, bad.on)
	}
}

// Every row is needed: with any one of them removed from the table, the walk of that row asks
// for a move outside the table, which is counted, so TestTransitionTable fails.
func TestEveryTransitionIsNeeded(t *testing.T) {
	all := transitions
	defer func() { transitions = all }()
	for i, row := range all {
		t.Run(row.from.String()+"--"+row.on.String()+"->"+row.to.String(), func(t *testing.T) {
			transitions = append(slices.Clone(all[:i]), all[i+1:]...)
			defer func() { transitions = all }()
			counted := false
			for _, sc := range transitionScenarios() {
				if sc.from == row.from && sc.to == row.to {
					_, _, illegal := sc.walk(t)
					counted = counted || illegal > 0
				}
			}
			require.True(t, counted, "without the row, its walk counts a move outside the table")
		})
	}
}

// eventOf returns the event of the table's only row from → to.
func eventOf(t *testing.T, from, to state) event {
	t.Helper()
	for _, row := range transitions {
		if row.from == from && row.to == to {
			return row.on
		}
	}
	t.Fatalf("no row %v → %v", from, to)
	return 0
}

// Each (from, to) pair is one row, which lets the walk above name rows by their states.
func TestTransitionPairsAreUnique(t *testing.T) {
	seen := map[[2]state]bool{}
	for _, row := range transitions {
		k := [2]state{row.from, row.to}
		require.False(t, seen[k], "%v → %v twice", row.from, row.to)
		seen[k] = true
	}
}
