package envoyconf

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/anypb"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	jwtauthnv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/jwt_authn/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	httpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/check"
	"github.com/idempotency-extproc/idempotency-extproc/internal/check/checktest"
)

// defaultRouteTimeout is Envoy's RouteAction.timeout, which Settings reports when the bootstrap
// leaves it unset.
const defaultRouteTimeout = 15 * time.Second

// Settings gathers what an Envoy-compatible test proxy needs from a bootstrap. Unset values carry
// Envoy's defaults, so the proxy behaves like Envoy running the same file.
type Settings struct {
	// Filter is the ext_proc filter configuration.
	Filter *filterextproc.ExternalProcessor
	// FilterName is the ext_proc filter's name in http_filters, the key of its per-route config.
	FilterName string
	// ListenerBufferLimit is the listener's per_connection_buffer_limit_bytes (Envoy default
	// 1 MiB): a BUFFERED request body above it is answered 413.
	ListenerBufferLimit uint32
	// UpstreamBufferLimit is the upstream cluster's per_connection_buffer_limit_bytes (default
	// 1 MiB): a BUFFERED response body above it is answered 500.
	UpstreamBufferLimit uint32
	// RouteTimeout is the "/" route's timeout (Envoy default 15s; 0 means none).
	RouteTimeout time.Duration
	// DisabledPrefixes are the route prefixes whose typed_per_filter_config disables ext_proc,
	// in route order, up to the "/" route (later routes never match). Routes holds them too.
	DisabledPrefixes []string
	// Routes is the virtual host's route table, in order: names, matches (prefix, path,
	// safe_regex, grpc), metadata, timeouts (unset: 15s; 0: none, as -1), retry and hedge policies
	// (the route's, else the virtual host's) and the ext_proc filter's typed_per_filter_config
	// (ExtProcPerRoute, or FilterConfig disabled or wrapping one).
	Routes []proxy.Route
	// VirtualHostExtProc is the virtual host's typed_per_filter_config for the ext_proc filter.
	VirtualHostExtProc *filterextproc.ExtProcPerRoute
	// LocalReplyConfig is the connection manager's local_reply_config, nil when unset.
	LocalReplyConfig *hcmv3.LocalReplyConfig
	// JWTAuthn is the jwt_authn filter placed before ext_proc in http_filters, nil when none.
	JWTAuthn *jwtauthnv3.JwtAuthentication
	// Tracing is set when the connection manager has tracing configured (the proxy models the
	// OpenTelemetry tracer); Unsampled when random_sampling is 0.
	Tracing *proxy.Tracing
	// ProcessorCluster is the ext_proc envoy_grpc cluster name.
	ProcessorCluster string
	// ProcessorThresholds are the processor cluster's circuit breaker thresholds.
	ProcessorThresholds Thresholds
	// UpstreamCluster is the "/" route's cluster.
	UpstreamCluster string
	// ProcessorHealthCheck is the processor cluster's gRPC health check, nil when it has none.
	ProcessorHealthCheck *corev3.HealthCheck
	// StreamRetries is grpc_service.retry_policy.num_retries when retry_on covers streams that
	// could not be opened (connect-failure or refused-stream), else 0.
	StreamRetries int
	// UpstreamTrailers and DownstreamTrailers are enable_trailers of the upstream cluster's and
	// of the connection manager's HTTP/1 options: off by default, Envoy drops HTTP/1 trailers.
	UpstreamTrailers, DownstreamTrailers bool
	// DownstreamHTTP2 is set when the connection manager's codec_type is AUTO (the default) or
	// HTTP2; UpstreamHTTP2 when the upstream cluster's explicit_http_config sets
	// http2_protocol_options.
	DownstreamHTTP2, UpstreamHTTP2 bool
}

