package policy

import (
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/jsonbody"
)

// where says at which level of the file a field may be given.
type where int

const (
	anywhere   where = iota // in defaults and in routes
	routesOnly              // in routes only
)

// field is one field of a route (or of the defaults): its key, its built-in default as YAML ("":
// none), the values it accepts when it is an enumeration, where it may be given, its
// documentation, and set, which validates its value and applies it to the route being compiled.
type field struct {
	key    string
	def    string
	values []string
	where  where
	// inDefaults is what a routesOnly field given in the defaults is told; by default that it
	// belongs to routes.
	inDefaults string
	doc        string
	set        func(d *decoder, x *draft, v *yaml.Node, path string)
}

// topField is one top-level field of the file.
type topField struct {
	key    string
	def    string
	values []string
	doc    string
	set    func(d *decoder, p *Policy, v *yaml.Node, path string)
}

func names[T ~string](vs ...T) []string {
	out := make([]string, len(vs))
	for i, v := range vs {
		out[i] = string(v)
	}
	return out
}

// topFields are the top-level fields besides defaults and routes.
var topFields = []topField{
	{key: "fail_mode", def: string(FailClosed), values: names(FailClosed, FailOpen),
		doc: "what a covered request gets when the store fails: `closed` answers 503 `store-unavailable`, `open` passes it through, logged and counted",
		set: func(_ *decoder, p *Policy, v *yaml.Node, _ string) { p.FailMode = FailMode(v.Value) }},
	{key: "store_timeout", def: "100ms",
		doc: "bounds each store operation; readiness pings are bounded by 1s whatever it says",
		set: func(d *decoder, p *Policy, v *yaml.Node, path string) {
			if t, ok := d.duration(v, path, time.Millisecond, MaxDuration, " (ten years)"); ok {
				p.StoreTimeout = t
			}
		}},
	{key: "metadata_namespace", def: DefaultMetadataNamespace,
		doc: "the dynamic metadata namespace under which the settling answer reports `outcome`, `route`, `key_hash`, `replayed` and `release_reason` to Envoy's access log",
		set: func(d *decoder, p *Policy, v *yaml.Node, path string) {
			s, ok := d.str(v, path)
			switch {
			case !ok:
			case s == "" || strings.ContainsFunc(s, func(r rune) bool { return r <= ' ' || r == 0x7f }):
				d.fail(v, path, "must be a name without spaces, got %q", s)
			default:
				p.MetadataNamespace = s
			}
		}},
	{key: "problems",
		doc: "replaces built-in problem responses for every route, by problem code: `{status, content_type, body}`, see the per-route `problems`",
		set: func(d *decoder, p *Policy, v *yaml.Node, path string) { p.Problems = d.problems(v, path) }},
	{key: "durability", def: "{replicas: 0, timeout: " + DefaultDurabilityTimeout.String() + "}",
		doc: durabilityDoc,
		set: func(d *decoder, p *Policy, v *yaml.Node, path string) { d.durability(&p.Durability, nil, v, path) }},
}

