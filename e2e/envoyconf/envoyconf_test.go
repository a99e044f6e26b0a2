package envoyconf

import (
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	httpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/check/checktest"
)

// The shared test helpers, under the names these tests use.
var (
	envoyFile     = checktest.EnvoyFile
	readEnvoyFile = checktest.ReadEnvoyFile
	shippedPolicy = checktest.ShippedPolicy
	mutate        = checktest.Mutate
)

const (
	storeTimeout = checktest.StoreTimeout
	minimal      = checktest.Minimal
)

// loadForProxy loads envoy.yaml for the tests of ProxySettings and Rewrite (settings.go).
func loadForProxy(t testing.TB) *bootstrapv3.Bootstrap {
	t.Helper()
	b, err := Load(envoyFile(t, "envoy.yaml"))
	require.NoError(t, err)
	return b
}

func TestEnvoyYAMLProxySettings(t *testing.T) {
	b := loadForProxy(t)
	s, err := ProxySettings(b)
	require.NoError(t, err)

	f, err := ExtProc(b)
	require.NoError(t, err)
	require.True(t, proto.Equal(f, s.Filter))
	s.Filter = nil
	hc := s.ProcessorHealthCheck
	require.NotNil(t, hc, "the processor cluster is health checked over grpc.health.v1")
	require.Equal(t, "envoy.service.ext_proc.v3.ExternalProcessor", hc.GetGrpcHealthCheck().GetServiceName())
	require.Equal(t, time.Second, hc.GetInterval().AsDuration())
	require.Equal(t, uint32(1), hc.GetUnhealthyThreshold().GetValue())
	s.ProcessorHealthCheck = nil
	require.True(t, s.Routes[0].ExtProc.GetDisabled(), "/healthz disables ext_proc")
	require.Equal(t, "refunds", s.Routes[2].ExtProc.GetOverrides().GetGrpcInitialMetadata()[0].GetValue(),
		"the refunds route names its policy route in the stream's initial metadata")
	require.Contains(t, s.JWTAuthn.GetProviders(), "demo", "jwt_authn runs before ext_proc")
	require.Equal(t, "demo", s.Routes[1].JWT.GetRequirementName(), "the transfers route requires the demo provider's token")
	s.JWTAuthn = nil
	require.Equal(t, Settings{
		FilterName:          "envoy.filters.http.ext_proc",
		ListenerBufferLimit: 1 << 20,
		UpstreamBufferLimit: 1 << 20,
		RouteTimeout:        30 * time.Second,
		DisabledPrefixes:    []string{"/healthz"},
		Routes: []proxy.Route{
			{Name: "healthz", Prefix: "/healthz", Timeout: 15 * time.Second, ExtProc: s.Routes[0].ExtProc},
			{Name: "transfers", Prefix: "/v1/transfers", Timeout: 30 * time.Second, JWT: s.Routes[1].JWT},
			{Name: "refunds", Prefix: "/v1/refunds", Timeout: 30 * time.Second, ExtProc: s.Routes[2].ExtProc},
			{Name: "documents", Prefix: "/v1/documents", Timeout: 30 * time.Second},
			{Name: "default", Prefix: "/", Timeout: 30 * time.Second},
		},
		ProcessorCluster:    "idempotency_extproc",
		ProcessorThresholds: Thresholds{MaxConnections: 100000, MaxPendingRequests: 100000, MaxRequests: 100000, MaxRetries: 100000},
		UpstreamCluster:     "upstream_app",
		StreamRetries:       2,
		DownstreamHTTP2:     true, // codec_type AUTO
	}, s)

	// The processor cluster speaks HTTP/2 with keepalive pings.
	pc := cluster(b, s.ProcessorCluster)
	require.NotNil(t, pc)
	po := &httpv3.HttpProtocolOptions{}
	require.NoError(t, pc.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].UnmarshalTo(po))
	ka := po.GetExplicitHttpConfig().GetHttp2ProtocolOptions().GetConnectionKeepalive()
	require.Equal(t, 30*time.Second, ka.GetInterval().AsDuration())
	require.Equal(t, 5*time.Second, ka.GetTimeout().AsDuration())
}

