package check

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	accesslogv3 "github.com/envoyproxy/go-control-plane/envoy/config/accesslog/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	accesslogfilev3 "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/file/v3"
	accesslogstreamv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/stream/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
)

const istioGroup = "networking.istio.io"

// istioSpec mirrors the EnvoyFilter spec fields the file may use; it is decoded strictly.
type istioSpec struct {
	WorkloadSelector *istioWorkloadSelector `yaml:"workloadSelector"`
	TargetRefs       any                    `yaml:"targetRefs"`
	Priority         int                    `yaml:"priority"`
	ConfigPatches    []istioPatch           `yaml:"configPatches"`
}

type istioWorkloadSelector struct {
	Labels map[string]string `yaml:"labels"`
}

type istioPatch struct {
	ApplyTo string     `yaml:"applyTo"`
	Match   istioMatch `yaml:"match"`
	Patch   struct {
		Operation   string    `yaml:"operation"`
		Value       yaml.Node `yaml:"value"`
		FilterClass string    `yaml:"filterClass"`
	} `yaml:"patch"`
}

type istioMatch struct {
	Context            string                        `yaml:"context"`
	Proxy              any                           `yaml:"proxy"`
	Listener           *istioListenerMatch           `yaml:"listener"`
	RouteConfiguration *istioRouteConfigurationMatch `yaml:"routeConfiguration"`
	Cluster            any                           `yaml:"cluster"`
}

// istioRouteConfigurationMatch is EnvoyFilter.RouteConfigurationMatch, for HTTP_ROUTE patches.
type istioRouteConfigurationMatch struct {
	PortNumber int    `yaml:"portNumber"`
	PortName   string `yaml:"portName"`
	Gateway    string `yaml:"gateway"`
	Name       string `yaml:"name"`
	Vhost      *struct {
		Name       string `yaml:"name"`
		DomainName string `yaml:"domainName"`
		Route      *struct {
			Name   string `yaml:"name"`
			Action string `yaml:"action"`
		} `yaml:"route"`
	} `yaml:"vhost"`
}

type istioListenerMatch struct {
	PortNumber  int              `yaml:"portNumber"`
	Name        string           `yaml:"name"`
	FilterChain istioFilterChain `yaml:"filterChain"`
}

type istioFilterChain struct {
	Name                 string      `yaml:"name"`
	Sni                  string      `yaml:"sni"`
	TransportProtocol    string      `yaml:"transportProtocol"`
	ApplicationProtocols string      `yaml:"applicationProtocols"`
	DestinationPort      int         `yaml:"destinationPort"`
	Filter               istioFilter `yaml:"filter"`
}

type istioFilter struct {
	Name      string `yaml:"name"`
	SubFilter struct {
		Name string `yaml:"name"`
	} `yaml:"subFilter"`
}

// IstioDeployment reads the ext_proc deployment of the Istio file at path, which holds exactly one
// EnvoyFilter: the filter of its HTTP_FILTER patch (its typed_config, decoded like a bootstrap:
// unknown fields are errors; the patch must insert the filter ahead of the router, INSERT_BEFORE
// envoy.filters.http.router or INSERT_FIRST, into the http_connection_manager), the per-route configs of
// its HTTP_ROUTE patches (each patch value decoded as a Route; its route name is the patch's
// routeConfiguration.vhost.route.name), and the route names the file's VirtualServices give
// Envoy: an http route's name, or name.matchName for a match with a name (Istio's translateRoute).
// Istio builds the connection manager itself and sets no local_reply_config.
func IstioDeployment(path string) (Deployment, error) {
	objs, err := readDocs(path)
	if err != nil {
		return Deployment{}, err
	}
	ef, err := only(objs, istioGroup, "EnvoyFilter")
	if err != nil {
		return Deployment{}, fmt.Errorf("%s: %w", path, err)
	}
	if ef == nil {
		return Deployment{}, fmt.Errorf("%s: no EnvoyFilter", path)
	}
	d, found, err := istioDeployment(ef, objs)
	switch {
	case err != nil:
		return Deployment{}, fmt.Errorf("%s: %s: %w", path, ef.ref(), err)
	case !found:
		return Deployment{}, fmt.Errorf("%s: no HTTP_FILTER patch with an ExternalProcessor typed_config", path)
	}
	return d, nil
}

