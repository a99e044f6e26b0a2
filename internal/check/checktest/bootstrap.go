package checktest

import (
	"errors"
	"fmt"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
)

// The bootstrap the tests read and edit is the shape the shipped envoy/envoy.yaml has: a first
// static listener whose first filter chain holds the HTTP connection manager, with an inline
// route_config and one ext_proc filter. These helpers find and edit its parts; the checks read
// bootstraps of every shape with their own code.

// HCMFilter returns the network filter holding the first HTTP connection manager of the first
// listener, and the manager decoded.
func HCMFilter(b *bootstrapv3.Bootstrap) (*listenerv3.Filter, *hcmv3.HttpConnectionManager, error) {
	ls := b.GetStaticResources().GetListeners()
	if len(ls) == 0 {
		return nil, nil, errors.New("no static listener")
	}
	chains := ls[0].GetFilterChains()
	if dc := ls[0].GetDefaultFilterChain(); dc != nil {
		chains = append(chains[:len(chains):len(chains)], dc)
	}
	for _, fc := range chains {
		for _, nf := range fc.GetFilters() {
			tc := nf.GetTypedConfig()
			if tc == nil || !tc.MessageIs(&hcmv3.HttpConnectionManager{}) {
				continue
			}
			hcm := &hcmv3.HttpConnectionManager{}
			if err := tc.UnmarshalTo(hcm); err != nil {
				return nil, nil, fmt.Errorf("listener %q: %w", ls[0].GetName(), err)
			}
			return nf, hcm, nil
		}
	}
	return nil, nil, fmt.Errorf("listener %q has no http_connection_manager", ls[0].GetName())
}

// FirstHCM returns the first HTTP connection manager of the first listener of b.
func FirstHCM(b *bootstrapv3.Bootstrap) (*hcmv3.HttpConnectionManager, error) {
	_, hcm, err := HCMFilter(b)
	return hcm, err
}

// ExtProcHTTPFilter returns the first ext_proc filter of hcm, or nil.
func ExtProcHTTPFilter(hcm *hcmv3.HttpConnectionManager) *hcmv3.HttpFilter {
	for _, hf := range hcm.GetHttpFilters() {
		if tc := hf.GetTypedConfig(); tc != nil && tc.MessageIs(&filterextproc.ExternalProcessor{}) {
			return hf
		}
	}
	return nil
}

// ExtProcFilter returns the ext_proc filter config of the first HTTP connection manager of the
// first listener and the http filter that holds it, or an error when there is none.
func ExtProcFilter(b *bootstrapv3.Bootstrap) (*filterextproc.ExternalProcessor, *hcmv3.HttpFilter, error) {
	hcm, err := FirstHCM(b)
	if err != nil {
		return nil, nil, err
	}
	hf := ExtProcHTTPFilter(hcm)
	if hf == nil {
		return nil, nil, errors.New("no ext_proc filter")
	}
	f := &filterextproc.ExternalProcessor{}
	if err := hf.GetTypedConfig().UnmarshalTo(f); err != nil {
		return nil, nil, err
	}
	return f, hf, nil
}

// Cluster returns the static cluster of b named name, or nil.
func Cluster(b *bootstrapv3.Bootstrap, name string) *clusterv3.Cluster {
	for _, c := range b.GetStaticResources().GetClusters() {
		if c.GetName() == name {
			return c
		}
	}
	return nil
}

// CatchAllCluster returns the cluster of the first route with prefix "/" in b's first connection
// manager.
func CatchAllCluster(b *bootstrapv3.Bootstrap) (string, error) {
	hcm, err := FirstHCM(b)
	if err != nil {
		return "", err
	}
	for _, vh := range hcm.GetRouteConfig().GetVirtualHosts() {
		for _, r := range vh.GetRoutes() {
			if r.GetMatch().GetPrefix() == "/" && r.GetRoute().GetCluster() != "" {
				return r.GetRoute().GetCluster(), nil
			}
		}
	}
	return "", errors.New(`no route with prefix "/" and a single cluster`)
}