// routeFields are the fields of a route and of the defaults, in the order the docs list them.
var routeFields = []field{
	{key: "name", where: routesOnly,
		doc: "required; unique, and not `default` (the defaults' name); the route label of metrics and logs, and what `x-idempotency-route` names",
		set: func(d *decoder, x *draft, v *yaml.Node, path string) {
			switch s, ok := d.str(v, path); {
			case !ok:
			case s == "":
				d.fail(v, path, "must not be empty")
			default:
				x.r.Name = s
			}
		}},
	{key: "match", where: routesOnly,
		doc: "required; exactly one of `path_prefix`, `path_exact`, `path_regex` (the path without its query) or `route_name_exact`, `route_name_prefix`, `route_name_regex` (Envoy's `xds.route_name`); regexes are Go RE2 and match anywhere unless anchored; beside it, `json: {/pointer: value}` holds only when the request body is a JSON object whose members equal those strings, numbers, bools or nulls (else the next route is tried)",
		set: func(d *decoder, x *draft, v *yaml.Node, path string) { d.match(x, v, path) }},
	{key: "enabled", def: "true",
		doc: "`false` passes every request of the route through untouched",
		set: setBool(func(r *Route, b bool) { r.Enabled = b })},
	{key: "mode", def: string(ModeEnforce), values: names(ModeEnforce, ModeShadow),
		doc: "`shadow` claims and records as `enforce` does, but every request reaches the upstream and every response the client untouched; `idempotency_shadow_total` counts what enforcing would have done",
		set: func(_ *decoder, x *draft, v *yaml.Node, _ string) { x.r.Mode = Mode(v.Value) }},
	{key: "methods", def: "[POST, PUT, PATCH]",
		doc: "the methods covered",
		set: func(d *decoder, x *draft, v *yaml.Node, path string) {
			methods := []string{}
			ok := d.list(v, path, func(item *yaml.Node, at string) {
				switch m, ok := d.str(item, at); {
				case !ok:
				case !isToken(m):
					d.fail(item, at, "%q is not an HTTP method", m)
				default:
					methods = append(methods, strings.ToUpper(m))
				}
			})
			if ok {
				x.r.Methods = methods
			}
		}},
	{key: "key_headers", def: "[idempotency-key, x-idempotency-key, x-idempotency]",
		doc: "the headers the key is read from; at least one",
		set: func(d *decoder, x *draft, v *yaml.Node, path string) {
			if hs, ok := d.headerList(v, path, false); ok {
				if len(hs) == 0 {
					d.fail(v, path, "must name at least one header")
				}
				x.r.KeyHeaders = hs
			}
		}},
	{key: "key_json", def: "[]",
		doc: "JSON Pointers (RFC 6901) into the request body, tried after `key_headers` in order: the first present, non-empty string is the key, with a header key's limits; a header key and a different body key get 400 `idempotency-key-conflict`",
		set: setPointers(func(r *Route, ps []jsonbody.Pointer) { r.KeyJSON = ps })},
	{key: "missing_key", def: string(MissingKeyOptional), values: names(MissingKeyOptional, MissingKeyRequired, MissingKeyBodyHash),
		doc: "a request without a key: passed through, answered 400 `missing-idempotency-key`, or keyed by the hex SHA-256 of method, path and body (on a route with `json_rpc` or `fingerprint_ignore_json`, the canonical body the fingerprint hashes, without those members)",
		set: func(_ *decoder, x *draft, v *yaml.Node, _ string) { x.r.MissingKey = MissingKey(v.Value) }},
	{key: "ttl", def: "24h",
		doc: "how long a completed record lives; at least 1ms, at most `max_ttl`",
		set: setDuration(func(r *Route, t time.Duration) { r.TTL = t })},
	{key: "ttl_header", def: "x-ttl",
		doc: "lets the first request choose its TTL in whole seconds, capped at `max_ttl`; `\"\"` turns it off",
		set: setOptionalHeader(func(r *Route, h string) { r.TTLHeader = h })},
	{key: "max_ttl", def: "24h",
		doc: "the longest TTL `ttl` and `ttl_header` may give; at most `87600h` (ten years)",
		set: setDuration(func(r *Route, t time.Duration) { r.MaxTTL = t })},
	{key: "lock_ttl", def: "30s",
		doc: "the lease of a request in flight, renewed every `lock_ttl`/3 while it runs",
		set: setDuration(func(r *Route, t time.Duration) { r.LockTTL = t })},
	{key: "in_flight_wait", def: "0s",
		doc: "how long a duplicate of a request in flight waits for its replay before 409; at most `10s`; `Prefer: wait=N` asks for less; keep Envoy's `message_timeout` above it",
		set: func(d *decoder, x *draft, v *yaml.Node, path string) {
			if t, ok := d.duration(v, path, 0, MaxInFlightWait, ""); ok {
				x.r.InFlightWait = t
			}
		}},
	{key: "fingerprint", def: "[method, path, body]",
		doc: "what a reused key must repeat (`method`, `path` with the query, `body`); `[]` turns the mismatch check off within the route, and then `fingerprint_headers` must be empty",
		set: func(d *decoder, x *draft, v *yaml.Node, path string) {
			parts := []Part{}
			ok := d.list(v, path, func(item *yaml.Node, at string) {
				p, ok := d.str(item, at)
				switch part := Part(p); {
				case !ok:
				case part != PartMethod && part != PartPath && part != PartBody:
					d.fail(item, at, "%q is not one of method, path, body", p)
				case slices.Contains(parts, part):
					d.fail(item, at, "%q is listed twice", p)
				default:
					parts = append(parts, part)
				}
			})
			if ok {
				x.r.Fingerprint = parts
			}
		}},
	{key: "fingerprint_headers", def: "[]",
		doc: "request headers a reused key must repeat too; `:authority` for the host (`host` is refused)",
		set: func(d *decoder, x *draft, v *yaml.Node, path string) {
			if hs, ok := d.headerList(v, path, true); ok {
				x.r.FingerprintHeaders = hs
			}
		}},
	{key: "fingerprint_ignore_json", def: "[]",
		doc: "JSON Pointers of body members left out of the fingerprint, which is then over the body's RFC 8785 canonical form (member order and whitespace do not count; numbers keep their written digits where a double would change them); a body that is not JSON is fingerprinted raw; `[]` fingerprints the raw bytes",
		set: setPointers(func(r *Route, ps []jsonbody.Pointer) { r.FingerprintIgnoreJSON = ps })},
	{key: "scope", def: "[{header: authorization}]",
		doc: "where the scope values come from, hashed in order into the stored key: `{header: name}`, `{jwt_claim: name}` (the payload jwt_authn verified), `peer_identity` (the mTLS peer's URI SAN), `{path_param: group}` (a named group of the route's `path_regex`), `{json: /pointer}` (the JSON text of a request body member; missing: empty); not together with `scope_headers` or `scope_path_params`",
		set: func(d *decoder, x *draft, v *yaml.Node, path string) { d.scope(x, v, path) }},
	{key: "scope_headers",
		doc: "shorthand for a `scope` of `header` entries",
		set: func(d *decoder, x *draft, v *yaml.Node, path string) {
			if hs, ok := d.headerList(v, path, true); ok {
				x.scopeHeaders = hs
			}
		}},
	{key: "scope_path_params", where: routesOnly,
		doc: "named groups of the route's `path_regex`, added to the scope after the inherited or `scope_headers` entries; each must name one group",
		set: func(d *decoder, x *draft, v *yaml.Node, path string) {
			d.list(v, path, func(item *yaml.Node, at string) {
				if s, ok := d.str(item, at); ok {
					x.pathParams = append(x.pathParams, scopeEntry{ScopeSource{ScopePathParam, s}, item, at})
				}
			})
		}},
	{key: "require_scope", def: "false",
		doc: "answers 401 `scope-missing` to a covered request whose scope values are all empty",
		set: setBool(func(r *Route, b bool) { r.RequireScope = b })},
	{key: "jwt_payload_key", def: `""`,
		doc: "the jwt_authn payload that `jwt_claim` reads (its `payload_in_metadata` name); `\"\"` takes the only one there, and more than one is a 500 `scope-ambiguous`",
		set: func(d *decoder, x *draft, v *yaml.Node, path string) {
			if s, ok := d.str(v, path); ok {
				x.r.JWTPayloadKey = s
			}
		}},
	{key: "store_statuses", def: `["2xx"]`,
		doc: "the statuses whose responses are stored: classes (`\"2xx\"`) or codes (`409`); any other releases the key",
		set: func(d *decoder, x *draft, v *yaml.Node, path string) {
			if s, ok := d.statuses(v, path); ok {
				x.r.StoreStatuses = s
			}
		}},
	{key: "grpc", where: routesOnly,
		doc: "`true`: the route is a gRPC unary method, and its requests without a `:path` (grpc-go's own ext_proc client, which sends no `content-type` either) are gRPC; a request with a `:path` is gRPC only when its `content-type` says so, so plain HTTP on the route stays HTTP, and `check` holds its Envoy route to what gRPC needs; requests with a `content-type` of `application/grpc` are gRPC on any route",
		set: setBool(func(r *Route, b bool) { r.GRPC = b })},
	{key: "store_grpc_statuses", def: "[OK]",
		doc: "the gRPC statuses whose responses are stored, by name (`OK`, `NOT_FOUND`) or number (`5`), read from `grpc-status` in the response trailers (or the headers of a trailers-only response); any other releases the key",
		set: func(d *decoder, x *draft, v *yaml.Node, path string) {
			if s, ok := d.grpcStatuses(v, path); ok {
				x.r.StoreGRPCStatuses = s
			}
		}},
	{key: "unknown_outcome", def: string(UnknownOutcomeRelease), values: names(UnknownOutcomeRelease, UnknownOutcomeKeep, UnknownOutcomeRecord),
		doc: "a lease whose outcome the processor cannot know: freed at once, left to expire after `lock_ttl`, or kept as an outcome-unknown record (409 `outcome-unknown`) for the TTL",
		set: func(_ *decoder, x *draft, v *yaml.Node, _ string) { x.r.UnknownOutcome = UnknownOutcome(v.Value) }},
	{key: "max_response_bytes", def: strconv.Itoa(DefaultMaxResponseBytes),
		doc: "the largest response body stored; a larger one completes without body (409 `response-not-replayable`); at most `268435456`",
		set: setBytes(MaxResponseBytesLimit, func(r *Route, n int) { r.MaxResponseBytes = n })},
	{key: "max_request_bytes", def: strconv.Itoa(DefaultMaxRequestBytes),
		doc: "the largest request body the processor holds itself (STREAMED, FULL_DUPLEX_STREAMED); a larger one gets 413 `request-too-large`; at most `268435456`",
		set: setBytes(MaxRequestBytesLimit, func(r *Route, n int) { r.MaxRequestBytes = n })},
	{key: "store_body", def: "true",
		doc: "`false` keeps status and headers only: the request still runs at most once, and duplicates get 409 `response-not-replayable`",
		set: setBool(func(r *Route, b bool) { r.StoreBody = b })},
	{key: "replay_header", def: "x-idempotency-replayed",
		doc: "`true` on replays",
		set: func(d *decoder, x *draft, v *yaml.Node, path string) {
			if h, ok := d.header(v, path, false); ok {
				x.r.ReplayHeader = h
			}
		}},
	{key: "replay_header_fresh", def: "true",
		doc: "also writes `replay_header: false` on every other answer to a keyed request; `false` writes the header on replays only",
		set: setBool(func(r *Route, b bool) { r.ReplayHeaderFresh = b })},
	{key: "expires_header", def: "x-idempotency-expires",
		doc: "the record's expiry as an HTTP-date, on stored responses and replays; `\"\"` turns it off",
		set: setOptionalHeader(func(r *Route, h string) { r.ExpiresHeader = h })},
	{key: "first_sent_header", def: "x-idempotency-first-sent",
		doc: "the first request's time as an HTTP-date, on replays; `\"\"` turns it off",
		set: setOptionalHeader(func(r *Route, h string) { r.FirstSentHeader = h })},
	{key: "exclude_response_headers", def: "[]",
		doc: "response headers never stored nor replayed",
		set: func(d *decoder, x *draft, v *yaml.Node, path string) {
			if hs, ok := d.headerList(v, path, false); ok {
				x.r.ExcludeResponseHeaders = hs
			}
		}},
	{key: "key_prefix", def: `"idempotency:"`,
		doc: "the prefix of stored keys",
		set: func(d *decoder, x *draft, v *yaml.Node, path string) {
			if s, ok := d.str(v, path); ok {
				x.r.KeyPrefix = s
			}
		}},
	{key: "json_rpc", def: "false",
		doc: "JSON-RPC 2.0 requests: the request's `id` is left out of the fingerprint, a replay carries the current request's `id` (in each JSON-RPC response of a `text/event-stream` body too), the processor's own answers are JSON-RPC errors with HTTP 200, and a batch passes uncovered",
		set: setBool(func(r *Route, b bool) { r.JSONRPC = b })},
	{key: "durability", where: routesOnly, inDefaults: "belongs at the top level (for every route) or in a route, not in defaults",
		doc: "the top-level `durability` for the route's requests, field by field: `{replicas, timeout}`",
		set: func(d *decoder, x *draft, v *yaml.Node, path string) { d.durability(&x.r.Durability, x.r, v, path) }},
	{key: "problems", where: routesOnly, inDefaults: "belongs at the top level (for every route) or in a route, not in defaults",
		doc: "replaces built-in problem responses of the route, by problem code, over the top-level entries: `{status, content_type, body}`; `status` 200–599 (default: the built-in one), `content_type` (default `application/problem+json`, only with `body`), `body` a Go `text/template` over `.Code`, `.Title`, `.Detail`, `.Status` (and `json`, which writes its argument as JSON), checked at start-up; the codes are " + codeList(),
		set: func(d *decoder, x *draft, v *yaml.Node, path string) {
			own := d.problems(v, path)
			if len(own) == 0 {
				return
			}
			merged := maps.Clone(x.r.Problems)
			if merged == nil {
				merged = map[string]*Problem{}
			}
			maps.Copy(merged, own)
			x.r.Problems = merged
		}},
}