// istioDeployment reads the ext_proc deployment of EnvoyFilter ef with the VirtualServices of
// objs, as IstioDeployment; found is false when ef patches in no ext_proc filter.
func istioDeployment(ef *object, objs []*object) (d Deployment, found bool, err error) {
	spec, err := decodeSpec[istioSpec](ef)
	if err != nil {
		return Deployment{}, false, err
	}
	d = Deployment{Source: ef.File + ": " + ef.ref(), File: ef.File, Resource: ef.ref(), Platform: platformIstio}
	var routePatches []int
	var filterContext string // the ext_proc patch's match context
	for i := range spec.ConfigPatches {
		cp := &spec.ConfigPatches[i]
		switch {
		case cp.ApplyTo == "HTTP_ROUTE":
			routePatches = append(routePatches, i)
		case cp.ApplyTo == "NETWORK_FILTER" && cp.Patch.Operation == "MERGE":
			// A MERGE into the connection manager Istio generates may give it a
			// local_reply_config.
			hcm, err := istioHCMPatch(cp)
			if err != nil {
				return Deployment{}, false, within(fmt.Sprintf("spec.configPatches[%d].patch.value", i), err)
			}
			if lr := hcm.GetLocalReplyConfig(); lr != nil {
				d.LocalReply, d.HCMPath = lr, fmt.Sprintf("configPatches[%d].patch.value.typed_config", i)
			}
		case cp.ApplyTo == "HTTP_FILTER":
			isExtProc, err := istioFilterPatch(i, cp, &d)
			if err != nil {
				return Deployment{}, false, err
			}
			if isExtProc {
				filterContext = cp.Match.Context
			}
		}
	}
	if d.Filter == nil {
		return Deployment{}, false, nil
	}
	if d.Processor, err = patchedProcessorLimits(ef, spec, d.Filter.GetGrpcService().GetEnvoyGrpc().GetClusterName()); err != nil {
		return Deployment{}, false, err
	}
	buffer := istioBufferLimit(objs)
	vsRoutes, err := virtualServiceRoutes(objs, filterContext, buffer)
	if err != nil {
		return Deployment{}, false, err
	}
	patched, err := routePatchEntries(spec, routePatches, d.FilterName, buffer)
	if err != nil {
		return Deployment{}, false, err
	}
	patched = mergeRoutePatches(vsRoutes, patched)
	d.Routes = append(append(d.Routes, vsRoutes...), patched...)
	return d, true, nil
}

// istioFilterPatch reads the HTTP_FILTER patch cp, the i-th, into d when it patches in an
// ext_proc filter, which it reports; it refuses a second ext_proc patch and one that does not
// insert the filter ahead of the router in the connection manager.
func istioFilterPatch(i int, cp *istioPatch, d *Deployment) (bool, error) {
	hf := &hcmv3.HttpFilter{}
	if err := decodePatch(cp, hf); err != nil {
		return false, within(fmt.Sprintf("spec.configPatches[%d].patch.value", i), err)
	}
	if !hf.GetTypedConfig().MessageIs(&filterextproc.ExternalProcessor{}) {
		return false, nil
	}
	if d.Filter != nil {
		return false, errors.New("more than one ext_proc patch")
	}
	l := cp.Match.Listener
	if l == nil || l.FilterChain.Filter.Name != "envoy.filters.network.http_connection_manager" {
		return false, fmt.Errorf("configPatches[%d] does not match the http_connection_manager", i)
	}
	switch op := cp.Patch.Operation; {
	case op == "INSERT_FIRST":
	case op == "INSERT_BEFORE" && l.FilterChain.Filter.SubFilter.Name == "envoy.filters.http.router":
	default:
		return false, fmt.Errorf("configPatches[%d] must INSERT_BEFORE envoy.filters.http.router (or INSERT_FIRST), have %s %q",
			i, op, l.FilterChain.Filter.SubFilter.Name)
	}
	d.Filter = &filterextproc.ExternalProcessor{}
	if err := hf.GetTypedConfig().UnmarshalTo(d.Filter); err != nil {
		return false, fmt.Errorf("configPatches[%d]: %w", i, err)
	}
	d.FilterName = hf.GetName()
	d.FilterDisabled = hf.GetDisabled()
	d.FilterPath = fmt.Sprintf("configPatches[%d].patch.value.typed_config", i)
	return true, nil
}