// ProxySettings extracts Settings from b. It fails when the first listener's HTTP connection
// manager has no ext_proc filter or no inline route_config with one virtual host, when no route
// matches prefix "/", when a route does not go to the single upstream cluster, when a referenced cluster is not a static
// cluster, and when the bootstrap asks for something the test proxy would not honour: a filter
// disabled by default, a route match field other than a path specifier, case_sensitive true and
// grpc (headers, query parameters, runtime_fraction, ...), per-route grpc_service, a jwt_authn
// filter after ext_proc or a jwt_authn rule matching on more than the path.
func ProxySettings(b *bootstrapv3.Bootstrap) (Settings, error) {
	f, hf, err := checktest.ExtProcFilter(b)
	if err != nil {
		return Settings{}, err
	}
	if hf.GetDisabled() {
		return Settings{}, fmt.Errorf("http filter %q is disabled by default (enabled per route): not supported by the test proxy", hf.GetName())
	}
	filterName := hf.GetName()
	hcm, err := checktest.FirstHCM(b)
	if err != nil {
		return Settings{}, err
	}
	s := Settings{
		Filter:              f,
		FilterName:          filterName,
		ListenerBufferLimit: bufferLimit(b.GetStaticResources().GetListeners()[0]),
		ProcessorCluster:    f.GetGrpcService().GetEnvoyGrpc().GetClusterName(),
	}
	if s.ProcessorCluster == "" {
		return Settings{}, errors.New("ext_proc grpc_service has no envoy_grpc cluster_name")
	}
	pc := cluster(b, s.ProcessorCluster)
	if pc == nil {
		return Settings{}, fmt.Errorf("ext_proc cluster %q is not a static cluster", s.ProcessorCluster)
	}
	s.ProcessorThresholds = thresholds(pc)
	for _, hc := range pc.GetHealthChecks() {
		if hc.GetGrpcHealthCheck() != nil {
			s.ProcessorHealthCheck = hc
			break
		}
	}
	if rp := f.GetGrpcService().GetRetryPolicy(); rp != nil {
		on := "," + strings.ReplaceAll(rp.GetRetryOn(), " ", "") + ","
		if strings.Contains(on, ",connect-failure,") || strings.Contains(on, ",refused-stream,") {
			s.StreamRetries = int(rp.GetNumRetries().GetValue())
			if rp.GetNumRetries() == nil {
				s.StreamRetries = 1 // Envoy's default num_retries
			}
		}
	}

	rc := hcm.GetRouteConfig()
	if rc == nil {
		return Settings{}, errors.New("http_connection_manager has no inline route_config")
	}
	vhs := rc.GetVirtualHosts()
	if len(vhs) != 1 {
		return Settings{}, fmt.Errorf("route_config has %d virtual hosts, the test proxy models one", len(vhs))
	}
	vh := vhs[0]
	if s.VirtualHostExtProc, err = perRoute(vh.GetTypedPerFilterConfig()[filterName]); err != nil {
		return Settings{}, fmt.Errorf("virtual host %q: %w", vh.GetName(), err)
	}
	jwtName := jwtFilterName(hcm)
	var root *routev3.Route
	for i, r := range vh.GetRoutes() {
		rt, err := proxyRoute(r, filterName, jwtName)
		if err != nil {
			return Settings{}, fmt.Errorf("virtual host %q route %d (%q): %w", vh.GetName(), i, r.GetName(), err)
		}
		if rt.Retry == nil {
			rt.Retry = vh.GetRetryPolicy() // a route's own policy replaces its virtual host's
		}
		if rt.Hedge == nil {
			rt.Hedge = vh.GetHedgePolicy()
		}
		cl := r.GetRoute().GetCluster()
		if cl == "" {
			return Settings{}, fmt.Errorf("virtual host %q route %d (%q) does not route to a single cluster", vh.GetName(), i, r.GetName())
		}
		if s.UpstreamCluster == "" {
			s.UpstreamCluster = cl
		} else if cl != s.UpstreamCluster {
			return Settings{}, fmt.Errorf("routes use clusters %q and %q: the test proxy has one upstream", s.UpstreamCluster, cl)
		}
		s.Routes = append(s.Routes, rt)
		if root == nil && rt.Prefix != "" && rt.ExtProc.GetDisabled() {
			s.DisabledPrefixes = append(s.DisabledPrefixes, rt.Prefix)
		}
		if root == nil && rt.Prefix == "/" {
			root = r
		}
	}
	if root == nil {
		// The shipped configurations end with a catch-all route (a contract check relies on
		// this error); a request no route matches would get the router's 404.
		return Settings{}, errors.New(`no route with prefix "/"`)
	}
	s.RouteTimeout = defaultRouteTimeout
	if t := root.GetRoute().GetTimeout(); t != nil {
		s.RouteTimeout = t.AsDuration()
	}
	s.LocalReplyConfig = hcm.GetLocalReplyConfig()
	if tr := hcm.GetTracing(); tr != nil {
		s.Tracing = &proxy.Tracing{Unsampled: tr.GetRandomSampling() != nil && tr.GetRandomSampling().GetValue() == 0}
	}
	if s.JWTAuthn, err = jwtBefore(hcm, hf); err != nil {
		return Settings{}, err
	}
	uc := cluster(b, s.UpstreamCluster)
	if uc == nil {
		return Settings{}, fmt.Errorf("upstream cluster %q is not a static cluster", s.UpstreamCluster)
	}
	s.UpstreamBufferLimit = bufferLimit(uc)
	s.DownstreamTrailers = hcm.GetHttpProtocolOptions().GetEnableTrailers()
	ct := hcm.GetCodecType()
	s.DownstreamHTTP2 = ct == hcmv3.HttpConnectionManager_AUTO || ct == hcmv3.HttpConnectionManager_HTTP2
	if a, ok := uc.GetTypedExtensionProtocolOptions()[upstreamHTTPOptions]; ok {
		po := &httpv3.HttpProtocolOptions{}
		if err := a.UnmarshalTo(po); err != nil {
			return Settings{}, fmt.Errorf("upstream cluster %q: %w", s.UpstreamCluster, err)
		}
		s.UpstreamTrailers = po.GetExplicitHttpConfig().GetHttpProtocolOptions().GetEnableTrailers()
		s.UpstreamHTTP2 = po.GetExplicitHttpConfig().GetHttp2ProtocolOptions() != nil
	}
	return s, nil
}

