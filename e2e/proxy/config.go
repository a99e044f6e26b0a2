package proxy

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	jwtauthnv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/jwt_authn/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// Defaults that match Envoy's.
const (
	// DefaultBufferLimit is Envoy's default per_connection_buffer_limit_bytes (1 MiB), for a
	// listener (ListenerImpl's constructor in source/common/listener_manager/listener_impl.cc)
	// and a cluster (ClusterInfoImpl's in source/common/upstream/upstream_impl.cc) alike.
	DefaultBufferLimit = 1 << 20
	// DefaultRouteTimeout is Envoy's default route timeout (DEFAULT_ROUTE_TIMEOUT_MS, read in
	// RouteEntryImplBase's constructor in source/common/router/config_impl.cc).
	DefaultRouteTimeout = 15 * time.Second
	// DefaultMessageTimeout is ext_proc's default message_timeout
	// (ExternalProcessingFilterConfig::DefaultMessageTimeoutMs in config.h).
	DefaultMessageTimeout = 200 * time.Millisecond
	// DefaultDeferredCloseTimeout is ext_proc's default deferred_close_timeout, used only in
	// observability mode (ext_proc.h DEFAULT_DEFERRED_CLOSE_TIMEOUT_MS).
	DefaultDeferredCloseTimeout = 5 * time.Second
	// DefaultReadSize is the size of the reads that feed the filter chain with body data when no
	// Shape says otherwise. Envoy's data callbacks follow socket reads, whose size depends on
	// timing and on the peer's writes; 16 KiB is a typical read and the approximation the proxy
	// uses.
	DefaultReadSize = 16 << 10
)

