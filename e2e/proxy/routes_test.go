package proxy_test

import (
	"net/http"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
)

func overrides(o *filterextproc.ExtProcOverrides) *filterextproc.ExtProcPerRoute {
	return &filterextproc.ExtProcPerRoute{Override: &filterextproc.ExtProcPerRoute_Overrides{Overrides: o}}
}

func disabled() *filterextproc.ExtProcPerRoute {
	return &filterextproc.ExtProcPerRoute{Override: &filterextproc.ExtProcPerRoute_Disabled{Disabled: true}}
}

// The route table: the first matching route wins (prefix on :path, path and regex on :path
// without query); its name is xds.route_name and its metadata xds.route_metadata (as
// ShortDebugString, Filters::Common::Expr::print); ExtProcPerRoute disables the filter or
// overrides processing_mode (which protocol_config then reports) and grpc_initial_metadata
// (merged by key into grpc_service.initial_metadata, the stream's metadata).
func TestRoutes(t *testing.T) {
	f := bufferedFilter()
	f.RequestAttributes = []string{"xds.route_name", "xds.route_metadata"}
	f.GrpcService = &corev3.GrpcService{InitialMetadata: []*corev3.HeaderValue{
		{Key: "x-idempotency-route", Value: "filter-default"}, {Key: "x-cluster", Value: "c1"},
	}}
	md := &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy-gateway": {Fields: map[string]*structpb.Value{
		"kind": structpb.NewStringValue("HTTPRoute"),
	}}}}
	routes := []proxy.Route{
		{Name: "health", Prefix: "/healthz", ExtProc: disabled()},
		{Name: "payments", Path: "/v1/payments", Metadata: md, ExtProc: overrides(&filterextproc.ExtProcOverrides{
			GrpcInitialMetadata: []*corev3.HeaderValue{{Key: "x-idempotency-route", Value: "payments"}},
		})},
		{Name: "uploads", Regex: `/v1/uploads/[0-9]+`, ExtProc: overrides(&filterextproc.ExtProcOverrides{
			ProcessingMode: fullMode(bodySTR, modeSEND, bodyBUF),
		})},
		{Name: "", Prefix: "/v1/"},
	}
	e := newEnv(t, f, nil, func(c *proxy.Config) { c.Routes = routes })

	for _, tc := range []struct {
		path, name string
		bodyMode   filterextproc.ProcessingMode_BodySendMode
		routeMD    string
	}{
		{"/v1/payments?x=1", "payments", bodyBUF, `filter_metadata { key: "envoy-gateway" value { fields { key: "kind" value { string_value: "HTTPRoute" } } } }`},
		{"/v1/uploads/42", "uploads", bodySTR, ""},
		{"/v1/other", "", bodyBUF, ""},
	} {
		resp, _ := e.do(t, http.MethodPost, tc.path, []byte("x"))
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.Equal(t, tc.name, e.record(t).Route)
		log := e.proc.next(t)
		attrs := log.msgs[0].GetAttributes()[fieldsKey].GetFields()
		require.Equal(t, tc.name, attrs["xds.route_name"].GetStringValue(), tc.path)
		require.Equal(t, tc.routeMD, attrs["xds.route_metadata"].GetStringValue(), tc.path)
		require.Equal(t, tc.bodyMode, log.msgs[0].GetProtocolConfig().GetRequestBodyMode(), "protocol_config carries the per-route mode")
		wantRoute := "filter-default"
		if tc.name == "payments" {
			wantRoute = "payments"
		}
		require.Equal(t, []string{wantRoute}, log.md.Get("x-idempotency-route"))
		require.Equal(t, []string{"c1"}, log.md.Get("x-cluster"))
	}

	// Disabled: no stream at all.
	resp, _ := e.do(t, http.MethodGet, "/healthz/live", nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	rec := e.record(t)
	require.Equal(t, "health", rec.Route)
	require.Empty(t, rec.Processor)
	e.proc.none(t)

	// No route: the router's 404 route_not_found (NR), attempt count 0, and on 1.37 the
	// processor sees the local reply's response phases.
	resp, _ = e.do(t, http.MethodGet, "/nowhere", nil)
	require.Equal(t, http.StatusNotFound, resp.StatusCode)
	rec = e.record(t)
	require.Equal(t, "route_not_found", rec.CodeDetails)
	require.Equal(t, "NR", rec.ResponseFlags)
	require.Zero(t, rec.Attempts)
	log := e.proc.next(t)
	require.Equal(t, []string{"request_headers", "response_headers"}, kinds(log.msgs))
	require.Nil(t, log.msgs[0].GetAttributes()[fieldsKey].GetFields()["xds.route_name"], "no route: the attribute fails")
}

