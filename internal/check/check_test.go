package check

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// Where the findings on the shipped files point.
const (
	bootstrapListener = `listener "ingress_http"`
	bootstrapFilter   = "filter_chains[0].filters[0].typed_config.http_filters[envoy.filters.http.ext_proc].typed_config"
	bootstrapRoutes   = "filter_chains[0].filters[0].typed_config.route_config.virtual_hosts[0].routes"
	istioFilterPath   = "configPatches[0].patch.value.typed_config"
	istioResource     = "EnvoyFilter istio-system/idempotency-extproc"
	egTransfers       = "EnvoyExtensionPolicy payments/idempotency-transfers"
)

// shippedInputs are the shipped files, as the check subcommand reads them.
func shippedInputs(t testing.TB, names ...string) []Input {
	var out []Input
	for _, n := range names {
		out = append(out, Input{Name: "envoy/" + n, Data: []byte(readEnvoyFile(t, n))})
	}
	return out
}

func parsePolicy(t testing.TB, text string) *policy.Policy {
	t.Helper()
	if text == "" {
		return shippedPolicy(t)
	}
	p, err := policy.Parse([]byte(text))
	require.NoError(t, err)
	return p
}

// fieldsOf returns the distinct fields of the findings of severity s, in order.
func fieldsOf(rep Report, s Severity) []string {
	var out []string
	for _, f := range rep.Findings {
		if f.Severity == s && !slices.Contains(out, f.Field) {
			out = append(out, f.Field)
		}
	}
	return out
}

// The shipped files pass, alone and together: no error. Envoy Gateway's one gap (request
// trailers) is a warning; the kinds check does not read are named.
func TestRunShippedFilesPass(t *testing.T) {
	all := []string{"envoy.yaml", "istio-envoyfilter.yaml", "envoy-gateway.yaml"}
	for _, files := range [][]string{{all[0]}, {all[1]}, {all[2]}, all} {
		t.Run(strings.Join(files, "+"), func(t *testing.T) {
			rep, err := Run(shippedPolicy(t), shippedInputs(t, files...), Options{})
			require.NoError(t, err)
			require.Zero(t, rep.Errors(), "%v", rep.Findings)
			var warnings []string
			for _, f := range rep.Findings {
				warnings = append(warnings, f.Resource+" "+f.Field)
			}
			if slices.Contains(files, "envoy-gateway.yaml") {
				require.Equal(t, []string{
					egTransfers + " extProc[0].processingMode.request.body",
					"EnvoyExtensionPolicy payments/idempotency-refunds extProc[0].processingMode.request.body",
				}, warnings)
			} else {
				require.Empty(t, warnings)
			}
		})
	}
	rep, err := Run(shippedPolicy(t), shippedInputs(t, all...), Options{})
	require.NoError(t, err)
	require.Equal(t, []string{
		"Gateway payments/payments-gateway (envoy/istio-envoyfilter.yaml)",
		"RequestAuthentication istio-system/payments-jwt (envoy/istio-envoyfilter.yaml)",
		"Service idempotency/idempotency-extproc (envoy/istio-envoyfilter.yaml)",
	}, rep.Skipped)
}

