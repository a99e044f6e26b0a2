package check

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"

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

// The attributes every shipped configuration requests: what the processor reads.
var (
	shippedRequestAttributes  = []string{"request.id", "xds.route_name", "connection.uri_san_peer_certificate"}
	shippedResponseAttributes = []string{"response.code", "response.code_details", "response.flags", "upstream.request_attempt_count"}
)

// shippedMode is the processing_mode every shipped configuration spells out, as docs/deploying.md
// documents it: CheckSpec also accepts a STREAMED response body.
var shippedMode = &filterextproc.ProcessingMode{
	RequestHeaderMode:   filterextproc.ProcessingMode_SEND,
	RequestBodyMode:     filterextproc.ProcessingMode_BUFFERED,
	RequestTrailerMode:  filterextproc.ProcessingMode_SEND,
	ResponseHeaderMode:  filterextproc.ProcessingMode_SEND,
	ResponseBodyMode:    filterextproc.ProcessingMode_BUFFERED,
	ResponseTrailerMode: filterextproc.ProcessingMode_SKIP,
}

// typedConfigs returns the message inside every google.protobuf.Any of m, recursively.
func typedConfigs(t testing.TB, m proto.Message) []proto.Message {
	var out []proto.Message
	walkAnys(m.ProtoReflect(), "", func(a *anypb.Any, path string) {
		inner, err := a.UnmarshalNew()
		require.NoError(t, err, path)
		out = append(out, inner)
		out = append(out, typedConfigs(t, inner)...)
	})
	return out
}

// checkBootstrap is the whole verdict on a standalone bootstrap: it parses, every message
// (typed configs included) passes its validation rules, the ext_proc filter meets the contract
// (CheckSpec), nothing in it breaks protection under envoy/policy.yaml, the processor cluster's
// circuit breakers are far above Envoy's 1024, and the buffer limits hold a 1 MiB body. The
// shipped envoy.yaml must pass it; every broken variant must fail it.
func checkBootstrap(t testing.TB, yamlText string) error {
	t.Helper()
	b, err := Parse([]byte(yamlText))
	if err != nil {
		return err
	}
	if err := Validate(b); err != nil {
		return err
	}
	d, err := bootstrapDeployment(b, "envoy.yaml")
	if err != nil {
		return err
	}
	if err := errors.Join(CheckSpec(d.Filter, storeTimeout), CheckProtection(d, shippedPolicy(t))); err != nil {
		return err
	}
	th, listener, upstream, err := bootstrapLimits(b, d.Filter)
	if err != nil {
		return err
	}
	return checkLimits(th, listener, upstream)
}

// bootstrapLimits returns the processor cluster's thresholds and the listener's and the catch-all
// route's cluster's buffer limits, with Envoy's defaults.
func bootstrapLimits(b *bootstrapv3.Bootstrap, f *filterextproc.ExternalProcessor) (Thresholds, uint32, uint32, error) {
	name := f.GetGrpcService().GetEnvoyGrpc().GetClusterName()
	pc := staticCluster(b, name)
	if pc == nil {
		return Thresholds{}, 0, 0, fmt.Errorf("ext_proc cluster %q is not a static cluster", name)
	}
	up, err := checktest.CatchAllCluster(b)
	if err != nil {
		return Thresholds{}, 0, 0, err
	}
	uc := staticCluster(b, up)
	if uc == nil {
		return Thresholds{}, 0, 0, fmt.Errorf("upstream cluster %q is not a static cluster", up)
	}
	return ClusterThresholds(pc), BufferLimit(b.GetStaticResources().GetListeners()[0]), BufferLimit(uc), nil
}

