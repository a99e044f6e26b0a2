package envoyconf

import (
	"testing"
	"time"

	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/proxy"
)

// mesh is a bootstrap with what issue 16 relies on: named routes with metadata and per-route
// ExtProcPerRoute, a virtual-host default, local_reply_config, jwt_authn before ext_proc,
// forward/mutation/metadata options on the filter, and tracing.
const mesh = `
static_resources:
  listeners:
  - name: l
    address: { socket_address: { address: 0.0.0.0, port_value: 10000 } }
    per_connection_buffer_limit_bytes: 32768
    filter_chains:
    - filters:
      - name: hcm
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: s
          tracing:
            random_sampling: { value: 0 }
          local_reply_config:
            mappers:
            - filter: { status_code_filter: { comparison: { op: EQ, value: { default_value: 409, runtime_key: unused } } } }
              status_code: 400
          route_config:
            virtual_hosts:
            - name: v
              domains: ["*"]
              typed_per_filter_config:
                envoy.filters.http.ext_proc:
                  "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute
                  overrides:
                    grpc_initial_metadata: [{ key: x-idempotency-route, value: default }]
              routes:
              - name: health
                match: { prefix: "/healthz" }
                route: { cluster: app }
                typed_per_filter_config:
                  envoy.filters.http.ext_proc:
                    "@type": type.googleapis.com/envoy.config.route.v3.FilterConfig
                    disabled: true
              - name: payments
                match: { path: "/v1/payments", grpc: {}, case_sensitive: true }
                metadata: { filter_metadata: { "envoy-gateway": { kind: HTTPRoute } } }
                route: { cluster: app, timeout: 0s }
                typed_per_filter_config:
                  envoy.filters.http.ext_proc:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute
                    overrides:
                      processing_mode: { request_header_mode: SEND, request_body_mode: STREAMED, response_header_mode: SEND, response_body_mode: BUFFERED }
                      grpc_initial_metadata: [{ key: x-idempotency-route, value: payments }]
                      failure_mode_allow: false
                      metadata_options: { forwarding_namespaces: { untyped: [envoy.filters.http.jwt_authn] } }
              - name: uploads
                match: { safe_regex: { regex: "/v1/uploads/[0-9]+" } }
                route: { cluster: app }
                typed_per_filter_config:
                  envoy.filters.http.ext_proc:
                    "@type": type.googleapis.com/envoy.config.route.v3.FilterConfig
                    config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute
                      disabled: true
              - name: rest
                match: { prefix: "/" }
                route: { cluster: app, timeout: 20s }
          http_filters:
          - name: envoy.filters.http.jwt_authn
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication
              providers:
                test:
                  issuer: https://issuer.test
                  payload_in_metadata: jwt_payload
                  local_jwks: { inline_string: '{"keys":[{"kty":"oct","kid":"k","k":"c2VjcmV0"}]}' }
              rules:
              - match: { prefix: "/" }
                requires: { provider_name: test }
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: { envoy_grpc: { cluster_name: proc } }
              processing_mode: { request_header_mode: SEND, request_body_mode: BUFFERED, response_header_mode: SEND, response_body_mode: BUFFERED }
              forward_rules: { disallowed_headers: { patterns: [{ exact: cookie }] } }
              mutation_rules: { disallow_is_error: true }
              metadata_options:
                forwarding_namespaces: { untyped: [envoy.filters.http.jwt_authn] }
                receiving_namespaces: { untyped: [idempotency] }
              request_attributes: [xds.route_name, connection.uri_san_peer_certificate]
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: proc
  - name: app
`