// Each setting that breaks protection, seeded alone into a copy of a shipped file, is an error
// naming its field, and the only one.
func TestRunFindsEachSetting(t *testing.T) {
	const (
		inFlightWait   = "defaults:\n  in_flight_wait: 1s\nroutes:\n  - name: refunds\n    match: { path_prefix: /v1/refunds }\n"
		largeResponses = "defaults:\n  max_response_bytes: 2097152\nroutes:\n  - name: refunds\n    match: { path_prefix: /v1/refunds }\n"
		routeAdd       = "                match: { prefix: \"/\" }\n                route: { cluster: upstream_app, timeout: 30s }\n"
		refundsMeta    = "                      - { key: x-idempotency-route, value: refunds }\n"
		vsTransfers    = "  - name: transfers\n    match:\n    - uri: { prefix: /v1/transfers }\n"
		btpAt          = "  connection:\n    bufferLimit: 1Mi             # response bodies"
	)
	costs := map[string]bool{
		"allow_mode_override false": true, "Istio allow_mode_override false": true,
		"no upstream.request_attempt_count": true, "Istio response_attributes": true,
		"no response.code_details": true, "EG response attributes": true,
		"response_trailer_mode left DEFAULT": true,
		"outcome namespace not received":     true, "per-route metadata_options": true,
		"Istio outcome namespace": true, "EG outcome namespace": true,
		"send_body_without_waiting_for_header_response": true, "allowed_override_modes": true, "Istio allowed_override_modes": true,
		"response_trailer_mode DEFAULT": true, "processing_request_modifier": true, "EG allowModeOverride false": true,
	}
	const keep = "defaults:\n  unknown_outcome: keep\nroutes:\n  - name: refunds\n    match: { path_prefix: /v1/refunds }\n"
	for _, tc := range []struct {
		name, file, old, new string
		policy               string
		resource, field      string
		problem              string
	}{
		// Where an unknown outcome keeps the lease, a response Envoy made before the request
		// went upstream would block its retries: the missing attributes are errors.
		{"no upstream.request_attempt_count under keep", "envoy.yaml", `, "upstream.request_attempt_count"]`, `]`, keep,
			bootstrapListener, bootstrapFilter + ".response_attributes", `lacks "upstream.request_attempt_count"`},
		{"no response.code_details under keep", "envoy.yaml", `"response.code_details", `, ``, keep,
			bootstrapListener, bootstrapFilter + ".response_attributes", `lacks "response.code_details"`},
		// A standalone bootstrap.
		{"router retries", "envoy.yaml", routeAdd, "                match: { prefix: \"/\" }\n                route: { cluster: upstream_app, timeout: 30s, retry_policy: { retry_on: 5xx } }\n", "",
			bootstrapListener, bootstrapRoutes + "[4].route.retry_policy.retry_on", `has "5xx"`},
		{"hedging", "envoy.yaml", routeAdd, "                match: { prefix: \"/\" }\n                route: { cluster: upstream_app, timeout: 30s, hedge_policy: { hedge_on_per_try_timeout: true } }\n", "",
			bootstrapListener, bootstrapRoutes + "[4].route.hedge_policy", "may run twice"},
		{"allow_mode_override false", "envoy.yaml", "allow_mode_override: true", "allow_mode_override: false", "",
			bootstrapListener, bootstrapFilter + ".allow_mode_override", "is false"},
		{"request body NONE", "envoy.yaml", "request_body_mode: BUFFERED", "request_body_mode: NONE", "",
			bootstrapListener, bootstrapFilter + ".processing_mode.request_body_mode", "500 body-not-available"},
		{"request body NONE under a route that reads JSON members", "envoy.yaml", "request_body_mode: BUFFERED", "request_body_mode: NONE",
			"defaults:\n  fingerprint: [method, path]\nroutes:\n  - name: refunds\n    match: { path_prefix: /v1/refunds }\n  - name: mcp\n    match: { path_prefix: /mcp }\n    key_json: [/params/_meta/idempotencyKey]\n",
			bootstrapListener, bootstrapFilter + ".processing_mode.request_body_mode", "500 body-not-available"},
		{"per-route request body NONE where the route needs it", "envoy.yaml", refundsMeta,
			refundsMeta + "                      processing_mode: { request_header_mode: SEND, request_body_mode: NONE, request_trailer_mode: SEND, response_header_mode: SEND, response_body_mode: BUFFERED, response_trailer_mode: SKIP }\n", "",
			bootstrapListener, bootstrapRoutes + "[2].typed_per_filter_config[envoy.filters.http.ext_proc].overrides.processing_mode.request_body_mode", "needs the body"},
		{"request trailers SKIP", "envoy.yaml", "request_trailer_mode: SEND", "request_trailer_mode: SKIP", "",
			bootstrapListener, bootstrapFilter + ".processing_mode.request_trailer_mode", "may run twice"},
		{"forward_rules hiding the scope header", "envoy.yaml", "route_cache_action: RETAIN",
			"route_cache_action: RETAIN\n              forward_rules: { disallowed_headers: { patterns: [{ exact: authorization }] } }", "",
			bootstrapListener, bootstrapFilter + ".forward_rules.disallowed_headers.patterns[0]", "hides authorization"},
		{"mutation_rules refusing the replay header", "envoy.yaml", "route_cache_action: RETAIN",
			"route_cache_action: RETAIN\n              mutation_rules: { disallow_expression: { regex: \"x-idempotency-.*\" } }", "",
			bootstrapListener, bootstrapFilter + ".mutation_rules.disallow_expression", "x-idempotency-replayed"},
		{"local_reply_config", "envoy.yaml", "          codec_type: AUTO\n",
			"          codec_type: AUTO\n          local_reply_config: { body_format: { text_format: \"%LOCAL_REPLY_BODY%\" } }\n", "",
			bootstrapListener, "filter_chains[0].filters[0].typed_config.local_reply_config.body_format", "replayed body"},
		{"failure_mode_allow", "envoy.yaml", "failure_mode_allow: false", "failure_mode_allow: true", "",
			bootstrapListener, bootstrapFilter + ".failure_mode_allow", "bypass idempotency"},
		{"failure_mode_allow per route", "envoy.yaml", refundsMeta, refundsMeta + "                      failure_mode_allow: true\n", "",
			bootstrapListener, bootstrapRoutes + "[2].typed_per_filter_config[envoy.filters.http.ext_proc].overrides.failure_mode_allow", "bypass idempotency"},
		{"message_timeout not above store_timeout", "envoy.yaml", "message_timeout: 0.5s", "message_timeout: 0.1s", "",
			bootstrapListener, bootstrapFilter + ".message_timeout", "100ms is not above store_timeout 100ms"},
		{"message_timeout not above store_timeout plus in_flight_wait", "envoy.yaml", "message_timeout: 0.5s", "message_timeout: 1s", inFlightWait,
			bootstrapListener, bootstrapFilter + ".message_timeout", `1s is not above store_timeout 100ms plus in_flight_wait 1s (route "refunds")`},
		{"no upstream.request_attempt_count", "envoy.yaml", `, "upstream.request_attempt_count"]`, `]`, "",
			bootstrapListener, bootstrapFilter + ".response_attributes", `lacks "upstream.request_attempt_count"`},
		{"no response.code_details", "envoy.yaml", `"response.code_details", `, ``, "",
			bootstrapListener, bootstrapFilter + ".response_attributes", `lacks "response.code_details"`},
		{"no xds.route_name", "envoy.yaml", `"request.id", "xds.route_name"`, `"request.id"`, "",
			bootstrapListener, bootstrapFilter + ".request_attributes", `lacks "xds.route_name"`},
		{"jwt_authn payload not forwarded", "envoy.yaml", "untyped: [envoy.filters.http.jwt_authn]", "untyped: []", "",
			bootstrapListener, bootstrapFilter + ".metadata_options.forwarding_namespaces.untyped", "JWT claims"},
		{"response body NONE", "envoy.yaml", "response_body_mode: BUFFERED\n                response_trailer_mode: SKIP",
			"response_body_mode: NONE\n                response_trailer_mode: SKIP", "",
			bootstrapListener, bootstrapFilter + ".processing_mode.response_body_mode", "409 response-not-replayable"},
		{"per-route response body NONE where the route stores bodies", "envoy.yaml", refundsMeta,
			refundsMeta + "                      processing_mode: { request_header_mode: SEND, request_body_mode: BUFFERED, request_trailer_mode: SEND, response_header_mode: SEND, response_body_mode: NONE, response_trailer_mode: SKIP }\n", "",
			bootstrapListener, bootstrapRoutes + "[2].typed_per_filter_config[envoy.filters.http.ext_proc].overrides.processing_mode.response_body_mode", `policy route "refunds" stores response bodies`},
		{"a buffer limit below max_response_bytes", "envoy.yaml", "per_connection_buffer_limit_bytes: 1048576\n    load_assignment:\n      cluster_name: upstream_app",
			"per_connection_buffer_limit_bytes: 65536\n    load_assignment:\n      cluster_name: upstream_app", "",
			`cluster "upstream_app"`, "per_connection_buffer_limit_bytes", "max_response_bytes 1048576, above the 65536-byte upstream buffer"},
		{"a max_response_bytes above Envoy's buffer", "envoy.yaml", "    per_connection_buffer_limit_bytes: 1048576\n    load_assignment:\n      cluster_name: upstream_app",
			"    load_assignment:\n      cluster_name: upstream_app", largeResponses,
			bootstrapListener, bootstrapFilter + ".processing_mode.response_body_mode", `nothing sets per_connection_buffer_limit_bytes of cluster "upstream_app"`},
		{"a route naming no policy route", "envoy.yaml", "value: refunds }", "value: refund }", "",
			bootstrapListener, bootstrapRoutes + "[2].typed_per_filter_config[envoy.filters.http.ext_proc].overrides.grpc_initial_metadata[0]", `"refund"`},

		{"observability_mode", "envoy.yaml", "route_cache_action: RETAIN", "route_cache_action: RETAIN\n              observability_mode: true", "",
			bootstrapListener, bootstrapFilter + ".observability_mode", "ignores the processor's answers"},
		{"disable_immediate_response", "envoy.yaml", "route_cache_action: RETAIN", "route_cache_action: RETAIN\n              disable_immediate_response: true", "",
			bootstrapListener, bootstrapFilter + ".disable_immediate_response", "replays and errors could not be sent"},
		{"send_body_without_waiting_for_header_response", "envoy.yaml", "route_cache_action: RETAIN", "route_cache_action: RETAIN\n              send_body_without_waiting_for_header_response: true", "",
			bootstrapListener, bootstrapFilter + ".send_body_without_waiting_for_header_response", "ignore mode_override"},
		{"allowed_override_modes", "envoy.yaml", "request_body_mode: NONE\n                request_trailer_mode: SKIP", "request_body_mode: NONE\n                request_trailer_mode: DEFAULT", "",
			bootstrapListener, bootstrapFilter + ".allowed_override_modes[0]", "request_trailer_mode is DEFAULT, want SKIP"},
		{"response_trailer_mode DEFAULT", "envoy.yaml", "response_body_mode: BUFFERED\n                response_trailer_mode: SKIP", "response_body_mode: BUFFERED\n                response_trailer_mode: DEFAULT", "",
			bootstrapListener, bootstrapFilter + ".processing_mode.response_trailer_mode", "which Envoy reads as SKIP"},
		{"request headers skipped", "envoy.yaml", "processing_mode:\n                request_header_mode: SEND", "processing_mode:\n                request_header_mode: SKIP", "",
			bootstrapListener, bootstrapFilter + ".processing_mode.request_header_mode", "covered requests would run unprotected"},
		{"response headers skipped", "envoy.yaml", "request_trailer_mode: SEND\n                response_header_mode: SEND", "request_trailer_mode: SEND\n                response_header_mode: SKIP", "",
			bootstrapListener, bootstrapFilter + ".processing_mode.response_header_mode", "the outcome unknown"},
		{"request body GRPC", "envoy.yaml", "request_body_mode: BUFFERED\n                # SEND", "request_body_mode: GRPC\n                # SEND", "",
			bootstrapListener, bootstrapFilter + ".processing_mode.request_body_mode", "is GRPC"},
		{"processing_request_modifier", "envoy.yaml", "route_cache_action: RETAIN",
			"route_cache_action: RETAIN\n              processing_request_modifier: { name: m, typed_config: { \"@type\": type.googleapis.com/google.protobuf.Struct, value: {} } }", "",
			bootstrapListener, bootstrapFilter + ".processing_request_modifier", "may rename"},
		{"mutation_rules disallow_is_error", "envoy.yaml", "route_cache_action: RETAIN", "route_cache_action: RETAIN\n              mutation_rules: { disallow_is_error: true }", "",
			bootstrapListener, bootstrapFilter + ".mutation_rules.disallow_is_error", "500 after the upstream ran"},
		{"outcome namespace not received", "envoy.yaml", "untyped: [idempotency]", "untyped: []", "",
			bootstrapListener, bootstrapFilter + ".metadata_options.receiving_namespaces.untyped", `lacks "idempotency"`},
		{"no peer identity while the policy scopes by it", "envoy.yaml", `, "connection.uri_san_peer_certificate"]`, `]`,
			"defaults:\n  scope: [peer_identity]\nroutes:\n  - name: refunds\n    match: { path_prefix: /v1/refunds }\n",
			bootstrapListener, bootstrapFilter + ".request_attributes", "every mTLS peer would share one scope"},
		{"per-route request headers skipped", "envoy.yaml", refundsMeta,
			refundsMeta + "                      processing_mode: { request_header_mode: SKIP, request_body_mode: BUFFERED, request_trailer_mode: SEND, response_header_mode: SEND, response_body_mode: BUFFERED, response_trailer_mode: SKIP }\n", "",
			bootstrapListener, bootstrapRoutes + "[2].typed_per_filter_config[envoy.filters.http.ext_proc].overrides.processing_mode.request_header_mode", "disabled: true"},
		{"per-route FULL_DUPLEX_STREAMED without trailers", "envoy.yaml", refundsMeta,
			refundsMeta + "                      processing_mode: { request_header_mode: SEND, request_body_mode: FULL_DUPLEX_STREAMED, request_trailer_mode: SKIP, response_header_mode: SEND, response_body_mode: BUFFERED, response_trailer_mode: SKIP }\n", "",
			bootstrapListener, bootstrapRoutes + "[2].typed_per_filter_config[envoy.filters.http.ext_proc].overrides.processing_mode.request_trailer_mode", "FULL_DUPLEX_STREAMED needs SEND"},
		{"per-route metadata_options", "envoy.yaml", refundsMeta,
			refundsMeta + "                      metadata_options: { forwarding_namespaces: { untyped: [envoy.filters.http.jwt_authn] } }\n", "",
			bootstrapListener, bootstrapRoutes + "[2].typed_per_filter_config[envoy.filters.http.ext_proc].overrides.metadata_options.receiving_namespaces.untyped", `lacks "idempotency"`},
		{"virtual host retries", "envoy.yaml", "              domains: [\"*\"]\n", "              domains: [\"*\"]\n              retry_policy: { retry_on: gateway-error }\n", "",
			bootstrapListener, "filter_chains[0].filters[0].typed_config.route_config.virtual_hosts[0].retry_policy.retry_on", `has "gateway-error"`},

		// Istio.
		{"VirtualService retries", "istio-envoyfilter.yaml", vsTransfers, vsTransfers + "    retries: { attempts: 3, retryOn: \"connect-failure,5xx\" }\n", "",
			"VirtualService payments/payments-api", "http[0].retries.retryOn", `has "5xx"`},
		{"Istio allow_mode_override false", "istio-envoyfilter.yaml", "allow_mode_override: true", "allow_mode_override: false", "",
			istioResource, istioFilterPath + ".allow_mode_override", "is false"},
		{"Istio request body NONE", "istio-envoyfilter.yaml", "request_body_mode: BUFFERED", "request_body_mode: NONE", "",
			istioResource, istioFilterPath + ".processing_mode.request_body_mode", "body-not-available"},
		{"Istio request trailers SKIP", "istio-envoyfilter.yaml", "request_trailer_mode: SEND", "request_trailer_mode: SKIP", "",
			istioResource, istioFilterPath + ".processing_mode.request_trailer_mode", "may run twice"},
		{"Istio forward_rules", "istio-envoyfilter.yaml", "route_cache_action: RETAIN",
			"route_cache_action: RETAIN\n          forward_rules: { allowed_headers: { patterns: [{ prefix: \":\" }] } }", "",
			istioResource, istioFilterPath + ".forward_rules.allowed_headers", "idempotency-key"},
		{"Istio mutation_rules", "istio-envoyfilter.yaml", "route_cache_action: RETAIN",
			"route_cache_action: RETAIN\n          mutation_rules: { disallow_all: true }", "",
			istioResource, istioFilterPath + ".mutation_rules.disallow_all", "x-idempotency-replayed"},
		{"Istio local_reply_config", "istio-envoyfilter.yaml", "          access_log:\n",
			"          local_reply_config: { mappers: [{ filter: { status_code_filter: { comparison: { op: EQ, value: { default_value: 409, runtime_key: k } } } }, status_code: 400 }] }\n          access_log:\n", "",
			istioResource, "configPatches[2].patch.value.typed_config.local_reply_config.mappers[0]", "local replies"},
		{"Istio failure_mode_allow", "istio-envoyfilter.yaml", "failure_mode_allow: false", "failure_mode_allow: true", "",
			istioResource, istioFilterPath + ".failure_mode_allow", "bypass"},
		{"Istio failure_mode_allow per route", "istio-envoyfilter.yaml", "        request_body_buffer_limit: 16777216",
			"        typed_per_filter_config:\n          envoy.filters.http.ext_proc:\n            \"@type\": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute\n            overrides: { failure_mode_allow: true }", "",
			istioResource, "configPatches[1].patch.value.typed_per_filter_config[envoy.filters.http.ext_proc].overrides.failure_mode_allow", "bypass"},
		{"Istio message_timeout", "istio-envoyfilter.yaml", "message_timeout: 0.5s", "message_timeout: 0.05s", "",
			istioResource, istioFilterPath + ".message_timeout", "50ms is not above store_timeout 100ms"},
		{"Istio response_attributes", "istio-envoyfilter.yaml", `, "upstream.request_attempt_count"]`, `]`, "",
			istioResource, istioFilterPath + ".response_attributes", "upstream.request_attempt_count"},
		{"Istio xds.route_name", "istio-envoyfilter.yaml", `"request.id", "xds.route_name"`, `"request.id"`, "",
			istioResource, istioFilterPath + ".request_attributes", "xds.route_name"},
		{"Istio jwt_authn payload", "istio-envoyfilter.yaml", "untyped: [envoy.filters.http.jwt_authn]", "untyped: [other]", "",
			istioResource, istioFilterPath + ".metadata_options.forwarding_namespaces.untyped", "JWT claims"},
		{"Istio response body NONE", "istio-envoyfilter.yaml", "response_body_mode: BUFFERED", "response_body_mode: NONE", "",
			istioResource, istioFilterPath + ".processing_mode.response_body_mode", "response-not-replayable"},
		{"Istio buffer limit", "istio-envoyfilter.yaml", "  # Large uploads on the documents route",
			"  - applyTo: CLUSTER\n    match: { context: GATEWAY }\n    patch: { operation: MERGE, value: { per_connection_buffer_limit_bytes: 32768 } }\n  # Large uploads on the documents route", "",
			istioResource, "configPatches[1].patch.value.per_connection_buffer_limit_bytes", "32768-byte upstream buffer"},

		{"Istio observability_mode", "istio-envoyfilter.yaml", "route_cache_action: RETAIN", "route_cache_action: RETAIN\n          observability_mode: true", "",
			istioResource, istioFilterPath + ".observability_mode", "ignores the processor's answers"},
		{"Istio allowed_override_modes", "istio-envoyfilter.yaml", "response_trailer_mode: SKIP\n          - request_header_mode", "response_trailer_mode: DEFAULT\n          - request_header_mode", "",
			istioResource, istioFilterPath + ".allowed_override_modes[0]", "response_trailer_mode is DEFAULT, want SKIP"},
		{"Istio outcome namespace", "istio-envoyfilter.yaml", "untyped: [idempotency]", "untyped: [other]", "",
			istioResource, istioFilterPath + ".metadata_options.receiving_namespaces.untyped", `lacks "idempotency"`},
		{"Istio mutation_rules disallow_is_error", "istio-envoyfilter.yaml", "route_cache_action: RETAIN", "route_cache_action: RETAIN\n          mutation_rules: { disallow_is_error: true }", "",
			istioResource, istioFilterPath + ".mutation_rules.disallow_is_error", "500 after the upstream ran"},
		{"Istio route naming no policy route", "istio-envoyfilter.yaml", "        request_body_buffer_limit: 16777216",
			"        typed_per_filter_config:\n          envoy.filters.http.ext_proc:\n            \"@type\": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute\n            overrides: { grpc_initial_metadata: [{ key: x-idempotency-route, value: nope }] }", "",
			istioResource, "configPatches[1].patch.value.typed_per_filter_config[envoy.filters.http.ext_proc].overrides.grpc_initial_metadata[0]", `"nope"`},

		// Envoy Gateway.
		{"BackendTrafficPolicy retries", "envoy-gateway.yaml", btpAt, "  retry:\n    retryOn: { triggers: [connect-failure, reset] }\n" + btpAt, "",
			"BackendTrafficPolicy payments/idempotency-buffers", "retry.retryOn", `has "reset"`},
		{"EG allowModeOverride false", "envoy-gateway.yaml", "allowModeOverride: true", "allowModeOverride: false", "",
			egTransfers, "extProc[0].processingMode.allowModeOverride", "is false"},
		{"EG request body unset", "envoy-gateway.yaml", "      request:\n        body: Buffered\n        # xds.route_name", "      request:\n        # xds.route_name", "",
			egTransfers, "extProc[0].processingMode.request.body", "is NONE"},
		{"EG failOpen", "envoy-gateway.yaml", "    failOpen: false", "    failOpen: true", "",
			egTransfers, "extProc[0].failOpen", "bypass idempotency"},
		{"EG messageTimeout", "envoy-gateway.yaml", "messageTimeout: 500ms", "messageTimeout: 100ms", "",
			egTransfers, "extProc[0].messageTimeout", "100ms is not above store_timeout 100ms"},
		{"EG response attributes", "envoy-gateway.yaml", `"response.code", "response.code_details", "response.flags"`, `"response.code", "response.flags"`, "",
			egTransfers, "extProc[0].processingMode.response.attributes", "response.code_details"},
		{"EG xds.route_name", "envoy-gateway.yaml", `"request.id", "xds.route_name"`, `"request.id"`, "",
			egTransfers, "extProc[0].processingMode.request.attributes", "xds.route_name"},
		{"EG jwt_authn payload", "envoy-gateway.yaml", "accessibleNamespaces: [envoy.filters.http.jwt_authn]  # the verified", "accessibleNamespaces: []  # the verified", "",
			egTransfers, "extProc[0].metadata.accessibleNamespaces", "JWT claims"},
		{"EG response body unset", "envoy-gateway.yaml", "        body: Buffered           # Streamed", "        # Streamed", "",
			egTransfers, "extProc[0].processingMode.response.body", "response-not-replayable"},
		{"EG shadowMode", "envoy-gateway.yaml", "    failOpen: false\n    processingMode:\n      allowModeOverride: true\n      request:\n        body: Buffered\n        # xds",
			"    failOpen: false\n    shadowMode: true\n    processingMode:\n      allowModeOverride: true\n      request:\n        body: Buffered\n        # xds", "",
			egTransfers, "extProc[0].shadowMode", "ignores the processor's answers"},
		{"EG outcome namespace", "envoy-gateway.yaml", "      writableNamespaces: [idempotency]                      # the outcome", "      writableNamespaces: [other]                      # the outcome", "",
			egTransfers, "extProc[0].metadata.writableNamespaces", `lacks "idempotency"`},
		{"EG no peer identity", "envoy-gateway.yaml", `"xds.route_name", "connection.uri_san_peer_certificate"]`, `"xds.route_name"]`,
			"defaults:\n  scope: [peer_identity]\n",
			egTransfers, "extProc[0].processingMode.request.attributes", "every mTLS peer would share one scope"},
		{"EG buffer limit", "envoy-gateway.yaml", "bufferLimit: 1Mi             # response", "bufferLimit: 64Ki             # response", "",
			"BackendTrafficPolicy payments/idempotency-buffers", "connection.bufferLimit", "65536-byte upstream buffer"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Settings that only cost something are warnings: the others are errors.
			severity := Error
			if costs[tc.name] {
				severity = Warning
			}
			text := mutate(t, readEnvoyFile(t, tc.file), tc.old, tc.new, 1)
			rep, err := Run(parsePolicy(t, tc.policy), []Input{{Name: "copy/" + tc.file, Data: []byte(text)}}, Options{})
			require.NoError(t, err)
			if severity == Warning {
				require.Zero(t, rep.Errors(), "%v", rep.Findings)
			}
			require.Contains(t, fieldsOf(rep, severity), tc.field, "%v", rep.Findings)
			if severity == Error {
				require.Equal(t, []string{tc.field}, fieldsOf(rep, Error), "exactly this field is refused: %v", rep.Findings)
			}
			for _, f := range rep.Findings {
				if f.File == "copy/"+tc.file {
					require.Positive(t, f.Line, "every finding about a file names its line: %v", f)
				}
				if f.Severity != severity || f.Field != tc.field {
					continue
				}
				require.Equal(t, tc.resource, f.Resource)
				require.Equal(t, "copy/"+tc.file, f.File)
				require.Contains(t, f.Problem, tc.problem)
				require.NotEmpty(t, f.Fix)
				require.Equal(t, severity, kindSeverity[f.Kind], "the kind decides the severity")
				requireAtField(t, text, f)
				require.True(t, strings.HasPrefix(f.String(), fmt.Sprintf("copy/%s:%d:%d: %s: %s: %s: ", tc.file, f.Line, f.Column, tc.resource, tc.field, severity)), f.String())
			}
		})
	}
}

