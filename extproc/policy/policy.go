// Package policy reads the YAML policy file (SPEC §6) and compiles it into the per-route settings
// the stream state machine consults.
package policy

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
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
	// 409 outcome-unknown until an operator purges the key or the TTL ends (SPEC §8).
	UnknownOutcomeRecord UnknownOutcome = "record"
)

// FailMode says what happens to a covered request when the store fails.
type FailMode string

// The fail_mode values.
const (
	FailClosed FailMode = "closed" // answer 503 store-unavailable
	FailOpen   FailMode = "open"   // pass the request through untouched
)

// Part is one element of the request fingerprint.
type Part string

// The fingerprint parts.
const (
	PartMethod Part = "method"
	PartPath   Part = "path" // with the query
	PartBody   Part = "body" // raw bytes
)

// Defaults of SPEC §6.
const (
	DefaultTTL              = 24 * time.Hour
	DefaultLockTTL          = 30 * time.Second
	DefaultStoreTimeout     = 100 * time.Millisecond
	DefaultMaxResponseBytes = 1 << 20
	// DefaultMaxRequestBytes bounds the request bodies the processor holds itself (STREAMED,
	// FULL_DUPLEX_STREAMED; SPEC §8).
	DefaultMaxRequestBytes = 1 << 20
	// MaxRequestBytesLimit is the largest max_request_bytes accepted.
	MaxRequestBytesLimit = 256 << 20
	// MaxResponseBytesLimit is the largest max_response_bytes accepted.
	MaxResponseBytesLimit = 256 << 20
	// MaxDuration is the longest ttl, max_ttl and lock_ttl accepted: ten years, the stores' limit
	// (cache.MaxTTL).
	MaxDuration = 10 * 365 * 24 * time.Hour
)

// Document is the policy file as written. Every field of a route is optional: unset fields are
// inherited from defaults, field by field.
type Document struct {
	Defaults     Spec   `yaml:"defaults"`
	Routes       []Spec `yaml:"routes"`
	FailMode     string `yaml:"fail_mode"`
	StoreTimeout string `yaml:"store_timeout"`
}

// Spec is one route, or the defaults, as written in the file.
type Spec struct {
	Name                   string     `yaml:"name"`
	Match                  *MatchSpec `yaml:"match"`
	Enabled                *bool      `yaml:"enabled"`
	ScopePathParams        *[]string  `yaml:"scope_path_params"`
	Methods                *[]string  `yaml:"methods"`
	KeyHeaders             *[]string  `yaml:"key_headers"`
	MissingKey             *string    `yaml:"missing_key"`
	TTL                    *string    `yaml:"ttl"`
	TTLHeader              *string    `yaml:"ttl_header"`
	MaxTTL                 *string    `yaml:"max_ttl"`
	LockTTL                *string    `yaml:"lock_ttl"`
	Fingerprint            *[]string  `yaml:"fingerprint"`
	FingerprintHeaders     *[]string  `yaml:"fingerprint_headers"`
	ScopeHeaders           *[]string  `yaml:"scope_headers"`
	StoreStatuses          *[]any     `yaml:"store_statuses"`
	UnknownOutcome         *string    `yaml:"unknown_outcome"`
	MaxResponseBytes       *int64     `yaml:"max_response_bytes"`
	MaxRequestBytes        *int64     `yaml:"max_request_bytes"`
	ReplayHeader           *string    `yaml:"replay_header"`
	ExcludeResponseHeaders *[]string  `yaml:"exclude_response_headers"`
	KeyPrefix              *string    `yaml:"key_prefix"`
}

// MatchSpec selects a route by the request path without its query; exactly one field is set.
type MatchSpec struct {
	PathPrefix string `yaml:"path_prefix"`
	PathExact  string `yaml:"path_exact"`
	PathRegex  string `yaml:"path_regex"`
}

// Policy is a compiled, valid policy. It is immutable and safe for concurrent use.
type Policy struct {
	// Routes in file order; the first match wins.
	Routes []*Route
	// Default applies to paths that match no route. Its name is "default".
	Default      *Route
	FailMode     FailMode
	StoreTimeout time.Duration
}

// Route is the compiled settings of one route.
type Route struct {
	Name    string
	Enabled bool

	prefix, exact string
	regex         *regexp.Regexp
	// scopeGroups are the regex submatch indexes of ScopePathParams, in order.
	scopeGroups []int

	ScopePathParams        []string
	Methods                []string
	KeyHeaders             []string
	MissingKey             MissingKey
	TTL                    time.Duration
	TTLHeader              string
	MaxTTL                 time.Duration
	LockTTL                time.Duration
	Fingerprint            []Part
	FingerprintHeaders     []string
	ScopeHeaders           []string
	StoreStatuses          StatusSet
	UnknownOutcome         UnknownOutcome
	MaxResponseBytes       int
	MaxRequestBytes        int
	ReplayHeader           string
	ExcludeResponseHeaders []string
	KeyPrefix              string
}

