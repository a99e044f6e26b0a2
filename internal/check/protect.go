package check

import (
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"

	mutationrulesv3 "github.com/envoyproxy/go-control-plane/envoy/config/common/mutation_rules/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	jwtauthnv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/jwt_authn/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// refusal is one setting CheckProtection refuses: the path of the field in the deployment's
// source, why the setting breaks protection and what to set instead.
type refusal struct {
	Kind   Kind   // what is refused, whatever the field's value
	Source string // Deployment.Source
	Field  string // e.g. "http_filters[envoy.filters.http.ext_proc].typed_config.forward_rules.allowed_headers"
	Reason string
	Fix    string
	// Resource and File name the resource that holds Field, and its input, when it is not the
	// deployment's own (an Istio VirtualService, an Envoy Gateway BackendTrafficPolicy): Field
	// then starts with Resource.
	Resource, File string
}

func (r *refusal) Error() string {
	if r.Source == "" {
		return r.Field + ": " + r.Reason
	}
	return r.Source + ": " + r.Field + ": " + r.Reason
}

// refusalsIn returns every refusal in err, which may be one or an errors.Join of several, in order.
func refusalsIn(err error) []*refusal { return collect[*refusal](err) }

// collect returns every T in err's tree (errors.Join and wrapping followed), in order; a T is not
// looked into.
func collect[T error](err error) []T {
	var out []T
	var walk func(error)
	walk = func(e error) {
		if e == nil {
			return
		}
		if r, ok := e.(T); ok {
			out = append(out, r)
			return
		}
		switch u := e.(type) {
		case interface{ Unwrap() []error }:
			for _, x := range u.Unwrap() {
				walk(x)
			}
		case interface{ Unwrap() error }:
			walk(u.Unwrap())
		}
	}
	walk(err)
	return out
}

// The names CheckProtection uses for what the processor reads and writes outside the policy.
const (
	// routeMetadataKey is the gRPC initial metadata key with which an Envoy route names a policy
	// route.
	routeMetadataKey = "x-idempotency-route"
	// jwtNamespace is the dynamic metadata namespace jwt_authn writes verified payloads to.
	jwtNamespace = "envoy.filters.http.jwt_authn"
	// defaultOutcomeNamespace is the namespace the processor writes its outcome to (the default of the
	// policy's metadata_namespace).
	defaultOutcomeNamespace = "idempotency"
)

// localReplyFix is the fix of every local_reply_config refusal.
const localReplyFix = "remove local_reply_config from the connection manager"

// retryFix is the fix of a retry condition that may run a claimed request again.
const retryFix = "keep only connect-failure, refused-stream and reset-before-request in retry_on on covered routes, or set num_retries 0"

// storedHeaderSample stands for "the stored response headers in general": the response fields of
// RFC 9110 and RFC 6265 an upstream commonly sends. A forward rule that hides one of them from the
// processor, or a mutation rule that refuses it, makes replays differ from first responses. Rules
// aimed only at other names (an operator's own x-internal-* headers, say) are accepted; the
// deployment guide (docs/deploying.md) says such headers are missing from replays.
var storedHeaderSample = []string{
	"content-type", "content-encoding", "content-language", "content-location", "location",
	"cache-control", "etag", "last-modified", "expires", "vary", "link", "set-cookie",
	"retry-after", "www-authenticate", "allow",
}

// CheckProtection returns every setting of d that silently breaks idempotency under p, each a
// *refusal naming the field, joined with errors.Join; nil when there is none. It
// complements CheckSpec, which holds the filter-level config to the contract without a policy.
// It refuses:
//
//   - local_reply_config on the connection manager (mappers or body_format): it rewrites every
//     local reply it matches, and replays and the processor's problem responses are local replies;
//   - forward_rules that hide from the processor a request header it reads (:method, :path,
//     content-type, and each enabled route's key, scope and fingerprint headers and ttl_header)
//     or a response header it stores (:status and the storedHeaderSample);
//   - mutation_rules with disallow_is_error (a refused mutation in a CONTINUE answer fails the
//     request with 500 after the upstream ran), or that refuse a header the processor sets
//     (each replay_header, content-type, retry-after) or the stored headers (storedHeaderSample);
//   - processing_request_modifier, at filter level or per route: it may rename the attributes and
//     metadata keys the processor looks up;
//   - request_attributes without xds.route_name or connection.uri_san_peer_certificate when the
//     policy reads them, metadata_options without forwarding envoy.filters.http.jwt_authn when
//     it reads JWT claims, and metadata_options without receiving the outcome namespace
//     (idempotency), at filter level and in per-route metadata_options (which replace the lists);
//   - where the connection manager is shown (a bootstrap) and the policy reads JWT claims: no
//     jwt_authn filter before ext_proc, no provider writing payload_in_metadata, or none writing
//     a route's jwt_payload_key;
//   - per route (every typed_per_filter_config of the filter): overrides.failure_mode_allow true;
//     a processing_mode that skips request headers (use disabled: true to opt a route out), skips
//     response headers, or uses the GRPC body mode (not implemented by Envoy); request_body_mode
//     NONE where the policy route (the one named by x-idempotency-route, else any enabled route)
//     needs the body; FULL_DUPLEX_STREAMED without its direction's trailer mode SEND; request
//     trailers other than SEND where the policy route needs the body (a request with trailers
//     and no data would skip the body phase and run unclaimed); and an
//     x-idempotency-route initial metadata that names no policy route (the processor would answer
//     500 unknown-idempotency-route);
//   - per route, the router's retry_policy (the route's, else its virtual host's; Istio's
//     VirtualService retries or its default policy; Envoy Gateway's BackendTrafficPolicy retry)
//     with a retry_on condition outside safeRetryOn, or retrying a status some enabled route
//     stores, and a hedge_policy that hedges on per-try timeouts: each may send a claimed request
//     upstream again after the upstream ran it.
//
// A per-route processing_mode replaces the filter-level one whole, and is read as Envoy reads
// it: DEFAULT header modes send, DEFAULT trailer modes skip. Per-route body modes the processor
// handles are accepted: BUFFERED, STREAMED, BUFFERED_PARTIAL, FULL_DUPLEX_STREAMED, and
// NONE where the body is not needed, for requests; all but GRPC for responses.
func CheckProtection(d Deployment, p *policy.Policy) error {
	if p == nil {
		return errors.New("no policy")
	}
	return checkProtection(d, needsOf(p))
}

// neededHeader is a request header the processor reads, with the first route that reads it.
type neededHeader struct {
	name, role, route string
}

// policyNeeds is what a policy reads from Envoy and writes back through it.
type policyNeeds struct {
	request       []neededHeader  // request headers, each name once
	replayHeaders []string        // the replay headers of enabled routes
	routes        map[string]bool // every route name the policy defines → it needs the request body
	anyBody       bool            // some enabled route needs the request body
	// What the policy reads besides headers: the xds.route_name attribute (route_name_*
	// matchers), the mTLS peer's URI SAN (peer_identity scope), and the verified JWT payload
	// (jwt_claim scope) of the routes in jwtKeys, each with the payload it reads.
	routeNameAttribute, peerIdentity bool
	jwtKeys                          []routeJWTKey
	outcomeNamespace                 string
	// unknownReleases: every enabled route releases the key on an unknown outcome;
	// envoyStatusStored: some enabled route stores a 4xx or 5xx, statuses Envoy also makes.
	unknownReleases, envoyStatusStored bool
	// stored reports whether some enabled route stores a response of this status (a router
	// retry on it would run a request whose outcome counts).
	stored func(status int) bool
}

// routeJWTKey is a route that scopes by jwt_claim and the payload it reads (its jwt_payload_key,
// "" for the only one there).
type routeJWTKey struct{ route, key string }

// needsOf derives policyNeeds from p's routes and default, enabled ones only: the scope list's
// header entries join the request headers, a jwt_claim entry needs the verified payload, a
// peer_identity entry the peer's URI SAN, a route_name_* matcher the route name, and the outcome
// goes to p's metadata_namespace.
func needsOf(p *policy.Policy) policyNeeds {
	n := policyNeeds{routes: map[string]bool{}, outcomeNamespace: p.MetadataNamespace, unknownReleases: true}
	var stores []policy.StatusSet
	n.stored = func(status int) bool {
		return slices.ContainsFunc(stores, func(s policy.StatusSet) bool { return s.Has(status) })
	}
	seen := map[string]bool{}
	add := func(name, role, route string) {
		if name == "" || seen[name] {
			return
		}
		seen[name] = true
		n.request = append(n.request, neededHeader{name, role, route})
	}
	for _, r := range append(slices.Clone(p.Routes), p.Default) {
		body := r.Enabled && (r.FingerprintsBody() || r.MissingKey == policy.MissingKeyBodyHash || r.ReadsJSON())
		n.routes[r.Name] = n.routes[r.Name] || body
		if !r.Enabled {
			continue
		}
		stores = append(stores, r.StoreStatuses)
		n.unknownReleases = n.unknownReleases && r.UnknownOutcome == policy.UnknownOutcomeRelease
		for status := 400; status < 600; status++ {
			n.envoyStatusStored = n.envoyStatusStored || r.StoreStatuses.Has(status)
		}
		n.anyBody = n.anyBody || body
		for _, h := range r.KeyHeaders {
			add(h, "key header", r.Name)
		}
		if r.ReadsClaims() {
			n.jwtKeys = append(n.jwtKeys, routeJWTKey{route: r.Name, key: r.JWTPayloadKey})
		}
		for _, src := range r.Scope {
			switch src.Kind {
			case policy.ScopeHeader:
				add(src.Name, "scope header", r.Name)
			case policy.ScopePeerIdentity:
				n.peerIdentity = true
			}
		}
		n.routeNameAttribute = n.routeNameAttribute || r.MatchesRouteName()
		for _, h := range r.FingerprintHeaders {
			add(h, "fingerprint header", r.Name)
		}
		add(r.TTLHeader, "ttl_header", r.Name)
		if !slices.Contains(n.replayHeaders, r.ReplayHeader) {
			n.replayHeaders = append(n.replayHeaders, r.ReplayHeader)
		}
	}
	return n
}

// roleWhy says what hiding a request header of each role from the processor does.
var roleWhy = map[string]string{
	"key header":         "requests would look keyless: they pass through unprotected (or get 400 under missing_key: required)",
	"scope header":       "every caller would share one scope and could be replayed another caller's response",
	"fingerprint header": "requests that differ in it would replay each other instead of getting 422",
	"ttl_header":         "per-request TTLs would be ignored",
	"request":            "the processor could not tell the method or route of a request",
	"content-type":       "gRPC calls would be taken for HTTP requests: answered with HTTP problems, and their outcome read from :status instead of grpc-status",
}

type checker struct {
	d    Deployment
	n    policyNeeds
	errs []error
	// retryChecked holds the retry paths already checked: a virtual host's policy is every
	// route's that has none of its own, and is reported once.
	retryChecked map[string]bool
}

// refuse records a refusal of field: what it breaks (format, args) and fix, what to set instead.
func (c *checker) refuse(kind Kind, field, fix, format string, args ...any) {
	c.errs = append(c.errs, &refusal{Kind: kind, Source: c.d.Source, Field: field, Reason: fmt.Sprintf(format, args...), Fix: fix})
}

func checkProtection(d Deployment, n policyNeeds) error {
	if d.Filter == nil {
		return fmt.Errorf("%s: no ext_proc filter config", d.Source)
	}
	c := &checker{d: d, n: n}
	f, fp := d.Filter, d.FilterPath

	if lr := d.LocalReply; lr != nil {
		for i := range lr.GetMappers() {
			c.refuse(kindLocalReplyConfig, fmt.Sprintf("%s.local_reply_config.mappers[%d]", d.HCMPath, i), localReplyFix,
				"rewrites the local replies it matches, and replays and the processor's problem responses are local replies: clients would get a different status, body or content-type")
		}
		if lr.GetBodyFormat() != nil {
			c.refuse(kindLocalReplyConfig, d.HCMPath+".local_reply_config.body_format", localReplyFix,
				"rewrites the body of every local reply, and replays are local replies: a replayed body would not be the stored one")
		}
	}
	c.forwardRules(fp+".forward_rules", f.GetForwardRules())
	c.mutationRules(fp+".mutation_rules", f.GetMutationRules())
	if f.GetProcessingRequestModifier() != nil {
		c.refuse(kindRequestModifier, fp+".processing_request_modifier", "remove processing_request_modifier", "may rename the attributes and metadata the processor looks up")
	}
	c.requestAttributes(fp+".request_attributes", f.GetRequestAttributes())
	c.metadataOptions(fp+".metadata_options", f.GetMetadataOptions())
	c.jwtPayloads()

	for _, e := range d.Routes {
		c.route(e)
	}
	return errors.Join(c.errs...)
}

// forwardRules refuses forward rules that hide a header the processor reads or stores.
func (c *checker) forwardRules(path string, fr *filterextproc.HeaderForwardingRules) {
	if fr == nil {
		return
	}
	type hidden struct{ names, whys []string }
	byField := map[string]*hidden{}
	var order []string
	var evalErr error
	hide := func(name, why string) {
		field, err := forwardBlocker(fr, name)
		if err != nil {
			evalErr = err
			return
		}
		if field == "" {
			return
		}
		h := byField[field]
		if h == nil {
			h = &hidden{}
			byField[field] = h
			order = append(order, field)
		}
		h.names = append(h.names, name)
		if !slices.Contains(h.whys, why) {
			h.whys = append(h.whys, why)
		}
	}
	hide(":method", roleWhy["request"])
	hide(":path", roleWhy["request"])
	hide("content-type", roleWhy["content-type"])
	for _, h := range c.n.request {
		hide(h.name, fmt.Sprintf("%s is a %s of route %q: %s", h.name, h.role, h.route, roleWhy[h.role]))
	}
	hide(":status", "the processor could not tell which responses to store")
	for _, h := range storedHeaderSample {
		hide(h, "stored responses would lack the response headers it hides: replays would differ from first responses")
	}
	if evalErr != nil {
		c.refuse(kindRulesNotEvaluable, path, "use exact, prefix, suffix, contains or a valid safe_regex matcher, so that the rules can be checked", "%v", evalErr)
		return
	}
	for _, field := range order {
		h := byField[field]
		c.refuse(kindForwardRulesHide, path+"."+field, "let forward_rules pass "+strings.Join(h.names, ", ")+" (or drop forward_rules)", "hides %s from the processor (forward rules apply to request and response headers alike): %s",
			strings.Join(h.names, ", "), strings.Join(h.whys, "; "))
	}
}

// forwardBlocker returns the forward_rules field that keeps Envoy from sending header name to
// the processor, "" when it is sent. It follows Envoy's MutationUtils::headerCanBeForwarded: a
// name matching a disallowed pattern is hidden; otherwise a non-empty allow list must match it.
func forwardBlocker(fr *filterextproc.HeaderForwardingRules, name string) (string, error) {
	for i, m := range fr.GetDisallowedHeaders().GetPatterns() {
		ok, err := matchString(m, name)
		if err != nil {
			return "", fmt.Errorf("disallowed_headers.patterns[%d]: %w", i, err)
		}
		if ok {
			return fmt.Sprintf("disallowed_headers.patterns[%d]", i), nil
		}
	}
	allowed := fr.GetAllowedHeaders().GetPatterns()
	if len(allowed) == 0 {
		return "", nil
	}
	for i, m := range allowed {
		ok, err := matchString(m, name)
		if err != nil {
			return "", fmt.Errorf("allowed_headers.patterns[%d]: %w", i, err)
		}
		if ok {
			return "", nil
		}
	}
	return "allowed_headers", nil
}

// matchString evaluates an Envoy StringMatcher against s the way Envoy does: ignore_case applies
// to exact, prefix, suffix and contains; safe_regex must match the whole string (RE2 full match).
func matchString(m *matcherv3.StringMatcher, s string) (bool, error) {
	fold := func(x string) string {
		if m.GetIgnoreCase() {
			return strings.ToLower(x)
		}
		return x
	}
	switch p := m.GetMatchPattern().(type) {
	case *matcherv3.StringMatcher_Exact:
		return fold(s) == fold(p.Exact), nil
	case *matcherv3.StringMatcher_Prefix:
		return strings.HasPrefix(fold(s), fold(p.Prefix)), nil
	case *matcherv3.StringMatcher_Suffix:
		return strings.HasSuffix(fold(s), fold(p.Suffix)), nil
	case *matcherv3.StringMatcher_Contains:
		return strings.Contains(fold(s), fold(p.Contains)), nil
	case *matcherv3.StringMatcher_SafeRegex:
		return fullMatch(p.SafeRegex.GetRegex(), s)
	}
	return false, errors.New("a custom or empty string matcher cannot be evaluated here")
}

func fullMatch(re, s string) (bool, error) {
	r, err := regexp.Compile(`^(?:` + re + `)$`)
	if err != nil {
		return false, fmt.Errorf("regex %q: %w", re, err)
	}
	return r.MatchString(s), nil
}

// mutationRules refuses header mutation rules that keep the processor's answers from carrying
// the headers it sets, or that turn a refused mutation into a 500.
func (c *checker) mutationRules(path string, r *mutationrulesv3.HeaderMutationRules) {
	if r == nil {
		r = &mutationrulesv3.HeaderMutationRules{} // Envoy's defaults still refuse x-envoy-* and routing headers
	}
	if r.GetDisallowIsError().GetValue() {
		c.refuse(kindMutationDisallowIsError, path+".disallow_is_error", "set disallow_is_error false",
			"a refused mutation in a CONTINUE answer fails the request with 500 after the upstream ran: the outcome is then unknown, and a retry may run it again")
	}
	type refused struct{ names, whys []string }
	byField := map[string]*refused{}
	var order []string
	var evalErr error
	check := func(name, why string) {
		field, err := mutationBlocker(r, name)
		if err != nil {
			evalErr = err
			return
		}
		if field == "" {
			return
		}
		x := byField[field]
		if x == nil {
			x = &refused{}
			byField[field] = x
			order = append(order, field)
		}
		if !slices.Contains(x.names, name) {
			x.names = append(x.names, name)
		}
		if !slices.Contains(x.whys, why) {
			x.whys = append(x.whys, why)
		}
	}
	for _, h := range c.n.replayHeaders {
		check(h, "the replay header tells a client that it got a replay")
	}
	check("content-type", "problem responses and replays set content-type: Envoy would send text/plain")
	check("retry-after", "409 request-in-progress answers carry retry-after")
	for _, h := range storedHeaderSample {
		check(h, "replays set the stored response headers: a replay would lack the ones refused")
	}
	if evalErr != nil {
		c.refuse(kindRulesNotEvaluable, path, "use valid regexes, so that the rules can be checked", "%v", evalErr)
		return
	}
	for _, field := range order {
		x := byField[field]
		c.refuse(kindMutationRulesRefuse, path+"."+field, "let mutation_rules allow "+strings.Join(x.names, ", ")+" (allow_expression, or drop the rule)", "refuses mutations of %s (mutation rules apply to immediate responses too): %s",
			strings.Join(x.names, ", "), strings.Join(x.whys, "; "))
	}
}

// mutationBlocker returns the mutation_rules field that refuses a mutation of header name, ""
// when it is allowed. It follows Envoy's MutationRules::Checker::isAllowed, in its order.
func mutationBlocker(r *mutationrulesv3.HeaderMutationRules, name string) (string, error) {
	name = strings.ToLower(name)
	if re := r.GetDisallowExpression(); re != nil {
		ok, err := fullMatch(re.GetRegex(), name)
		if err != nil {
			return "", fmt.Errorf("disallow_expression: %w", err)
		}
		if ok {
			return "disallow_expression", nil
		}
	}
	if re := r.GetAllowExpression(); re != nil {
		ok, err := fullMatch(re.GetRegex(), name)
		if err != nil {
			return "", fmt.Errorf("allow_expression: %w", err)
		}
		if ok {
			return "", nil
		}
	}
	switch {
	case r.GetDisallowAll().GetValue():
		return "disallow_all", nil
	case !r.GetAllowAllRouting().GetValue() && slices.Contains([]string{"host", ":authority", ":method", ":scheme"}, name):
		return "allow_all_routing", nil
	case r.GetDisallowSystem().GetValue() && strings.HasPrefix(name, ":"):
		return "disallow_system", nil
	case !r.GetAllowEnvoy().GetValue() && strings.HasPrefix(name, "x-envoy"):
		return "allow_envoy", nil
	}
	return "", nil
}

func (c *checker) requestAttributes(path string, attrs []string) {
	for _, want := range []struct {
		attr string
		need bool
		kind Kind
	}{
		{"xds.route_name", c.n.routeNameAttribute, kindRouteNameAttribute},
		{"connection.uri_san_peer_certificate", c.n.peerIdentity, kindPeerIdentityAttribute},
	} {
		if want.need && !slices.Contains(attrs, want.attr) {
			c.refuse(want.kind, path, fmt.Sprintf("add %q to request_attributes", want.attr), "lacks %q, which the policy reads: %s", want.attr, attributeWhy[want.attr])
		}
	}
}

func (c *checker) metadataOptions(path string, mo *filterextproc.MetadataOptions) {
	if len(c.n.jwtKeys) > 0 && !slices.Contains(mo.GetForwardingNamespaces().GetUntyped(), jwtNamespace) {
		c.refuse(kindJWTNotForwarded, path+".forwarding_namespaces.untyped", fmt.Sprintf("add %q to metadata_options.forwarding_namespaces.untyped", jwtNamespace), "lacks %q, while the policy scopes by JWT claims: %s", jwtNamespace, claimsEmpty)
	}
	if ns := c.n.outcomeNamespace; !slices.Contains(mo.GetReceivingNamespaces().GetUntyped(), ns) {
		c.refuse(kindOutcomeNotReceived, path+".receiving_namespaces.untyped", fmt.Sprintf("add %q to metadata_options.receiving_namespaces.untyped", ns), "lacks %q: Envoy drops the outcome the processor writes there, so access logs and traces never show it", ns)
	}
}

// claimsEmpty is what a policy that scopes by JWT claims gets where Envoy sends no payload, or
// not the one a route reads.
const claimsEmpty = "the claims would all be empty (every caller in one scope, or 401 under require_scope)"

// jwtPayloads refuses, where the deployment shows its connection manager (a bootstrap), a policy
// that scopes by jwt_claim with no jwt_authn filter before ext_proc, or with none of its
// providers writing the payload a route reads (payload_in_metadata): the claims would all be
// empty, every caller in one scope, or 401 under require_scope.
func (c *checker) jwtPayloads() {
	if len(c.n.jwtKeys) == 0 || c.d.Platform != platformEnvoy {
		return
	}
	if c.d.JWTAuthn == nil {
		c.refuse(kindJWTAuthnMissing, c.d.HCMPath+".http_filters", "add envoy.filters.http.jwt_authn before the ext_proc filter, its providers setting payload_in_metadata",
			"has no jwt_authn filter before ext_proc, while route %q scopes by jwt_claim: %s", c.n.jwtKeys[0].route, claimsEmpty)
		return
	}
	written := jwtPayloadNames(c.d.JWTAuthn)
	path := c.d.JWTAuthnPath + ".providers"
	if len(written) == 0 {
		c.refuse(kindJWTPayloadMissing, path, "set payload_in_metadata on the providers (and jwt_payload_key to it when there are several)",
			"writes no verified payload to dynamic metadata (no provider sets payload_in_metadata), while route %q scopes by jwt_claim: %s", c.n.jwtKeys[0].route, claimsEmpty)
		return
	}
	for _, k := range c.n.jwtKeys {
		if k.key != "" && !slices.Contains(written, k.key) {
			c.refuse(kindJWTPayloadKey, path, fmt.Sprintf("set payload_in_metadata: %s on the provider that verifies the route's callers, or the route's jwt_payload_key to one of %s", k.key, strings.Join(written, ", ")),
				"has no provider writing payload_in_metadata %q, the jwt_payload_key of route %q: %s", k.key, k.route, claimsEmpty)
		}
	}
}

// jwtPayloadNames returns the payload_in_metadata names a jwt_authn config writes, sorted, each once.
func jwtPayloadNames(j *jwtauthnv3.JwtAuthentication) []string {
	var out []string
	for _, p := range j.GetProviders() {
		if name := p.GetPayloadInMetadata(); name != "" && !slices.Contains(out, name) {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// route checks one per-route config of the filter.
func (c *checker) route(e routeEntry) {
	cfg := e.Config
	if cfg.GetDisabled() || c.d.FilterDisabled && cfg == nil {
		return // the filter does not run on this route
	}
	c.retries(e)
	if cfg == nil {
		return
	}
	o := cfg.GetOverrides()
	if o == nil {
		return
	}
	path := e.Path + ".overrides"
	if o.GetFailureModeAllow().GetValue() {
		c.refuse(kindFailureModeAllow, path+".failure_mode_allow", "set failure_mode_allow false, or remove it", "requests on this route would bypass idempotency whenever the processor fails, and may run twice")
	}
	if o.GetProcessingRequestModifier() != nil {
		c.refuse(kindRequestModifier, path+".processing_request_modifier", "remove processing_request_modifier", "may rename the attributes and metadata the processor looks up")
	}
	if o.GetMetadataOptions() != nil {
		c.metadataOptions(path+".metadata_options", o.GetMetadataOptions())
	}
	needsBody := c.n.anyBody
	for i, h := range o.GetGrpcInitialMetadata() {
		if !strings.EqualFold(h.GetKey(), routeMetadataKey) {
			continue
		}
		name := headerValueString(h)
		body, ok := c.n.routes[name]
		if !ok {
			c.refuse(kindUnknownPolicyRoute, fmt.Sprintf("%s.grpc_initial_metadata[%d]", path, i), "name a route the policy file defines, or add that route to it",
				"names policy route %q, which the policy does not define: the processor answers 500 unknown-idempotency-route", name)
			continue
		}
		needsBody = body
	}
	if pm := o.GetProcessingMode(); pm != nil {
		c.routeMode(path+".processing_mode", pm, needsBody)
	}
}

func headerValueString(h *corev3.HeaderValue) string {
	if v := h.GetValue(); v != "" {
		return v
	}
	return string(h.GetRawValue())
}

// routeMode checks a per-route processing_mode, read as Envoy reads it.
func (c *checker) routeMode(path string, pm *filterextproc.ProcessingMode, needsBody bool) {
	const (
		skip       = filterextproc.ProcessingMode_SKIP
		send       = filterextproc.ProcessingMode_SEND
		none       = filterextproc.ProcessingMode_NONE
		streamed   = filterextproc.ProcessingMode_STREAMED
		fullDuplex = filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
	)
	if pm.GetRequestHeaderMode() == skip {
		c.refuse(kindRouteRequestHeaderSkip, path+".request_header_mode", "set SEND (opt a route out with disabled: true)",
			"is SKIP: the processor would never see requests on this route, and covered ones would run unprotected (opt a route out with disabled: true)")
	}
	if pm.GetResponseHeaderMode() == skip {
		c.refuse(kindRouteResponseHeaderSkip, path+".response_header_mode", "set SEND",
			"is SKIP: the processor would never see the responses: each stream ends with the outcome unknown, so a retry runs again (unknown_outcome: release) or gets 409 until lock_ttl ends (keep)")
	}
	reqBody, respBody := pm.GetRequestBodyMode(), pm.GetResponseBodyMode()
	switch reqBody {
	case filterextproc.ProcessingMode_BUFFERED, streamed, filterextproc.ProcessingMode_BUFFERED_PARTIAL, fullDuplex:
	case none:
		if needsBody {
			c.refuse(kindRouteRequestBodyNone, path+".request_body_mode", "set BUFFERED (or STREAMED, BUFFERED_PARTIAL, FULL_DUPLEX_STREAMED)",
				"is NONE, but the policy route needs the body (fingerprint body, missing_key: body-hash, or a json field): covered requests with a body get 500 body-not-available")
		}
	default:
		c.refuse(kindRouteBodyModeGRPC, path+".request_body_mode", "set BUFFERED (or STREAMED, BUFFERED_PARTIAL, FULL_DUPLEX_STREAMED)", "is %s, under which Envoy sends no body message (Filter::onData has no case for it) unless the body came whole with the headers: the request runs before its key is claimed, and may run twice", reqBody)
	}
	switch respBody {
	case none, filterextproc.ProcessingMode_BUFFERED, streamed, filterextproc.ProcessingMode_BUFFERED_PARTIAL, fullDuplex:
	default:
		c.refuse(kindRouteBodyModeGRPC, path+".response_body_mode", "set BUFFERED or STREAMED", "is %s, under which Envoy sends no body message (Filter::onData has no case for it): the processor cannot capture the response", respBody)
	}
	switch m := pm.GetRequestTrailerMode(); {
	case reqBody == fullDuplex && m != send:
		c.refuse(kindDuplexTrailerMode, path+".request_trailer_mode", "set SEND", "is %s: FULL_DUPLEX_STREAMED needs SEND (the trailers end the body: under SKIP a request with trailers is never seen whole, runs unclaimed and may run twice; Envoy refuses it at filter level)", m)
	case needsBody && m != send && (reqBody == filterextproc.ProcessingMode_BUFFERED || reqBody == streamed || reqBody == filterextproc.ProcessingMode_BUFFERED_PARTIAL):
		c.refuse(kindRequestTrailerMode, path+".request_trailer_mode", "set SEND", "is %s, want SEND: the policy route needs the body, and %s", m, trailerWhy)
	}
	if m := pm.GetResponseTrailerMode(); respBody == fullDuplex && m != send {
		c.refuse(kindDuplexTrailerMode, path+".response_trailer_mode", "set SEND", "is %s: FULL_DUPLEX_STREAMED needs SEND (the trailers end the response: under SKIP a response with trailers is never seen whole; Envoy refuses it at filter level)", m)
	}
}

// safeRetryOn are the retry_on conditions under which Envoy's router retries only requests the
// upstream never received or never answered as an application (router/retry_state_impl.cc):
// the connection or stream was refused before the request was sent, or an upstream Envoy
// rate-limited it. The gRPC conditions (cancelled, deadline-exceeded, internal,
// resource-exhausted, unavailable) fire only on a response that carries grpc-status: accepted
// here, for HTTP routes whose upstreams do not send it, and refused on gRPC routes
// (grpcFindings).
var safeRetryOn = map[string]bool{
	"connect-failure": true, "refused-stream": true, "reset-before-request": true, "envoy-ratelimited": true,
	"cancelled": true, "deadline-exceeded": true, "internal": true, "resource-exhausted": true, "unavailable": true,
}

// refuseRetry records a refusal of e's retry policy, which may live in another resource.
func (c *checker) refuseRetry(kind Kind, e routeEntry, fix, format string, args ...any) {
	c.errs = append(c.errs, &refusal{Kind: kind, Source: c.d.Source, Field: e.RetryPath + ".retry_policy.retry_on", Reason: fmt.Sprintf(format, args...),
		Fix: fix, Resource: e.RetryResource, File: e.RetryFile})
}

// retries refuses a retry or hedge policy on a covered route that may send a claimed request
// upstream again after the upstream may have run it: the processor sees one request and one
// lease, while the upstream runs it twice. A retry on a status the policy does not store is
// allowed: that status releases the key, so the router's retry is the client's retry, earlier.
func (c *checker) retries(e routeEntry) {
	if c.retryChecked == nil {
		c.retryChecked = map[string]bool{}
	}
	// The router reads only hedge_on_per_try_timeout (FilterUtility::finalHedgingParams in
	// router.cc); initial_requests and additional_request_chance are not implemented.
	if h := e.Hedge; !c.retryChecked["hedge "+e.HedgePath] && h.GetHedgeOnPerTryTimeout() {
		c.retryChecked["hedge "+e.HedgePath] = true
		c.refuse(kindHedge, e.HedgePath+".hedge_policy", "remove hedge_on_per_try_timeout on covered routes", "hedge_on_per_try_timeout sends a claimed request upstream again while the first attempt may still be running: it may run twice")
	}
	if c.retryChecked[e.RetryPath] {
		return
	}
	c.retryChecked[e.RetryPath] = true
	rp := e.Retry
	if rp == nil || (rp.GetNumRetries() != nil && rp.GetNumRetries().GetValue() == 0) {
		return
	}
	for _, cond := range strings.Split(rp.GetRetryOn(), ",") {
		switch cond = strings.TrimSpace(cond); {
		case cond == "" || safeRetryOn[cond]:
		case cond == "retriable-status-codes" || cond == "retriable-4xx":
			codes := rp.GetRetriableStatusCodes()
			if cond == "retriable-4xx" {
				codes = []uint32{409}
			}
			for _, code := range codes {
				if c.n.stored(int(code)) {
					c.refuseRetry(kindRouterRetryStatus, e, fmt.Sprintf("stop retrying status %d on covered routes (or set num_retries 0)", code), "retries %s on status %d, which the policy stores: the upstream ran, and the router runs it again instead of the response being kept", cond, code)
				}
			}
		default:
			c.refuseRetry(kindRouterRetry, e, retryFix, "has %q: the router retries after the upstream may have run the request (a reset, a timeout, an answer), so a claimed request may run twice", cond)
		}
	}
}