// patchedProcessorLimits is the circuit breaker thresholds of the processor's cluster, named name, when
// ef adds it itself (a processor next to Envoy, in the gateway pod on a unix socket, is a
// cluster with a pipe address); nil when it does not.
func patchedProcessorLimits(ef *object, spec istioSpec, name string) (*processorLimits, error) {
	var limits *processorLimits
	for i := range spec.ConfigPatches {
		cp := &spec.ConfigPatches[i]
		if cp.ApplyTo != "CLUSTER" || cp.Patch.Operation != "ADD" {
			continue
		}
		c := &clusterv3.Cluster{}
		if err := decodePatch(cp, c); err != nil {
			return nil, within(fmt.Sprintf("spec.configPatches[%d].patch.value", i), err)
		}
		if c.GetName() == name {
			limits = &processorLimits{Thresholds: ClusterThresholds(c), File: ef.File, Resource: ef.ref(),
				Field: fmt.Sprintf("configPatches[%d].patch.value.circuit_breakers.thresholds", i), Default: c.GetCircuitBreakers() == nil}
		}
	}
	return limits, nil
}

// virtualServiceRoutes are the routes the VirtualServices of objs give Envoy, each with the
// retries the router applies on it: none when the filter runs in the inbound sidecar
// (filterContext SIDECAR_INBOUND), where the caller's outbound sidecar retries instead.
func virtualServiceRoutes(objs []*object, filterContext string, buffer *limitSetting) ([]routeEntry, error) {
	var out []routeEntry
	for _, vs := range objs {
		if !vs.is(istioGroup, "VirtualService") {
			continue
		}
		vsSpec, err := decodeLoose[istioVirtualService](vs)
		if err != nil {
			return nil, fmt.Errorf("VirtualService %s: %w", vs.Name, err)
		}
		for i, h := range vsSpec.HTTP {
			at := fmt.Sprintf("%s http[%d]", vs.ref(), i)
			retry, retryAt := h.Retries.policy(), at+".retries"
			if h.Retries == nil {
				retryAt = at + " (no retries: Istio's default retry policy)"
			}
			if filterContext == "SIDECAR_INBOUND" {
				// The VirtualService's retries run in the caller's outbound sidecar: a retry
				// reaches this filter as a new request with the same key (a duplicate).
				retry, retryAt = nil, ""
			}
			for _, name := range h.routeNames() {
				out = append(out, routeEntry{Name: name, Path: at, Retry: retry, RetryPath: retryAt, RetryResource: vs.ref(), RetryFile: vs.File,
					ResponseBuffer: buffer})
			}
		}
	}
	return out, nil
}

// istioVirtualService is what the check reads of a VirtualService's spec.
type istioVirtualService struct {
	HTTP []istioHTTPRoute `yaml:"http"`
}

// istioHTTPRoute is one http route of a VirtualService.
type istioHTTPRoute struct {
	Name  string `yaml:"name"`
	Match []struct {
		Name string `yaml:"name"`
	} `yaml:"match"`
	Retries *istioRetries `yaml:"retries"`
}