// perRoute decodes a typed_per_filter_config entry for ext_proc: ExtProcPerRoute, or the generic
// FilterConfig (disabled, or wrapping an ExtProcPerRoute). Nil stays nil.
func perRoute(a *anypb.Any) (*filterextproc.ExtProcPerRoute, error) {
	if a == nil {
		return nil, nil
	}
	m, err := a.UnmarshalNew()
	if err != nil {
		return nil, err
	}
	switch c := m.(type) {
	case *filterextproc.ExtProcPerRoute:
		if c.GetOverrides().GetGrpcService() != nil {
			return nil, errors.New("ExtProcPerRoute overrides.grpc_service is not supported by the test proxy")
		}
		return c, nil
	case *routev3.FilterConfig:
		if c.GetDisabled() {
			return &filterextproc.ExtProcPerRoute{Override: &filterextproc.ExtProcPerRoute_Disabled{Disabled: true}}, nil
		}
		return perRoute(c.GetConfig())
	}
	return nil, fmt.Errorf("unexpected per-route config %s for ext_proc", m.ProtoReflect().Descriptor().FullName())
}

// jwtFilterName returns the name of the connection manager's jwt_authn filter, "" when none.
func jwtFilterName(hcm *hcmv3.HttpConnectionManager) string {
	for _, f := range hcm.GetHttpFilters() {
		if tc := f.GetTypedConfig(); tc != nil && tc.MessageIs(&jwtauthnv3.JwtAuthentication{}) {
			return f.GetName()
		}
	}
	return ""
}

// modelledMatch refuses a RouteMatch field the test proxy does not model, every field the
// bootstrap sets being read through reflection so that none is ignored, new ones included. It
// models the path specifiers prefix, path and safe_regex, case_sensitive left true, and, where
// grpc is set (a route's match, not a jwt_authn rule's), grpc: {}.
func modelledMatch(m *routev3.RouteMatch, grpc bool) error {
	var err error
	m.ProtoReflect().Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch name := fd.Name(); {
		case name == "prefix" || name == "path" || name == "safe_regex":
		case name == "case_sensitive" && m.GetCaseSensitive().GetValue():
		case name == "case_sensitive":
			err = errors.New("case-insensitive matches are not supported by the test proxy")
		case name == "grpc" && grpc:
		case fd.ContainingOneof() != nil:
			err = fmt.Errorf("path specifier %s is not supported by the test proxy", name)
		default:
			err = fmt.Errorf("match field %s is not supported by the test proxy", name)
		}
		return err == nil
	})
	return err
}

