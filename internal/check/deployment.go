package check

import (
	"errors"
	"fmt"
	"strconv"

	"google.golang.org/protobuf/types/known/anypb"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	jwtauthnv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/jwt_authn/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
)

// Platform is what writes the Envoy configuration of a deployment; findings phrase their fixes
// in its terms.
type platform int

// The platforms.
const (
	platformEnvoy        platform = iota // an Envoy bootstrap
	platformIstio                        // an Istio EnvoyFilter
	platformEnvoyGateway                 // an Envoy Gateway EnvoyExtensionPolicy
)

// Deployment is what one deployment makes of the ext_proc filter, as far as the protection checks
// (CheckProtection) need it: the filter-level config, the connection manager settings that touch
// the processor's answers, and every place a route configures the filter. Field paths in it are
// where the setting lives in the source file, for error messages.
type Deployment struct {
	// Source names the file and the resource, e.g. "envoy/envoy.yaml".
	Source string
	// File is the input that holds the filter; Resource the resource that configures it there
	// (`listener "ingress"`, "EnvoyFilter ns/name", "EnvoyExtensionPolicy ns/name").
	File, Resource string
	// Platform says what wrote the configuration.
	Platform platform
	// Filter is the ext_proc filter-level config; FilterPath is where it lives.
	Filter     *filterextproc.ExternalProcessor
	FilterPath string
	// FilterName is the filter's name in the connection manager, the key of its
	// typed_per_filter_config entries.
	FilterName string
	// FilterDisabled is set when the filter is disabled by default (http filter disabled: true):
	// it then runs only on the routes whose per-route config enables it.
	FilterDisabled bool
	// LocalReply is the connection manager's local_reply_config, nil when it has none or when the
	// deployment does not show its connection manager (Istio and Envoy Gateway generate theirs and
	// set none). HCMPath is where the connection manager lives.
	LocalReply *hcmv3.LocalReplyConfig
	HCMPath    string
	// Routes are the Envoy routes of the deployment in order, with their per-route ext_proc
	// config, plus entries for the virtual hosts and route configurations that configure the
	// filter (Name "" for those).
	Routes []routeEntry
	// RoutesUnknown says why the routes could not be read (they come from RDS), "" when they were.
	RoutesUnknown string
	// After are the HTTP filters after ext_proc in the connection manager, when it is shown.
	After []filterRef
	// JWTAuthn is the first jwt_authn filter before ext_proc in the connection manager, and
	// JWTAuthnPath where its config lives; nil when the connection manager has none before
	// ext_proc or is not shown (Istio and Envoy Gateway generate theirs).
	JWTAuthn     *jwtauthnv3.JwtAuthentication
	JWTAuthnPath string
	// Processor are the circuit breaker thresholds of the processor's cluster, nil when unknown.
	Processor *processorLimits
}

// routeEntry is one Envoy route (or virtual host) and its ext_proc per-route config.
type routeEntry struct {
	// Name is the Envoy route name (the xds.route_name attribute), "" for a virtual host.
	Name string
	// Path is where the typed_per_filter_config entry lives (or the route, when it has none).
	Path string
	// Config is the per-route config, nil when the route has none. A FilterConfig wrapper is
	// unwrapped: FilterConfig{disabled: true} reads as ExtProcPerRoute{disabled: true}, and a
	// FilterConfig that only enables a filter disabled by default (Envoy Gateway's) as an empty
	// ExtProcPerRoute.
	Config *filterextproc.ExtProcPerRoute
	// Retry and Hedge are the retry and hedge policies the router applies on this route (each the
	// route's own, else its virtual host's), nil when it has none; RetryPath and HedgePath are
	// where they live.
	Retry                *routev3.RetryPolicy
	Hedge                *routev3.HedgePolicy
	RetryPath, HedgePath string
	// RetryResource is the resource that holds Retry when it is not the deployment's own (an
	// Istio VirtualService, an Envoy Gateway BackendTrafficPolicy), RetryPath then starting with
	// it; RetryFile is the input that holds it.
	RetryResource, RetryFile string
	// Partial is set on an entry that stands for routes the inputs do not show (an Envoy Gateway
	// target outside them: a Gateway, targetSelectors, an HTTPRoute of another file).
	Partial bool
	// ResponseBuffer is the buffer limit a BUFFERED response body of this route must fit in, nil
	// when it is not known (a cluster that is not static).
	ResponseBuffer *limitSetting
	// GRPC: the route serves gRPC calls (its match has grpc: {}).
	GRPC bool
}