// routeNames are the Envoy route names Istio gives h (translateRoute): name.matchName for each
// match with a name, and the route's name once for the matches without one (or no match).
func (h istioHTTPRoute) routeNames() []string {
	var names []string
	named := false
	for _, m := range h.Match {
		if m.Name != "" {
			names = append(names, h.Name+"."+m.Name)
		} else if !named {
			names = append(names, h.Name)
			named = true
		}
	}
	if len(h.Match) == 0 {
		names = append(names, h.Name)
	}
	return names
}

// routePatchEntries are the routes of the HTTP_ROUTE patches of spec (at indexes patches), each
// with its per-route config of the filter named filterName.
func routePatchEntries(spec istioSpec, patches []int, filterName string, buffer *limitSetting) ([]routeEntry, error) {
	var out []routeEntry
	for _, i := range patches {
		cp := &spec.ConfigPatches[i]
		rc := cp.Match.RouteConfiguration
		if rc == nil || rc.Vhost == nil || rc.Vhost.Route == nil || rc.Vhost.Route.Name == "" {
			return nil, fmt.Errorf("configPatches[%d]: an HTTP_ROUTE patch must match routeConfiguration.vhost.route.name", i)
		}
		r := &routev3.Route{}
		if err := decodePatch(cp, r); err != nil {
			return nil, within(fmt.Sprintf("spec.configPatches[%d].patch.value", i), err)
		}
		e := routeEntry{Name: rc.Vhost.Route.Name, Path: fmt.Sprintf("configPatches[%d].patch.value", i), ResponseBuffer: buffer}
		if a, ok := r.GetTypedPerFilterConfig()[filterName]; ok {
			e.Path += ".typed_per_filter_config[" + filterName + "]"
			var err error
			if e.Config, err = deployedPerRoute(a); err != nil {
				return nil, fmt.Errorf("%s: %w", e.Path, err)
			}
		}
		out = append(out, e)
	}
	return out, nil
}

// mergeRoutePatches gives each VirtualService route of vsRoutes the per-route config of the
// HTTP_ROUTE patch of patched that names it, and returns the patches left: Istio MERGEs a patch
// into the route it generated (a gRPC route's processing modes, say), so the route's retries and
// its per-route config meet on one route, which the patch's path then names.
func mergeRoutePatches(vsRoutes, patched []routeEntry) []routeEntry {
	return slices.DeleteFunc(patched, func(p routeEntry) bool {
		merged := false
		for i := range vsRoutes {
			if p.Config != nil && vsRoutes[i].Name == p.Name {
				vsRoutes[i].Config, vsRoutes[i].Path = p.Config, p.Path
				merged = true
			}
		}
		return merged
	})
}

// istioBufferLimit is the upstream buffer limit of Istio's clusters: Envoy's default, which
// Istio leaves alone, unless an EnvoyFilter of objs MERGEs per_connection_buffer_limit_bytes
// into clusters (the least such value then).
func istioBufferLimit(objs []*object) *limitSetting {
	l := &limitSetting{Bytes: defaultBufferLimit, Field: "per_connection_buffer_limit_bytes", Default: true}
	for _, ef := range objs {
		if !ef.is(istioGroup, "EnvoyFilter") {
			continue
		}
		spec, err := decodeSpec[istioSpec](ef)
		if err != nil {
			continue // istioDeployment reports it
		}
		for i, cp := range spec.ConfigPatches {
			if cp.ApplyTo != "CLUSTER" || cp.Patch.Operation != "MERGE" {
				continue
			}
			c := &clusterv3.Cluster{}
			if decodePatch(&cp, c) != nil || c.GetPerConnectionBufferLimitBytes() == nil {
				continue
			}
			if v := c.GetPerConnectionBufferLimitBytes().GetValue(); l.Default || v < l.Bytes {
				l = &limitSetting{Bytes: v, File: ef.File, Resource: ef.ref(),
					Field: fmt.Sprintf("configPatches[%d].patch.value.per_connection_buffer_limit_bytes", i)}
			}
		}
	}
	return l
}