// What cannot be read or parsed is an *InputError naming the file, and the line and field where
// the decoder knows them.
func TestRunInputErrors(t *testing.T) {
	envoyYAML := readEnvoyFile(t, "envoy.yaml")
	for _, tc := range []struct {
		name, text string
		line       int
		field      string
		want       string
	}{
		{"YAML syntax", "static_resources:\n  listeners: [\n", 2, "", "YAML: did not find expected node content"},
		{"JSON syntax", "{\n  \"static_resources\": {\n    \"listeners\": [\n  }\n}\n", 3, "", "YAML: did not find expected node content"},
		{"JSON on one line", "{\"static_resources\": {\"listeners\": [}", 0, "", "did not find expected node content"},
		{"unknown JSON field", "{\n  \"static_resources\": {\n    \"listenerz\": []\n  }\n}\n", 3, "static_resources.listenerz", `unknown field "listenerz"`},
		{"empty", "# nothing\n", 0, "", "empty"},
		{"unknown bootstrap field", mutate(t, envoyYAML, "route_cache_action: RETAIN", "route_cache_action: RETAIN\n              bogus_field: 1", 1),
			232, "static_resources.listeners[0].filter_chains[0].filters[0].typed_config.http_filters[1].typed_config.bogus_field", `unknown field "bogus_field"`},
		{"bad enum", mutate(t, envoyYAML, "route_cache_action: RETAIN", "route_cache_action: KEEP", 1),
			231, "static_resources.listeners[0].filter_chains[0].filters[0].typed_config.http_filters[1].typed_config.route_cache_action", "KEEP"},
		{"misspelt @type", mutate(t, envoyYAML, "ext_proc.v3.ExtProcPerRoute", "ext_proc.v3.ExtProcPerRoot", 1),
			70, "static_resources.listeners[0].filter_chains[0].filters[0].typed_config.route_config.virtual_hosts[0].routes[0].typed_per_filter_config[envoy.filters.http.ext_proc].@type", "ExtProcPerRoot"},
		{"an Any without its value", mutate(t, envoyYAML, "route_cache_action: RETAIN",
			"route_cache_action: RETAIN\n              processing_request_modifier: { name: m, typed_config: { \"@type\": type.googleapis.com/google.protobuf.Struct } }", 1),
			232, "static_resources.listeners[0].filter_chains[0].filters[0].typed_config.http_filters[1].typed_config.processing_request_modifier.typed_config", `missing "value" field`},
		{"Envoy's validation", mutate(t, envoyYAML, "message_timeout: 0.5s", "message_timeout: 4000s", 1), 229,
			"static_resources.listeners[0].filter_chains[0].filters[0].typed_config.http_filters[1].typed_config.message_timeout", "the bootstrap fails Envoy's validation"},
		{"a tab in the indentation", mutate(t, envoyYAML, "          stat_prefix:", "          \tstat_prefix:", 1), 42, "", "found a tab character"},
		{"a route without match", mutate(t, envoyYAML, "                match: { prefix: \"/\" }\n", "", 1), 105,
			"static_resources.listeners[0].filter_chains[0].filters[0].typed_config.route_config.virtual_hosts[0].routes[4].match", "invalid Route.Match: value is required"},
		{"two bootstraps", "admin: {}\n---\nadmin: {}\n", 3, "", "a second YAML document without kind"},
		{"an object without apiVersion", "kind: EnvoyFilter\nmetadata: {name: x}\n", 1, "", "needs apiVersion and kind"},
		{"unknown field in an EnvoyExtensionPolicy", mutate(t, readEnvoyFile(t, "envoy-gateway.yaml"), "failOpen: false", "failopen: false", 1),
			100, "spec.extProc[0].failopen", "EnvoyExtensionPolicy payments/idempotency-transfers: spec.extProc[0].failopen: field failopen not found"},
		{"an EnvoyFilter's filter fails Envoy's validation", mutate(t, readEnvoyFile(t, "istio-envoyfilter.yaml"), "message_timeout: 0.5s", "message_timeout: 4000s", 1),
			0, "configPatches[0].patch.value.typed_config", "EnvoyFilter istio-system/idempotency-extproc: configPatches[0].patch.value.typed_config: the filter fails Envoy's validation"},
		{"unknown field in an EnvoyFilter patch", mutate(t, readEnvoyFile(t, "istio-envoyfilter.yaml"), "route_cache_action: RETAIN", "route_cache_action: RETAIN\n          bogus: 1", 1),
			108, "spec.configPatches[0].patch.value.typed_config.bogus", `EnvoyFilter istio-system/idempotency-extproc: spec.configPatches[0].patch.value.typed_config.bogus: unknown field "bogus"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Run(shippedPolicy(t), []Input{{Name: "bad.yaml", Data: []byte(tc.text)}}, Options{})
			var ie *fileError
			require.True(t, errors.As(err, &ie), "%v", err)
			require.Equal(t, "bad.yaml", ie.File)
			require.Equal(t, tc.line, ie.Line, "%v", err)
			require.Equal(t, tc.field, ie.Field, "%v", err)
			require.ErrorContains(t, err, tc.want)
			place := "bad.yaml: "
			switch {
			case tc.line > 0 && strings.HasPrefix(tc.want, "YAML: did not"):
				// The YAML decoder's syntax errors say the line only.
				place = fmt.Sprintf("bad.yaml:%d: ", tc.line)
			case tc.line > 0:
				place = fmt.Sprintf("bad.yaml:%d:%d: ", tc.line, ie.Column)
				require.Positive(t, ie.Column, "%v", err)
			}
			require.True(t, strings.HasPrefix(err.Error(), place), err.Error())
		})
	}
	_, err := Run(shippedPolicy(t), shippedInputs(t, "envoy.yaml"), Options{EnvoyVersion: "one.thirty"})
	require.ErrorContains(t, err, `--envoy-version: "one.thirty" is not an Envoy version`)
}

// Kubernetes input as kubectl and helm print it: one file of many documents, a List, objects
// split over several inputs, fields an API server adds; other kinds are skipped and named.
func TestRunKubernetesInputs(t *testing.T) {
	eg := readEnvoyFile(t, "envoy-gateway.yaml")
	docs := strings.Split(eg, "\n---\n")
	require.Len(t, docs, 7)
	indent := func(doc string) string {
		var b strings.Builder
		for i, line := range strings.Split(strings.TrimSpace(doc), "\n") {
			if i == 0 {
				b.WriteString("- " + line + "\n")
			} else {
				b.WriteString("  " + line + "\n")
			}
		}
		return b.String()
	}
	var list strings.Builder
	list.WriteString("apiVersion: v1\nkind: List\nitems:\n")
	for _, d := range docs {
		list.WriteString(indent(d))
	}
	withStatus := strings.Replace(docs[1], "  namespace: payments\n", "  namespace: payments\n  uid: 5d1c\n  resourceVersion: \"42\"\n", 1) +
		"\nstatus:\n  ancestors: []\n"

	for _, tc := range []struct {
		name   string
		inputs []Input
	}{
		{"one file", []Input{{Name: "eg.yaml", Data: []byte(eg)}}},
		{"a List", []Input{{Name: "list.yaml", Data: []byte(list.String())}}},
		{"one object per input, with server fields", []Input{
			{Name: "route.yaml", Data: []byte(docs[0])}, {Name: "policy.yaml", Data: []byte(withStatus)},
			{Name: "rest.yaml", Data: []byte(strings.Join(docs[2:], "\n---\n"))},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep, err := Run(shippedPolicy(t), tc.inputs, Options{})
			require.NoError(t, err)
			require.Zero(t, rep.Errors(), "%v", rep.Findings)
			require.Len(t, rep.Findings, 2, "the request trailer warning of each policy")
			require.Empty(t, rep.Skipped, "every kind of envoy-gateway.yaml is read")
		})
	}

	// A BackendTrafficPolicy in one input retries the routes an EnvoyExtensionPolicy of another
	// attaches to.
	retrying := strings.Replace(docs[5], "  connection:", "  retry:\n    retryOn: { triggers: [reset] }\n  connection:", 1)
	rep, err := Run(shippedPolicy(t), []Input{{Name: "eg.yaml", Data: []byte(strings.Join(docs[:5], "\n---\n"))}, {Name: "btp.yaml", Data: []byte(retrying)}}, Options{})
	require.NoError(t, err)
	require.Equal(t, []string{"retry.retryOn"}, fieldsOf(rep, Error))
	require.Equal(t, "btp.yaml", rep.Findings[0].File)
}

// Objects read from several files together: an error names the file of the object it is about,
// whichever file holds the EnvoyExtensionPolicy.
func TestRunNamesTheFileOfTheBadObject(t *testing.T) {
	docs := strings.Split(readEnvoyFile(t, "envoy-gateway.yaml"), "\n---\n")
	require.Len(t, docs, 7)
	copyOf := strings.Replace(docs[1], "name: idempotency-transfers", "name: idempotency-copy", 1)
	for _, tc := range []struct {
		name    string
		doc     int // the document changed
		changed string
		file    string // the file the error names
		want    string
	}{
		{"an HTTPRoute that cannot be read", 0, strings.Replace(docs[0], "  rules:\n", "  rules: 7\n  old_rules:\n", 1),
			"0.yaml", "HTTPRoute payments/payments-api"},
		{"a bad bufferLimit", 5, strings.Replace(docs[5], "bufferLimit: 1Mi", "bufferLimit: lots", 1),
			"5.yaml", "BackendTrafficPolicy payments/idempotency-buffers: spec.connection.bufferLimit"},
		{"a SecurityPolicy that cannot be read", 3, strings.Replace(docs[3], "  jwt:\n", "  jwt: 7\n  old_jwt:\n", 1),
			"3.yaml", "SecurityPolicy payments/payments-jwt"},
		{"a second policy on a rule", 7, copyOf,
			"7.yaml", "EnvoyExtensionPolicy payments/idempotency-transfers and payments/idempotency-copy both target rule"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var inputs []Input
			for i, d := range append(slices.Clone(docs), "") {
				if i == tc.doc {
					d = tc.changed
				}
				if d != "" {
					inputs = append(inputs, Input{Name: strconv.Itoa(i) + ".yaml", Data: []byte(d)})
				}
			}
			_, err := Run(shippedPolicy(t), inputs, Options{})
			var ie *fileError
			require.True(t, errors.As(err, &ie), "%v", err)
			require.Equal(t, tc.file, ie.File, "%v", err)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// The chart's resources come without the application's HTTPRoutes, Gateways or EnvoyProxy: the
// filter is still checked, and a BackendTrafficPolicy targeting the same HTTPRoute applies.
func TestRunEnvoyGatewayWithoutItsRoutes(t *testing.T) {
	docs := strings.Split(readEnvoyFile(t, "envoy-gateway.yaml"), "\n---\n")
	rep, err := Run(shippedPolicy(t), []Input{{Name: "eg.yaml", Data: []byte(strings.Join(docs[1:3], "\n---\n"))}}, Options{})
	require.NoError(t, err)
	require.Equal(t, []string{"extProc[0].processingMode.response.body"}, fieldsOf(rep, Error),
		"without a BackendTrafficPolicy, Envoy Gateway's 32 KiB buffer holds no 1 MiB response")
	require.Contains(t, rep.Findings[0].Problem, "32768-byte upstream buffer")
	require.Contains(t, rep.Findings[0].Fix, "BackendTrafficPolicy connection.bufferLimit")

	rep, err = Run(shippedPolicy(t), []Input{{Name: "eg.yaml", Data: []byte(strings.Join(append(docs[1:3:3], docs[5]), "\n---\n"))}}, Options{})
	require.NoError(t, err)
	require.Zero(t, rep.Errors(), "%v", rep.Findings)
}

// The inputs must hold the filter somewhere.
func TestRunNoExtProc(t *testing.T) {
	orig := readEnvoyFile(t, "envoy.yaml")
	start := strings.Index(orig, "          - name: envoy.filters.http.ext_proc\n")
	end := strings.Index(orig, "          - name: envoy.filters.http.router\n")
	require.True(t, start > 0 && end > start)
	rep, err := Run(shippedPolicy(t), []Input{
		{Name: "envoy.yaml", Data: []byte(orig[:start] + orig[end:])},
		{Name: "svc.yaml", Data: []byte("apiVersion: v1\nkind: Service\nmetadata: {name: s}\n")},
	}, Options{})
	require.NoError(t, err)
	require.Equal(t, 1, rep.Errors())
	require.Equal(t, "envoy.yaml, svc.yaml", rep.Findings[0].File)
	require.Contains(t, rep.Findings[0].Problem, "no ext_proc filter found")
	require.Equal(t, []string{"Service s (svc.yaml)"}, rep.Skipped)
}

// --envoy-version adds the known defects of that version as warnings, after the errors.
func TestRunEnvoyVersion(t *testing.T) {
	for _, tc := range []struct {
		version string
		want    []string // the warnings' problems, a prefix each
	}{
		{"1.38", []string{"before 1.39 Envoy ignores failure_mode_allow: false", "before 1.39 Envoy mishandles unexpected ProcessingResponses"}},
		{"v1.37.2", []string{"before 1.39 Envoy ignores", "before 1.39 Envoy mishandles"}},
		{"1.39.0", []string{"1.39.0 lacks the lifetime fixes"}},
		{"1.39", []string{"1.39.0 lacks the lifetime fixes"}},
		{"1.39.1", nil},
		{"1.40", nil},
		{"", nil},
	} {
		t.Run(tc.version, func(t *testing.T) {
			rep, err := Run(shippedPolicy(t), shippedInputs(t, "envoy.yaml"), Options{EnvoyVersion: tc.version})
			require.NoError(t, err)
			require.Zero(t, rep.Errors())
			var got []string
			for _, f := range rep.Findings {
				require.Equal(t, Warning, f.Severity)
				require.Equal(t, "--envoy-version", f.File)
				got = append(got, f.Problem)
			}
			require.Len(t, got, len(tc.want))
			for i, w := range tc.want {
				require.True(t, strings.HasPrefix(got[i], w), got[i])
			}
		})
	}
	// Errors come first.
	broken := mutate(t, readEnvoyFile(t, "envoy.yaml"), "failure_mode_allow: false", "failure_mode_allow: true", 1)
	rep, err := Run(shippedPolicy(t), []Input{{Name: "e.yaml", Data: []byte(broken)}}, Options{EnvoyVersion: "1.38"})
	require.NoError(t, err)
	require.Equal(t, []Severity{Error, Warning, Warning}, []Severity{rep.Findings[0].Severity, rep.Findings[1].Severity, rep.Findings[2].Severity})
}

// A policy that scopes by jwt_claim needs the payload written where its routes read it: in a
// bootstrap, which shows its jwt_authn filter, by a filter before ext_proc whose providers write
// it; with Envoy Gateway under a SecurityPolicy provider's name; with Istio under "payload".
func TestRunJWTPayloads(t *testing.T) {
	const (
		httpFilters = "filter_chains[0].filters[0].typed_config.http_filters"
		providers   = httpFilters + "[envoy.filters.http.jwt_authn].typed_config.providers"
		keyed       = "routes:\n  - name: refunds\n    match: { path_prefix: /v1/refunds }\n    scope: [{ jwt_claim: sub }]\n    jwt_payload_key: "
		noClaims    = "routes:\n  - name: refunds\n    match: { path_prefix: /v1/refunds }\n"
	)
	envoyYAML := readEnvoyFile(t, "envoy.yaml")
	jwtFilter := envoyYAML[strings.Index(envoyYAML, "          - name: envoy.filters.http.jwt_authn\n"):strings.Index(envoyYAML, "          - name: envoy.filters.http.ext_proc\n")]
	after := mutate(t, mutate(t, envoyYAML, jwtFilter, "", 1), "          - name: envoy.filters.http.router\n", jwtFilter+"          - name: envoy.filters.http.router\n", 1)
	for _, tc := range []struct {
		name, policy, text string
		field, problem     string // the error; "" for none
	}{
		{"the shipped files", "", envoyYAML, "", ""},
		{"jwt_authn after ext_proc", "", after, httpFilters, `has no jwt_authn filter before ext_proc, while route "transfers" scopes by jwt_claim`},
		{"no jwt_authn at all", "", mutate(t, envoyYAML, jwtFilter, "", 1), httpFilters, "has no jwt_authn filter before ext_proc"},
		{"no payload_in_metadata", "", mutate(t, envoyYAML, "payload_in_metadata: demo", "forward_payload_header: x-jwt", 1),
			providers, "writes no verified payload to dynamic metadata"},
		{"a jwt_payload_key no provider writes", keyed + "other\n", envoyYAML,
			providers, `has no provider writing payload_in_metadata "other", the jwt_payload_key of route "refunds"`},
		{"a jwt_payload_key a provider writes", keyed + "demo\n", envoyYAML, "", ""},
		{"a policy without claims needs no jwt_authn", noClaims, mutate(t, envoyYAML, jwtFilter, "", 1), "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep, err := Run(parsePolicy(t, tc.policy), []Input{{Name: "envoy.yaml", Data: []byte(tc.text)}}, Options{})
			require.NoError(t, err)
			if tc.field == "" {
				require.Zero(t, rep.Errors(), "%v", rep.Findings)
				return
			}
			require.Equal(t, []string{tc.field}, fieldsOf(rep, Error), "%v", rep.Findings)
			require.Contains(t, rep.Findings[0].Problem, tc.problem)
		})
	}
	for _, tc := range []struct {
		name, key, file string
		severity        Severity // of the finding on field; "" for none
		resource, field string
	}{
		{"Envoy Gateway, a key naming no provider", "other", "envoy-gateway.yaml", Error, "SecurityPolicy payments/payments-jwt", "jwt.providers"},
		{"Envoy Gateway, the provider's name", "demo", "envoy-gateway.yaml", "", "", ""},
		{"Istio, another key", "demo", "istio-envoyfilter.yaml", Warning, istioResource, istioFilterPath + ".metadata_options.forwarding_namespaces"},
		{"Istio, its key", "payload", "istio-envoyfilter.yaml", "", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep, err := Run(parsePolicy(t, keyed+tc.key+"\n"), []Input{{Name: tc.file, Data: []byte(readEnvoyFile(t, tc.file))}}, Options{})
			require.NoError(t, err)
			i := slices.IndexFunc(rep.Findings, func(f Finding) bool { return strings.Contains(f.Problem, "jwt_payload_key") })
			if tc.severity == "" {
				require.Equal(t, -1, i, "%v", rep.Findings)
				return
			}
			require.GreaterOrEqual(t, i, 0, "%v", rep.Findings)
			f := rep.Findings[i]
			require.Equal(t, tc.severity, f.Severity)
			require.Equal(t, tc.resource, f.Resource)
			require.Equal(t, tc.field, f.Field)
			require.Contains(t, f.Problem, `route "refunds"`)
		})
	}

	// Moved after ext_proc, jwt_authn is also a filter replays skip.
	rep, err := Run(shippedPolicy(t), []Input{{Name: "envoy.yaml", Data: []byte(after)}}, Options{})
	require.NoError(t, err)
	require.Equal(t, []string{httpFilters + "[envoy.filters.http.jwt_authn]"}, fieldsOf(rep, Warning))
	i := slices.IndexFunc(rep.Findings, func(f Finding) bool { return f.Severity == Warning })
	require.Contains(t, rep.Findings[i].Problem, "replays and 409s skip JWT verification")
}

// Warnings: what works, at a cost.
func TestRunWarnings(t *testing.T) {
	envoyYAML := readEnvoyFile(t, "envoy.yaml")
	for _, tc := range []struct {
		name, file, text string
		resource, field  string
		problem          string
	}{
		{"an RBAC filter after ext_proc, of a type check does not link", "envoy.yaml",
			mutate(t, envoyYAML, "          - name: envoy.filters.http.router\n",
				"          - name: envoy.filters.http.rbac\n            typed_config:\n              \"@type\": type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC\n              rules: { action: ALLOW }\n          - name: envoy.filters.http.router\n", 1),
			bootstrapListener, "filter_chains[0].filters[0].typed_config.http_filters[envoy.filters.http.rbac]", "skip authorization (RBAC)"},
		{"Envoy's circuit breakers", "envoy.yaml", mutate(t, envoyYAML, "max_requests: 100000", "max_requests: 1024", 1),
			`cluster "idempotency_extproc"`, "circuit_breakers.thresholds", "allow max_requests 1024"},
		{"Envoy Gateway's circuit breakers", "envoy-gateway.yaml", mutate(t, readEnvoyFile(t, "envoy-gateway.yaml"), "      circuitBreaker:\n        maxConnections: 100000\n        maxPendingRequests: 100000\n        maxParallelRequests: 100000\n", "", 1),
			egTransfers, "extProc[0].backendSettings.circuitBreaker (unset)", "max_connections 1024, max_pending_requests 1024, max_requests 1024"},
		{"Istio's DestinationRule", "istio-envoyfilter.yaml", mutate(t, readEnvoyFile(t, "istio-envoyfilter.yaml"), "http2MaxRequests: 100000", "http2MaxRequests: 1000", 1),
			"DestinationRule idempotency/idempotency-extproc", "trafficPolicy.connectionPool", "max_requests 1000"},
		{"an EnvoyProxy leaving ext_proc before RBAC", "envoy-gateway.yaml", mutate(t, readEnvoyFile(t, "envoy-gateway.yaml"),
			"  - name: envoy.filters.http.ext_proc\n    after: envoy.filters.http.local_ratelimit\n  - name: envoy.filters.http.ext_proc\n    after: envoy.filters.http.ratelimit\n", "", 1),
			"EnvoyProxy payments/idempotency-filter-order", "filterOrder", "before envoy.filters.http.local_ratelimit, envoy.filters.http.ratelimit"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep, err := Run(shippedPolicy(t), []Input{{Name: tc.file, Data: []byte(tc.text)}}, Options{})
			require.NoError(t, err)
			require.Zero(t, rep.Errors(), "%v", rep.Findings)
			i := slices.IndexFunc(rep.Findings, func(f Finding) bool { return f.Field == tc.field })
			require.GreaterOrEqual(t, i, 0, "no warning on %s: %v", tc.field, rep.Findings)
			f := rep.Findings[i]
			require.Equal(t, Warning, f.Severity)
			require.Equal(t, tc.resource, f.Resource)
			require.Contains(t, f.Problem, tc.problem)
			requireAtField(t, tc.text, f)
		})
	}
}

// A filter disabled by default (http filter disabled: true) runs only on the routes that enable
// it: a retry on another route cannot run a claimed request twice.
func TestRunFilterDisabledByDefault(t *testing.T) {
	text := mutate(t, readEnvoyFile(t, "envoy.yaml"), "          - name: envoy.filters.http.ext_proc\n",
		"          - name: envoy.filters.http.ext_proc\n            disabled: true\n", 1)
	text = mutate(t, text, "                match: { prefix: \"/\" }\n                route: { cluster: upstream_app, timeout: 30s }\n",
		"                match: { prefix: \"/\" }\n                route: { cluster: upstream_app, timeout: 30s, retry_policy: { retry_on: 5xx } }\n", 1)
	rep, err := Run(shippedPolicy(t), []Input{{Name: "e.yaml", Data: []byte(text)}}, Options{})
	require.NoError(t, err)
	// The default route does not run the filter, so its retry is no error; neither does the
	// transfers route, so the policy route that matches its name protects nothing.
	require.Equal(t, []string{"routes[0].match"}, fieldsOf(rep, Error), "%v", rep.Findings)
	require.Equal(t, kindRouteNameMatchesNothing, rep.Findings[0].Kind)

	// Enabled on the virtual host, the filter runs on documents again.
	enabled := mutate(t, text, "              domains: [\"*\"]\n",
		"              domains: [\"*\"]\n              typed_per_filter_config:\n                envoy.filters.http.ext_proc:\n                  \"@type\": type.googleapis.com/envoy.config.route.v3.FilterConfig\n", 1)
	rep, err = Run(shippedPolicy(t), []Input{{Name: "e.yaml", Data: []byte(enabled)}}, Options{})
	require.NoError(t, err)
	require.Equal(t, []string{bootstrapRoutes + "[4].route.retry_policy.retry_on"}, fieldsOf(rep, Error))
}

// A bootstrap whose routes come from RDS is checked at filter level, with a warning.
func TestRunRDS(t *testing.T) {
	orig := readEnvoyFile(t, "envoy.yaml")
	start := strings.Index(orig, "          route_config:\n")
	end := strings.Index(orig, "          http_filters:\n")
	require.True(t, start > 0 && end > start)
	text := orig[:start] + "          rds: { route_config_name: local_route, config_source: { ads: {} } }\n" + orig[end:]
	rep, err := Run(shippedPolicy(t), []Input{{Name: "e.yaml", Data: []byte(text)}}, Options{})
	require.NoError(t, err)
	require.Zero(t, rep.Errors(), "%v", rep.Findings)
	require.Len(t, rep.Findings, 1)
	require.Contains(t, rep.Findings[0].Problem, "routes come from RDS (local_route)")
}

// Aliases and merge keys that name one mapping many times (a billion laughs) cost what the
// document's size does: each reader looks at a node once, and the YAML decoder refuses
// excessive aliasing.
func TestRunAliasBombs(t *testing.T) {
	var b strings.Builder
	b.WriteString("a0: &a0 {x: 1}\n")
	for i := 1; i < 16; i++ {
		fmt.Fprintf(&b, "a%d: &a%d {<<: [%s]}\n", i, i, strings.TrimSuffix(strings.Repeat(fmt.Sprintf("*a%d, ", i-1), 8), ", "))
	}
	bomb := b.String()
	for _, text := range []string{
		bomb + "<<: *a15\n",
		bomb + "kind: Service\napiVersion: v1\nmetadata: {name: s}\n",
		bomb + "apiVersion: gateway.envoyproxy.io/v1alpha1\nkind: EnvoyExtensionPolicy\nmetadata: {name: x}\nspec: {extProc: [*a15]}\n",
	} {
		type result struct {
			rep Report
			err error
		}
		done := make(chan result, 1)
		go func() {
			rep, err := Run(shippedPolicy(t), []Input{{Name: "bomb.yaml", Data: []byte(text)}}, Options{})
			done <- result{rep, err}
		}()
		select {
		case r := <-done:
			requireWellFormed(t, r.rep, r.err)
			if r.err == nil {
				require.Equal(t, 1, r.rep.Errors(), "no ext_proc filter: %v", r.rep.Findings)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("the readers expand the aliases")
		}
	}
}

// The filter-level modes CheckSpec refuses without a policy pass where the policy needs no
// body: routes whose fingerprint omits it are claimed at request_headers, and a route that
// stores no body needs no response body.
func TestRunModesThePolicyAllows(t *testing.T) {
	const noBodies = "defaults:\n  fingerprint: [method, path]\n  store_body: false\n  scope_headers: [authorization]\n"
	text := mutate(t, readEnvoyFile(t, "envoy.yaml"), "request_body_mode: BUFFERED\n                # SEND", "request_body_mode: NONE\n                # SEND", 1)
	text = mutate(t, text, "request_trailer_mode: SEND\n                response_header_mode", "request_trailer_mode: SKIP\n                response_header_mode", 1)
	text = mutate(t, text, "response_body_mode: BUFFERED\n                response_trailer_mode: SKIP", "response_body_mode: NONE\n                response_trailer_mode: SKIP", 1)
	text = mutate(t, text, "value: refunds }", "value: default }", 1)
	for _, tc := range []struct {
		name, policy string
		errors       []string
	}{
		{"a policy that needs no body", noBodies, nil},
		{"a policy that reads request bodies", strings.Replace(noBodies, "fingerprint: [method, path]", "fingerprint: [method, path, body]", 1), []string{
			bootstrapFilter + ".processing_mode.request_body_mode", bootstrapFilter + ".processing_mode.request_trailer_mode"}},
		{"a policy that stores response bodies", strings.Replace(noBodies, "store_body: false", "store_body: true", 1), []string{
			bootstrapFilter + ".processing_mode.response_body_mode"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep, err := Run(parsePolicy(t, tc.policy), []Input{{Name: "e.yaml", Data: []byte(text)}}, Options{})
			require.NoError(t, err)
			require.Equal(t, tc.errors, fieldsOf(rep, Error), "%v", rep.Findings)
		})
	}
}

// requireAtField holds that f's line and column point, in text, at a step of its field path:
// the field's key, or the key or item it would go under when it is missing.
func requireAtField(t *testing.T, text string, f Finding) {
	t.Helper()
	require.Positive(t, f.Line, "%v", f)
	require.Positive(t, f.Column, "%v", f)
	lines := strings.Split(text, "\n")
	require.LessOrEqual(t, f.Line, len(lines), "%v", f)
	line := lines[f.Line-1]
	require.LessOrEqual(t, f.Column, len(line), "%v", f)
	at := line[f.Column-1:]
	steps, _ := fieldSteps(f.Field)
	for _, s := range steps {
		var names []string
		switch k := s.(type) {
		case string:
			names = []string{k, lowerCamel(k)}
		case nameStep:
			names = []string{"name", string(k)}
		default: // an item: a flow mapping, or a block mapping's first key
			if at != "" && (at[0] == '{' || at[0] == '[' || at[0] == '"' || at[0] == '_' || 'a' <= at[0] && at[0] <= 'z' || 'A' <= at[0] && at[0] <= 'Z') {
				return
			}
		}
		for _, n := range names {
			if strings.HasPrefix(at, n) {
				return
			}
		}
	}
	require.Failf(t, "the line and column point at none of the field's steps", "%s at %d:%d: %q", f.Field, f.Line, f.Column, at)
}