// Config describes one proxy: an HTTP/1 (and optionally HTTP/2) listener whose connection
// manager runs an optional jwt_authn filter, one ext_proc filter and the router, with one
// upstream cluster and a route table. The package doc lists what is modelled and what is not.
type Config struct {
	// Filter is the ext_proc filter configuration. The proxy honours processing_mode,
	// allow_mode_override, allowed_override_modes, message_timeout, max_message_timeout,
	// failure_mode_allow, status_on_error, disable_immediate_response,
	// send_body_without_waiting_for_header_response, request_attributes, response_attributes,
	// mutation_rules, forward_rules, metadata_options (untyped namespaces), observability_mode,
	// deferred_close_timeout and grpc_service.initial_metadata. The rest of grpc_service is
	// ignored: the processors are in Processors. Nil means an empty configuration (headers
	// SEND, bodies NONE). New rejects what Envoy's config.cc verifyProcessingModeConfig rejects.
	Filter *filterextproc.ExternalProcessor
	// Processors are the ext_proc gRPC addresses, host:port or unix:///path. Each HTTP request
	// opens its stream (when it first needs one) to the next address, round robin.
	Processors []string
	// Upstream is the upstream base URL, e.g. http://127.0.0.1:8080. Only its scheme and host
	// are used; the request's path is forwarded as is.
	Upstream string
	// ListenerBufferLimit bounds request bodies held by the filter chain (Envoy's listener
	// per_connection_buffer_limit_bytes); 0 means DefaultBufferLimit.
	ListenerBufferLimit uint32
	// UpstreamBufferLimit bounds response bodies held by the filter chain (the upstream
	// cluster's per_connection_buffer_limit_bytes); 0 means DefaultBufferLimit.
	UpstreamBufferLimit uint32
	// UpstreamTrailers and DownstreamTrailers are the enable_trailers of the upstream cluster's
	// and of the connection manager's HTTP/1 options. Without UpstreamTrailers the upstream's
	// response trailers are dropped and request trailers are not sent upstream; without
	// DownstreamTrailers the client's request trailers are dropped and response trailers do not
	// go downstream.
	UpstreamTrailers, DownstreamTrailers bool
	// DownstreamHTTP2 serves HTTP/2 without TLS (prior knowledge, h2c) on the listener beside
	// HTTP/1.1, as a connection manager with codec_type AUTO does on a plaintext listener (it
	// picks HTTP/2 when the connection starts with the HTTP/2 preface:
	// ConnectionManagerUtility::determineNextProtocol in source/common/http/conn_manager_utility.cc)
	// or HTTP2. Over TLS the listener stays HTTP/1.1. On HTTP/2 streams trailers always pass
	// (enable_trailers is an HTTP/1 option, Http1Settings::enable_trailers_), the HTTP/1 codec's
	// content-length: 0 is not added, and a reset is an RST_STREAM rather than a closed
	// connection.
	DownstreamHTTP2 bool
	// UpstreamHTTP2 makes the router speak HTTP/2 without TLS (prior knowledge) to the upstream,
	// as a cluster whose typed_extension_protocol_options set explicit_http_config
	// http2_protocol_options does; trailers then always pass both ways.
	UpstreamHTTP2 bool
	// RouteTimeout is the timeout of routes that set none; 0 means DefaultRouteTimeout. It starts
	// once the whole request has gone to the router and ends with the upstream response.
	RouteTimeout time.Duration
	// Routes is the virtual host's route table, in order: the first route that matches the
	// request's :path wins, and a request no route matches gets the router's 404. Empty means a
	// single unnamed route with prefix "/".
	Routes []Route
	// VirtualHostExtProc is the virtual host's typed_per_filter_config for the ext_proc filter,
	// merged under each route's (Http::Utility::getAllPerFilterConfig, less specific first).
	VirtualHostExtProc *filterextproc.ExtProcPerRoute
	// DisabledPrefixes are path prefixes whose route disables ext_proc (ExtProcPerRoute
	// disabled: true). They are routes placed before Routes; kept for older callers.
	DisabledPrefixes []string
	// LocalReplyConfig is the connection manager's local_reply_config. The proxy implements
	// mappers with status_code, header and runtime-free and/or filters, status_code, body,
	// headers_to_add and body_format_override, and body_format (text_format, text_format_source
	// inline_string, json_format, content_type) with the commands %LOCAL_REPLY_BODY%,
	// %RESPONSE_CODE%, %RESPONSE_CODE_DETAILS%, %RESPONSE_FLAGS%, %REQ(x)%, %RESP(x)%,
	// %PROTOCOL% and %DYNAMIC_METADATA(ns:key)%. New rejects anything else.
	LocalReplyConfig *hcmv3.LocalReplyConfig
	// JWTAuthn, when set, is a jwt_authn filter placed before ext_proc in http_filters. The proxy
	// implements providers with issuer, audiences, local_jwks (inline_string, HS256 "oct" and
	// RS256 "RSA" keys), from_headers (default Authorization: Bearer), forward,
	// payload_in_metadata and header_in_metadata, and rules matching a prefix, path or
	// safe_regex that require a provider_name, requires_any of them, or allow_missing. New
	// rejects anything else.
	JWTAuthn *jwtauthnv3.JwtAuthentication
	// Tracing, when set, is the connection manager's tracing with the OpenTelemetry tracer: the
	// request's span follows an incoming W3C traceparent, and the ext_proc stream's initial
	// metadata carries a child span's traceparent.
	Tracing *Tracing
	// TLS, when set, makes Start serve the listener over TLS with it (set ClientAuth and
	// ClientCAs for mTLS: connection.uri_san_peer_certificate is the client certificate's first
	// URI SAN).
	TLS *tls.Config
	// Envoy selects the behaviours that differ between Envoy versions; the zero value is 1.37.
	Envoy Behaviour
	// Shapes, when set, is asked once per request for the timing-dependent shape of its bodies,
	// so that tests can reproduce a shape instead of relying on timing.
	Shapes func(*http.Request) Shapes
	// AccessLog, when set, is called once per request after the response has been written (or
	// the request abandoned), like a line of Envoy's access log.
	AccessLog func(Record)
	// HealthCheck, when set, is the processor cluster's active gRPC health check: each processor
	// is asked grpc.health.v1 Check(ServiceName) every Interval; one that fails
	// UnhealthyThreshold checks in a row gets no new stream until it passes HealthyThreshold in a
	// row. When none is healthy all are used, as Envoy's panic threshold does.
	HealthCheck *HealthCheck
	// StreamRetries is how many other processors a request tries when its stream cannot be
	// opened (grpc_service.retry_policy with connect-failure or refused-stream): nothing reached
	// the processor that refused it.
	StreamRetries int
}

