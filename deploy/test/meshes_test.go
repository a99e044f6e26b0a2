package deploytest

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	istionet "istio.io/api/networking/v1alpha3"
	corev1 "k8s.io/api/core/v1"

	egv1a1 "github.com/envoyproxy/gateway/api/v1alpha1"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	gwapiv1b1 "sigs.k8s.io/gateway-api/apis/v1beta1"

	"github.com/idempotency-extproc/idempotency-extproc/e2e/envoyconf"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// What the shipped configs request and forward (docs/deploying.md#the-ext_proc-filter).
var (
	wantRequestAttributes  = []string{"request.id", "xds.route_name", "connection.uri_san_peer_certificate"}
	wantResponseAttributes = []string{"response.code_details", "upstream.request_attempt_count"}
	wantForwarded          = []string{"envoy.filters.http.jwt_authn"}
	wantReceived           = []string{"idempotency"}
)

// meshSets are the value sets that render the Istio and Envoy Gateway templates.
var meshSets = []string{"meshes", "redis-full"}

// writeDocs writes the rendered documents of the given kinds to one multi-document file, the
// form e2e/envoyconf reads, and returns its path.
func writeDocs(t *testing.T, r rendered, gvks ...string) string {
	t.Helper()
	var b strings.Builder
	for _, o := range r.objs {
		if slices.Contains(gvks, o.gvk) {
			b.WriteString("---\n")
			b.WriteString(o.yaml)
			b.WriteString("\n")
		}
	}
	p := filepath.Join(t.TempDir(), "rendered.yaml")
	require.NoError(t, os.WriteFile(p, []byte(b.String()), 0o600))
	return p
}

// withAppRoutes appends to the rendered file at path an HTTPRoute for each HTTPRoute the policy
// targets: the application's routes, which the chart does not render and Envoy Gateway needs to
// name the xDS routes the filter runs on.
func withAppRoutes(t *testing.T, path string, pol *egv1a1.EnvoyExtensionPolicy) string {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	for _, ref := range pol.Spec.TargetRefs {
		if ref.Kind != "HTTPRoute" {
			continue
		}
		b = fmt.Appendf(b, `---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: %s, namespace: %s}
spec:
  parentRefs: [{name: eg}]
  hostnames: [api.example.com]
  rules:
  - name: api
    matches: [{path: {type: PathPrefix, value: /}}]
    backendRefs: [{name: %s, port: 8080}]
`, ref.Name, pol.Namespace, ref.Name)
	}
	require.NoError(t, os.WriteFile(path, b, 0o600))
	return path
}

// storeTimeout is the store_timeout of the set's rendered policy.
func (r rendered) storeTimeout(t *testing.T) time.Duration {
	t.Helper()
	return r.policy(t).StoreTimeout
}

// policy is the set's rendered policy.
func (r rendered) policy(t *testing.T) *policy.Policy {
	t.Helper()
	for _, cm := range find[*corev1.ConfigMap](r.objs, "v1/ConfigMap") {
		if data, ok := cm.Data["policy.yaml"]; ok {
			p, err := policy.Parse([]byte(data))
			require.NoError(t, err)
			return p
		}
	}
	t.Fatal("no policy ConfigMap")
	return nil
}

func (r rendered) service(t *testing.T) (*corev1.Service, int32) {
	t.Helper()
	svc := the[*corev1.Service](t, r, "v1/Service")
	for _, p := range svc.Spec.Ports {
		if p.Name == "grpc" {
			return svc, p.Port
		}
	}
	t.Fatal("no grpc port on the Service")
	return nil, 0
}

// checkThresholds is the circuit-breaker rule of the shipped configs' tests: each in-flight
// request holds a stream, so 1024 (Envoy's default) is far too few.
func checkThresholds(t *testing.T, th envoyconf.Thresholds) {
	t.Helper()
	for name, v := range map[string]uint32{"max_connections": th.MaxConnections, "max_pending_requests": th.MaxPendingRequests, "max_requests": th.MaxRequests} {
		require.Greater(t, v, uint32(1024), "processor circuit breaker %s", name)
	}
}