// proxyRoute maps one route: its name, match, metadata, timeout and the per-route config of the
// ext_proc filter and of the jwt_authn filter jwtName. Match fields other than the path
// specifiers, case_sensitive true and grpc (headers, query parameters, runtime_fraction,
// cookies, tls_context, dynamic_metadata, filter_state, ...), and route actions other than a
// cluster, are errors.
func proxyRoute(r *routev3.Route, filterName, jwtName string) (proxy.Route, error) {
	m := r.GetMatch()
	if err := modelledMatch(m, true); err != nil {
		return proxy.Route{}, err
	}
	rt := proxy.Route{Name: r.GetName(), Metadata: r.GetMetadata(), Grpc: m.GetGrpc() != nil}
	switch ps := m.GetPathSpecifier().(type) {
	case *routev3.RouteMatch_Prefix:
		rt.Prefix = ps.Prefix
		if rt.Prefix == "" {
			rt.Prefix = "/"
		}
	case *routev3.RouteMatch_Path:
		rt.Path = ps.Path
	case *routev3.RouteMatch_SafeRegex:
		rt.Regex = ps.SafeRegex.GetRegex()
	default:
		return proxy.Route{}, fmt.Errorf("path specifier %T is not supported by the test proxy", ps)
	}
	if r.GetRoute() == nil {
		return proxy.Route{}, errors.New("only route actions (to a cluster) are supported by the test proxy")
	}
	rt.Retry, rt.Hedge = r.GetRoute().GetRetryPolicy(), r.GetRoute().GetHedgePolicy()
	rt.Timeout = defaultRouteTimeout
	if t := r.GetRoute().GetTimeout(); t != nil {
		rt.Timeout = t.AsDuration()
		if rt.Timeout == 0 {
			rt.Timeout = -1 // Envoy: 0 disables the timeout
		}
	}
	var err error
	if rt.ExtProc, err = perRoute(r.GetTypedPerFilterConfig()[filterName]); err != nil {
		return proxy.Route{}, err
	}
	if a := r.GetTypedPerFilterConfig()[jwtName]; a != nil && jwtName != "" {
		rt.JWT = &jwtauthnv3.PerRouteConfig{}
		if err := a.UnmarshalTo(rt.JWT); err != nil {
			return proxy.Route{}, fmt.Errorf("jwt_authn per-route config: %w", err)
		}
	}
	return rt, nil
}

// jwtBefore returns the jwt_authn filter's configuration when one precedes the ext_proc filter
// hf in http_filters; one after it is an error (the test proxy runs it first), and so is a rule
// whose match sets a field the test proxy does not model (it matches rules on the path alone).
func jwtBefore(hcm *hcmv3.HttpConnectionManager, hf *hcmv3.HttpFilter) (*jwtauthnv3.JwtAuthentication, error) {
	var found *jwtauthnv3.JwtAuthentication
	seenExtProc := false
	for _, f := range hcm.GetHttpFilters() {
		if f == hf || f.GetName() == hf.GetName() {
			seenExtProc = true
			continue
		}
		tc := f.GetTypedConfig()
		if tc == nil || !tc.MessageIs(&jwtauthnv3.JwtAuthentication{}) {
			continue
		}
		if seenExtProc {
			return nil, fmt.Errorf("http filter %q (jwt_authn) runs after ext_proc: not supported by the test proxy", f.GetName())
		}
		if found != nil {
			return nil, errors.New("more than one jwt_authn filter: not supported by the test proxy")
		}
		found = &jwtauthnv3.JwtAuthentication{}
		if err := tc.UnmarshalTo(found); err != nil {
			return nil, fmt.Errorf("http filter %q: %w", f.GetName(), err)
		}
		for i, r := range found.GetRules() {
			if err := modelledMatch(r.GetMatch(), false); err != nil {
				return nil, fmt.Errorf("http filter %q rule %d: %w", f.GetName(), i, err)
			}
		}
	}
	return found, nil
}

// ProxyConfig is the proxy.Config that runs s with the given processors (host:port or
// unix:///path) and upstream base URL: the filter, the buffer limits, trailers, the route table,
// local_reply_config, jwt_authn, tracing, the processor cluster's health check and the stream
// retries. Callers add what a bootstrap does not say (AccessLog, Envoy, Shapes, TLS).
func (s Settings) ProxyConfig(processors []string, upstream string) proxy.Config {
	cfg := proxy.Config{
		Filter:              s.Filter,
		Processors:          processors,
		Upstream:            upstream,
		ListenerBufferLimit: s.ListenerBufferLimit,
		UpstreamBufferLimit: s.UpstreamBufferLimit,
		UpstreamTrailers:    s.UpstreamTrailers,
		DownstreamTrailers:  s.DownstreamTrailers,
		DownstreamHTTP2:     s.DownstreamHTTP2,
		UpstreamHTTP2:       s.UpstreamHTTP2,
		RouteTimeout:        s.RouteTimeout,
		Routes:              s.Routes,
		VirtualHostExtProc:  s.VirtualHostExtProc,
		LocalReplyConfig:    s.LocalReplyConfig,
		JWTAuthn:            s.JWTAuthn,
		Tracing:             s.Tracing,
		StreamRetries:       s.StreamRetries,
	}
	if h := s.ProcessorHealthCheck; h != nil {
		cfg.HealthCheck = &proxy.HealthCheck{
			Interval:           h.GetInterval().AsDuration(),
			Timeout:            h.GetTimeout().AsDuration(),
			UnhealthyThreshold: int(h.GetUnhealthyThreshold().GetValue()),
			HealthyThreshold:   int(h.GetHealthyThreshold().GetValue()),
			ServiceName:        h.GetGrpcHealthCheck().GetServiceName(),
		}
	}
	return cfg
}