// EnableHTTP1Trailers turns on enable_trailers on both sides, and ProxySettings reads them.
func TestEnableHTTP1Trailers(t *testing.T) {
	b := loadForProxy(t)
	s, err := ProxySettings(b)
	require.NoError(t, err)
	require.False(t, s.UpstreamTrailers || s.DownstreamTrailers, "off in the shipped file, as in Envoy")
	require.NoError(t, EnableHTTP1Trailers(b))
	s, err = ProxySettings(b)
	require.NoError(t, err)
	require.True(t, s.UpstreamTrailers)
	require.True(t, s.DownstreamTrailers)
	require.NoError(t, b.ValidateAll(), "still a valid bootstrap")
	require.Error(t, EnableHTTP1Trailers(b), "the cluster already has HTTP protocol options")
}

func TestProxySettingsDefaults(t *testing.T) {
	b, err := Parse([]byte(minimal))
	require.NoError(t, err)
	s, err := ProxySettings(b)
	require.NoError(t, err)
	s.Filter = nil
	require.Equal(t, Settings{
		FilterName:          "my_ext_proc",
		ListenerBufferLimit: 1 << 20,
		UpstreamBufferLimit: 1 << 20,
		RouteTimeout:        15 * time.Second,
		Routes:              []proxy.Route{{Prefix: "/", Timeout: 15 * time.Second}},
		ProcessorCluster:    "proc",
		ProcessorThresholds: Thresholds{MaxConnections: 1024, MaxPendingRequests: 1024, MaxRequests: 1024, MaxRetries: 3},
		UpstreamCluster:     "app",
		DownstreamHTTP2:     true, // codec_type AUTO
	}, s)
	// TestEnvoyDefaultsFailTheContract (internal/check) holds this bootstrap to the contract.
}

func TestProxySettingsRejects(t *testing.T) {
	for _, tc := range []struct{ name, old, new, want string }{
		{"filter disabled by default", "- name: my_ext_proc\n", "- name: my_ext_proc\n            disabled: true\n",
			"disabled by default"},
		{"weighted clusters", "route: { cluster: app }", "route: { weighted_clusters: { clusters: [{ name: app, weight: 1 }] } }",
			"does not route to a single cluster"},
		{"upstream cluster missing", "  - name: app\n", "", `upstream cluster "app" is not a static cluster`},
		{"google_grpc", "grpc_service: { envoy_grpc: { cluster_name: proc } }",
			"grpc_service: { google_grpc: { target_uri: \"proc:9002\", stat_prefix: p } }", "no envoy_grpc cluster_name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := Parse([]byte(mutate(t, minimal, tc.old, tc.new, 1)))
			if err == nil {
				_, err = ProxySettings(b)
			}
			require.ErrorContains(t, err, tc.want)
		})
	}

	t.Run("RDS", func(t *testing.T) {
		b, err := Parse([]byte(minimal))
		require.NoError(t, err)
		nf := b.GetStaticResources().GetListeners()[0].GetFilterChains()[0].GetFilters()[0]
		hcm := &hcmv3.HttpConnectionManager{}
		require.NoError(t, nf.GetTypedConfig().UnmarshalTo(hcm))
		hcm.RouteSpecifier = &hcmv3.HttpConnectionManager_Rds{Rds: &hcmv3.Rds{RouteConfigName: "r"}}
		a, err := anypb.New(hcm)
		require.NoError(t, err)
		nf.ConfigType = &listenerv3.Filter_TypedConfig{TypedConfig: a}
		_, err = ProxySettings(b)
		require.ErrorContains(t, err, "no inline route_config")
	})
}

