package envoyconf

import (
	"testing"

	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"github.com/stretchr/testify/require"
)

// ProxySettings reads HTTP/2 from the bootstrap: downstream from codec_type (AUTO and HTTP2
// serve it, HTTP1 does not), upstream from the "/" cluster's http2_protocol_options.
func TestProxySettingsHTTP2(t *testing.T) {
	b := loadForProxy(t)
	s, err := ProxySettings(b)
	require.NoError(t, err)
	require.True(t, s.DownstreamHTTP2, "the shipped connection manager is codec_type AUTO")
	require.False(t, s.UpstreamHTTP2, "the shipped upstream cluster speaks HTTP/1")

	require.NoError(t, MutateHCM(b, func(hcm *hcmv3.HttpConnectionManager) error {
		hcm.CodecType = hcmv3.HttpConnectionManager_HTTP1
		return nil
	}))
	require.NoError(t, EnableUpstreamHTTP2(b))
	require.Error(t, EnableUpstreamHTTP2(b), "the cluster already has HTTP protocol options")
	require.NoError(t, b.ValidateAll())

	s, err = ProxySettings(b)
	require.NoError(t, err)
	require.False(t, s.DownstreamHTTP2)
	require.True(t, s.UpstreamHTTP2)
	cfg := s.ProxyConfig([]string{"127.0.0.1:1"}, "http://127.0.0.1:2")
	require.False(t, cfg.DownstreamHTTP2)
	require.True(t, cfg.UpstreamHTTP2)
}