// codeList is ProblemCodes for the docs.
func codeList() string {
	quoted := make([]string, len(ProblemCodes))
	for i, c := range ProblemCodes {
		quoted[i] = "`" + c + "`"
	}
	return strings.Join(quoted, ", ")
}

func setBool(assign func(*Route, bool)) func(*decoder, *draft, *yaml.Node, string) {
	return func(d *decoder, x *draft, v *yaml.Node, path string) {
		if b, ok := d.boolean(v, path); ok {
			assign(x.r, b)
		}
	}
}

// setDuration is for ttl, max_ttl and lock_ttl: at least 1ms and at most ten years.
func setDuration(assign func(*Route, time.Duration)) func(*decoder, *draft, *yaml.Node, string) {
	return func(d *decoder, x *draft, v *yaml.Node, path string) {
		if t, ok := d.duration(v, path, time.Millisecond, MaxDuration, " (ten years)"); ok {
			assign(x.r, t)
		}
	}
}

func setBytes(limit int, assign func(*Route, int)) func(*decoder, *draft, *yaml.Node, string) {
	return func(d *decoder, x *draft, v *yaml.Node, path string) {
		if n, ok := d.intIn(v, path, 0, int64(limit), fmt.Sprintf("between 0 and %d", limit)); ok {
			assign(x.r, n)
		}
	}
}