func TestRewrite(t *testing.T) {
	b := loadForProxy(t)
	before := proto.Clone(b)

	js, err := Rewrite(b, Ports{
		Listener:   18000,
		Admin:      18001,
		Processors: []string{"127.0.0.1:19002", "[::1]:19012", "unix:///tmp/extproc.sock"},
		Upstream:   "localhost:18080",
	})
	require.NoError(t, err)
	require.True(t, proto.Equal(before, b), "Rewrite modified its input")
	require.True(t, strings.HasPrefix(strings.TrimSpace(string(js)), "{"), "Envoy reads .json files as JSON")

	got, err := Parse(js)
	require.NoError(t, err)
	require.NoError(t, Validate(got))

	l := got.GetStaticResources().GetListeners()[0]
	require.Equal(t, "127.0.0.1", l.GetAddress().GetSocketAddress().GetAddress())
	require.EqualValues(t, 18000, l.GetAddress().GetSocketAddress().GetPortValue())
	require.Equal(t, "127.0.0.1", got.GetAdmin().GetAddress().GetSocketAddress().GetAddress())
	require.EqualValues(t, 18001, got.GetAdmin().GetAddress().GetSocketAddress().GetPortValue())

	s, err := ProxySettings(got)
	require.NoError(t, err)
	require.NoError(t, CheckSpec(s.Filter, storeTimeout))
	require.Equal(t, []string{"/healthz"}, s.DisabledPrefixes)

	pc, uc := cluster(got, s.ProcessorCluster), cluster(got, s.UpstreamCluster)
	require.Equal(t, clusterv3.Cluster_STATIC, pc.GetType())
	var procs []string
	for _, e := range pc.GetLoadAssignment().GetEndpoints()[0].GetLbEndpoints() {
		a := e.GetEndpoint().GetAddress()
		if p := a.GetPipe(); p != nil {
			procs = append(procs, "unix://"+p.GetPath())
			continue
		}
		sa := a.GetSocketAddress()
		procs = append(procs, net.JoinHostPort(sa.GetAddress(), strconv.Itoa(int(sa.GetPortValue()))))
	}
	require.Equal(t, []string{"127.0.0.1:19002", "[::1]:19012", "unix:///tmp/extproc.sock"}, procs)
	require.Equal(t, s.ProcessorCluster, pc.GetLoadAssignment().GetClusterName())
	// Everything else about the processor cluster survives: HTTP/2 and the circuit breakers.
	require.Len(t, pc.GetTypedExtensionProtocolOptions(), 1)
	require.Equal(t, Thresholds{MaxConnections: 100000, MaxPendingRequests: 100000, MaxRequests: 100000, MaxRetries: 100000}, s.ProcessorThresholds)

	require.Equal(t, clusterv3.Cluster_STRICT_DNS, uc.GetType(), "a hostname needs DNS")
	ua := uc.GetLoadAssignment().GetEndpoints()[0].GetLbEndpoints()[0].GetEndpoint().GetAddress().GetSocketAddress()
	require.Equal(t, "localhost", ua.GetAddress())
	require.EqualValues(t, 18080, ua.GetPortValue())
	require.EqualValues(t, 1<<20, s.UpstreamBufferLimit)
}

func TestRewriteRejects(t *testing.T) {
	b := loadForProxy(t)
	ok := Ports{Listener: 1, Admin: 2, Processors: []string{"127.0.0.1:3"}, Upstream: "127.0.0.1:4"}
	for _, tc := range []struct {
		name   string
		change func(*Ports)
		want   string
	}{
		{"listener port 0", func(p *Ports) { p.Listener = 0 }, "listener port 0"},
		{"admin port too big", func(p *Ports) { p.Admin = 70000 }, "admin port 70000"},
		{"no processors", func(p *Ports) { p.Processors = nil }, "no processor address"},
		{"processor without port", func(p *Ports) { p.Processors = []string{"127.0.0.1"} }, "processor cluster"},
		{"upstream bad port", func(p *Ports) { p.Upstream = "127.0.0.1:http" }, "upstream cluster"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := ok
			tc.change(&p)
			_, err := Rewrite(b, p)
			require.ErrorContains(t, err, tc.want)
		})
	}
	_, err := Rewrite(&bootstrapv3.Bootstrap{}, ok)
	require.ErrorContains(t, err, "no static listener")
}