// Route is one route of the virtual host.
type Route struct {
	// Name is the route's name: the xds.route_name attribute.
	Name string
	// Prefix, Path and Regex are the route's match (RouteMatch prefix, path and safe_regex);
	// at most one may be set, none means prefix "/". Prefix is compared with the whole :path,
	// Path and Regex with :path without its query string, as Envoy's route matchers do.
	Prefix, Path, Regex string
	// Grpc is the match's grpc: {} (RouteMatch.grpc): the route matches only gRPC requests,
	// content-type application/grpc or application/grpc+…, as Envoy's
	// RouteEntryImplBase::matchRoute (source/common/router/config_impl.cc) checks
	// Grpc::Common::isGrpcRequestHeaders (source/common/grpc/common.cc) before the path; a
	// request that is not gRPC falls to the next route.
	Grpc bool
	// Metadata is the route's metadata: the xds.route_metadata attribute.
	Metadata *corev3.Metadata
	// ExtProc is the route's typed_per_filter_config for the ext_proc filter.
	ExtProc *filterextproc.ExtProcPerRoute
	// JWT is the route's typed_per_filter_config for the jwt_authn filter (Config.JWTAuthn):
	// disabled, or the name of a requirement of its requirement_map.
	JWT *jwtauthnv3.PerRouteConfig
	// Timeout is the route's timeout; 0 means Config.RouteTimeout, a negative value none.
	Timeout time.Duration
	// Retry is the router's retry_policy on the route (the route's, else its virtual host's),
	// nil for none. The proxy retries on the status conditions: 5xx, gateway-error,
	// retriable-4xx and retriable-status-codes, and the gRPC ones (cancelled, deadline-exceeded,
	// internal, resource-exhausted, unavailable) on a trailers-only response, up to num_retries
	// (default 1), once the whole
	// request body reached the router, sending the same headers and body again; the processor
	// sees one request and, in upstream.request_attempt_count, the attempts.
	Retry *routev3.RetryPolicy
	// Hedge is the router's hedge_policy on the route (the route's, else its virtual host's),
	// nil for none. With hedge_on_per_try_timeout and Retry's per_try_timeout, the proxy sends
	// another attempt when an attempt outlasts its per-try timeout, the first one left running,
	// and the first response wins (hedge.go).
	Hedge *routev3.HedgePolicy
}

// Behaviour holds the behaviours that differ between Envoy versions. The zero value is Envoy
// 1.37 as read from its source; Envoy136 and Envoy133 return the older ones.
type Behaviour struct {
	// SkipExtProcOnLocalReply keeps local replies made by other filters and by the router (a
	// jwt_authn 401, the router's 503 and 504, a 413) away from the processor: it sees no
	// response phase for them and its stream just ends. Envoy 1.34 to 1.36 behave so
	// (CVE-2025-30157, runtime guard envoy.reloadable_features.skip_ext_proc_on_local_reply).
	// Envoy 1.37 sends them again (PR #41769): its ext_proc.cc Filter::encodeHeaders has no
	// such check and the guard is gone from runtime_features.cc. For 1.34–1.36 the model follows
	// the 1.34 release note.
	SkipExtProcOnLocalReply bool
	// NoStreamCloseOptimization keeps the side stream open until the HTTP stream ends, as before
	// Envoy 1.37. Without it the stream is closed right after the last expected answer
	// (ext_proc.cc Filter::closeGrpcStreamIfLastRespReceived, runtime guard
	// envoy.reloadable_features.ext_proc_stream_close_optimization) and when encodeHeaders finds
	// nothing to process on the response path.
	NoStreamCloseOptimization bool
	// CompleteBodyWithoutDataContinues sends the trailers (or continues) when a direction's
	// trailers arrived during its header call with no data before them, as
	// ProcessorState::handleHeadersResponse did before handleCompleteBodyAvailable took that
	// case over. The newest processor_state.cc read (1.37-era main) sends nothing there and does
	// not continue, so the stream stays paused until a timeout; the version that changed it was
	// not read, so no preset sets this.
	CompleteBodyWithoutDataContinues bool
	// NoStreamedImmediateResponse is an Envoy before 1.37, whose ProcessingResponse has no
	// streamed_immediate_response: proto parsing keeps the field as an unknown field, so the
	// response oneof is unset and Filter::onReceiveMessage in ext_proc.cc takes the default
	// branch of its switch on response_case() ("Any other message is considered spurious":
	// FailedPreconditionError("unhandled message")), then handles it as every spurious message:
	// since Envoy 1.35 (envoyproxy/envoy#39994) a local reply with status_on_error unless
	// failure_mode_allow, which closes the stream and sends the request upstream. The default
	// branch was read in an ext_proc.cc without the streamed case (1.3x era, before #39994,
	// where every spurious message continued the request); what 1.35 and 1.36 do next is from
	// #39994, not from their source.
	NoStreamedImmediateResponse bool
}