// requireSuperset checks that got holds every element of want.
func requireSuperset(t *testing.T, got, want []string, what string) {
	t.Helper()
	for _, w := range want {
		require.Contains(t, got, w, "%s lacks %q", what, w)
	}
}

// sameExceptNames compares the rendered filter with the shipped one. The cluster name, the
// attributes and the metadata namespaces are compared apart (the rendered lists must contain the
// shipped ones), and so are the fields the chart's values set (body and trailer modes, message
// timeout, stream timeout) when they are not the defaults.
func sameFilter(t *testing.T, rendered, shipped *filterextproc.ExternalProcessor, defaults bool) {
	t.Helper()
	r, s := proto.Clone(rendered).(*filterextproc.ExternalProcessor), proto.Clone(shipped).(*filterextproc.ExternalProcessor)
	requireSuperset(t, r.GetRequestAttributes(), s.GetRequestAttributes(), "request_attributes")
	requireSuperset(t, r.GetResponseAttributes(), s.GetResponseAttributes(), "response_attributes")
	requireSuperset(t, r.GetMetadataOptions().GetForwardingNamespaces().GetUntyped(), s.GetMetadataOptions().GetForwardingNamespaces().GetUntyped(), "forwarding_namespaces")
	requireSuperset(t, r.GetMetadataOptions().GetReceivingNamespaces().GetUntyped(), s.GetMetadataOptions().GetReceivingNamespaces().GetUntyped(), "receiving_namespaces")
	for _, f := range []*filterextproc.ExternalProcessor{r, s} {
		f.GrpcService.GetEnvoyGrpc().ClusterName = ""
		f.RequestAttributes, f.ResponseAttributes, f.MetadataOptions = nil, nil, nil
		if !defaults {
			f.ProcessingMode.ResponseBodyMode, f.ProcessingMode.ResponseTrailerMode = 0, 0
			f.MessageTimeout, f.GrpcService.Timeout = nil, nil
		}
	}
	require.True(t, proto.Equal(s, r), "the rendered filter and envoy/'s disagree:\nrendered: %v\nshipped:  %v", r, s)
}