// mode_override merges with the filter-level processing_mode, not with the route's, and
// allowed_override_modes compares that merge (Filter::onReceiveMessage passes
// config_->processingMode() to effectiveModeOverride): a route that sends response
// trailers still loses them to an override whose trailer mode is DEFAULT.
func TestModeOverrideUsesTheFilterLevelMode(t *testing.T) {
	f := bufferedFilter() // trailers SKIP at the filter level
	f.AllowedOverrideModes = []*filterextproc.ProcessingMode{fullMode(bodyBUF, modeSEND, bodyBUF)}
	routeMode := fullMode(bodyBUF, modeSEND, bodyBUF)
	routeMode.ResponseTrailerMode = modeSEND
	h := on("request_headers", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		resp := cont(req)
		resp.ModeOverride = &filterextproc.ProcessingMode{RequestBodyMode: bodyBUF, ResponseBodyMode: bodyBUF}
		return st.Send(resp)
	})
	e := newEnv(t, f, h, func(c *proxy.Config) {
		c.Routes = []proxy.Route{{Name: "r", ExtProc: overrides(&filterextproc.ExtProcOverrides{ProcessingMode: routeMode})}}
		c.UpstreamTrailers = true
	})
	resp, _ := e.do(t, http.MethodPost, "/x", []byte("x"), "X-Test-Body-Bytes", "10", "X-Test-Trailer-Grpc-Status", "0")
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, int64(1), e.proxy.Stats().ModeOverrides, "the merge with the filter-level mode is in the allow list")
	require.NotContains(t, kinds(e.proc.next(t).msgs), "response_trailers", "the override's DEFAULT trailer mode is the filter's SKIP")
}

// Per-route failure_mode_allow and metadata_options replace the filter's
// (FilterConfigPerRoute, Filter::mergePerRouteConfig).
func TestPerRouteFailureModeAndMetadata(t *testing.T) {
	f := metadataFilter()
	routes := []proxy.Route{
		{Name: "open", Prefix: "/open", ExtProc: overrides(&filterextproc.ExtProcOverrides{FailureModeAllow: wrapperspb.Bool(true)})},
		{Name: "nometa", Prefix: "/nometa", ExtProc: overrides(&filterextproc.ExtProcOverrides{MetadataOptions: &filterextproc.MetadataOptions{
			ForwardingNamespaces: &filterextproc.MetadataOptions_MetadataNamespaces{},
		}})},
		{Name: "closed"},
	}
	secret := []byte("test-secret-0123456789")
	jwks := `{"keys":[{"kty":"oct","kid":"k1","alg":"HS256","k":"` + b64.EncodeToString(secret) + `"}]}`
	jwt := jwtConfig(jwks, false)
	jwt.Rules = jwt.Rules[1:] // every path
	failing := on("request_body", statusErr(codes.Unavailable, "down"))
	e := newEnv(t, f, failing, func(c *proxy.Config) { c.Routes = routes; c.JWTAuthn = jwt })
	auth := "Bearer " + signHS256(t, secret, "k1", claims(nil))

	resp, _ := e.do(t, http.MethodPost, "/open", []byte("x"), "Authorization", auth)
	require.Equal(t, http.StatusOK, resp.StatusCode, "failure_mode_allow on this route")
	e.proc.next(t)
	e.record(t)
	resp, _ = e.do(t, http.MethodPost, "/closed", []byte("x"), "Authorization", auth)
	require.Equal(t, http.StatusInternalServerError, resp.StatusCode)
	log := e.proc.next(t)
	require.NotEmpty(t, log.msgs[0].GetMetadataContext().GetFilterMetadata()[jwtNS])
	e.record(t)
	resp, _ = e.do(t, http.MethodPost, "/nometa", []byte("x"), "Authorization", auth)
	require.Equal(t, http.StatusInternalServerError, resp.StatusCode)
	log = e.proc.next(t)
	require.Empty(t, log.msgs[0].GetMetadataContext().GetFilterMetadata(), "the route forwards no namespace")
}

// A route matching with grpc: {} takes only gRPC requests (RouteEntryImplBase::matchRoute,
// Grpc::Common::isGrpcRequestHeaders): content-type exactly application/grpc or
// application/grpc+…; any other request, on the same path, falls to the next route.
func TestRouteGrpcMatch(t *testing.T) {
	routes := []proxy.Route{
		{Name: "grpc-only", Path: unaryPath, Grpc: true, ExtProc: disabled()},
		{Name: "grpc-prefix", Prefix: "/grpc.testing.", Grpc: true, ExtProc: disabled()},
		{Name: "fallback", Prefix: "/", ExtProc: disabled()},
	}
	e := newEnv(t, bufferedFilter(), nil, func(c *proxy.Config) { c.Routes = routes })
	for _, tc := range []struct {
		path, contentType, route string
	}{
		{unaryPath, "application/grpc", "grpc-only"},
		{unaryPath + "?x=1", "application/grpc+proto", "grpc-only"},
		{"/grpc.testing.TestService/EmptyCall", "application/grpc", "grpc-prefix"},
		{unaryPath, "application/grpc-web", "fallback"},
		{unaryPath, "application/grpc;charset=utf-8", "fallback"},
		{unaryPath, "application/json", "fallback"},
		{unaryPath, "", "fallback"},
		{"/grpc.testing.TestService/EmptyCall", "text/plain", "fallback"},
	} {
		var hdr []string
		if tc.contentType != "" {
			hdr = []string{"content-type", tc.contentType}
		}
		resp, _ := e.do(t, http.MethodPost, tc.path, []byte("x"), hdr...)
		require.Equal(t, http.StatusOK, resp.StatusCode, "%s %q", tc.path, tc.contentType)
		require.Equal(t, tc.route, e.record(t).Route, "%s %q", tc.path, tc.contentType)
	}

	// A grpc-go client's call, over HTTP/2, takes the grpc-only route.
	g := newGrpcEnv(t, grpcMode(bodyNONE, bodyNONE, modeSKIP), nil, func(c *proxy.Config) { c.Routes = routes })
	resp, _, _, st := g.call(t, "hi")
	require.Equal(t, codes.OK, st.Code(), st.Message())
	require.Equal(t, "echo:hi", string(resp.GetPayload().GetBody()))
	require.Equal(t, "grpc-only", g.record(t).Route)
}