// Envoy137 is the behaviour of Envoy 1.37 (the zero Behaviour).
func Envoy137() Behaviour { return Behaviour{} }

// Envoy136 is the behaviour of Envoy 1.34 to 1.36 (and of the patched 1.31 to 1.33).
func Envoy136() Behaviour {
	return Behaviour{SkipExtProcOnLocalReply: true, NoStreamCloseOptimization: true, NoStreamedImmediateResponse: true}
}

// Envoy133 is the behaviour of Envoys without the CVE-2025-30157 fix (envoyproxy/envoy#38818:
// 1.33.0, and patch releases before the fix: it shipped in 1.31.6, and per its advisory in the
// 1.32 and 1.33 patches of the same day, which were not read): local replies reach the
// processor and the stream stays open.
// NoStreamedImmediateResponse stays unset: those Envoys continue the request on a spurious
// message (before envoyproxy/envoy#39994), which the model does not play.
func Envoy133() Behaviour { return Behaviour{NoStreamCloseOptimization: true} }

// Shapes is the timing-dependent shape of one request's bodies.
type Shapes struct {
	Request, Response BodyShape
}

// DuringHeaders says what happens to body data while the header message of its direction is
// being answered.
type DuringHeaders int

const (
	// Race lets the body arrive as it does: the answer and the data race, as in Envoy.
	Race DuringHeaders = iota
	// Whole delivers the whole body (as far as the buffer limit lets it) before the header
	// answer is acted on: the case ext_proc handles in ProcessorState::handleCompleteBodyAvailable.
	Whole
	// Held delivers no body data until the header answer has been acted on.
	Held
)

// BodyShape controls how one body reaches the filter chain.
type BodyShape struct {
	// DuringHeaders is what body data does while the headers are being answered.
	DuringHeaders DuringHeaders
	// Chunks are the sizes of successive reads, each a data callback (a STREAMED message); the
	// last size repeats. Empty means reads of up to DefaultReadSize, as the data arrives.
	Chunks []int
	// Pipeline, when positive, bounds how many STREAMED chunks may wait for their answers before
	// the proxy reads more: 1 is lock-step. Zero leaves only Envoy's buffer limit.
	Pipeline int
}

// Tracing is the connection manager's tracing configuration with the OpenTelemetry tracer.
type Tracing struct {
	// Unsampled makes traces that start at the proxy (no incoming traceparent) unsampled, as
	// random_sampling 0 would; Envoy's default samples them all. A request with a traceparent
	// keeps its flag.
	Unsampled bool
}

// HealthCheck is an active gRPC health check of the processors (Envoy's cluster health_checks
// with grpc_health_check).
type HealthCheck struct {
	Interval, Timeout                    time.Duration
	UnhealthyThreshold, HealthyThreshold int
	ServiceName                          string
}

// Record describes one finished request, with the fields of Envoy's access log that tests need.
type Record struct {
	// RequestID is the x-request-id sent to the processor and the upstream.
	RequestID string
	// Method and Path are the request's :method and :path.
	Method, Path string
	// Route is the name of the route the request matched, "" for none or an unnamed one.
	Route string
	// Processor is the address whose stream served the request, "" when no stream was opened.
	Processor string
	// Status is the status sent downstream, 0 when none was sent.
	Status int
	// CodeDetails is %RESPONSE_CODE_DETAILS%: via_upstream, an ImmediateResponse's details,
	// ext_proc_local_response (a streamed immediate response), ext_proc_error_…,
	// upstream_response_timeout, request_payload_too_large, ….
	CodeDetails string
	// ResponseFlags is %RESPONSE_FLAGS%: "-", UF, UT, UC, UR, NR, DC.
	ResponseFlags string
	// Attempts is %UPSTREAM_REQUEST_ATTEMPT_COUNT%: 1 once the router tried the upstream.
	Attempts int
	// DynamicMetadata is the request's dynamic metadata by namespace (jwt_authn's and what the
	// processor wrote in receiving namespaces); read it with DynamicMetadataValue.
	DynamicMetadata map[string]*structpb.Struct
	// TraceParent is the traceparent of the request's span, "" without tracing.
	TraceParent string
	// Duration is the time from receiving the request to the end of its handling.
	Duration time.Duration
}