// setOptionalHeader is for a response header name that "" turns off.
func setOptionalHeader(assign func(*Route, string)) func(*decoder, *draft, *yaml.Node, string) {
	return func(d *decoder, x *draft, v *yaml.Node, path string) {
		if h, ok := d.header(v, path, true); ok {
			assign(x.r, h)
		}
	}
}

// FieldDoc documents one field of the policy file, as docs/configuration.md's table of fields
// shows it.
type FieldDoc struct {
	Key string
	// Where is "top level", "defaults, routes" or "routes".
	Where string
	// Default is the built-in value as YAML, or "none".
	Default string
	// Doc says what the field does, the values of an enumeration included.
	Doc string
}

// Fields lists every field of the policy file: the top-level ones, then those of a route.
func Fields() []FieldDoc {
	var routeOnly []string
	for _, f := range routeFields {
		if f.where == routesOnly {
			routeOnly = append(routeOnly, "`"+f.key+"`")
		}
	}
	docs := []FieldDoc{
		{Key: "defaults", Where: "top level", Default: "none", Doc: "the settings of requests that no route takes, and what every route inherits field by field; any route field but " + orList(routeOnly)},
		{Key: "routes", Where: "top level", Default: "[]", Doc: "the routes, in order: a named route (`x-idempotency-route`) wins, else the first whose `match` holds, else the defaults; lists a route sets replace the inherited ones"},
	}
	for _, f := range topFields {
		docs = append(docs, FieldDoc{Key: f.key, Where: "top level", Default: defaultDoc(f.def), Doc: withValues(f.doc, f.values)})
	}
	for _, f := range routeFields {
		w := "defaults, routes"
		if f.where == routesOnly {
			w = "routes"
		}
		docs = append(docs, FieldDoc{Key: f.key, Where: w, Default: defaultDoc(f.def), Doc: withValues(f.doc, f.values)})
	}
	return docs
}

func defaultDoc(def string) string {
	if def == "" {
		return "none"
	}
	return def
}

func withValues(doc string, values []string) string {
	if len(values) == 0 {
		return doc
	}
	quoted := make([]string, len(values))
	for i, v := range values {
		quoted[i] = "`" + v + "`"
	}
	return "one of " + strings.Join(quoted, ", ") + ": " + doc
}

// draft is a route being compiled: the route so far, and what its mapping gives that is
// checked once the whole mapping is read.
type draft struct {
	r      *Route
	path   string
	parent *Route
	given  map[string]*yaml.Node // the value of each field the mapping gives, by key
	inDefs bool                  // the defaults (or the built-in defaults), not a route
	scope  []scopeEntry          // from scope

	scopeHeaders []string     // from scope_headers
	pathParams   []scopeEntry // from scope_path_params
}

