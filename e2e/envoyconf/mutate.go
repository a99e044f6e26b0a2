package envoyconf

import (
	"fmt"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	httpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/idempotency-extproc/idempotency-extproc/internal/check/checktest"
)

// The edits of a parsed bootstrap live with the helpers of the checks' tests
// (checktest.MutateHCM and the others), which use them too.
var (
	MutateHCM             = checktest.MutateHCM
	MutateExtProc         = checktest.MutateExtProc
	MutateRoute           = checktest.MutateRoute
	MutateExtProcPerRoute = checktest.MutateExtProcPerRoute
)

// upstreamHTTPOptions is the typed_extension_protocol_options key of a cluster's HTTP options.
const upstreamHTTPOptions = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"

// EnableHTTP1Trailers turns on HTTP/1 trailers (enable_trailers) where Envoy drops them by
// default: on the first HTTP connection manager, toward clients, and on the "/" route's
// cluster, from the upstream. The cluster must not have HTTP protocol options already.
func EnableHTTP1Trailers(b *bootstrapv3.Bootstrap) error {
	err := MutateHCM(b, func(hcm *hcmv3.HttpConnectionManager) error {
		if hcm.HttpProtocolOptions == nil {
			hcm.HttpProtocolOptions = &corev3.Http1ProtocolOptions{}
		}
		hcm.HttpProtocolOptions.EnableTrailers = true
		return nil
	})
	if err != nil {
		return err
	}
	name, err := catchAllCluster(b)
	if err != nil {
		return err
	}
	c := cluster(b, name)
	if c == nil {
		return fmt.Errorf("cluster %q is not a static cluster", name)
	}
	if _, ok := c.GetTypedExtensionProtocolOptions()[upstreamHTTPOptions]; ok {
		return fmt.Errorf("cluster %q already has HTTP protocol options", c.GetName())
	}
	a, err := anypb.New(&httpv3.HttpProtocolOptions{
		UpstreamProtocolOptions: &httpv3.HttpProtocolOptions_ExplicitHttpConfig_{ExplicitHttpConfig: &httpv3.HttpProtocolOptions_ExplicitHttpConfig{
			ProtocolConfig: &httpv3.HttpProtocolOptions_ExplicitHttpConfig_HttpProtocolOptions{
				HttpProtocolOptions: &corev3.Http1ProtocolOptions{EnableTrailers: true},
			},
		}},
	})
	if err != nil {
		return err
	}
	if c.TypedExtensionProtocolOptions == nil {
		c.TypedExtensionProtocolOptions = map[string]*anypb.Any{}
	}
	c.TypedExtensionProtocolOptions[upstreamHTTPOptions] = a
	return nil
}

// EnableUpstreamHTTP2 makes the "/" route's cluster speak HTTP/2 (explicit_http_config
// http2_protocol_options), as a cluster of gRPC services must. The cluster must not have HTTP
// protocol options already.
func EnableUpstreamHTTP2(b *bootstrapv3.Bootstrap) error {
	name, err := catchAllCluster(b)
	if err != nil {
		return err
	}
	c := cluster(b, name)
	if c == nil {
		return fmt.Errorf("cluster %q is not a static cluster", name)
	}
	if _, ok := c.GetTypedExtensionProtocolOptions()[upstreamHTTPOptions]; ok {
		return fmt.Errorf("cluster %q already has HTTP protocol options", c.GetName())
	}
	a, err := anypb.New(&httpv3.HttpProtocolOptions{
		UpstreamProtocolOptions: &httpv3.HttpProtocolOptions_ExplicitHttpConfig_{ExplicitHttpConfig: &httpv3.HttpProtocolOptions_ExplicitHttpConfig{
			ProtocolConfig: &httpv3.HttpProtocolOptions_ExplicitHttpConfig_Http2ProtocolOptions{Http2ProtocolOptions: &corev3.Http2ProtocolOptions{}},
		}},
	})
	if err != nil {
		return err
	}
	if c.TypedExtensionProtocolOptions == nil {
		c.TypedExtensionProtocolOptions = map[string]*anypb.Any{}
	}
	c.TypedExtensionProtocolOptions[upstreamHTTPOptions] = a
	return nil
}