// Match returns the route for path (without its query): the first route that matches, else
// Default. The second result holds the values of the route's scope_path_params, in order.
func (p *Policy) Match(path string) (*Route, []string) {
	for _, r := range p.Routes {
		switch {
		case r.regex != nil:
			m := r.regex.FindStringSubmatch(path)
			if m == nil {
				continue
			}
			var params []string
			if len(r.scopeGroups) > 0 {
				params = make([]string, len(r.scopeGroups))
				for i, g := range r.scopeGroups {
					params[i] = m[g]
				}
			}
			return r, params
		case r.exact != "":
			if path == r.exact {
				return r, nil
			}
		case strings.HasPrefix(path, r.prefix):
			return r, nil
		}
	}
	return p.Default, nil
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

// Covers reports whether method is one of the route's methods.
func (r *Route) Covers(method string) bool { return slices.Contains(r.Methods, method) }

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

// Default returns the policy with every default of SPEC §6 and no routes.
func Default() *Policy {
	p, err := Compile(Document{})
	if err != nil {
		panic("policy: the built-in defaults do not compile: " + err.Error()) // a programming error
	}
	return p
}

// Parse decodes a policy file strictly and compiles it. The error names every bad field at once.
func Parse(data []byte) (*Policy, error) {
	var doc Document
	if err := Decode(data, &doc); err != nil {
		// Decoding keeps going past type errors; report them with the semantic ones.
		_, cerr := Compile(doc)
		return nil, errors.Join(err, cerr)
	}
	return Compile(doc)
}

// typeError is how yaml.v3 words a value of the wrong type: its line, its tag and, for a scalar,
// the value (its first 7 bytes and "..." when longer than 10); never the field.
var typeError = regexp.MustCompile("^line (\\d+): cannot unmarshal !!(\\w+)(?: `(.*)`)? into ")

// nameField puts the path of the field a yaml.v3 type error is about in front of it, such as
// defaults.max_response_bytes, found in root by the error's line and value; it leaves other
// errors as they are.
func nameField(root *yaml.Node, msg string) string {
	m := typeError.FindStringSubmatch(msg)
	if m == nil {
		return msg
	}
	line, _ := strconv.Atoi(m[1])
	kind := map[string]yaml.Kind{"map": yaml.MappingNode, "seq": yaml.SequenceNode}[m[2]]
	if kind == 0 {
		kind = yaml.ScalarNode
	}
	value, short := strings.CutSuffix(m[3], "...")
	var found string
	walkFields(root, "", func(n *yaml.Node, path string) bool {
		if found == "" && n.Kind == kind && n.Line == line && path != "" &&
			(kind != yaml.ScalarNode || n.Value == value || short && strings.HasPrefix(n.Value, value)) {
			found = path
		}
		return found == ""
	})
	if found == "" {
		return msg
	}
	return found + " (" + msg + ")"
}

// nullFields reports every value in root that is null, by its path.
func nullFields(root *yaml.Node) []error {
	var errs []error
	walkFields(root, "", func(n *yaml.Node, path string) bool {
		if path != "" && n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
			errs = append(errs, fmt.Errorf("policy: %s: has no value (leave the field out to inherit it; \"\" is the empty string)", path))
		}
		return true
	})
	return errs
}

// walkFields calls visit on n, at path, and on what n holds, each at its own path (defaults.ttl,
// routes[0].match), as long as visit returns true.
func walkFields(n *yaml.Node, path string, visit func(n *yaml.Node, path string) bool) {
	if !visit(n, path) {
		return
	}
	switch n.Kind {
	case yaml.DocumentNode:
		for _, c := range n.Content {
			walkFields(c, path, visit)
		}
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			walkFields(n.Content[i+1], join(path, n.Content[i].Value), visit)
		}
	case yaml.SequenceNode:
		for i, c := range n.Content {
			walkFields(c, fmt.Sprintf("%s[%d]", path, i), visit)
		}
	}
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// Decode decodes YAML into v (a Document, or a struct that inlines one), rejecting unknown
// fields. An empty document leaves v unchanged.
//
// A field written without a value (`ttl_header:` or `ttl_header: ~`) is an error: YAML reads it
// as null, which would leave the field unset and so inherited, the opposite of what an empty
// value suggests.
func Decode(data []byte, v any) error {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	err := dec.Decode(v)
	if errors.Is(err, io.EOF) {
		return nil
	}
	// The file's fields as a node tree, parsed once, to name them in errors; none if it does not
	// parse (the decoder has said why).
	var root yaml.Node
	if yaml.Unmarshal(data, &root) != nil {
		root = yaml.Node{}
	}
	errs := nullFields(&root)
	var te *yaml.TypeError
	if errors.As(err, &te) {
		for _, e := range te.Errors {
			errs = append(errs, errors.New("policy: "+nameField(&root, e)))
		}
		return errors.Join(errs...)
	}
	if err != nil {
		return fmt.Errorf("policy: %w", err)
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	var extra any
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		return errors.New("policy: the file must hold one YAML document")
	}
	return nil
}