// scopeEntry is one scope source and where the file gives it.
type scopeEntry struct {
	src  ScopeSource
	node *yaml.Node
	path string
}

// file compiles the whole file, root being its top-level value (nil or null: empty).
func (d *decoder) file(root *yaml.Node, settings []Setting) (*Policy, map[string]string) {
	p := &Policy{byName: map[string]*Route{}}
	for _, f := range topFields {
		if f.def != "" {
			d.builtin(f.key, f.def, func(v *yaml.Node, path string) { d.top(f, p, v, path) })
		}
	}
	// A built-in durability.timeout above the file's store_timeout is the file's to fix where
	// durability is on (checkDurability), not an error of the built-in defaults.
	d.durabilities = nil
	values := map[string]string{}
	var defaults, routes *yaml.Node
	if root != nil && !isNull(root) {
		defaults, routes = d.topLevel(root, p, settings, values)
	}

	builtin := d.builtinRoute()
	builtin.Problems, builtin.Durability = p.Problems, p.Durability
	p.Default = builtin
	if defaults != nil {
		p.Default, _ = d.route(builtin, defaults, "defaults", true)
	}
	p.Default.Name = "default"
	p.byName["default"] = p.Default
	if routes != nil {
		d.routes(p, routes)
	}
	d.scopeKinds(p)
	d.checkDurability(p)
	return p, values
}

// topLevel reads the file's top-level mapping: the top-level fields into p, the program
// settings into values; it returns the defaults' and the routes' values (nil: not given).
func (d *decoder) topLevel(root *yaml.Node, p *Policy, settings []Setting, values map[string]string) (defaults, routes *yaml.Node) {
	known := []string{"defaults", "routes"}
	for _, f := range topFields {
		known = append(known, f.key)
	}
	bySetting := map[string]Setting{}
	for _, s := range settings {
		bySetting[s.Key] = s
		known = append(known, s.Key)
	}
	d.fields(root, "", func(key string, k, v *yaml.Node, path string) {
		if i := slices.IndexFunc(topFields, func(f topField) bool { return f.key == key }); i >= 0 {
			d.top(topFields[i], p, v, path)
			return
		}
		if s, ok := bySetting[key]; ok {
			if val, ok := d.setting(s, v, path); ok {
				values[key] = val
			}
			return
		}
		switch key {
		case "defaults":
			defaults = v
		case "routes":
			routes = v
		default:
			d.unknown(k, path, known)
		}
	})
	return defaults, routes
}

// routes compiles the routes list into p.Routes, each over p.Default; names must be unique.
func (d *decoder) routes(p *Policy, routes *yaml.Node) {
	d.list(routes, "routes", func(item *yaml.Node, at string) {
		at = routePath(item, at)
		r, ok := d.route(p.Default, item, at, false)
		switch {
		case !ok:
		case r.Name == "":
			if d.given(item, "name") == nil {
				d.fail(item, at+".name", "is required")
			}
		case p.byName[r.Name] != nil:
			d.fail(d.given(item, "name"), at+".name", "%q is used twice (or is the reserved name of the defaults)", r.Name)
		default:
			p.byName[r.Name] = r
		}
		p.Routes = append(p.Routes, r)
	})
}

// scopeKinds refuses two routes that share a key_prefix and read one scope name as a header in
// one and as a path parameter in the other. Stored keys hash a header's and a path parameter's
// values behind their name alone (the encoding the records of earlier releases were stored
// under), so such a pair could give two clients the same stored key.
func (d *decoder) scopeKinds(p *Policy) {
	routes := append([]*Route{p.Default}, p.Routes...)
	for i, a := range routes {
		for j, b := range routes[i+1:] {
			if a == nil || b == nil || a.KeyPrefix != b.KeyPrefix {
				continue
			}
			for _, sa := range a.Scope {
				for _, sb := range b.Scope {
					if sa.Name != sb.Name || sa.Kind == sb.Kind || !headerOrParam(sa.Kind) || !headerOrParam(sb.Kind) {
						continue
					}
					// b is routes[i+j]: routes[0] is the defaults.
					d.fail(nil, fmt.Sprintf("routes[%d] (%s).scope", i+j, b.Name), "%q is a %s here and a %s in %s, which shares key_prefix %q: their stored keys could collide; give one of them its own key_prefix",
						sb.Name, sb.Kind, sa.Kind, a.Description(), a.KeyPrefix)
				}
			}
		}
	}
}

// headerOrParam reports whether k's values are hashed behind their name alone (see scopeKinds).
func headerOrParam(k ScopeKind) bool { return k == ScopeHeader || k == ScopePathParam }

// Description names r in a message: "the defaults" for the policy's defaults, else the route
// by its name.
func (r *Route) Description() string {
	if r.Name == "default" {
		return "the defaults"
	}
	return fmt.Sprintf("route %q", r.Name)
}

func (d *decoder) top(f topField, p *Policy, v *yaml.Node, path string) {
	if len(f.values) > 0 {
		if _, ok := d.oneOf(v, path, f.values); !ok {
			return
		}
	}
	f.set(d, p, v, path)
}

