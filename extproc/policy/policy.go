// Package policy reads the YAML policy file (docs/configuration.md) and compiles it into the
// per-route settings the stream state machine consults.
//
// Every field is described once, in the tables of fields.go: its key, its built-in default (as
// YAML), the values it accepts and its documentation. The built-in defaults are compiled from
// those tables like any file, the file is validated in one walk over its YAML node tree, and
// Fields lists the same tables for docs/configuration.md.
package policy

import (
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"text/template"
	"time"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/jsonbody"
)

// MissingKey says what happens to a covered request without a key.
type MissingKey string

// The missing_key values.
const (
	MissingKeyOptional MissingKey = "optional"  // pass it through untouched
	MissingKeyRequired MissingKey = "required"  // answer 400 missing-idempotency-key
	MissingKeyBodyHash MissingKey = "body-hash" // use the hex SHA-256 of method, path and body as its key
)

// UnknownOutcome says what happens to a lease when the stream ends before the response was seen.
type UnknownOutcome string

// The unknown_outcome values.
const (
	UnknownOutcomeRelease UnknownOutcome = "release" // free the key: a retry runs again
	UnknownOutcomeKeep    UnknownOutcome = "keep"    // leave the lease to expire after lock_ttl
	// UnknownOutcomeRecord stores an outcome-unknown record for the record's TTL: duplicates get
	// 409 outcome-unknown until an operator purges the key or the TTL ends.
	UnknownOutcomeRecord UnknownOutcome = "record"
)

// FailMode says what happens to a covered request when the store fails.
type FailMode string

// The fail_mode values.
const (
	FailClosed FailMode = "closed" // answer 503 store-unavailable
	FailOpen   FailMode = "open"   // pass the request through untouched
)

// Mode says whether a route enforces idempotency or only counts what enforcing would do.
type Mode string

// The mode values.
const (
	// ModeEnforce answers duplicates with replays, 409 and 422.
	ModeEnforce Mode = "enforce"
	// ModeShadow claims, records and replays in the store as ModeEnforce does, but every request
	// reaches the upstream and every response the client untouched.
	ModeShadow Mode = "shadow"
)

// Part is one element of the request fingerprint.
type Part string

// The fingerprint parts.
const (
	PartMethod Part = "method"
	PartPath   Part = "path" // with the query
	PartBody   Part = "body" // raw bytes
)

// ScopeKind is where a scope value comes from.
type ScopeKind string

// The scope sources.
const (
	// ScopeHeader is a request header, named by ScopeSource.Name (lower case; ":authority" for
	// the host).
	ScopeHeader ScopeKind = "header"
	// ScopeJWTClaim is a claim of the payload Envoy's jwt_authn filter verified and forwarded in
	// metadata_context, named by ScopeSource.Name.
	ScopeJWTClaim ScopeKind = "jwt_claim"
	// ScopePeerIdentity is the mTLS peer's URI SAN (connection.uri_san_peer_certificate); its
	// ScopeSource.Name is empty.
	ScopePeerIdentity ScopeKind = "peer_identity"
	// ScopePathParam is a named group of the route's path_regex, named by ScopeSource.Name.
	ScopePathParam ScopeKind = "path_param"
	// ScopeJSON is the JSON text of the request body's member at the RFC 6901 pointer
	// ScopeSource.Name, in its canonical form; a missing member is an empty value.
	ScopeJSON ScopeKind = "json"
)

// ScopeSource is one element of a route's scope.
type ScopeSource struct {
	Kind ScopeKind
	Name string // empty for ScopePeerIdentity
}

