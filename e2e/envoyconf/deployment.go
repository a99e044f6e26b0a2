package envoyconf

import (
	"errors"
	"fmt"
	"strconv"

	"google.golang.org/protobuf/types/known/anypb"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
)

// Deployment is what one shipped deployment makes of the ext_proc filter, as far as the
// protection checks (CheckProtection) need it: the filter-level config, the connection manager
// settings that touch the processor's answers, and every place a route configures the filter.
// Field paths in it are where the setting lives in the source file, for error messages.
type Deployment struct {
	// Source names the file and the resource, e.g. "envoy/envoy.yaml".
	Source string
	// Filter is the ext_proc filter-level config; FilterPath is where it lives.
	Filter     *filterextproc.ExternalProcessor
	FilterPath string
	// FilterName is the filter's name in the connection manager, the key of its
	// typed_per_filter_config entries.
	FilterName string
	// LocalReply is the connection manager's local_reply_config, nil when it has none or when the
	// deployment does not show its connection manager (Istio and Envoy Gateway generate theirs and
	// set none). HCMPath is where the connection manager lives.
	LocalReply *hcmv3.LocalReplyConfig
	HCMPath    string
	// Routes are the Envoy routes of the deployment in order, with their per-route ext_proc
	// config, plus entries for the virtual hosts and route configurations that configure the
	// filter (Name "" for those).
	Routes []RouteEntry
}

// RouteEntry is one Envoy route (or virtual host) and its ext_proc per-route config.
type RouteEntry struct {
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
}

// BootstrapDeployment reads the ext_proc deployment of a standalone bootstrap: the first HTTP
// connection manager of the first listener, its ext_proc filter and inline route_config. It
// fails when either is missing or a per-route config of the filter is not an ExtProcPerRoute.
func BootstrapDeployment(b *bootstrapv3.Bootstrap, source string) (Deployment, error) {
	f, hf, err := extProcOf(b)
	if err != nil {
		return Deployment{}, err
	}
	hcm, err := firstHCM(b)
	if err != nil {
		return Deployment{}, err
	}
	d := Deployment{
		Source:     source,
		Filter:     f,
		FilterName: hf.GetName(),
		FilterPath: "http_filters[" + hf.GetName() + "].typed_config",
		LocalReply: hcm.GetLocalReplyConfig(),
		HCMPath:    "http_connection_manager",
	}
	rc := hcm.GetRouteConfig()
	if rc == nil {
		return Deployment{}, errors.New("http_connection_manager has no inline route_config")
	}
	add := func(name, path string, tpfc map[string]*anypb.Any, retry RouteEntry) error {
		e := RouteEntry{Name: name, Path: path, Retry: retry.Retry, Hedge: retry.Hedge, RetryPath: retry.RetryPath, HedgePath: retry.HedgePath}
		if a, ok := tpfc[d.FilterName]; ok {
			e.Path = path + ".typed_per_filter_config[" + d.FilterName + "]"
			c, err := deployedPerRoute(a)
			if err != nil {
				return fmt.Errorf("%s: %w", e.Path, err)
			}
			e.Config = c
		} else if name == "" {
			return nil // a virtual host that leaves the filter alone
		}
		d.Routes = append(d.Routes, e)
		return nil
	}
	if err := add("", "route_config", rc.GetTypedPerFilterConfig(), RouteEntry{}); err != nil {
		return Deployment{}, err
	}
	for i, vh := range rc.GetVirtualHosts() {
		vp := "route_config.virtual_hosts[" + strconv.Itoa(i) + "]"
		if err := add("", vp, vh.GetTypedPerFilterConfig(), RouteEntry{}); err != nil {
			return Deployment{}, err
		}
		for j, r := range vh.GetRoutes() {
			rp := vp + ".routes[" + strconv.Itoa(j) + "]"
			// A route's retry_policy replaces its virtual host's whole, and so does its
			// hedge_policy, each on its own (route_components.proto).
			retry := RouteEntry{Retry: vh.GetRetryPolicy(), Hedge: vh.GetHedgePolicy(), RetryPath: vp, HedgePath: vp}
			ra := r.GetRoute()
			if ra.GetRetryPolicy() != nil {
				retry.Retry, retry.RetryPath = ra.GetRetryPolicy(), rp+".route"
			}
			if ra.GetHedgePolicy() != nil {
				retry.Hedge, retry.HedgePath = ra.GetHedgePolicy(), rp+".route"
			}
			if err := add(r.GetName(), rp, r.GetTypedPerFilterConfig(), retry); err != nil {
				return Deployment{}, err
			}
			for k, cw := range r.GetRoute().GetWeightedClusters().GetClusters() {
				cp := rp + ".route.weighted_clusters.clusters[" + strconv.Itoa(k) + "]"
				if _, ok := cw.GetTypedPerFilterConfig()[d.FilterName]; !ok {
					continue
				}
				if err := add(r.GetName(), cp, cw.GetTypedPerFilterConfig(), RouteEntry{}); err != nil {
					return Deployment{}, err
				}
			}
		}
	}
	return d, nil
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
