package deploytest

import (
	"testing"

	"github.com/stretchr/testify/require"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// source is a pod that may try to reach the processor: its labels and its namespace's.
type source struct {
	name      string
	namespace string
	pod, ns   map[string]string
}

func inNamespace(ns string, pod map[string]string) source {
	return source{name: ns + "/" + labels.Set(pod).String(), namespace: ns, pod: pod, ns: map[string]string{"kubernetes.io/metadata.name": ns}}
}

// admits reports whether rule lets src in, as Kubernetes reads a NetworkPolicyIngressRule: no
// peers admit every source; a peer's namespaceSelector picks namespaces (without one, the
// policy's own), its podSelector pods in them (without one, all of them).
func admits(t *testing.T, np *networkingv1.NetworkPolicy, rule networkingv1.NetworkPolicyIngressRule, src source) bool {
	t.Helper()
	if len(rule.From) == 0 {
		return true
	}
	matches := func(sel *metav1.LabelSelector, set map[string]string) bool {
		s, err := metav1.LabelSelectorAsSelector(sel)
		require.NoError(t, err)
		return s.Matches(labels.Set(set))
	}
	for _, p := range rule.From {
		if p.IPBlock != nil {
			continue
		}
		nsOK := src.namespace == np.Namespace
		if p.NamespaceSelector != nil {
			nsOK = matches(p.NamespaceSelector, src.ns)
		}
		if nsOK && (p.PodSelector == nil || matches(p.PodSelector, src.pod)) {
			return true
		}
	}
	return false
}

// ingressRule returns the one ingress rule of np for the named port.
func ingressRule(t *testing.T, np *networkingv1.NetworkPolicy, port string) networkingv1.NetworkPolicyIngressRule {
	t.Helper()
	var found []networkingv1.NetworkPolicyIngressRule
	for _, r := range np.Spec.Ingress {
		for _, p := range r.Ports {
			if p.Port != nil && p.Port.String() == port {
				found = append(found, r)
			}
		}
	}
	require.Len(t, found, 1, "one ingress rule for port %s", port)
	require.Len(t, found[0].Ports, 1, "the rule for %s opens no other port", port)
	return found[0]
}

// The chart's NetworkPolicy (off by default) admits the gRPC port from the gateway's pods and the
// admin port from the monitoring namespace, as networkPolicy.gateway and .monitoring select them,
// plus the peers grpcFrom and adminFrom add; a rule with no peer at all admits every source.
func TestChartNetworkPolicy(t *testing.T) {
	gateway := inNamespace("istio-system", map[string]string{"app": "istio-ingressgateway"})
	otherPodBesideGateway := inNamespace("istio-system", map[string]string{"app": "istiod"})
	gatewayLabelsElsewhere := inNamespace("default", map[string]string{"app": "istio-ingressgateway"})
	sameNamespaceGateway := inNamespace(releaseNS, map[string]string{"app": "gateway"})
	sameNamespaceOther := inNamespace(releaseNS, map[string]string{"app": "other"})
	prometheus := inNamespace("monitoring", map[string]string{"app.kubernetes.io/name": "prometheus"})
	payments := inNamespace("payments", map[string]string{"app": "payments"})
	grafana := inNamespace("monitoring", map[string]string{"app": "grafana"})

	for _, tc := range []struct {
		name        string
		values      map[string]any
		grpc, admin map[string]bool // source name -> admitted
		noPolicy    bool
		policyTypes []networkingv1.PolicyType
	}{
		{name: "off by default", values: map[string]any{}, noPolicy: true},
		{
			name:        "gateway in its namespace, monitoring namespace, extra gRPC peers",
			values:      readValues(t, "redis-full"),
			policyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress, networkingv1.PolicyTypeEgress},
			grpc: map[string]bool{gateway.name: true, payments.name: true, otherPodBesideGateway.name: false,
				gatewayLabelsElsewhere.name: false, sameNamespaceOther.name: false, prometheus.name: false},
			admin: map[string]bool{prometheus.name: true, gateway.name: false, payments.name: false, sameNamespaceOther.name: false},
		},
		{
			name: "gateway pods of the release's namespace",
			values: parseValues(t, `
networkPolicy:
  enabled: true
  gateway: { podSelector: { matchLabels: { app: gateway } } }
  monitoring: { namespaceSelector: { matchLabels: { kubernetes.io/metadata.name: monitoring } }, podSelector: { matchLabels: { app.kubernetes.io/name: prometheus } } }
`),
			policyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
			grpc:        map[string]bool{sameNamespaceGateway.name: true, sameNamespaceOther.name: false, gateway.name: false},
			admin:       map[string]bool{prometheus.name: true, grafana.name: false, sameNamespaceOther.name: false},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			objs, err := decodeAll(mustRender(t, tc.values))
			require.NoError(t, err)
			nps := find[*networkingv1.NetworkPolicy](objs, "networking.k8s.io/v1/NetworkPolicy")
			if tc.noPolicy {
				require.Empty(t, nps)
				return
			}
			require.Len(t, nps, 1)
			np := nps[0]
			require.Equal(t, releaseNS, np.Namespace)
			require.ElementsMatch(t, tc.policyTypes, np.Spec.PolicyTypes)
			require.Len(t, np.Spec.Ingress, 2, "one rule per port")
			grpcRule, adminRule := ingressRule(t, np, "grpc"), ingressRule(t, np, "http-admin")
			for _, src := range []source{gateway, otherPodBesideGateway, gatewayLabelsElsewhere, sameNamespaceGateway, sameNamespaceOther, prometheus, payments, grafana} {
				if want, ok := tc.grpc[src.name]; ok {
					require.Equal(t, want, admits(t, np, grpcRule, src), "gRPC port from %s", src.name)
				}
				if want, ok := tc.admin[src.name]; ok {
					require.Equal(t, want, admits(t, np, adminRule, src), "admin port from %s", src.name)
				}
			}
		})
	}

	// With no selector and no peer, each rule admits every source: enabling the policy alone
	// changes nothing until it is told who the gateway and the monitoring are.
	objs, err := decodeAll(mustRender(t, parseValues(t, "networkPolicy: { enabled: true }\n")))
	require.NoError(t, err)
	np := find[*networkingv1.NetworkPolicy](objs, "networking.k8s.io/v1/NetworkPolicy")[0]
	require.Empty(t, ingressRule(t, np, "grpc").From)
	require.Empty(t, ingressRule(t, np, "http-admin").From)
}