// limitSetting is a response buffer limit and where it is set.
type limitSetting struct {
	Bytes uint32
	// File, Resource and Field say where the limit is set; Default is set when nothing sets it
	// and Envoy's (or Envoy Gateway's) default applies: Field then names what would set it.
	File, Resource, Field string
	Default               bool
}

// bootstrapDeployment reads the ext_proc deployment of a standalone bootstrap: the first HTTP
// connection manager of the first listener, its ext_proc filter and inline route_config. It
// fails when either is missing or a per-route config of the filter is not an ExtProcPerRoute.
func bootstrapDeployment(b *bootstrapv3.Bootstrap, source string) (Deployment, error) {
	f, hf, err := extProcFilter(b)
	if err != nil {
		return Deployment{}, err
	}
	hcm, err := firstHCM(b)
	if err != nil {
		return Deployment{}, err
	}
	if hcm.GetRouteConfig() == nil {
		return Deployment{}, errors.New("http_connection_manager has no inline route_config")
	}
	d := Deployment{Source: source, File: source, Resource: "listener " + strconv.Quote(b.GetStaticResources().GetListeners()[0].GetName())}
	if err := hcmDeployment(&d, b, hcm, hf, f, "http_connection_manager"); err != nil {
		return Deployment{}, err
	}
	return d, nil
}

// bootstrapDeployments reads every ext_proc filter of every HTTP connection manager of every
// static listener of b.
func bootstrapDeployments(b *bootstrapv3.Bootstrap, file string) ([]Deployment, error) {
	var out []Deployment
	for i, l := range b.GetStaticResources().GetListeners() {
		resource := "listener " + strconv.Quote(l.GetName())
		if l.GetName() == "" {
			resource = "static_resources.listeners[" + strconv.Itoa(i) + "]"
		}
		for j, fc := range filterChains(l) {
			for k, nf := range fc.GetFilters() {
				tc := nf.GetTypedConfig()
				if tc == nil || !tc.MessageIs(&hcmv3.HttpConnectionManager{}) {
					continue
				}
				hcmPath := fmt.Sprintf("filter_chains[%d].filters[%d]", j, k)
				if j == len(l.GetFilterChains()) {
					hcmPath = fmt.Sprintf("default_filter_chain.filters[%d]", k)
				}
				hcm := &hcmv3.HttpConnectionManager{}
				if err := tc.UnmarshalTo(hcm); err != nil {
					return nil, fmt.Errorf("%s %s: %w", resource, hcmPath, err)
				}
				for _, hf := range hcm.GetHttpFilters() {
					if !isExtProc(hf) {
						continue
					}
					f := &filterextproc.ExternalProcessor{}
					if err := hf.GetTypedConfig().UnmarshalTo(f); err != nil {
						return nil, fmt.Errorf("%s %s: http filter %q: %w", resource, hcmPath, hf.GetName(), err)
					}
					d := Deployment{Source: file, File: file, Resource: resource}
					if err := hcmDeployment(&d, b, hcm, hf, f, hcmPath+".typed_config"); err != nil {
						return nil, fmt.Errorf("%s: %w", resource, err)
					}
					out = append(out, d)
				}
			}
		}
	}
	return out, nil
}