// DynamicMetadataValue formats %DYNAMIC_METADATA(ns:key)%: a string as is, any other value as
// JSON, "-" when absent. Nested keys are separated by ':' as in Envoy's format.
func (r Record) DynamicMetadataValue(ns string, keys ...string) string {
	s := r.DynamicMetadata[ns]
	if s == nil {
		return "-"
	}
	v := structpb.NewStructValue(s)
	for _, k := range keys {
		f, ok := v.GetStructValue().GetFields()[k]
		if !ok {
			return "-"
		}
		v = f
	}
	if sv, ok := v.GetKind().(*structpb.Value_StringValue); ok {
		return sv.StringValue
	}
	b, err := v.MarshalJSON()
	if err != nil {
		return "-"
	}
	return string(b)
}

// Stats are counters that mirror the ext_proc filter's stats (ALL_EXT_PROC_FILTER_STATS in
// source/extensions/filters/http/ext_proc/ext_proc.h) plus a few of
// the proxy's own. All counts are totals since New.
type Stats struct {
	// StreamsStarted counts gRPC streams opened (streams_started).
	StreamsStarted int64
	// StreamErrors counts streams that could not be opened or that ended with a gRPC error
	// status (streams_failed).
	StreamErrors int64
	// StreamsClosedEarly counts streams closed right after their last expected answer.
	StreamsClosedEarly int64
	// MessagesSent and MessagesReceived count ProcessingRequests and ProcessingResponses.
	MessagesSent, MessagesReceived int64
	// Spurious counts responses of the wrong kind (spurious_msgs_received).
	Spurious int64
	// MessageTimeouts counts expired message timers (message_timeouts).
	MessageTimeouts int64
	// FailureModeAllowed counts failures ignored because of failure_mode_allow.
	FailureModeAllowed int64
	// ImmediateResponses counts ImmediateResponses received and acted on.
	ImmediateResponses int64
	// StreamedImmediateResponses counts streamed immediate responses whose headers started a
	// local response.
	StreamedImmediateResponses int64
	// RejectedMutations counts header mutations refused by the mutation rules or invalid
	// (rejected_header_mutations).
	RejectedMutations int64
	// ImmediateMutationErrors counts ImmediateResponses whose header mutation failed: Envoy logs
	// "Immediate response mutations failed" and sends the reply anyway.
	ImmediateMutationErrors int64
	// ModeOverrides and ModeOverridesIgnored count mode_override fields honoured and ignored.
	ModeOverrides, ModeOverridesIgnored int64
	// TimeoutOverrides and TimeoutOverridesIgnored count override_message_timeout fields
	// (override_message_timeout_received / _ignored).
	TimeoutOverrides, TimeoutOverridesIgnored int64
	// LocalReplies counts local replies other than ImmediateResponses: 413, 500, 503, 504, 401,
	// 404, status_on_error.
	LocalReplies int64
	// Resets counts downstream streams reset mid-response.
	Resets int64
}

// route is a Route ready for matching.
type route struct {
	Route
	regex *regexp.Regexp
}

// matches reports whether r matches a request with path (the :path header) that is gRPC or
// not (isGrpc), as Envoy's PrefixRouteEntryImpl, PathRouteEntryImpl and RegexRouteEntryImpl do
// (case sensitive, query removed for path and regex): each calls
// RouteEntryImplBase::matchRoute first, which refuses a request that is not gRPC on a route
// with grpc: {} (config_impl.cc).
func (r *route) matches(path string, grpc bool) bool {
	if r.Grpc && !grpc {
		return false
	}
	noQuery, _, _ := strings.Cut(path, "?")
	switch {
	case r.Path != "":
		return noQuery == r.Path
	case r.regex != nil:
		return r.regex.MatchString(noQuery)
	default:
		prefix := r.Prefix
		if prefix == "" {
			prefix = "/"
		}
		return strings.HasPrefix(path, prefix)
	}
}