// bufferLimit and thresholds are a listener's or cluster's buffer limit and a cluster's circuit
// breaker thresholds, with Envoy's defaults.
var (
	bufferLimit = check.BufferLimit
	thresholds  = check.ClusterThresholds
)

// Ports are the loopback addresses Rewrite substitutes. Listener and Admin are ports on
// 127.0.0.1. Processors are the ext_proc server's addresses, each "host:port" or
// "unix:///path.sock". Upstream is the upstream server's "host:port".
type Ports struct {
	Listener, Admin int
	Processors      []string
	Upstream        string
}

// Rewrite returns b as JSON (which Envoy accepts as a bootstrap) after substituting p: the only
// listener and the admin interface bind 127.0.0.1 on the given ports, and the processor and
// upstream clusters get p's endpoints. A cluster whose endpoints are all IP literals or Unix
// sockets becomes STATIC, otherwise STRICT_DNS. b itself is not modified.
func Rewrite(b *bootstrapv3.Bootstrap, p Ports) ([]byte, error) {
	if err := checkPort("listener", p.Listener); err != nil {
		return nil, err
	}
	if err := checkPort("admin", p.Admin); err != nil {
		return nil, err
	}
	if len(p.Processors) == 0 {
		return nil, errors.New("no processor address")
	}
	s, err := ProxySettings(b)
	if err != nil {
		return nil, err
	}
	out := proto.Clone(b).(*bootstrapv3.Bootstrap)
	ls := out.GetStaticResources().GetListeners()
	if len(ls) != 1 {
		return nil, fmt.Errorf("want exactly one listener, have %d", len(ls))
	}
	ls[0].Address = tcpAddress("127.0.0.1", uint32(p.Listener))
	if out.Admin == nil {
		out.Admin = &bootstrapv3.Admin{}
	}
	out.Admin.Address = tcpAddress("127.0.0.1", uint32(p.Admin))

	if err := setEndpoints(cluster(out, s.ProcessorCluster), p.Processors); err != nil {
		return nil, fmt.Errorf("processor cluster %q: %w", s.ProcessorCluster, err)
	}
	if err := setEndpoints(cluster(out, s.UpstreamCluster), []string{p.Upstream}); err != nil {
		return nil, fmt.Errorf("upstream cluster %q: %w", s.UpstreamCluster, err)
	}
	return protojson.MarshalOptions{UseProtoNames: true, Multiline: true}.Marshal(out)
}

func checkPort(what string, port int) error {
	if port <= 0 || port > 65535 {
		return fmt.Errorf("%s port %d out of range", what, port)
	}
	return nil
}

func tcpAddress(host string, port uint32) *corev3.Address {
	return &corev3.Address{Address: &corev3.Address_SocketAddress{SocketAddress: &corev3.SocketAddress{
		Address:       host,
		PortSpecifier: &corev3.SocketAddress_PortValue{PortValue: port},
	}}}
}

func setEndpoints(c *clusterv3.Cluster, addrs []string) error {
	static := true
	var eps []*endpointv3.LbEndpoint
	for _, a := range addrs {
		var addr *corev3.Address
		if path, ok := strings.CutPrefix(a, "unix://"); ok {
			addr = &corev3.Address{Address: &corev3.Address_Pipe{Pipe: &corev3.Pipe{Path: path}}}
		} else {
			host, port, err := net.SplitHostPort(a)
			if err != nil {
				return err
			}
			n, err := strconv.ParseUint(port, 10, 16)
			if err != nil || n == 0 {
				return fmt.Errorf("address %q: bad port", a)
			}
			if net.ParseIP(host) == nil {
				static = false
			}
			addr = tcpAddress(host, uint32(n))
		}
		eps = append(eps, &endpointv3.LbEndpoint{HostIdentifier: &endpointv3.LbEndpoint_Endpoint{
			Endpoint: &endpointv3.Endpoint{Address: addr},
		}})
	}
	c.LoadAssignment = &endpointv3.ClusterLoadAssignment{
		ClusterName: c.GetName(),
		Endpoints:   []*endpointv3.LocalityLbEndpoints{{LbEndpoints: eps}},
	}
	typ := clusterv3.Cluster_STRICT_DNS
	if static {
		typ = clusterv3.Cluster_STATIC
	}
	c.ClusterDiscoveryType = &clusterv3.Cluster_Type{Type: typ}
	return nil
}