// hcmDeployment fills d from the connection manager hcm at hcmPath and its ext_proc filter hf,
// whose config is f.
func hcmDeployment(d *Deployment, b *bootstrapv3.Bootstrap, hcm *hcmv3.HttpConnectionManager, hf *hcmv3.HttpFilter, f *filterextproc.ExternalProcessor, hcmPath string) error {
	d.Platform = platformEnvoy
	d.Filter = f
	d.FilterName = hf.GetName()
	d.FilterDisabled = hf.GetDisabled()
	d.FilterPath = "http_filters[" + hf.GetName() + "].typed_config"
	if hcmPath != "http_connection_manager" {
		d.FilterPath = hcmPath + "." + d.FilterPath
	}
	d.LocalReply = hcm.GetLocalReplyConfig()
	d.HCMPath = hcmPath
	if err := d.otherFilters(hcm, hf, hcmPath); err != nil {
		return err
	}
	if name := f.GetGrpcService().GetEnvoyGrpc().GetClusterName(); name != "" {
		if c := staticCluster(b, name); c != nil {
			d.Processor = &processorLimits{Thresholds: ClusterThresholds(c), File: d.File, Resource: "cluster " + strconv.Quote(name),
				Field: "circuit_breakers.thresholds", Default: c.GetCircuitBreakers() == nil}
		}
	}
	rc := hcm.GetRouteConfig()
	if rc == nil {
		d.RoutesUnknown = "the connection manager's routes come from RDS (" + hcm.GetRds().GetRouteConfigName() + ")"
		return nil
	}
	rcPath := "route_config"
	if hcmPath != "http_connection_manager" {
		rcPath = hcmPath + ".route_config"
	}
	w := routeWalk{d: d, b: b}
	if err := w.add("", rcPath, rc.GetTypedPerFilterConfig(), routeEntry{}); err != nil {
		return err
	}
	rcEnables := enablesFilter(rc.GetTypedPerFilterConfig()[d.FilterName], false)
	for i, vh := range rc.GetVirtualHosts() {
		if err := w.virtualHost(vh, rcPath+".virtual_hosts["+strconv.Itoa(i)+"]", rcEnables); err != nil {
			return err
		}
	}
	return nil
}

// otherFilters reads the HTTP filters of hcm around the ext_proc filter hf: those after it, and
// the first jwt_authn filter before it.
func (d *Deployment) otherFilters(hcm *hcmv3.HttpConnectionManager, hf *hcmv3.HttpFilter, hcmPath string) error {
	seen := false
	for _, other := range hcm.GetHttpFilters() {
		switch {
		case other == hf:
			seen = true
		case seen:
			d.After = append(d.After, filterRef{Name: other.GetName(), Type: anyType(other.GetTypedConfig())})
		case d.JWTAuthn == nil && other.GetTypedConfig().MessageIs(&jwtauthnv3.JwtAuthentication{}):
			d.JWTAuthn = &jwtauthnv3.JwtAuthentication{}
			d.JWTAuthnPath = "http_filters[" + other.GetName() + "].typed_config"
			if hcmPath != "http_connection_manager" {
				d.JWTAuthnPath = hcmPath + "." + d.JWTAuthnPath
			}
			if err := other.GetTypedConfig().UnmarshalTo(d.JWTAuthn); err != nil {
				return fmt.Errorf("%s: %w", d.JWTAuthnPath, err)
			}
		}
	}
	return nil
}

// enablesFilter says whether the per-route config a enables a filter disabled by default: a
// route's own config, or else its virtual host's, or else its route configuration's (parent,
// what the level above says) does.
func enablesFilter(a *anypb.Any, parent bool) bool {
	if a == nil {
		return parent
	}
	c, err := deployedPerRoute(a)
	return err == nil && !c.GetDisabled()
}

// routeWalk adds the routes of an inline route configuration to d.
type routeWalk struct {
	d *Deployment
	b *bootstrapv3.Bootstrap
}

// add adds the route named name at path with its per-route config of the filter in tpfc, over
// what base says of it; a virtual host or route configuration (name "") is added only when it
// configures the filter.
func (w routeWalk) add(name, path string, tpfc map[string]*anypb.Any, base routeEntry) error {
	e := routeEntry{Name: name, Path: path, Retry: base.Retry, Hedge: base.Hedge, RetryPath: base.RetryPath, HedgePath: base.HedgePath,
		ResponseBuffer: base.ResponseBuffer, Config: base.Config, GRPC: base.GRPC}
	if a, ok := tpfc[w.d.FilterName]; ok {
		e.Path = path + ".typed_per_filter_config[" + w.d.FilterName + "]"
		c, err := deployedPerRoute(a)
		if err != nil {
			return fmt.Errorf("%s: %w", e.Path, err)
		}
		e.Config = c
	} else if name == "" {
		return nil // a virtual host that leaves the filter alone
	}
	w.d.Routes = append(w.d.Routes, e)
	return nil
}