// Compile validates doc and applies the defaults. The error names every bad field at once.
func Compile(doc Document) (*Policy, error) {
	c := compiler{}
	p := &Policy{FailMode: FailClosed, StoreTimeout: DefaultStoreTimeout}
	switch FailMode(doc.FailMode) {
	case "":
	case FailClosed, FailOpen:
		p.FailMode = FailMode(doc.FailMode)
	default:
		c.errorf("fail_mode", "must be closed or open, got %q", doc.FailMode)
	}
	if doc.StoreTimeout != "" {
		p.StoreTimeout = c.duration("store_timeout", doc.StoreTimeout)
	}

	base := builtin()
	d := doc.Defaults
	if d.Name != "" || d.Match != nil || d.ScopePathParams != nil {
		c.errorf("defaults", "name, match and scope_path_params belong to routes, not defaults")
	}
	def := c.route("defaults", base, d)
	def.Name = "default"
	p.Default = def

	names := map[string]bool{"default": true}
	for i, spec := range doc.Routes {
		field := fmt.Sprintf("routes[%d]", i)
		if spec.Name != "" {
			field = fmt.Sprintf("routes[%d] (%s)", i, spec.Name)
		}
		switch {
		case spec.Name == "":
			c.errorf(field+".name", "is required")
		case names[spec.Name]:
			c.errorf(field+".name", "%q is used twice (or is the reserved name of the defaults)", spec.Name)
		}
		names[spec.Name] = true
		r := c.route(field, def, spec)
		r.Name = spec.Name
		c.match(field, r, spec)
		p.Routes = append(p.Routes, r)
	}
	if err := errors.Join(c.errs...); err != nil {
		return nil, err
	}
	return p, nil
}

func builtin() *Route {
	var statuses StatusSet
	for code := 200; code < 300; code++ {
		statuses.add(code)
	}
	return &Route{
		Enabled:          true,
		Methods:          []string{"POST", "PUT", "PATCH"},
		KeyHeaders:       []string{"idempotency-key", "x-idempotency-key", "x-idempotency"},
		MissingKey:       MissingKeyOptional,
		TTL:              DefaultTTL,
		TTLHeader:        "x-ttl",
		MaxTTL:           DefaultTTL,
		LockTTL:          DefaultLockTTL,
		Fingerprint:      []Part{PartMethod, PartPath, PartBody},
		ScopeHeaders:     []string{"authorization"},
		StoreStatuses:    statuses,
		UnknownOutcome:   UnknownOutcomeRelease,
		MaxResponseBytes: DefaultMaxResponseBytes,
		MaxRequestBytes:  DefaultMaxRequestBytes,
		ReplayHeader:     "x-idempotency-replayed",
		KeyPrefix:        "idempotency:",
	}
}

type compiler struct{ errs []error }

func (c *compiler) errorf(field, format string, args ...any) {
	c.errs = append(c.errs, fmt.Errorf("policy: %s: %s", field, fmt.Sprintf(format, args...)))
}

func (c *compiler) duration(field, s string) time.Duration {
	d, err := time.ParseDuration(s)
	switch {
	case err != nil:
		c.errorf(field, "invalid duration %q (use units such as 300ms, 30s, 24h)", s)
	case d < time.Millisecond:
		c.errorf(field, "must be at least 1ms, got %s", s)
	case d > MaxDuration:
		c.errorf(field, "must be at most %v (ten years), got %s", MaxDuration, s)
	}
	return d
}