// The rendered EnvoyFilter is the filter of envoy/istio-envoyfilter.yaml for this release's
// Service: it passes the same contract checks, requests the attributes and forwards the
// metadata the processor reads, and its DestinationRule raises the circuit breakers of that cluster.
func TestChartIstioMeetsSpec(t *testing.T) {
	shipped, err := envoyconf.IstioExtProc(filepath.Join(repoRoot, "envoy", "istio-envoyfilter.yaml"))
	require.NoError(t, err)
	for _, name := range meshSets {
		t.Run(name, func(t *testing.T) {
			r := renderSet(t, name)
			file := writeDocs(t, r, "networking.istio.io/v1alpha3/EnvoyFilter")
			f, err := envoyconf.IstioExtProc(file)
			require.NoError(t, err)
			require.NoError(t, envoyconf.Validate(f))
			require.NoError(t, envoyconf.CheckSpec(f, r.storeTimeout(t)))
			d, err := envoyconf.IstioDeployment(file)
			require.NoError(t, err)
			require.NoError(t, envoyconf.CheckProtection(d, r.policy(t)), "the checks that hold envoy/ hold the chart too")

			requireSuperset(t, f.GetRequestAttributes(), wantRequestAttributes, "request_attributes")
			requireSuperset(t, f.GetResponseAttributes(), wantResponseAttributes, "response_attributes")
			require.Equal(t, wantForwarded, f.GetMetadataOptions().GetForwardingNamespaces().GetUntyped())
			require.Equal(t, wantReceived, f.GetMetadataOptions().GetReceivingNamespaces().GetUntyped())

			// The access log, where the value set turns it on, is envoy/'s.
			logs, err := envoyconf.IstioAccessLogFormats(file)
			require.NoError(t, err)
			if r.value("istio.accessLog.enabled") == true {
				shippedLogs, err := envoyconf.IstioAccessLogFormats(filepath.Join(repoRoot, "envoy", "istio-envoyfilter.yaml"))
				require.NoError(t, err)
				require.Equal(t, shippedLogs, logs)
			} else {
				require.Empty(t, logs)
			}

			svc, grpcPort := r.service(t)
			domain := r.value("istio.clusterDomain")
			fqdn := fmt.Sprintf("%s.%s.svc.%s", svc.Name, svc.Namespace, domain)
			require.Equal(t, fmt.Sprintf("outbound|%d||%s", grpcPort, fqdn), f.GetGrpcService().GetEnvoyGrpc().GetClusterName())

			x := r.value("extProc").(map[string]any)
			require.Equal(t, x["responseBodyMode"], f.GetProcessingMode().GetResponseBodyMode().String())
			require.Equal(t, x["responseTrailerMode"], f.GetProcessingMode().GetResponseTrailerMode().String())
			require.Equal(t, time.Duration(x["messageTimeoutMs"].(float64))*time.Millisecond, f.GetMessageTimeout().AsDuration())
			defaults := name == "meshes"
			sameFilter(t, f, shipped, defaults)

			ef := the[*istioObject](t, r, "networking.istio.io/v1alpha3/EnvoyFilter")
			require.Equal(t, r.value("istio.namespace"), ef.Namespace)
			sel := ef.Spec.(*istionet.EnvoyFilter).GetWorkloadSelector().GetLabels()
			for k, v := range r.value("istio.workloadSelector").(map[string]any) {
				require.Equal(t, v, sel[k])
			}
			require.Len(t, sel, len(r.value("istio.workloadSelector").(map[string]any)))

			dr := the[*istioObject](t, r, "networking.istio.io/v1/DestinationRule")
			spec := dr.Spec.(*istionet.DestinationRule)
			require.Equal(t, fqdn, spec.GetHost())
			pool := spec.GetTrafficPolicy().GetConnectionPool()
			checkThresholds(t, envoyconf.Thresholds{
				MaxConnections:     uint32(pool.GetTcp().GetMaxConnections()),
				MaxPendingRequests: uint32(pool.GetHttp().GetHttp1MaxPendingRequests()),
				MaxRequests:        uint32(pool.GetHttp().GetHttp2MaxRequests()),
			})
		})
	}
}

// Envoy Gateway's CRD validation of the fields the chart sets (kubebuilder markers of
// api/v1alpha1/ext_proc_types.go), which strict decoding alone does not apply.
var egAttribute = regexp.MustCompile(`^(connection\.|source\.|destination\.|request\.|response\.|upstream\.|xds\.route_)[a-z_1-9]*$`)