func TestProxySettingsMesh(t *testing.T) {
	b, err := Parse([]byte(mesh))
	require.NoError(t, err)
	s, err := ProxySettings(b)
	require.NoError(t, err)

	require.Equal(t, uint32(32768), s.ListenerBufferLimit)
	require.Equal(t, 20*time.Second, s.RouteTimeout, `the "/" route's timeout`)
	require.Equal(t, []string{"/healthz"}, s.DisabledPrefixes)
	require.Equal(t, "default", s.VirtualHostExtProc.GetOverrides().GetGrpcInitialMetadata()[0].GetValue())

	require.Len(t, s.Routes, 4)
	health, payments, uploads, rest := s.Routes[0], s.Routes[1], s.Routes[2], s.Routes[3]
	require.Equal(t, "health", health.Name)
	require.Equal(t, "/healthz", health.Prefix)
	require.True(t, health.ExtProc.GetDisabled(), "FilterConfig disabled")
	require.Equal(t, 15*time.Second, health.Timeout, "Envoy's default route timeout")

	require.Equal(t, "payments", payments.Name)
	require.Equal(t, "/v1/payments", payments.Path)
	require.True(t, payments.Grpc, "grpc: {}")
	require.False(t, health.Grpc)
	require.Equal(t, time.Duration(-1), payments.Timeout, "timeout 0s disables the timeout")
	require.Equal(t, "HTTPRoute", payments.Metadata.GetFilterMetadata()["envoy-gateway"].GetFields()["kind"].GetStringValue())
	o := payments.ExtProc.GetOverrides()
	require.Equal(t, "STREAMED", o.GetProcessingMode().GetRequestBodyMode().String())
	require.Equal(t, "payments", o.GetGrpcInitialMetadata()[0].GetValue())
	require.NotNil(t, o.GetFailureModeAllow())
	require.Equal(t, []string{"envoy.filters.http.jwt_authn"}, o.GetMetadataOptions().GetForwardingNamespaces().GetUntyped())

	require.Equal(t, "/v1/uploads/[0-9]+", uploads.Regex)
	require.True(t, uploads.ExtProc.GetDisabled(), "FilterConfig wrapping an ExtProcPerRoute")
	require.Equal(t, "/", rest.Prefix)
	require.Nil(t, rest.ExtProc)

	require.Len(t, s.LocalReplyConfig.GetMappers(), 1)
	require.Equal(t, uint32(400), s.LocalReplyConfig.GetMappers()[0].GetStatusCode().GetValue())
	require.Equal(t, "jwt_payload", s.JWTAuthn.GetProviders()["test"].GetPayloadInMetadata())
	require.Equal(t, &proxy.Tracing{Unsampled: true}, s.Tracing)
	require.True(t, s.Filter.GetMutationRules().GetDisallowIsError().GetValue())
	require.Equal(t, "cookie", s.Filter.GetForwardRules().GetDisallowedHeaders().GetPatterns()[0].GetExact())

	// The config runs: the proxy accepts every part of it (the local_reply_config's runtime
	// key aside, which the test bootstrap sets to show that New rejects it).
	cfg := s.ProxyConfig([]string{"127.0.0.1:1"}, "http://127.0.0.1:2")
	require.Equal(t, s.Routes, cfg.Routes)
	require.Equal(t, s.JWTAuthn, cfg.JWTAuthn)
	_, err = proxy.New(cfg)
	require.ErrorContains(t, err, "runtime keys are not supported")
	cfg.LocalReplyConfig.GetMappers()[0].GetFilter().GetStatusCodeFilter().GetComparison().GetValue().RuntimeKey = ""
	p, err := proxy.New(cfg)
	require.NoError(t, err)
	require.NoError(t, p.Close())
}

