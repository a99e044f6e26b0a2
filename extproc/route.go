package extproc

import (
	"sync"
	"sync/atomic"
	"time"

	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// route is a policy route compiled, once at start-up, into what its requests do: which features
// they use, the metric series they count in, the answers that depend on the route alone, and its
// dynamic metadata templates. A request pays per request only for what its route turns on.
type route struct {
	*policy.Route

	// What the route's requests use.
	claims          bool // the scope reads jwt_authn's payload
	bodyFingerprint bool // the fingerprint reads the request body
	shadow          bool // mode: shadow
	// decidedByBody: match.json decides the route at the body's end (policy.Route.DecidedByBody).
	decidedByBody bool
	// json is what the route reads of its request bodies' members; nil when nothing.
	json *jsonRoute
	// batches counts the JSON-RPC batches passed through; nil unless json_rpc.
	batches prometheus.Counter

	// The metric series.
	outcomes   map[Outcome]prometheus.Counter
	releases   map[string]prometheus.Counter
	unknown    map[policy.UnknownOutcome]prometheus.Counter
	unreadable prometheus.Counter // stored records this process could not open
	retried    prometheus.Counter // covered requests the router sent upstream more than once
	// trailersMissing counts the covered gRPC calls whose response ended without trailers.
	trailersMissing prometheus.Counter
	waitCalls       prometheus.Counter // store calls of duplicates waiting for a request in flight
	// shadowCounts counts what enforcement would have done, by outcome (shadow routes only).
	shadowCounts map[Outcome]prometheus.Counter

	// The answers that depend on the route alone. stored continues a response that will be
	// stored (when no expiry header is written); notStored also turns its body phase off.
	stored, notStored *extprocv3.ProcessingResponse
	problems          map[*problem]*extprocv3.ProcessingResponse
	// grpcProblems are the problems' answers to gRPC calls (grpcProblemResponse).
	grpcProblems map[*problem]*extprocv3.ProcessingResponse
	// fresh is the answer to a stored response's headers with the expiry of the second it
	// holds: every response stored within one second carries the same HTTP-date.
	fresh   atomic.Pointer[freshAnswer]
	freshMu sync.Mutex // serialises replacing fresh, and its encodings, with another second's
	// encodings holds the encodings of the current second's answers (codec.go); nil: none are
	// kept.
	encodings *encodings

	metadata metadataTemplates
}

// freshAnswer is a route's answer to the headers of a response stored to expire at second.
type freshAnswer struct {
	second        int64
	resp, noStore *extprocv3.ProcessingResponse
}

// compileRoute compiles r, counting in m.
func compileRoute(r *policy.Route, m *Metrics, namespace string) (*route, error) {
	c := &route{
		Route:           r,
		claims:          r.ReadsClaims(),
		bodyFingerprint: r.FingerprintsBody(),
		shadow:          r.Mode == policy.ModeShadow,
		decidedByBody:   r.DecidedByBody(),
		outcomes:        map[Outcome]prometheus.Counter{},
		releases:        map[string]prometheus.Counter{},
		unknown:         map[policy.UnknownOutcome]prometheus.Counter{},
		stored:          markResponseHeaders(r, nil, time.Time{}),
		notStored:       markResponseHeaders(r, noStoreMode, time.Time{}),
		problems:        map[*problem]*extprocv3.ProcessingResponse{},
		grpcProblems:    map[*problem]*extprocv3.ProcessingResponse{},
		waitCalls:       m.waitCalls.WithLabelValues(r.Name),
		unreadable:      m.unreadable.WithLabelValues(r.Name),
		retried:         m.upstreamRetries.WithLabelValues(r.Name),
		trailersMissing: m.grpcTrailers.missing.WithLabelValues(r.Name),
		metadata:        metadataTemplates{namespace: namespace, route: r.Name},
	}
	c.json = compileJSON(r)
	if r.JSONRPC {
		// Only a json_rpc route passes batches through: no zero series for the others.
		c.batches = m.notCovered.WithLabelValues(r.Name, notCoveredBatch)
	}
	if c.shadow {
		c.shadowCounts = map[Outcome]prometheus.Counter{}
		for _, o := range Outcomes {
			c.shadowCounts[o] = m.shadow.WithLabelValues(r.Name, string(o))
		}
	}
	for _, o := range Outcomes {
		c.outcomes[o] = m.requests.WithLabelValues(r.Name, string(o))
	}
	for _, reason := range releaseReasons {
		c.releases[reason] = m.releases.WithLabelValues(r.Name, reason)
	}
	for _, u := range []policy.UnknownOutcome{policy.UnknownOutcomeRelease, policy.UnknownOutcomeKeep, policy.UnknownOutcomeRecord} {
		c.unknown[u] = m.unknownOutcomes.WithLabelValues(r.Name, string(u))
	}
	for _, p := range problems {
		resp, err := problemResponse(p, r)
		if err != nil {
			return nil, err
		}
		c.problems[p] = resp
		c.grpcProblems[p] = grpcProblemResponse(p, r)
	}
	return c, nil
}

// freshHeaders returns the answer to the headers of a response that will be stored until
// expires, with the body phase turned off when noBody is set. The answers of the latest second
// are built once, encoded once (codec.go) and shared; an expiry before that second (a shorter
// ttl_header) gets an answer of its own, so that mixed TTLs do not make the shared ones churn.
func (r *route) freshHeaders(expires time.Time, noBody bool) *extprocv3.ProcessingResponse {
	sec := expires.Unix()
	f := r.fresh.Load()
	if f == nil || f.second < sec {
		r.freshMu.Lock()
		// Under the lock, a second's encodings are added before its answers are shared and
		// removed after they are replaced: none is left behind.
		if f = r.fresh.Load(); f == nil || f.second < sec {
			next := newFreshAnswer(r.Route, sec)
			if r.encodings != nil {
				r.encodings.add(next.resp, next.noStore)
			}
			r.fresh.Store(next)
			if r.encodings != nil && f != nil {
				r.encodings.remove(f.resp, f.noStore)
			}
		}
		f = r.fresh.Load()
		r.freshMu.Unlock()
	}
	if f.second != sec {
		// Only the answer this request sends: it is built for it alone.
		var mode *filterextproc.ProcessingMode
		if noBody {
			mode = noStoreMode
		}
		return markResponseHeaders(r.Route, mode, time.Unix(sec, 0))
	}
	if noBody {
		return f.noStore
	}
	return f.resp
}

// newFreshAnswer builds the answers to a stored response's headers with the expiry sec.
func newFreshAnswer(r *policy.Route, sec int64) *freshAnswer {
	at := time.Unix(sec, 0)
	return &freshAnswer{second: sec, resp: markResponseHeaders(r, nil, at), noStore: markResponseHeaders(r, noStoreMode, at)}
}