// builtin applies the built-in default def to the field at key.
func (d *decoder) builtin(key, def string, apply func(v *yaml.Node, path string)) {
	v, err := parseYAML(def)
	if err != nil {
		d.fail(nil, "built-in default of "+key, "%v", err)
		return
	}
	apply(v, "built-in default of "+key)
}

// builtinRoute compiles the defaults of the route table.
func (d *decoder) builtinRoute() *Route {
	var text strings.Builder
	for _, f := range routeFields {
		if f.def != "" {
			fmt.Fprintf(&text, "%s: %s\n", f.key, f.def)
		}
	}
	v, err := parseYAML(text.String())
	if err != nil {
		d.fail(nil, "built-in defaults", "%v", err)
		return &Route{}
	}
	r, _ := d.route(&Route{}, v, "built-in defaults", true)
	return r
}

// given returns the value a mapping gives key, or nil; for names and error lines only.
func (d *decoder) given(n *yaml.Node, key string) *yaml.Node {
	if n.Kind != yaml.MappingNode {
		return nil
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Value == key {
			return n.Content[i+1]
		}
	}
	return nil
}

// routePath is the path of the route at path: routes[2] (pay) when it has a name.
func routePath(n *yaml.Node, path string) string {
	if n.Kind != yaml.MappingNode {
		return path
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		if k, v := n.Content[i], n.Content[i+1]; k.Value == "name" && v.Kind == yaml.ScalarNode && !isNull(v) && v.Value != "" {
			name := v.Value
			if len(name) > 64 {
				name = name[:61] + "..."
			}
			return fmt.Sprintf("%s (%s)", path, name)
		}
	}
	return path
}

// route compiles the mapping n into a copy of parent with the fields n gives; false when n is
// not a mapping.
func (d *decoder) route(parent *Route, n *yaml.Node, path string, inDefs bool) (*Route, bool) {
	r := *parent
	r.match, r.scopeGroups = matcher{}, nil
	if !inDefs {
		r.Name = ""
	}
	x := &draft{r: &r, path: path, parent: parent, given: map[string]*yaml.Node{}, inDefs: inDefs}
	fields := routeFields
	known := make([]string, len(fields))
	for i, f := range fields {
		known[i] = f.key
	}
	ok := d.fields(n, path, func(key string, k, v *yaml.Node, at string) {
		i := slices.IndexFunc(fields, func(f field) bool { return f.key == key })
		if i < 0 {
			d.unknown(k, at, known)
			return
		}
		f := fields[i]
		if f.where == routesOnly && inDefs {
			if f.inDefaults == "" {
				f.inDefaults = "belongs to routes, not defaults"
			}
			d.fail(k, at, "%s", f.inDefaults)
			return
		}
		x.given[key] = v
		if len(f.values) > 0 {
			if _, ok := d.oneOf(v, at, f.values); !ok {
				return
			}
		}
		f.set(d, x, v, at)
	})
	if !ok {
		return &r, false
	}
	d.finish(x)
	return &r, true
}

// finish checks what depends on more than one field of the draft.
func (d *decoder) finish(x *draft) {
	r, f := x.r, func(key string) string { return join(x.path, key) }
	if !x.inDefs && x.given["match"] == nil {
		d.fail(nil, f("match"), "is required (%s)", orList(names(matchKinds()...)))
	}
	if ttl, maxTTL := x.given["ttl"], x.given["max_ttl"]; (ttl != nil || maxTTL != nil) && r.TTL > r.MaxTTL {
		d.fail(firstOf(ttl, maxTTL), f("ttl"), "%v exceeds max_ttl %v", r.TTL, r.MaxTTL)
	}
	if fp, fh := x.given["fingerprint"], x.given["fingerprint_headers"]; (fp != nil || fh != nil) && len(r.Fingerprint) == 0 && len(r.FingerprintHeaders) > 0 {
		// An empty fingerprint turns the mismatch check off: headers alone would silently be
		// ignored.
		d.fail(firstOf(fh, fp), f("fingerprint_headers"), "set while fingerprint is [], which turns the mismatch check off; list the parts to hash too, or drop the headers")
	}
	if ig := x.given["fingerprint_ignore_json"]; ig != nil && len(r.FingerprintIgnoreJSON) > 0 && !r.FingerprintsBody() {
		d.fail(ig, f("fingerprint_ignore_json"), "is set while fingerprint leaves out body, so it changes nothing; add body to fingerprint, or drop it")
	}
	d.compileScope(x)
	scopeGiven := x.given["scope"] != nil || x.given["scope_headers"] != nil || x.given["scope_path_params"] != nil
	if r.RequireScope && len(r.Scope) == 0 && (x.given["require_scope"] != nil || scopeGiven) {
		d.fail(firstOf(x.given["require_scope"], x.given["scope"], x.given["scope_headers"]), f("require_scope"),
			"is true while the scope is empty, which refuses every covered request")
	}
}

func firstOf(ns ...*yaml.Node) *yaml.Node {
	for _, n := range ns {
		if n != nil {
			return n
		}
	}
	return nil
}