// istioHCMPatch decodes a NETWORK_FILTER patch value: the connection manager it merges, empty
// when it patches another filter.
func istioHCMPatch(cp *istioPatch) (*hcmv3.HttpConnectionManager, error) {
	f := &listenerv3.Filter{}
	if err := decodePatch(cp, f); err != nil {
		return nil, err
	}
	hcm := &hcmv3.HttpConnectionManager{}
	if tc := f.GetTypedConfig(); tc != nil && tc.MessageIs(hcm) {
		if err := tc.UnmarshalTo(hcm); err != nil {
			return nil, err
		}
	}
	return hcm, nil
}

// decodePatch decodes an EnvoyFilter patch value into m as Istio and Envoy would read it:
// durations as Istio reads them (Go's "200ms" too), unknown fields and unknown "@type"s are
// errors, naming their line.
func decodePatch(cp *istioPatch, m proto.Message) error {
	istioDurations(&cp.Patch.Value, m.ProtoReflect().Descriptor())
	js, err := nodeToJSON(&cp.Patch.Value)
	if err != nil {
		return err
	}
	if err := protojson.Unmarshal(js, m); err != nil {
		return protoError("patch", &cp.Patch.Value, err)
	}
	return nil
}

// istioRetries is a VirtualService HTTPRoute's retries.
type istioRetries struct {
	Attempts              *uint32 `yaml:"attempts"`
	RetryOn               string  `yaml:"retryOn"`
	PerTryTimeout         string  `yaml:"perTryTimeout"`
	RetryRemoteLocalities *bool   `yaml:"retryRemoteLocalities"`
	Backoff               string  `yaml:"backoff"`
}

// istioDefaultRetryOn and istioDefaultRetryCodes are Istio's default retry policy, applied to
// every HTTP route whose VirtualService sets no retries (pilot/pkg/networking/core/route/retry,
// DefaultPolicy: 2 retries).
const istioDefaultRetryOn = "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes"

var istioDefaultRetryCodes = []uint32{503}

// policy is the router retry policy Istio builds from r (retry.ConvertPolicy): nil retries get
// the default policy, attempts 0 none; a retryOn replaces the default conditions, its numbers
// becoming retriable status codes.
func (r *istioRetries) policy() *routev3.RetryPolicy {
	p := &routev3.RetryPolicy{NumRetries: wrapperspb.UInt32(2), RetryOn: istioDefaultRetryOn, RetriableStatusCodes: istioDefaultRetryCodes}
	if r == nil {
		return p
	}
	if r.Attempts != nil {
		if *r.Attempts == 0 {
			return nil
		}
		p.NumRetries = wrapperspb.UInt32(*r.Attempts)
	}
	if r.RetryOn != "" {
		var conds []string
		p.RetriableStatusCodes = nil
		for _, c := range strings.Split(r.RetryOn, ",") {
			c = strings.TrimSpace(c)
			if n, err := strconv.ParseUint(c, 10, 32); err == nil {
				p.RetriableStatusCodes = append(p.RetriableStatusCodes, uint32(n))
				continue
			}
			conds = append(conds, c)
		}
		if len(p.RetriableStatusCodes) > 0 && !slices.Contains(conds, "retriable-status-codes") {
			conds = append(conds, "retriable-status-codes")
		}
		p.RetryOn = strings.Join(conds, ",")
	}
	return p
}