// The rendered EnvoyExtensionPolicy translates, as Envoy Gateway would, into the filter of
// envoy/envoy-gateway.yaml with the same limits, passes the same contract checks, and names
// this release's Service (with a ReferenceGrant when it lives in another namespace).
func TestChartEnvoyGatewayMeetsSpec(t *testing.T) {
	const (
		eep = "gateway.envoyproxy.io/v1alpha1/EnvoyExtensionPolicy"
		ctp = "gateway.envoyproxy.io/v1alpha1/ClientTrafficPolicy"
		btp = "gateway.envoyproxy.io/v1alpha1/BackendTrafficPolicy"
		rg  = "gateway.networking.k8s.io/v1beta1/ReferenceGrant"
	)
	shippedPolicies, shippedLimits, err := envoyconf.EnvoyGateway(filepath.Join(repoRoot, "envoy", "envoy-gateway.yaml"))
	require.NoError(t, err)
	require.NotEmpty(t, shippedPolicies)
	shipped := shippedPolicies[0].Deployment.Filter
	for _, name := range meshSets {
		t.Run(name, func(t *testing.T) {
			r := renderSet(t, name)
			pols, limits, err := envoyconf.EnvoyGateway(withAppRoutes(t, writeDocs(t, r, eep, ctp, btp, rg), the[*egv1a1.EnvoyExtensionPolicy](t, r, eep)))
			require.NoError(t, err)
			require.Len(t, pols, 1, "the chart renders one EnvoyExtensionPolicy")
			f := pols[0].Deployment.Filter
			require.NoError(t, envoyconf.Validate(f))
			require.NoError(t, envoyconf.WithoutGatewayGaps(envoyconf.CheckSpec(f, r.storeTimeout(t))), "Envoy Gateway's one gap aside (request trailers)")
			require.NoError(t, envoyconf.CheckProtection(pols[0].Deployment, r.policy(t)), "the checks that hold envoy/ hold the chart too")
			checkThresholds(t, pols[0].CircuitBreaker)
			require.GreaterOrEqual(t, limits.ClientBufferLimit, uint32(1<<20))
			require.GreaterOrEqual(t, limits.BackendBufferLimit, uint32(1<<20))
			requireSuperset(t, f.GetRequestAttributes(), wantRequestAttributes, "request attributes")
			requireSuperset(t, f.GetResponseAttributes(), wantResponseAttributes, "response attributes")

			defaults := name == "meshes"
			sameFilter(t, f, shipped, defaults)
			if defaults {
				require.Equal(t, shippedLimits, limits)
			}

			pol := the[*egv1a1.EnvoyExtensionPolicy](t, r, eep)
			require.Equal(t, r.value("envoyGateway.namespace"), pol.Namespace)
			require.Len(t, pol.Spec.ExtProc, 1)
			ep := pol.Spec.ExtProc[0]
			for _, a := range append(slices.Clone(ep.ProcessingMode.Request.Attributes), ep.ProcessingMode.Response.Attributes...) {
				require.Regexp(t, egAttribute, a, "Envoy Gateway refuses the attribute")
			}
			md := ep.Metadata
			require.NotNil(t, md)
			require.Equal(t, wantForwarded, md.AccessibleNamespaces)
			require.Equal(t, wantReceived, md.WritableNamespaces)
			require.LessOrEqual(t, len(md.WritableNamespaces), 8)
			for _, ns := range md.WritableNamespaces {
				require.False(t, strings.HasPrefix(ns, "envoy.filters.http"), "writableNamespaces cannot hold Envoy HTTP filter namespaces")
			}

			svc, grpcPort := r.service(t)
			require.Len(t, ep.BackendRefs, 1)
			ref := ep.BackendRefs[0]
			require.EqualValues(t, svc.Name, ref.Name)
			require.EqualValues(t, grpcPort, *ref.Port)
			grants := find[*gwapiv1b1.ReferenceGrant](r.objs, rg)
			if pol.Namespace == svc.Namespace {
				require.Nil(t, ref.Namespace)
				require.Empty(t, grants)
				return
			}
			require.EqualValues(t, svc.Namespace, *ref.Namespace)
			require.Len(t, grants, 1)
			g := grants[0]
			require.Equal(t, svc.Namespace, g.Namespace)
			require.Len(t, g.Spec.From, 1)
			require.EqualValues(t, "gateway.envoyproxy.io", g.Spec.From[0].Group)
			require.EqualValues(t, "EnvoyExtensionPolicy", g.Spec.From[0].Kind)
			require.EqualValues(t, pol.Namespace, g.Spec.From[0].Namespace)
			require.Len(t, g.Spec.To, 1)
			require.EqualValues(t, "", g.Spec.To[0].Group)
			require.EqualValues(t, "Service", g.Spec.To[0].Kind)
			require.EqualValues(t, svc.Name, *g.Spec.To[0].Name)
		})
	}
}