// match reads a route's match: exactly one of the six matchers.
func (d *decoder) match(x *draft, v *yaml.Node, path string) {
	kinds := names(matchKinds()...)
	count := 0
	var body []JSONMatch
	d.fields(v, path, func(key string, k, mv *yaml.Node, at string) {
		if key == "json" {
			body = d.matchJSON(mv, at)
			return
		}
		if !slices.Contains(kinds, key) {
			d.unknown(k, at, append(kinds, "json"))
			return
		}
		count++
		s, ok := d.str(mv, at)
		if !ok || count > 1 {
			return
		}
		m := matcher{kind: matchKind(key), value: s}
		switch m.kind {
		case matchPathPrefix, matchPathExact:
			if !strings.HasPrefix(s, "/") {
				d.fail(mv, at, "must start with /, got %q", s)
				return
			}
		case matchPathRegex, matchRouteNameRegex:
			if s == "" {
				d.fail(mv, at, "must not be empty")
				return
			}
			re, err := regexp.Compile(s)
			if err != nil {
				d.fail(mv, at, "invalid regular expression: %v", err)
				return
			}
			m.re = re
		case matchRouteNameExact, matchRouteNamePrefix:
			if s == "" {
				d.fail(mv, at, "must not be empty")
				return
			}
		}
		x.r.match = m
	})
	if count != 1 && v.Kind == yaml.MappingNode {
		d.fail(v, path, "needs exactly one of %s", orList(kinds))
		x.r.match = matcher{}
		return
	}
	x.r.match.json = body
}

// scope reads a scope list: peer_identity, or one-field mappings such as {header: authorization}.
func (d *decoder) scope(x *draft, v *yaml.Node, path string) {
	x.scope = []scopeEntry{}
	kinds := names(ScopeHeader, ScopeJWTClaim, ScopePathParam, ScopeJSON)
	d.list(v, path, func(item *yaml.Node, at string) {
		if item.Kind == yaml.ScalarNode {
			if item.Value != string(ScopePeerIdentity) {
				d.fail(item, at, "must be peer_identity or one of {header: name}, {jwt_claim: name}, {path_param: group}, {json: /pointer}, got %s", describe(item))
				return
			}
			x.scope = append(x.scope, scopeEntry{ScopeSource{Kind: ScopePeerIdentity}, item, at})
			return
		}
		if item.Kind != yaml.MappingNode {
			d.fail(item, at, "must be peer_identity or a one-field mapping such as {header: authorization}, got %s", describe(item))
			return
		}
		if len(item.Content) != 2 {
			d.fail(item, at, "must have exactly one field: header, jwt_claim, path_param or json")
			return
		}
		d.fields(item, at, func(key string, k, sv *yaml.Node, sat string) {
			if key == string(ScopePeerIdentity) {
				d.fail(k, sat, "is written bare: `- peer_identity`")
				return
			}
			if !slices.Contains(kinds, key) {
				d.unknown(k, sat, kinds)
				return
			}
			s, ok := d.str(sv, sat)
			if !ok {
				return
			}
			src := ScopeSource{Kind: ScopeKind(key), Name: s}
			switch src.Kind {
			case ScopeHeader:
				h, ok := d.requestHeader(sv, sat)
				if !ok {
					return
				}
				src.Name = h
			case ScopeJWTClaim:
				if s == "" {
					d.fail(sv, sat, "must name a claim")
					return
				}
			case ScopeJSON:
				if _, ok := d.pointer(sv, sat); !ok {
					return
				}
			}
			x.scope = append(x.scope, scopeEntry{src, sv, sat})
		})
	})
}

// compileScope builds the route's Scope: scope, or the scope_headers shorthand, or the inherited
// scope, then the scope_path_params; path parameters must each name one group of the route's
// path_regex.
func (d *decoder) compileScope(x *draft) {
	r, f := x.r, func(key string) string { return join(x.path, key) }
	scope, headers, params := x.given["scope"], x.given["scope_headers"], x.given["scope_path_params"]
	if scope != nil && headers != nil {
		d.fail(headers, f("scope_headers"), "is shorthand for scope: give one or the other")
	}
	if scope != nil && params != nil {
		d.fail(params, f("scope_path_params"), "is shorthand for path_param entries of scope: list them there instead")
	}
	var entries []scopeEntry
	switch {
	case scope != nil:
		entries = x.scope
	case headers != nil:
		for _, h := range x.scopeHeaders {
			entries = append(entries, scopeEntry{ScopeSource{ScopeHeader, h}, headers, f("scope_headers")})
		}
	default:
		for _, s := range x.parent.Scope {
			entries = append(entries, scopeEntry{src: s})
		}
	}
	if scope == nil {
		entries = append(entries, x.pathParams...)
	}

	r.Scope, r.ScopeHeaders, r.ScopePathParams, r.scopeGroups, r.ScopeJSON = []ScopeSource{}, nil, nil, nil, nil
	seen := map[ScopeSource]bool{}
	for _, e := range entries {
		if seen[e.src] {
			what := string(e.src.Kind)
			if e.src.Name != "" {
				what += " " + strconv.Quote(e.src.Name)
			}
			d.fail(e.node, e.path, "%s is listed twice", what)
			continue
		}
		seen[e.src] = true
		switch e.src.Kind {
		case ScopeHeader:
			r.ScopeHeaders = append(r.ScopeHeaders, e.src.Name)
		case ScopePathParam:
			g, ok := d.pathParam(x, e)
			if !ok {
				continue
			}
			r.scopeGroups = append(r.scopeGroups, g)
			r.ScopePathParams = append(r.ScopePathParams, e.src.Name)
		case ScopeJSON:
			ptr, _ := jsonbody.ParsePointer(e.src.Name) // checked when read
			r.ScopeJSON = append(r.ScopeJSON, ptr)
		}
		r.Scope = append(r.Scope, e.src)
	}
}