// IstioAccessLogFormats returns the text formats of the access logs the Istio file at path adds
// to the connection manager: its NETWORK_FILTER patches that MERGE an HttpConnectionManager
// typed_config with access_log entries (stdout or file loggers).
func IstioAccessLogFormats(path string) ([]string, error) {
	ef, err := theDoc(path, istioGroup, "EnvoyFilter")
	if err != nil {
		return nil, err
	}
	spec, err := decodeSpec[istioSpec](ef)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	var out []string
	for i, cp := range spec.ConfigPatches {
		if cp.ApplyTo != "NETWORK_FILTER" || cp.Patch.Operation != "MERGE" {
			continue
		}
		f := &listenerv3.Filter{}
		if err := decodePatch(&cp, f); err != nil {
			return nil, fmt.Errorf("%s: configPatches[%d].patch.value: %w", path, i, err)
		}
		hcm := &hcmv3.HttpConnectionManager{}
		if err := f.GetTypedConfig().UnmarshalTo(hcm); err != nil {
			return nil, fmt.Errorf("%s: configPatches[%d]: %w", path, i, err)
		}
		formats, err := accessLogFormats(hcm.GetAccessLog())
		if err != nil {
			return nil, fmt.Errorf("%s: configPatches[%d]: %w", path, i, err)
		}
		out = append(out, formats...)
	}
	return out, nil
}

// accessLogFormats returns the text format of each stdout or file access log in logs.
func accessLogFormats(logs []*accesslogv3.AccessLog) ([]string, error) {
	var out []string
	for _, l := range logs {
		m, err := l.GetTypedConfig().UnmarshalNew()
		if err != nil {
			return nil, err
		}
		switch c := m.(type) {
		case *accesslogstreamv3.StdoutAccessLog:
			out = append(out, c.GetLogFormat().GetTextFormatSource().GetInlineString())
		case *accesslogfilev3.FileAccessLog:
			out = append(out, c.GetLogFormat().GetTextFormatSource().GetInlineString())
		}
	}
	return out, nil
}

// istioProcessorLimits returns the circuit breaker thresholds a DestinationRule of objs sets on
// the processor's cluster (outbound|port|subset|host), nil when none names its host: Istio's
// own defaults are far above what a processor needs. An unset threshold is Istio's default.
func istioProcessorLimits(f *filterextproc.ExternalProcessor, objs []*object) *processorLimits {
	parts := strings.Split(f.GetGrpcService().GetEnvoyGrpc().GetClusterName(), "|")
	if len(parts) != 4 || parts[3] == "" {
		return nil
	}
	host := parts[3]
	for _, dr := range objs {
		if !dr.is(istioGroup, "DestinationRule") {
			continue
		}
		spec, err := decodeLoose[struct {
			Host          string `yaml:"host"`
			TrafficPolicy struct {
				ConnectionPool *struct {
					TCP struct {
						MaxConnections *uint32 `yaml:"maxConnections"`
					} `yaml:"tcp"`
					HTTP struct {
						HTTP1MaxPendingRequests *uint32 `yaml:"http1MaxPendingRequests"`
						HTTP2MaxRequests        *uint32 `yaml:"http2MaxRequests"`
					} `yaml:"http"`
				} `yaml:"connectionPool"`
			} `yaml:"trafficPolicy"`
		}](dr)
		if err != nil || spec.Host == "" || (spec.Host != host && !strings.HasPrefix(host, spec.Host+".")) {
			continue
		}
		cp := spec.TrafficPolicy.ConnectionPool
		if cp == nil {
			return nil
		}
		or := func(v *uint32) uint32 {
			if v == nil {
				return 1<<32 - 1
			}
			return *v
		}
		return &processorLimits{
			Thresholds: Thresholds{
				MaxConnections:     or(cp.TCP.MaxConnections),
				MaxPendingRequests: or(cp.HTTP.HTTP1MaxPendingRequests),
				MaxRequests:        or(cp.HTTP.HTTP2MaxRequests),
			},
			File: dr.File, Resource: dr.ref(), Field: "trafficPolicy.connectionPool",
		}
	}
	return nil
}