// Defaults and limits of the policy file that code outside this package refers to. The defaults
// of every field are in the tables of fields.go.
const (
	DefaultTTL              = 24 * time.Hour
	DefaultLockTTL          = 30 * time.Second
	DefaultStoreTimeout     = 100 * time.Millisecond
	DefaultMaxResponseBytes = 1 << 20
	// DefaultMaxRequestBytes bounds the request bodies the processor holds itself (STREAMED,
	// FULL_DUPLEX_STREAMED).
	DefaultMaxRequestBytes = 1 << 20
	// MaxRequestBytesLimit is the largest max_request_bytes accepted.
	MaxRequestBytesLimit = 256 << 20
	// MaxResponseBytesLimit is the largest max_response_bytes accepted.
	MaxResponseBytesLimit = 256 << 20
	// MaxDuration is the longest ttl, max_ttl and lock_ttl accepted: ten years, the stores' limit
	// (cache.MaxTTL).
	MaxDuration = 10 * 365 * 24 * time.Hour
	// MaxInFlightWait is the longest in_flight_wait accepted.
	MaxInFlightWait = 10 * time.Second
	// DefaultMetadataNamespace is the dynamic metadata namespace of the outcome.
	DefaultMetadataNamespace = "idempotency"
	// DefaultProblemContentType is the content type of a problem whose entry sets none.
	DefaultProblemContentType = "application/problem+json"
	// MaxProblemBytes bounds a rendered problem body.
	MaxProblemBytes = 64 << 10
)

// Policy is a compiled, valid policy. It is immutable and safe for concurrent use.
type Policy struct {
	// Routes in file order; the first whose match holds wins.
	Routes []*Route
	// Default applies to requests that no route takes. Its name is "default".
	Default      *Route
	FailMode     FailMode
	StoreTimeout time.Duration
	// MetadataNamespace is the dynamic metadata namespace the outcome is written under.
	MetadataNamespace string
	// Problems are the top-level problems entries, for answers that no route gives (an unknown
	// x-idempotency-route); every route's Problems already include them. Nil when none is set.
	Problems map[string]*Problem
	// Durability is the top-level durability, which every route's Durability starts from.
	Durability Durability

	byName map[string]*Route
}

// Route is the compiled settings of one route.
type Route struct {
	Name    string
	Enabled bool
	// Mode is ModeEnforce or ModeShadow.
	Mode Mode

	match matcher
	// scopeGroups are the regex submatch indexes of the ScopePathParam entries of Scope, in order.
	scopeGroups []int

	// Scope lists where the scope values come from, in the order they are hashed. scope_headers
	// and scope_path_params compile into it: the headers first, then the path parameters.
	Scope []ScopeSource
	// ScopeHeaders are the names of Scope's ScopeHeader entries, in order.
	ScopeHeaders []string
	// ScopePathParams are the names of Scope's ScopePathParam entries, in order; Select returns
	// their values in this order.
	ScopePathParams []string
	// RequireScope answers 401 scope-missing to a covered request whose scope values are all
	// empty.
	RequireScope bool
	// JWTPayloadKey names the jwt_authn payload that jwt_claim entries read; empty means the only
	// one there.
	JWTPayloadKey string

	// Methods are the request methods the route covers; a request of another passes through.
	Methods            []string
	KeyHeaders         []string
	MissingKey         MissingKey
	TTL                time.Duration
	TTLHeader          string
	MaxTTL             time.Duration
	LockTTL            time.Duration
	Fingerprint        []Part
	FingerprintHeaders []string
	StoreStatuses      StatusSet
	// GRPC: the route is a gRPC unary method: its requests without a :path (grpc-go's ext_proc
	// client) are gRPC; one with a :path is gRPC only by its content-type.
	GRPC bool
	// StoreGRPCStatuses are the grpc-status values of gRPC responses that are stored.
	StoreGRPCStatuses GRPCStatusSet
	UnknownOutcome    UnknownOutcome
	MaxResponseBytes  int
	MaxRequestBytes   int
	// StoreBody false keeps status and headers only: duplicates get 409 response-not-replayable.
	StoreBody bool
	// InFlightWait is how long a duplicate of a request in flight may wait for its replay; 0
	// answers 409 at once.
	InFlightWait time.Duration

	ReplayHeader string
	// ReplayHeaderFresh writes ReplayHeader: false on fresh responses; without it the header is
	// on replays only.
	ReplayHeaderFresh bool
	// ExpiresHeader carries the record's expiry on stored responses and replays; empty: none.
	ExpiresHeader string
	// FirstSentHeader carries the first request's time on replays; empty: none.
	FirstSentHeader        string
	ExcludeResponseHeaders []string
	KeyPrefix              string

	// Problems replace the built-in problem responses, by problem code: the route's entries over
	// the top-level ones. Nil when neither sets any.
	Problems map[string]*Problem
	// Durability is how many replicas of the store confirm the route's claims and completions:
	// the top-level durability with the route's fields over it.
	Durability Durability

	// The request body's members the route reads (jsonroute.go). KeyJSON are tried after
	// KeyHeaders, in order. ScopeJSON are the pointers of Scope's ScopeJSON entries, in order.
	// FingerprintIgnoreJSON, when not empty, fingerprints the body's canonical form without
	// those members. JSONRPC leaves the request's id out of the fingerprint, puts it in
	// replays, and answers the processor's problems as JSON-RPC errors.
	KeyJSON               []jsonbody.Pointer
	ScopeJSON             []jsonbody.Pointer
	FingerprintIgnoreJSON []jsonbody.Pointer
	JSONRPC               bool
}

