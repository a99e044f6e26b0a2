package extproc

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"

	"github.com/idempotency-extproc/idempotency-extproc/internal/clock"
)

// What one replica lets streams hold. Envoy opens a stream for each HTTP request the moment it has
// the request's first message to send (Filter::openStream, then sendRequest, in
// source/extensions/filters/http/ext_proc/ext_proc.cc), so its streams carry a message within
// microseconds and end with their request. A stream that sends nothing is not Envoy's, and a
// replica does not keep it: its first message has FirstMessageTimeout to arrive, and no more
// than MaxStreams streams are open at once.

// DefaultFirstMessageTimeout is how long a stream may stay open without its first message.
const DefaultFirstMessageTimeout = 10 * time.Second

// DefaultMaxStreams is how many ext_proc streams a replica keeps open at once by default: ten
// times what one Envoy with default circuit breakers opens to a whole cluster (max_requests
// 1,024), and at the 10,000 requests/s one replica serves on two cores (docs/performance.md),
// a second of every request's life. An idle stream costs the process 13 KiB of resident memory
// (docs/operating.md has the measurement), so the limit's streams hold about 130 MiB, which fits
// beside a full 256 MiB memory store in the chart's 512 MiB.
const DefaultMaxStreams = 10000

// The reasons of idempotency_streams_refused_total.
const (
	// refusedLimit: the stream came while MaxStreams were open; it was refused at once with
	// RESOURCE_EXHAUSTED.
	refusedLimit = "limit"
	// refusedFirstMessageTimeout: no first message within FirstMessageTimeout; the stream was
	// ended with DEADLINE_EXCEEDED.
	refusedFirstMessageTimeout = "first_message_timeout"
)

// streamMetrics are the metrics of the streams a replica holds.
type streamMetrics struct {
	open    prometheus.Gauge
	refused *prometheus.CounterVec
	limit   prometheus.Gauge
}

func newStreamMetrics() streamMetrics {
	m := streamMetrics{
		open: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "idempotency_streams",
			Help: "ext_proc streams open on this process (one per HTTP request Envoy is processing), at most idempotency_streams_limit.",
		}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idempotency_streams_refused_total",
			Help: "ext_proc streams refused, by reason: limit (idempotency_streams_limit were open; refused at once with RESOURCE_EXHAUSTED) or first_message_timeout (no message within 10 s of the stream's start; ended with DEADLINE_EXCEEDED).",
		}, []string{"reason"}),
		limit: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "idempotency_streams_limit",
			Help: "The most ext_proc streams this process keeps open at once (--max-streams).",
		}),
	}
	m.refused.WithLabelValues(refusedLimit)
	m.refused.WithLabelValues(refusedFirstMessageTimeout)
	return m
}

func (m streamMetrics) register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.open, m.refused, m.limit} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

// processMethod is the full name of the ext_proc method, as a tap sees it.
var processMethod = "/" + extprocv3.ExternalProcessor_ServiceDesc.ServiceName + "/Process"

// errFirstMessageLate is the cause of a stream's context cancelled for want of a first message.
var errFirstMessageLate = errors.New("no first message in time")

// firstMessageKey is the context key of a stream's first-message deadline (its
// *firstMessageContext).
type firstMessageKey struct{}

// TapHandle returns the handle to install with grpc.InTapHandle on the gRPC server that serves s.
// It gives every ext_proc stream FirstMessageTimeout to send its first message: when the time
// passes first, the stream's context ends, which ends its Recv, and grpc-go ends the stream with
// DEADLINE_EXCEEDED. The streams that wait for their first message share one timer (see
// firstMessageWatch): a stream costs a cancellable context and a place in a list, not a timer
// or a goroutine. Other services (gRPC health) pass untouched. It runs on the connection's
// reader goroutine, and does no more than that.
func (s *Server) TapHandle() tap.ServerInHandle {
	w := &firstMessageWatch{clock: s.clock, timeout: s.firstMessageTimeout, late: s.metrics.streams.refused.WithLabelValues(refusedFirstMessageTimeout)}
	w.ring.next, w.ring.prev = &w.ring, &w.ring
	s.firstMessages = w
	return func(ctx context.Context, info *tap.Info) (context.Context, error) {
		if info.FullMethodName != processMethod {
			return ctx, nil
		}
		ctx, cancel := context.WithCancelCause(ctx)
		c := &firstMessageContext{Context: ctx, cancel: cancel, watch: w}
		if v := info.Header[namedRouteHeader]; len(v) > 0 {
			c.named = v[0]
		}
		w.add(c)
		return c, nil
	}
}

// firstMessageContext is the context of a stream whose first message is due, and the deadline
// of that message, which arrived ends. Its Err is context.DeadlineExceeded once the message is
// late. grpc-go ends a stream whose Recv finds its context done with the status of the
// context's Err (serverStream.RecvMsg writes it, through ContextErr in its internal/transport),
// before the handler returns: DEADLINE_EXCEEDED, where a plain cancellation would say
// CANCELLED, as if the client had given up.
type firstMessageContext struct {
	context.Context
	cancel context.CancelCauseFunc
	watch  *firstMessageWatch
	// named is the stream's x-idempotency-route ("" for none), read from its headers with one map
	// lookup: HTTP/2 header names are lowercase (golang.org/x/net/http2's framer refuses any
	// other), and grpc-go's metadata keeps them as they came. metadata.ValueFromIncomingContext
	// would compare every other header's name case-insensitively when the stream has none
	// (BenchmarkNamedRoute).
	named string
	// Guarded by watch.mu: when the message is due, and the stream's place in the watch's ring
	// while it waits (nil otherwise).
	due        time.Time
	prev, next *firstMessageContext
}