// virtualHost adds the virtual host vh at vp and its routes; rcEnables says whether its route
// configuration enables a filter disabled by default.
func (w routeWalk) virtualHost(vh *routev3.VirtualHost, vp string, rcEnables bool) error {
	if err := w.add("", vp, vh.GetTypedPerFilterConfig(), routeEntry{}); err != nil {
		return err
	}
	vhEnables := enablesFilter(vh.GetTypedPerFilterConfig()[w.d.FilterName], rcEnables)
	for j, r := range vh.GetRoutes() {
		rp := vp + ".routes[" + strconv.Itoa(j) + "]"
		// A route's retry_policy replaces its virtual host's whole, and so does its
		// hedge_policy, each on its own (route_components.proto).
		base := routeEntry{Retry: vh.GetRetryPolicy(), Hedge: vh.GetHedgePolicy(), RetryPath: vp, HedgePath: vp,
			ResponseBuffer: routeBufferLimit(w.b, w.d.File, r.GetRoute()), GRPC: r.GetMatch().GetGrpc() != nil}
		ra := r.GetRoute()
		if ra.GetRetryPolicy() != nil {
			base.Retry, base.RetryPath = ra.GetRetryPolicy(), rp+".route"
		}
		if ra.GetHedgePolicy() != nil {
			base.Hedge, base.HedgePath = ra.GetHedgePolicy(), rp+".route"
		}
		if w.d.FilterDisabled && vhEnables {
			base.Config = &filterextproc.ExtProcPerRoute{} // enabled above the route
		}
		if err := w.add(r.GetName(), rp, r.GetTypedPerFilterConfig(), base); err != nil {
			return err
		}
		for k, cw := range ra.GetWeightedClusters().GetClusters() {
			if _, ok := cw.GetTypedPerFilterConfig()[w.d.FilterName]; !ok {
				continue
			}
			cp := rp + ".route.weighted_clusters.clusters[" + strconv.Itoa(k) + "]"
			if err := w.add(r.GetName(), cp, cw.GetTypedPerFilterConfig(), routeEntry{}); err != nil {
				return err
			}
		}
	}
	return nil
}

// routeBufferLimit returns the smallest buffer limit of the upstream clusters a route action
// sends to, nil when one of them is not a static cluster of b (or the route sends nowhere).
// Envoy's BUFFERED mode holds a whole response body in the filter's buffer
// (source/extensions/filters/http/ext_proc/ext_proc.cc), whose limit on the response path is
// the upstream cluster's per_connection_buffer_limit_bytes; above it Envoy answers 500.
func routeBufferLimit(b *bootstrapv3.Bootstrap, file string, ra *routev3.RouteAction) *limitSetting {
	names := []string{ra.GetCluster()}
	if wc := ra.GetWeightedClusters(); wc != nil {
		names = nil
		for _, c := range wc.GetClusters() {
			names = append(names, c.GetName())
		}
	}
	var least *limitSetting
	for _, name := range names {
		c := staticCluster(b, name)
		if c == nil {
			return nil
		}
		l := &limitSetting{Bytes: BufferLimit(c), File: file, Resource: "cluster " + strconv.Quote(name),
			Field: "per_connection_buffer_limit_bytes", Default: c.GetPerConnectionBufferLimitBytes() == nil}
		if least == nil || l.Bytes < least.Bytes {
			least = l
		}
	}
	return least
}

// deployedPerRoute decodes a typed_per_filter_config entry of the ext_proc filter, as the
// protection checks read it (an Envoy Gateway "enable" marker included).
func deployedPerRoute(a *anypb.Any) (*filterextproc.ExtProcPerRoute, error) {
	if a.GetTypeUrl() == "" {
		return &filterextproc.ExtProcPerRoute{}, nil // Envoy Gateway's "enable" marker
	}
	m, err := a.UnmarshalNew()
	if err != nil {
		return nil, err
	}
	switch c := m.(type) {
	case *filterextproc.ExtProcPerRoute:
		return c, nil
	case *routev3.FilterConfig:
		if c.GetDisabled() {
			return &filterextproc.ExtProcPerRoute{Override: &filterextproc.ExtProcPerRoute_Disabled{Disabled: true}}, nil
		}
		if c.GetConfig() == nil {
			return &filterextproc.ExtProcPerRoute{}, nil
		}
		return deployedPerRoute(c.GetConfig())
	}
	return nil, fmt.Errorf("unexpected per-route config %s for ext_proc", m.ProtoReflect().Descriptor().FullName())
}