// route returns a copy of parent with the fields spec sets, validating each.
func (c *compiler) route(field string, parent *Route, spec Spec) *Route {
	r := *parent
	r.regex, r.prefix, r.exact, r.scopeGroups, r.ScopePathParams = nil, "", "", nil, nil
	f := func(name string) string { return field + "." + name }

	if spec.Enabled != nil {
		r.Enabled = *spec.Enabled
	}
	if spec.Methods != nil {
		r.Methods = nil
		for _, m := range *spec.Methods {
			if !isToken(m) {
				c.errorf(f("methods"), "%q is not an HTTP method", m)
				continue
			}
			r.Methods = append(r.Methods, strings.ToUpper(m))
		}
	}
	if spec.KeyHeaders != nil {
		r.KeyHeaders = c.headerNames(f("key_headers"), *spec.KeyHeaders)
		if len(r.KeyHeaders) == 0 {
			c.errorf(f("key_headers"), "must name at least one header")
		}
	}
	if spec.MissingKey != nil {
		switch v := MissingKey(*spec.MissingKey); v {
		case MissingKeyOptional, MissingKeyRequired, MissingKeyBodyHash:
			r.MissingKey = v
		default:
			c.errorf(f("missing_key"), "must be optional, required or body-hash, got %q", *spec.MissingKey)
		}
	}
	if spec.TTL != nil {
		r.TTL = c.duration(f("ttl"), *spec.TTL)
	}
	if spec.MaxTTL != nil {
		r.MaxTTL = c.duration(f("max_ttl"), *spec.MaxTTL)
	}
	if spec.LockTTL != nil {
		r.LockTTL = c.duration(f("lock_ttl"), *spec.LockTTL)
	}
	if r.TTL > r.MaxTTL && (spec.TTL != nil || spec.MaxTTL != nil) {
		c.errorf(f("ttl"), "%v exceeds max_ttl %v", r.TTL, r.MaxTTL)
	}
	if spec.TTLHeader != nil {
		r.TTLHeader = ""
		if *spec.TTLHeader != "" {
			if names := c.headerNames(f("ttl_header"), []string{*spec.TTLHeader}); len(names) == 1 {
				r.TTLHeader = names[0]
			}
		}
	}
	if spec.Fingerprint != nil {
		r.Fingerprint = nil
		for _, p := range *spec.Fingerprint {
			part := Part(p)
			switch {
			case part != PartMethod && part != PartPath && part != PartBody:
				c.errorf(f("fingerprint"), "%q is not one of method, path, body", p)
			case slices.Contains(r.Fingerprint, part):
				c.errorf(f("fingerprint"), "%q is listed twice", p)
			default:
				r.Fingerprint = append(r.Fingerprint, part)
			}
		}
	}
	if spec.FingerprintHeaders != nil {
		r.FingerprintHeaders = c.requestHeaderNames(f("fingerprint_headers"), *spec.FingerprintHeaders)
	}
	if len(r.Fingerprint) == 0 && len(r.FingerprintHeaders) > 0 && (spec.Fingerprint != nil || spec.FingerprintHeaders != nil) {
		// An empty fingerprint turns the mismatch check off (SPEC §4): headers alone would
		// silently be ignored.
		c.errorf(f("fingerprint_headers"), "set while fingerprint is [], which turns the mismatch check off; list the parts to hash too, or drop the headers")
	}
	if spec.ScopeHeaders != nil {
		r.ScopeHeaders = c.requestHeaderNames(f("scope_headers"), *spec.ScopeHeaders)
	}
	if spec.StoreStatuses != nil {
		r.StoreStatuses = c.statuses(f("store_statuses"), *spec.StoreStatuses)
	}
	if spec.UnknownOutcome != nil {
		switch v := UnknownOutcome(*spec.UnknownOutcome); v {
		case UnknownOutcomeRelease, UnknownOutcomeKeep, UnknownOutcomeRecord:
			r.UnknownOutcome = v
		default:
			c.errorf(f("unknown_outcome"), "must be release, keep or record, got %q", *spec.UnknownOutcome)
		}
	}
	if spec.MaxResponseBytes != nil {
		n := *spec.MaxResponseBytes
		if n < 0 || n > MaxResponseBytesLimit {
			c.errorf(f("max_response_bytes"), "must be between 0 and %d, got %d", MaxResponseBytesLimit, n)
		} else {
			r.MaxResponseBytes = int(n)
		}
	}
	if spec.MaxRequestBytes != nil {
		n := *spec.MaxRequestBytes
		if n < 0 || n > MaxRequestBytesLimit {
			c.errorf(f("max_request_bytes"), "must be between 0 and %d, got %d", MaxRequestBytesLimit, n)
		} else {
			r.MaxRequestBytes = int(n)
		}
	}
	if spec.ReplayHeader != nil {
		names := c.headerNames(f("replay_header"), []string{*spec.ReplayHeader})
		if len(names) == 1 {
			r.ReplayHeader = names[0]
		}
	}
	if spec.ExcludeResponseHeaders != nil {
		r.ExcludeResponseHeaders = c.headerNames(f("exclude_response_headers"), *spec.ExcludeResponseHeaders)
	}
	if spec.KeyPrefix != nil {
		r.KeyPrefix = *spec.KeyPrefix
	}
	return &r
}