// buildRoutes turns the configuration's route table into routes, DisabledPrefixes first.
func buildRoutes(cfg Config) ([]*route, error) {
	var out []*route
	for _, p := range cfg.DisabledPrefixes {
		out = append(out, &route{Route: Route{Prefix: p, ExtProc: &filterextproc.ExtProcPerRoute{
			Override: &filterextproc.ExtProcPerRoute_Disabled{Disabled: true},
		}}})
	}
	routes := cfg.Routes
	if len(routes) == 0 {
		routes = []Route{{}}
	}
	for i, r := range routes {
		n := 0
		for _, s := range []string{r.Prefix, r.Path, r.Regex} {
			if s != "" {
				n++
			}
		}
		if n > 1 {
			return nil, fmt.Errorf("proxy: route %d (%q) sets more than one of prefix, path and regex", i, r.Name)
		}
		rt := &route{Route: r}
		if r.Regex != "" {
			// safe_regex matches the whole path (RE2 full match).
			re, err := regexp.Compile("^(?:" + r.Regex + ")$")
			if err != nil {
				return nil, fmt.Errorf("proxy: route %d (%q): %w", i, r.Name, err)
			}
			rt.regex = re
		}
		out = append(out, rt)
	}
	return out, nil
}

// verifyFilter rejects what Envoy's ext_proc config.cc verifyFilterConfig and
// verifyProcessingModeConfig reject at load time, for the filter-level processing mode only
// (per-route modes are not checked there: createRouteSpecificFilterConfigTyped builds them
// unchecked), and an http_service the proxy does not model.
//
// A filter without grpc_service is taken to have one (the processors are in Config.Processors),
// where Envoy refuses a filter with neither service ("One and only one of grpc_service or
// http_service must be configured").
//
// The GRPC body mode is accepted, as Envoy accepts it: neither function names it, and it is run
// as ext_proc.cc runs it (Filter::onData sends no body message for a mode it has no case for,
// and ProcessorState::handleHeadersResponseWithContinue in processor_state.cc continues without
// one, unless the whole body arrived during the header call, which it sends as one message as
// in every mode but NONE).
func verifyFilter(f *filterextproc.ExternalProcessor) error {
	if err := verifyService(f); err != nil {
		return err
	}
	m := f.GetProcessingMode()
	full := filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED
	if m.GetRequestBodyMode() == full && m.GetRequestTrailerMode() != filterextproc.ProcessingMode_SEND {
		return fmt.Errorf("proxy: If the ext_proc filter has the request_body_mode set to FULL_DUPLEX_STREAMED, then the request_trailer_mode has to be set to SEND")
	}
	if m.GetResponseBodyMode() == full && m.GetResponseTrailerMode() != filterextproc.ProcessingMode_SEND {
		return fmt.Errorf("proxy: If the ext_proc filter has the response_body_mode set to FULL_DUPLEX_STREAMED, then the response_trailer_mode has to be set to SEND")
	}
	if (m.GetRequestBodyMode() == full || m.GetResponseBodyMode() == full) && f.GetFailureModeAllow() {
		return fmt.Errorf("proxy: If the ext_proc filter has either the request_body_mode or the response_body_mode set to FULL_DUPLEX_STREAMED, then the failure_mode_allow has to be left as false")
	}
	if f.GetDisableClearRouteCache() && f.GetRouteCacheAction() != filterextproc.ExternalProcessor_DEFAULT {
		return fmt.Errorf("proxy: disable_clear_route_cache and route_cache_action can not be set to none-default at the same time")
	}
	return nil
}

// verifyService is the http_service half of config.cc: verifyFilterConfig refuses a filter with
// both services, and verifyProcessingModeConfig one with http_service whose processing mode sends
// a body or trailers (ExtProcHttpClient posts headers only). An http_service Envoy accepts is
// not modelled: the proxy speaks gRPC to its processors.
func verifyService(f *filterextproc.ExternalProcessor) error {
	if f.GetHttpService() == nil {
		return nil
	}
	if f.GetGrpcService() != nil {
		return errors.New("proxy: One and only one of grpc_service or http_service must be configured")
	}
	m := f.GetProcessingMode()
	if m.GetRequestBodyMode() != filterextproc.ProcessingMode_NONE || m.GetResponseBodyMode() != filterextproc.ProcessingMode_NONE ||
		m.GetRequestTrailerMode() == filterextproc.ProcessingMode_SEND || m.GetResponseTrailerMode() == filterextproc.ProcessingMode_SEND {
		return errors.New("proxy: If the ext_proc filter is configured with http_service instead of gRPC service, then the processing modes of this filter can not be configured to send body or trailer")
	}
	return errors.New("proxy: http_service is not modelled (the proxy's processors speak gRPC)")
}