// Selector is what a route is chosen by.
type Selector struct {
	// Path is the request path without its query.
	Path string
	// RouteName is Envoy's xds.route_name attribute; empty when Envoy did not send it.
	RouteName string
	// Named is the x-idempotency-route gRPC initial metadata: a route named outright.
	Named string
}

// ErrUnknownRoute is what every *UnknownRouteError is (errors.Is).
var ErrUnknownRoute = errors.New("policy: unknown route")

// UnknownRouteError is Select's error for an x-idempotency-route that names no route of the file.
type UnknownRouteError struct{ Name string }

func (e *UnknownRouteError) Error() string {
	// The name comes from the caller's configuration, unbounded: only its start is quoted.
	name, more := e.Name, ""
	if len(name) > maxQuotedName {
		name, more = name[:maxQuotedName], fmt.Sprintf(" (%d bytes in all)", len(e.Name))
	}
	return fmt.Sprintf("policy: x-idempotency-route names %q%s, which the policy file does not define", name, more)
}

// maxQuotedName bounds the part of an unknown route name an error message quotes.
const maxQuotedName = 256

// Is reports whether target is ErrUnknownRoute.
func (e *UnknownRouteError) Is(target error) bool { return target == ErrUnknownRoute }

// ErrPathParams is what every *PathParamsError is (errors.Is).
var ErrPathParams = errors.New("policy: path parameters not found")

// PathParamsError is Select's error when a route named by x-idempotency-route scopes by path
// parameters and its path_regex does not match the path, so that they have no value. Select
// returns the route with it, for the route label.
type PathParamsError struct{ Route string }

func (e *PathParamsError) Error() string {
	return fmt.Sprintf("policy: route %q is named by x-idempotency-route, but its path_regex does not match the path, so its scope's path parameters have no value", e.Route)
}

// Is reports whether target is ErrPathParams.
func (e *PathParamsError) Is(target error) bool { return target == ErrPathParams }

// Select returns the route for a request, and the values of the route's ScopePathParams in
// order (nil when it has none). Named wins over every match: it must name a route of the file
// (or "default", the defaults), else the error is an *UnknownRouteError; a named route that scopes
// by path parameters its path_regex cannot read from Path comes with a *PathParamsError.
// Otherwise the first route in file order whose match holds wins (route-name matchers never hold
// when RouteName is empty), else Default.
func (p *Policy) Select(s Selector) (*Route, []string, error) {
	if s.Named != "" {
		r := p.byName[s.Named]
		if r == nil {
			return nil, nil, &UnknownRouteError{Name: s.Named}
		}
		if len(r.scopeGroups) == 0 {
			return r, nil, nil
		}
		m := r.match.re.FindStringSubmatch(s.Path)
		if m == nil {
			return r, nil, &PathParamsError{Route: r.Name}
		}
		return r, r.params(m), nil
	}
	for _, r := range p.Routes {
		if m, ok := r.match.holds(s); ok {
			return r, r.params(m), nil
		}
	}
	return p.Default, nil, nil
}