// shippedPolicy is envoy/policy.yaml, the policy the shipped configurations are checked against.
func checkLimits(th Thresholds, listener, upstream uint32) error {
	var problems []string
	for name, v := range map[string]uint32{
		"max_connections": th.MaxConnections, "max_pending_requests": th.MaxPendingRequests,
		"max_requests": th.MaxRequests,
	} {
		if v <= 1024 {
			problems = append(problems, "processor circuit breaker "+name+" is not above 1024")
		}
	}
	if listener < 1<<20 {
		problems = append(problems, "listener buffer limit below 1 MiB")
	}
	if upstream < 1<<20 {
		problems = append(problems, "upstream buffer limit below 1 MiB")
	}
	if problems == nil {
		return nil
	}
	slices.Sort(problems)
	return &limitError{problems}
}

type limitError struct{ problems []string }

func (e *limitError) Error() string { return strings.Join(e.problems, "; ") }

func TestEnvoyYAMLMeetsSpec(t *testing.T) {
	b, err := load(envoyFile(t, "envoy.yaml"))
	require.NoError(t, err)

	require.NoError(t, b.ValidateAll(), "Bootstrap")
	configs := typedConfigs(t, b)
	var names []string
	for _, c := range configs {
		names = append(names, string(c.ProtoReflect().Descriptor().FullName()))
		v, ok := c.(interface{ ValidateAll() error })
		require.True(t, ok, "%T has no ValidateAll", c)
		require.NoError(t, v.ValidateAll(), "%T", c)
	}
	for _, want := range []string{
		"envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
		"envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
		"envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
		"envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
		"envoy.extensions.filters.http.jwt_authn.v3.PerRouteConfig",
		"envoy.extensions.filters.http.router.v3.Router",
		"envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
	} {
		require.Contains(t, names, want)
	}
	require.NoError(t, Validate(b))

	f, err := bootstrapExtProc(b)
	require.NoError(t, err)
	require.NoError(t, CheckSpec(f, storeTimeout))

	// Beyond CheckSpec: the shipped file spells out exactly what docs/deploying.md documents.
	require.True(t, proto.Equal(shippedMode, f.GetProcessingMode()), "processing_mode: %v", f.GetProcessingMode())
	require.Len(t, f.GetAllowedOverrideModes(), 2)
	require.True(t, proto.Equal(passThroughMode(), f.GetAllowedOverrideModes()[0]))
	require.True(t, proto.Equal(noStoreMode(), f.GetAllowedOverrideModes()[1]))
	require.Equal(t, shippedRequestAttributes, f.GetRequestAttributes())
	require.Equal(t, shippedResponseAttributes, f.GetResponseAttributes())
	require.Equal(t, []string{jwtNamespace}, f.GetMetadataOptions().GetForwardingNamespaces().GetUntyped())
	require.Equal(t, []string{defaultOutcomeNamespace}, f.GetMetadataOptions().GetReceivingNamespaces().GetUntyped())
	require.Equal(t, 500*time.Millisecond, f.GetMessageTimeout().AsDuration())
	require.Equal(t, filterextproc.ExternalProcessor_RETAIN, f.GetRouteCacheAction())
	require.False(t, f.GetFailureModeAllow())
	require.GreaterOrEqual(t, f.GetGrpcService().GetTimeout().AsDuration(), 30*time.Second,
		"the gRPC stream must outlive the route timeout")

	require.NoError(t, checkBootstrap(t, readEnvoyFile(t, "envoy.yaml")))
}

func TestParseRejects(t *testing.T) {
	_, err := Parse(nil)
	require.ErrorContains(t, err, "empty")
	_, err = Parse([]byte("admin: {}\n---\nadmin: {}\n"))
	require.ErrorContains(t, err, "more than one YAML document")
	_, err = Parse([]byte("admin: {address: [unclosed\n"))
	require.Error(t, err)
	_, err = load(filepath.Join(t.TempDir(), "missing.yaml"))
	require.ErrorIs(t, err, os.ErrNotExist)
}