func (c *firstMessageContext) Err() error {
	err := c.Context.Err()
	if err != nil && errors.Is(context.Cause(c.Context), errFirstMessageLate) {
		return context.DeadlineExceeded
	}
	return err
}

func (c *firstMessageContext) Value(key any) any {
	if key == (firstMessageKey{}) {
		return c
	}
	return c.Context.Value(key)
}

// arrived takes the stream off the watch: its first Recv returned, or the stream was refused.
// It returns nil, or, when the deadline passed first, the DEADLINE_EXCEEDED error to end the
// stream with, which it counts: each time it is called, so a stream calls it once. Safe on nil (a
// server without the tap).
func (c *firstMessageContext) arrived() error {
	if c == nil {
		return nil
	}
	w := c.watch
	w.mu.Lock()
	waiting := c.next != nil
	if waiting {
		c.prev.next, c.next.prev = c.next, c.prev
		c.prev, c.next = nil, nil
	}
	w.mu.Unlock()
	if waiting || !errors.Is(context.Cause(c.Context), errFirstMessageLate) {
		return nil
	}
	w.late.Inc()
	return status.Error(codes.DeadlineExceeded, fmt.Sprintf("idempotency-extproc: no message within %s of the stream's start", w.timeout))
}

// firstMessageWatch holds the streams waiting for their first message, in a ring in the order
// they opened, which is the order of their deadlines (each is FirstMessageTimeout after its
// stream's start), and one timer armed for a deadline at or before the first one's. When it
// fires it ends the streams whose deadline has passed and arms itself for the next one, if any.
// A stream that sends its first message leaves the ring; the timer is not stopped, and a firing
// that finds no stream due arms nothing. So under load a stream costs no timer operation, where
// one timer each took about half of what the deadline cost (BenchmarkFirstMessageTimer).
type firstMessageWatch struct {
	clock   clock.Clock
	timeout time.Duration
	late    prometheus.Counter // streams refused for want of a first message

	mu sync.Mutex
	// ring is the ring's anchor: ring.next is the first stream due, ring.prev the last.
	ring  firstMessageContext
	armed bool // the timer is armed, for a time at or before the first one's deadline
}

// add puts c, whose stream just opened, last in the ring.
func (w *firstMessageWatch) add(c *firstMessageContext) {
	w.mu.Lock()
	defer w.mu.Unlock()
	c.due = w.clock.Now().Add(w.timeout)
	c.prev, c.next = w.ring.prev, &w.ring
	c.prev.next, w.ring.prev = c, c
	if !w.armed {
		w.armed = true
		w.clock.AfterFunc(w.timeout, w.expire)
	}
}

// expire ends the streams whose first message is late, then arms the timer for the next
// deadline, if a stream still waits. A stream's context is cancelled before the lock is let go,
// so that an arrived that finds the stream gone finds its context ended too.
func (w *firstMessageWatch) expire() {
	w.mu.Lock()
	defer w.mu.Unlock()
	now := w.clock.Now()
	for c := w.ring.next; c != &w.ring && !c.due.After(now); c = w.ring.next {
		w.ring.next, c.next.prev = c.next, &w.ring
		c.prev, c.next = nil, nil
		c.cancel(errFirstMessageLate)
	}
	first := w.ring.next
	w.armed = first != &w.ring
	if w.armed {
		w.clock.AfterFunc(first.due.Sub(now), w.expire)
	}
}

// waiting returns how many streams wait for their first message.
func (w *firstMessageWatch) waiting() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for c := w.ring.next; c != &w.ring; c = c.next {
		n++
	}
	return n
}

// enter admits a stream unless MaxStreams are open: then it takes the stream off the
// first-message watch (first, nil without the tap) and returns the RESOURCE_EXHAUSTED error to
// end the stream with, or, when its first-message deadline passed before its handler started,
// the DEADLINE_EXCEEDED error arrived counted: each stream refused is counted once. A stream
// admitted calls leave when it ends.
func (s *Server) enter(first *firstMessageContext) error {
	// A compare-and-swap, so that a stream refused never holds a slot, even for a moment, that
	// one entering beside it could have had.
	for n := s.open.Load(); n < int64(s.maxStreams); n = s.open.Load() {
		if s.open.CompareAndSwap(n, n+1) {
			s.metrics.streams.open.Inc()
			return nil
		}
	}
	if err := first.arrived(); err != nil {
		return err
	}
	s.metrics.streams.refused.WithLabelValues(refusedLimit).Inc()
	return status.Errorf(codes.ResourceExhausted, "idempotency-extproc: %d streams are open, the most this replica takes", s.maxStreams)
}

func (s *Server) leave() {
	s.open.Add(-1)
	s.metrics.streams.open.Dec()
}
