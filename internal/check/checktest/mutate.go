package checktest

import (
	"errors"
	"fmt"

	"google.golang.org/protobuf/types/known/anypb"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
)

// Edits of a parsed bootstrap, in place, for the tests of internal/check and of the Envoy emulator
// (e2e/envoyconf), which run the shipped files with one setting changed.

// MutateHCM applies fn to the first HTTP connection manager of the first listener of b, in
// place: the typed_config holding it is re-packed. Tests use it to run envoy.yaml with one
// setting changed (a route timeout, a buffer mode) on the emulator and on a real Envoy alike.
func MutateHCM(b *bootstrapv3.Bootstrap, fn func(*hcmv3.HttpConnectionManager) error) error {
	nf, hcm, err := HCMFilter(b)
	if err != nil {
		return err
	}
	if err := fn(hcm); err != nil {
		return err
	}
	a, err := anypb.New(hcm)
	if err != nil {
		return err
	}
	nf.ConfigType = &listenerv3.Filter_TypedConfig{TypedConfig: a}
	return nil
}

// MutateExtProc applies fn to the ext_proc filter config of b's first HTTP connection manager.
func MutateExtProc(b *bootstrapv3.Bootstrap, fn func(*filterextproc.ExternalProcessor)) error {
	return MutateHCM(b, func(hcm *hcmv3.HttpConnectionManager) error {
		hf := ExtProcHTTPFilter(hcm)
		if hf == nil {
			return errors.New("no ext_proc filter")
		}
		f := &filterextproc.ExternalProcessor{}
		if err := hf.GetTypedConfig().UnmarshalTo(f); err != nil {
			return err
		}
		fn(f)
		a, err := anypb.New(f)
		if err != nil {
			return err
		}
		hf.ConfigType = &hcmv3.HttpFilter_TypedConfig{TypedConfig: a}
		return nil
	})
}

// MutateRoute applies fn to the route named name in the inline route_config of b's first HTTP
// connection manager. It fails when no route has that name.
func MutateRoute(b *bootstrapv3.Bootstrap, name string, fn func(*routev3.Route) error) error {
	return MutateHCM(b, func(hcm *hcmv3.HttpConnectionManager) error {
		for _, vh := range hcm.GetRouteConfig().GetVirtualHosts() {
			for _, r := range vh.GetRoutes() {
				if r.GetName() == name {
					return fn(r)
				}
			}
		}
		return fmt.Errorf("no route named %q", name)
	})
}

// MutateExtProcPerRoute applies fn to the ext_proc ExtProcPerRoute of the route named name (an
// empty one when the route has none) and stores the result in the route's
// typed_per_filter_config, under the ext_proc filter's name.
func MutateExtProcPerRoute(b *bootstrapv3.Bootstrap, name string, fn func(*filterextproc.ExtProcPerRoute)) error {
	_, hf, err := ExtProcFilter(b)
	if err != nil {
		return err
	}
	key := hf.GetName()
	return MutateRoute(b, name, func(r *routev3.Route) error {
		c := &filterextproc.ExtProcPerRoute{}
		if a, ok := r.GetTypedPerFilterConfig()[key]; ok {
			if err := a.UnmarshalTo(c); err != nil {
				return fmt.Errorf("route %q: %w", name, err)
			}
		}
		fn(c)
		a, err := anypb.New(c)
		if err != nil {
			return err
		}
		if r.TypedPerFilterConfig == nil {
			r.TypedPerFilterConfig = map[string]*anypb.Any{}
		}
		r.TypedPerFilterConfig[key] = a
		return nil
	})
}