// A broken envoy.yaml must fail this test.
func TestEnvoyYAMLBrokenVariantsFail(t *testing.T) {
	orig := readEnvoyFile(t, "envoy.yaml")
	for _, tc := range []struct {
		name, old, new string
		n              int
		want           string
	}{
		{"response body NONE", "response_body_mode: BUFFERED", "response_body_mode: NONE", 1,
			"processing_mode.response_body_mode is NONE, want BUFFERED, STREAMED or FULL_DUPLEX_STREAMED"},
		{"request body NONE", "request_body_mode: BUFFERED", "request_body_mode: NONE", 1,
			"processing_mode.request_body_mode is NONE, want BUFFERED, STREAMED, BUFFERED_PARTIAL or FULL_DUPLEX_STREAMED"},
		{"request body GRPC", "request_body_mode: BUFFERED", "request_body_mode: GRPC", 1,
			"processing_mode.request_body_mode is GRPC"},
		{"request headers skipped", "processing_mode:\n                request_header_mode: SEND",
			"processing_mode:\n                request_header_mode: SKIP", 1,
			"processing_mode.request_header_mode is SKIP, want SEND"},
		{"request trailers skipped", "request_trailer_mode: SEND\n                response_header_mode",
			"request_trailer_mode: SKIP\n                response_header_mode", 1,
			"processing_mode.request_trailer_mode is SKIP, want SEND (under SKIP a request with trailers and no body skips the body phase"},
		{"response trailer mode left DEFAULT", "response_body_mode: BUFFERED\n                response_trailer_mode: SKIP",
			"response_body_mode: BUFFERED\n                response_trailer_mode: DEFAULT", 1,
			"processing_mode.response_trailer_mode is DEFAULT, which Envoy reads as SKIP"},
		{"trailer mode left DEFAULT", "request_trailer_mode: SEND\n                response_header_mode", "request_trailer_mode: DEFAULT\n                response_header_mode", 1,
			"processing_mode.request_trailer_mode is DEFAULT, want SEND"},
		{"fail open", "failure_mode_allow: false", "failure_mode_allow: true", 1,
			"failure_mode_allow is true, want false"},
		{"no response.code_details", `"response.code", "response.code_details", "response.flags"`,
			`"response.code", "response.flags"`, 1, `response_attributes lacks "response.code_details"`},
		{"no attempt count", `, "upstream.request_attempt_count"]`, `]`, 1,
			`response_attributes lacks "upstream.request_attempt_count"`},
		{"outcome namespace not received", "untyped: [idempotency]", "untyped: []", 1,
			`http_filters[envoy.filters.http.ext_proc].typed_config.metadata_options.receiving_namespaces.untyped: lacks "idempotency"`},
		{"local reply rewritten", "          codec_type: AUTO\n", "          codec_type: AUTO\n          local_reply_config: { body_format: { text_format: \"%LOCAL_REPLY_BODY%\" } }\n", 1,
			"http_connection_manager.local_reply_config.body_format"},
		{"refunds names no policy route", "value: refunds }", "value: refund }", 1,
			`grpc_initial_metadata[0]: names policy route "refund", which the policy does not define`},
		{"refunds route failing open", "                      grpc_initial_metadata:\n",
			"                      failure_mode_allow: true\n                      grpc_initial_metadata:\n", 1,
			"route_config.virtual_hosts[0].routes[2].typed_per_filter_config[envoy.filters.http.ext_proc].overrides.failure_mode_allow"},
		{"jwt requirement unknown to jwt_authn", "requirement_name: demo", "requirement_name: \"\"", 1, "RequirementName"},
		{"no mode override", "allow_mode_override: true", "allow_mode_override: false", 1,
			"allow_mode_override is false"},
		{"message timeout below store timeout", "message_timeout: 0.5s", "message_timeout: 0.05s", 1,
			"message_timeout 50ms is not above store_timeout 100ms"},
		{"message timeout equal to store timeout", "message_timeout: 0.5s", "message_timeout: 0.1s", 1,
			"message_timeout 100ms is not above store_timeout 100ms"},
		{"message timeout over 1h breaks validation",
			"message_timeout: 0.5s", "message_timeout: 4000s", 1, "MessageTimeout"},
		{"override mode with DEFAULT where SKIP is required",
			"request_body_mode: NONE\n                request_trailer_mode: SKIP",
			"request_body_mode: NONE\n                request_trailer_mode: DEFAULT", 1,
			"allowed_override_modes[0] is not one of the processor's modes: request_trailer_mode is DEFAULT, want SKIP"},
		{"override mode with a body", "response_header_mode: SEND\n                response_body_mode: NONE",
			"response_header_mode: SEND\n                response_body_mode: BUFFERED", 1,
			"allowed_override_modes[1] is not one of the processor's modes: response_body_mode is BUFFERED, want NONE"},
		{"override mode missing", "response_header_mode: SEND\n                response_body_mode: NONE",
			"response_header_mode: SKIP\n                response_body_mode: NONE", 1,
			"allowed_override_modes lacks the no-store mode"},
		{"unknown field", "route_cache_action: RETAIN", "route_cache_action: RETAIN\n              bogus_field: 1", 1,
			"bogus_field"},
		{"misspelt enum", "route_cache_action: RETAIN", "route_cache_action: KEEP", 1, "KEEP"},
		{"bad @type", "ext_proc.v3.ExtProcPerRoute", "ext_proc.v3.ExtProcPerRoot", 1,
			"envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoot"},
		{"bad duration", "timeout: 30s", "timeout: 30 seconds", 1, "30 seconds"},
		{"default circuit breakers", "max_requests: 100000", "max_requests: 1024", 1,
			"processor circuit breaker max_requests is not above 1024"},
		{"small listener buffer", "per_connection_buffer_limit_bytes: 1048576", "per_connection_buffer_limit_bytes: 32768", 1,
			"listener buffer limit below 1 MiB"},
		{"small upstream buffer", "per_connection_buffer_limit_bytes: 1048576", "per_connection_buffer_limit_bytes: 32768", 2,
			"upstream buffer limit below 1 MiB"},
		{"processor cluster renamed", "cluster_name: idempotency_extproc\n                # There",
			"cluster_name: idempotency\n                # There", 1, `ext_proc cluster "idempotency" is not a static cluster`},
		{"no catch-all route", `prefix: "/" }`, `prefix: "/api" }`, 1, `no route with prefix "/"`},
		{"empty cluster name fails validation", "- name: upstream_app", "- name: \"\"", 1, "Name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := checkBootstrap(t, mutate(t, orig, tc.old, tc.new, tc.n))
			require.Error(t, err, "a broken config must fail this test")
			t.Log(err)
			require.ErrorContains(t, err, tc.want)
		})
	}

	t.Run("ext_proc filter removed", func(t *testing.T) {
		start := strings.Index(orig, "          - name: envoy.filters.http.ext_proc\n")
		end := strings.Index(orig, "          - name: envoy.filters.http.router\n")
		require.True(t, start > 0 && end > start, "filter blocks not found")
		err := checkBootstrap(t, orig[:start]+orig[end:])
		require.ErrorContains(t, err, "no ext_proc filter")
	})
}