func TestProxySettingsMeshRejects(t *testing.T) {
	for _, tc := range []struct{ name, old, new, want string }{
		// Every RouteMatch field but the path specifiers, case_sensitive true and grpc is refused,
		// by name, rather than ignored.
		{"header matcher", `match: { path: "/v1/payments", grpc: {}, case_sensitive: true }`, `match: { path: "/v1/payments", headers: [{ name: x, present_match: true }] }`,
			"match field headers is not supported"},
		{"query parameter", `match: { path: "/v1/payments", grpc: {}, case_sensitive: true }`, `match: { path: "/v1/payments", query_parameters: [{ name: x, present_match: true }] }`,
			"match field query_parameters is not supported"},
		{"runtime fraction", `match: { path: "/v1/payments", grpc: {}, case_sensitive: true }`, `match: { path: "/v1/payments", runtime_fraction: { default_value: { numerator: 50 } } }`,
			"match field runtime_fraction is not supported"},
		{"cookie", `match: { path: "/v1/payments", grpc: {}, case_sensitive: true }`, `match: { path: "/v1/payments", cookies: [{ name: x, string_match: { exact: v } }] }`,
			"match field cookies is not supported"},
		{"tls context", `match: { path: "/v1/payments", grpc: {}, case_sensitive: true }`, `match: { path: "/v1/payments", tls_context: { presented: true } }`,
			"match field tls_context is not supported"},
		{"dynamic metadata", `match: { path: "/v1/payments", grpc: {}, case_sensitive: true }`, `match: { path: "/v1/payments", dynamic_metadata: [{ filter: f, path: [{ key: k }], value: { present_match: true } }] }`,
			"match field dynamic_metadata is not supported"},
		{"filter state", `match: { path: "/v1/payments", grpc: {}, case_sensitive: true }`, `match: { path: "/v1/payments", filter_state: [{ key: k, string_match: { exact: v } }] }`,
			"match field filter_state is not supported"},
		{"case insensitive", `match: { path: "/v1/payments", grpc: {}, case_sensitive: true }`, `match: { path: "/v1/payments", case_sensitive: false }`,
			"case-insensitive matches are not supported"},
		{"path separated prefix", `match: { path: "/v1/payments", grpc: {}, case_sensitive: true }`, `match: { path_separated_prefix: "/v1/payments" }`,
			"path specifier path_separated_prefix is not supported"},
		{"jwt_authn rule on headers", `- match: { prefix: "/" }`, `- match: { prefix: "/", headers: [{ name: x, present_match: true }] }`,
			`http filter "envoy.filters.http.jwt_authn" rule 0: match field headers is not supported`},
		{"jwt_authn rule on grpc", `- match: { prefix: "/" }`, `- match: { prefix: "/", grpc: {} }`,
			`http filter "envoy.filters.http.jwt_authn" rule 0: match field grpc is not supported`},
		{"another cluster", "route: { cluster: app, timeout: 20s }", "route: { cluster: proc, timeout: 20s }",
			`routes use clusters "app" and "proc"`},
		{"per-route grpc_service", "failure_mode_allow: false", "grpc_service: { envoy_grpc: { cluster_name: proc } }",
			"grpc_service is not supported"},
		{"redirect", "route: { cluster: app }\n                typed_per_filter_config:\n                  envoy.filters.http.ext_proc:\n                    \"@type\": type.googleapis.com/envoy.config.route.v3.FilterConfig\n                    config:",
			"redirect: { path_redirect: /x }\n                typed_per_filter_config:\n                  envoy.filters.http.ext_proc:\n                    \"@type\": type.googleapis.com/envoy.config.route.v3.FilterConfig\n                    config:",
			"only route actions"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := Parse([]byte(mutate(t, mesh, tc.old, tc.new, 1)))
			require.NoError(t, err)
			_, err = ProxySettings(b)
			require.ErrorContains(t, err, tc.want)
		})
	}
	t.Run("jwt_authn after ext_proc", func(t *testing.T) {
		b, err := Parse([]byte(mesh))
		require.NoError(t, err)
		require.NoError(t, MutateHCM(b, func(hcm *hcmv3.HttpConnectionManager) error {
			hcm.HttpFilters[0], hcm.HttpFilters[1] = hcm.HttpFilters[1], hcm.HttpFilters[0]
			return nil
		}))
		_, err = ProxySettings(b)
		require.ErrorContains(t, err, "runs after ext_proc")
	})
}