// pathParam returns the submatch index of the group a path_param entry names.
func (d *decoder) pathParam(x *draft, e scopeEntry) (int, bool) {
	m := x.r.match
	switch {
	case x.inDefs:
		d.fail(e.node, e.path, "path_param needs a route's path_regex, and the defaults have none")
		return 0, false
	case m.kind == "":
		return 0, false // the match is missing or bad, and said so
	case m.kind != matchPathRegex:
		d.fail(e.node, e.path, "needs a path_regex with named groups")
		return 0, false
	}
	name := e.src.Name
	i := m.re.SubexpIndex(name)
	if i < 0 {
		d.fail(e.node, e.path, "%q is not a named group of path_regex", name)
		return 0, false
	}
	if n := countOf(m.re.SubexpNames(), name); n > 1 {
		// Only the first would be read: a path matched by another branch would scope by "".
		d.fail(e.node, e.path, "%q names %d groups of path_regex; give each a name of its own", name, n)
		return 0, false
	}
	return i, true
}

// setting reads a program setting's value.
func (d *decoder) setting(s Setting, v *yaml.Node, path string) (string, bool) {
	if s.List && v.Kind == yaml.SequenceNode {
		items, ok := d.strs(v, path)
		return strings.Join(items, ","), ok
	}
	return d.str(v, path)
}

// header reads a header name, lower-cased; "" is accepted when off says it turns the header off.
func (d *decoder) header(v *yaml.Node, path string, off bool) (string, bool) {
	s, ok := d.str(v, path)
	switch {
	case !ok:
		return "", false
	case s == "" && off:
		return "", true
	case !isToken(s):
		d.fail(v, path, "%q is not a valid header name", s)
		return "", false
	}
	return strings.ToLower(s), true
}

// headerList reads a list of header names; request says they are request headers the route
// reads (scope, fingerprint), where :authority is the host.
func (d *decoder) headerList(v *yaml.Node, path string, request bool) ([]string, bool) {
	out := []string{}
	ok := d.list(v, path, func(item *yaml.Node, at string) {
		read := d.header
		if request {
			read = func(v *yaml.Node, path string, _ bool) (string, bool) { return d.requestHeader(v, path) }
		}
		if h, ok := read(item, at, false); ok {
			out = append(out, h)
		}
	})
	return out, ok
}

// requestHeader reads the name of a request header the route reads (scope, fingerprint). Envoy
// gives the processor the request's host as :authority, never as host: host is refused.
func (d *decoder) requestHeader(v *yaml.Node, path string) (string, bool) {
	s, ok := d.str(v, path)
	if !ok {
		return "", false
	}
	if strings.EqualFold(s, ":authority") {
		return ":authority", true
	}
	h, ok := d.header(v, path, false)
	if ok && h == "host" {
		d.fail(v, path, "%q never reaches the processor: Envoy passes the request's host as \":authority\"; name that instead", s)
		return "", false
	}
	return h, ok
}

func (d *decoder) statuses(v *yaml.Node, path string) (StatusSet, bool) {
	var s StatusSet
	ok := d.list(v, path, func(item *yaml.Node, at string) {
		if !d.scalar(item, at, "a status class or code") {
			return
		}
		if item.ShortTag() == "!!int" {
			var code int
			if item.Decode(&code) != nil || code < 100 || code > 599 {
				d.fail(item, at, "%s is not an HTTP status code", item.Value)
				return
			}
			s.add(code)
			return
		}
		str := item.Value
		if len(str) == 3 && str[0] >= '1' && str[0] <= '5' && strings.EqualFold(str[1:], "xx") {
			base := int(str[0]-'0') * 100
			for code := base; code < base+100; code++ {
				s.add(code)
			}
			return
		}
		code, err := strconv.Atoi(str)
		if err != nil || code < 100 || code > 599 {
			d.fail(item, at, "%q is neither a status class such as \"2xx\" nor a status code", str)
			return
		}
		s.add(code)
	})
	return s, ok
}

// grpcStatuses reads a list of gRPC status codes, by canonical name or number.
func (d *decoder) grpcStatuses(v *yaml.Node, path string) (GRPCStatusSet, bool) {
	var s GRPCStatusSet
	ok := d.list(v, path, func(item *yaml.Node, at string) {
		if !d.scalar(item, at, "a gRPC status name or number") {
			return
		}
		if code, err := strconv.Atoi(item.Value); err == nil {
			if code < 0 || code >= len(GRPCStatusNames) {
				d.fail(item, at, "%s is not a gRPC status code (0 to %d)", item.Value, len(GRPCStatusNames)-1)
				return
			}
			s |= 1 << code
			return
		}
		code := slices.Index(GRPCStatusNames[:], strings.ToUpper(item.Value))
		if code < 0 {
			d.fail(item, at, "%q is not a gRPC status (OK, CANCELLED, ... UNAUTHENTICATED, or 0 to %d)", item.Value, len(GRPCStatusNames)-1)
			return
		}
		s |= 1 << code
	})
	return s, ok
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
	if s == "" || len(s) > 1<<16-1 {
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