// ValidateAll on a Bootstrap stops at every google.protobuf.Any; Validate goes inside.
func TestValidateEntersTypedConfigs(t *testing.T) {
	broken := mutate(t, readEnvoyFile(t, "envoy.yaml"), "message_timeout: 0.5s", "message_timeout: 4000s", 1)
	b, err := Parse([]byte(broken))
	require.NoError(t, err)
	require.NoError(t, b.ValidateAll(), "ValidateAll does not look inside typed_config")
	err = Validate(b)
	require.ErrorContains(t, err, "ExternalProcessor")
	require.ErrorContains(t, err, "MessageTimeout")
}

func TestCheckSpecRules(t *testing.T) {
	good := func() *filterextproc.ExternalProcessor {
		b, err := load(envoyFile(t, "envoy.yaml"))
		require.NoError(t, err)
		f, err := bootstrapExtProc(b)
		require.NoError(t, err)
		return f
	}
	require.ErrorContains(t, CheckSpec(nil, storeTimeout), "no ext_proc filter config")

	for _, tc := range []struct {
		name   string
		change func(f *filterextproc.ExternalProcessor)
		want   []string
	}{
		{"STREAMED responses are allowed", func(f *filterextproc.ExternalProcessor) {
			f.ProcessingMode.ResponseBodyMode = filterextproc.ProcessingMode_STREAMED
		}, nil},
		{"STREAMED responses with their trailers sent are allowed", func(f *filterextproc.ExternalProcessor) {
			f.ProcessingMode.ResponseBodyMode = filterextproc.ProcessingMode_STREAMED
			f.ProcessingMode.ResponseTrailerMode = filterextproc.ProcessingMode_SEND
		}, nil},
		{"empty allow-list is allowed", func(f *filterextproc.ExternalProcessor) {
			f.AllowedOverrideModes = nil
		}, nil},
		{"allow-list order does not matter", func(f *filterextproc.ExternalProcessor) {
			m := f.AllowedOverrideModes
			m[0], m[1] = m[1], m[0]
		}, nil},
		{"unset message_timeout is Envoy's 200ms", func(f *filterextproc.ExternalProcessor) {
			f.MessageTimeout = nil
		}, nil},
		{"no processing_mode", func(f *filterextproc.ExternalProcessor) {
			f.ProcessingMode = nil
		}, []string{"processing_mode is not set", "request_header_mode is DEFAULT, which Envoy reads as SEND", "request_body_mode is NONE"}},
		{"duplicate allow-list entry", func(f *filterextproc.ExternalProcessor) {
			f.AllowedOverrideModes = append(f.AllowedOverrideModes, passThroughMode())
		}, []string{"allowed_override_modes has 3 entries"}},
		{"only one allow-list entry", func(f *filterextproc.ExternalProcessor) {
			f.AllowedOverrideModes = f.AllowedOverrideModes[:1]
		}, []string{"allowed_override_modes lacks the no-store mode"}},
		{"http_service", func(f *filterextproc.ExternalProcessor) {
			f.GrpcService = nil
		}, []string{"grpc_service is not set"}},
		{"observability mode", func(f *filterextproc.ExternalProcessor) {
			f.ObservabilityMode = true
		}, []string{"observability_mode is true"}},
		{"immediate responses disabled", func(f *filterextproc.ExternalProcessor) {
			f.DisableImmediateResponse = true
		}, []string{"disable_immediate_response is true"}},
		{"body before header response", func(f *filterextproc.ExternalProcessor) {
			f.SendBodyWithoutWaitingForHeaderResponse = true
		}, []string{"send_body_without_waiting_for_header_response is true"}},
		{"every problem at once", func(f *filterextproc.ExternalProcessor) {
			f.FailureModeAllow = true
			f.AllowModeOverride = false
			f.ResponseAttributes = nil
		}, []string{"failure_mode_allow is true", "allow_mode_override is false", "response_attributes lacks"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := good()
			tc.change(f)
			err := CheckSpec(f, storeTimeout)
			if tc.want == nil {
				require.NoError(t, err)
				return
			}
			require.Error(t, err)
			for _, w := range tc.want {
				require.ErrorContains(t, err, w)
			}
		})
	}
}

// Envoy's defaults fail the contract: no modes spelled out, no attributes, 1024 streams.
func TestEnvoyDefaultsFailTheContract(t *testing.T) {
	err := checkBootstrap(t, minimal)
	require.Error(t, err)
	require.ErrorContains(t, err, "request_body_mode is NONE, want BUFFERED, STREAMED, BUFFERED_PARTIAL or FULL_DUPLEX_STREAMED")
	require.ErrorContains(t, err, "allow_mode_override is false")
	require.ErrorContains(t, err, "response.code_details")
}

// load reads an Envoy bootstrap YAML (or JSON) file into a Bootstrap. It fails like Parse.
func load(path string) (*bootstrapv3.Bootstrap, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	b, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return b, nil
}