func (c *compiler) match(field string, r *Route, spec Spec) {
	m := spec.Match
	if m == nil {
		c.errorf(field+".match", "is required (path_prefix, path_exact or path_regex)")
		return
	}
	set := 0
	for _, v := range []string{m.PathPrefix, m.PathExact, m.PathRegex} {
		if v != "" {
			set++
		}
	}
	if set != 1 {
		c.errorf(field+".match", "needs exactly one of path_prefix, path_exact or path_regex")
		return
	}
	switch {
	case m.PathPrefix != "":
		r.prefix = m.PathPrefix
		if !strings.HasPrefix(m.PathPrefix, "/") {
			c.errorf(field+".match.path_prefix", "must start with /, got %q", m.PathPrefix)
		}
	case m.PathExact != "":
		r.exact = m.PathExact
		if !strings.HasPrefix(m.PathExact, "/") {
			c.errorf(field+".match.path_exact", "must start with /, got %q", m.PathExact)
		}
	default:
		re, err := regexp.Compile(m.PathRegex)
		if err != nil {
			c.errorf(field+".match.path_regex", "invalid regular expression: %v", err)
			return
		}
		r.regex = re
	}
	if spec.ScopePathParams == nil {
		return
	}
	if r.regex == nil {
		c.errorf(field+".scope_path_params", "needs a path_regex with named groups")
		return
	}
	for _, name := range *spec.ScopePathParams {
		i := r.regex.SubexpIndex(name)
		if i < 0 {
			c.errorf(field+".scope_path_params", "%q is not a named group of path_regex", name)
			continue
		}
		if n := countOf(r.regex.SubexpNames(), name); n > 1 {
			// Only the first would be read: a path matched by another branch would scope by "".
			c.errorf(field+".scope_path_params", "%q names %d groups of path_regex; give each a name of its own", name, n)
			continue
		}
		r.scopeGroups = append(r.scopeGroups, i)
		r.ScopePathParams = append(r.ScopePathParams, name)
	}
}

func (c *compiler) headerNames(field string, names []string) []string {
	out := make([]string, 0, len(names))
	for _, n := range names {
		if !isToken(n) {
			c.errorf(field, "%q is not a valid header name", n)
			continue
		}
		out = append(out, strings.ToLower(n))
	}
	return out
}

// requestHeaderNames is headerNames for the request headers a route reads as scope or payload.
// Envoy gives the processor the request's host as :authority, never as host, so that name is
// refused and :authority taken instead.
func (c *compiler) requestHeaderNames(field string, names []string) []string {
	out := make([]string, 0, len(names))
	for _, n := range names {
		switch strings.ToLower(n) {
		case ":authority":
			out = append(out, ":authority")
		case "host":
			c.errorf(field, "%q never reaches the processor: Envoy passes the request's host as \":authority\"; name that instead", n)
		default:
			out = append(out, c.headerNames(field, []string{n})...)
		}
	}
	return out
}

func (c *compiler) statuses(field string, values []any) StatusSet {
	var s StatusSet
	for _, v := range values {
		switch v := v.(type) {
		case int:
			if v < 100 || v > 599 {
				c.errorf(field, "%d is not an HTTP status code", v)
				continue
			}
			s.add(v)
		case string:
			if len(v) == 3 && v[0] >= '1' && v[0] <= '5' && strings.EqualFold(v[1:], "xx") {
				base := int(v[0]-'0') * 100
				for code := base; code < base+100; code++ {
					s.add(code)
				}
				continue
			}
			code, err := strconv.Atoi(v)
			if err != nil || code < 100 || code > 599 {
				c.errorf(field, "%q is neither a status class such as \"2xx\" nor a status code", v)
				continue
			}
			s.add(code)
		default:
			c.errorf(field, "%v is neither a status class such as \"2xx\" nor a status code", v)
		}
	}
	return s
}

func countOf(names []string, name string) int {
	n := 0
	for _, s := range names {
		if s == name {
			n++
		}
	}
	return n
}

// isToken reports whether s is a non-empty RFC 9110 token, the syntax of header names and methods.
func isToken(s string) bool {
	if s == "" || len(s) > math.MaxUint16 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return true
}