// Match returns the route for path (without its query) as Select does with nothing but the
// path: the first route whose path match holds, else Default. The second result holds the
// values of the route's ScopePathParams, in order.
func (p *Policy) Match(path string) (*Route, []string) {
	r, params, _ := p.Select(Selector{Path: path})
	return r, params
}

// params returns the values of r's scope path parameters in m, the submatches of its path_regex.
func (r *Route) params(m []string) []string {
	if len(r.scopeGroups) == 0 {
		return nil
	}
	params := make([]string, len(r.scopeGroups))
	for i, g := range r.scopeGroups {
		params[i] = m[g]
	}
	return params
}

// MaxResponseBytes returns the largest max_response_bytes of any route.
func (p *Policy) MaxResponseBytes() int {
	n := p.Default.MaxResponseBytes
	for _, r := range p.Routes {
		n = max(n, r.MaxResponseBytes)
	}
	return n
}

// MaxRequestBytes returns the largest max_request_bytes of any route.
func (p *Policy) MaxRequestBytes() int {
	n := p.Default.MaxRequestBytes
	for _, r := range p.Routes {
		n = max(n, r.MaxRequestBytes)
	}
	return n
}

// matchKind is which of a route's six matchers it has.
type matchKind string

// The match keys.
const (
	matchPathPrefix      matchKind = "path_prefix"
	matchPathExact       matchKind = "path_exact"
	matchPathRegex       matchKind = "path_regex"
	matchRouteNameExact  matchKind = "route_name_exact"
	matchRouteNamePrefix matchKind = "route_name_prefix"
	matchRouteNameRegex  matchKind = "route_name_regex"
)

func matchKinds() []matchKind {
	return []matchKind{matchPathPrefix, matchPathExact, matchPathRegex, matchRouteNameExact, matchRouteNamePrefix, matchRouteNameRegex}
}

// matcher is a route's match: one test of the path or of Envoy's route name, and the body
// members match.json asks for (tested by SelectBy).
type matcher struct {
	kind  matchKind
	value string
	re    *regexp.Regexp // for the regex kinds
	json  []JSONMatch
}

// holds reports whether the matcher holds for s, and for a path_regex its submatches.
func (m matcher) holds(s Selector) ([]string, bool) {
	switch m.kind {
	case matchPathPrefix:
		return nil, strings.HasPrefix(s.Path, m.value)
	case matchPathExact:
		return nil, s.Path == m.value
	case matchPathRegex:
		sub := m.re.FindStringSubmatch(s.Path)
		return sub, sub != nil
	case matchRouteNameExact:
		return nil, s.RouteName != "" && s.RouteName == m.value
	case matchRouteNamePrefix:
		return nil, s.RouteName != "" && strings.HasPrefix(s.RouteName, m.value)
	case matchRouteNameRegex:
		return nil, s.RouteName != "" && m.re.MatchString(s.RouteName)
	}
	return nil, false
}

// ReadsClaims reports whether the route's scope reads the verified JWT payload (a jwt_claim
// entry), which Envoy sends only when it forwards jwt_authn's metadata namespace.
func (r *Route) ReadsClaims() bool {
	return slices.ContainsFunc(r.Scope, func(src ScopeSource) bool { return src.Kind == ScopeJWTClaim })
}

// FingerprintsBody reports whether the route's fingerprint includes the request body.
func (r *Route) FingerprintsBody() bool { return slices.Contains(r.Fingerprint, PartBody) }

// MatchesRouteName reports whether the route is matched by Envoy's route name (a route_name_*
// matcher), which Envoy sends only when xds.route_name is in request_attributes.
func (r *Route) MatchesRouteName() bool {
	switch r.match.kind {
	case matchRouteNameExact, matchRouteNamePrefix, matchRouteNameRegex:
		return true
	}
	return false
}

// StatusSet is a set of HTTP status codes, given as classes ("2xx") or codes (409).
type StatusSet struct{ bits [10]uint64 }

// Has reports whether code is in the set.
func (s StatusSet) Has(code int) bool {
	if code < 0 || code >= 640 {
		return false
	}
	return s.bits[code/64]&(1<<(code%64)) != 0
}

func (s *StatusSet) add(code int) { s.bits[code/64] |= 1 << (code % 64) }

// GRPCStatusSet is a set of gRPC status codes (0 to 16), one bit each.
type GRPCStatusSet uint32

// Has reports whether code is in the set.
func (s GRPCStatusSet) Has(code int) bool {
	return code >= 0 && code < len(GRPCStatusNames) && s&(1<<code) != 0
}

// GRPCStatusNames are the gRPC status codes' canonical names, by number
// (https://grpc.github.io/grpc/core/md_doc_statuscodes.html).
var GRPCStatusNames = [...]string{
	"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
	"ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",
	"OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
}

// Problem replaces the built-in answer for one problem code (docs/outcomes.md lists the codes).
type Problem struct {
	// Status is the HTTP status; 0 keeps the built-in one.
	Status int
	// ContentType is DefaultProblemContentType unless the entry sets another.
	ContentType string
	// Body renders the body from a ProblemData; nil keeps the built-in body. It was executed
	// once at start-up, so that a field it names is one of ProblemData's.
	Body *template.Template
}

// ProblemData is what a problem body template is executed on.
type ProblemData struct {
	Code   string // the problem code, such as request-in-progress
	Title  string // the status's RFC 9110 reason phrase
	Detail string // one sentence
	Status int    // the HTTP status the client gets
}

// Render executes the problem's body template on d. It fails when the template does or when the
// body would exceed MaxProblemBytes; Body must not be nil.
func (p *Problem) Render(d ProblemData) ([]byte, error) {
	var w limitedWriter
	if err := p.Body.Execute(&w, d); err != nil {
		return nil, err
	}
	return w.buf, nil
}

// limitedWriter keeps up to MaxProblemBytes and fails past them.
type limitedWriter struct{ buf []byte }

func (w *limitedWriter) Write(p []byte) (int, error) {
	if len(w.buf)+len(p) > MaxProblemBytes {
		return 0, fmt.Errorf("the body exceeds %d bytes", MaxProblemBytes)
	}
	w.buf = append(w.buf, p...)
	return len(p), nil
}

// ProblemCodes are the problem codes the processor answers with, the keys a problems entry may
// have. Read it; never modify it.
var ProblemCodes = []string{
	"missing-idempotency-key",
	"invalid-idempotency-key",
	"invalid-ttl",
	"request-in-progress",
	"idempotency-key-reused",
	"response-not-replayable",
	"outcome-unknown",
	"store-unavailable",
	"durability-unmet",
	"request-too-large",
	"body-not-available",
	"unknown-idempotency-route",
	"scope-missing",
	"scope-ambiguous",
	"scope-claim-ambiguous",
	"grpc-not-unary",
	"idempotency-key-conflict",
	"invalid-json-body",
}

// Default returns the policy with every built-in default and no routes.
func Default() *Policy {
	p, err := Parse(nil)
	if err != nil {
		panic("policy: the built-in defaults do not compile: " + err.Error()) // a programming error
	}
	return p
}

// Parse compiles a policy file. The error names every bad field at once, each as a *FieldError
// (joined with errors.Join).
func Parse(data []byte) (*Policy, error) {
	p, _, err := ParseFile(data, nil)
	return p, err
}

// MatchesName reports whether the route is matched by Envoy's route name (a route_name_*
// matcher) and its matcher holds for name.
func (r *Route) MatchesName(name string) bool {
	if !r.MatchesRouteName() {
		return false
	}
	_, ok := r.match.holds(Selector{RouteName: name})
	return ok
}
