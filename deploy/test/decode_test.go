package deploytest

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	egv1a1 "github.com/envoyproxy/gateway/api/v1alpha1"
	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	istionet "istio.io/api/networking/v1alpha3"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	gwapiv1 "sigs.k8s.io/gateway-api/apis/v1"
	gwapiv1b1 "sigs.k8s.io/gateway-api/apis/v1beta1"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

// object is one rendered document decoded into its API type.
type object struct {
	manifest
	gvk  string // apiVersion + "/" + kind, e.g. "apps/v1/Deployment"
	meta metav1.ObjectMeta
	// obj is a pointer to the Kubernetes, Envoy Gateway, Gateway API or Prometheus Operator
	// type, or an *istioObject.
	obj any
}

// istioObject is an Istio resource: Kubernetes metadata around a spec that is an istio.io/api
// protobuf message. Istio's Go types decode their specs leniently (AllowUnknownFields), so the
// spec is decoded here with protojson, which rejects unknown fields.
type istioObject struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              proto.Message `json:"-"`
}

// kinds are the API types the chart may render, by apiVersion/kind. Each returns a fresh value
// to decode into.
var kinds = map[string]func() any{
	"v1/ConfigMap":                                        func() any { return &corev1.ConfigMap{} },
	"v1/Secret":                                           func() any { return &corev1.Secret{} },
	"v1/Service":                                          func() any { return &corev1.Service{} },
	"v1/ServiceAccount":                                   func() any { return &corev1.ServiceAccount{} },
	"apps/v1/Deployment":                                  func() any { return &appsv1.Deployment{} },
	"batch/v1/Job":                                        func() any { return &batchv1.Job{} },
	"policy/v1/PodDisruptionBudget":                       func() any { return &policyv1.PodDisruptionBudget{} },
	"autoscaling/v2/HorizontalPodAutoscaler":              func() any { return &autoscalingv2.HorizontalPodAutoscaler{} },
	"networking.k8s.io/v1/NetworkPolicy":                  func() any { return &networkingv1.NetworkPolicy{} },
	"monitoring.coreos.com/v1/ServiceMonitor":             func() any { return &monitoringv1.ServiceMonitor{} },
	"monitoring.coreos.com/v1/PrometheusRule":             func() any { return &monitoringv1.PrometheusRule{} },
	"gateway.envoyproxy.io/v1alpha1/EnvoyExtensionPolicy": func() any { return &egv1a1.EnvoyExtensionPolicy{} },
	"gateway.envoyproxy.io/v1alpha1/ClientTrafficPolicy":  func() any { return &egv1a1.ClientTrafficPolicy{} },
	"gateway.envoyproxy.io/v1alpha1/BackendTrafficPolicy": func() any { return &egv1a1.BackendTrafficPolicy{} },
	"gateway.networking.k8s.io/v1beta1/ReferenceGrant":    func() any { return &gwapiv1b1.ReferenceGrant{} },
	// envoy/envoy-gateway.yaml's, and the chart's in sidecar mode.
	"gateway.envoyproxy.io/v1alpha1/EnvoyProxy": func() any { return &egv1a1.EnvoyProxy{} },
	"gateway.envoyproxy.io/v1alpha1/Backend":    func() any { return &egv1a1.Backend{} },
	"networking.istio.io/v1alpha3/EnvoyFilter": func() any {
		return &istioObject{Spec: &istionet.EnvoyFilter{}}
	},
	// networking.istio.io/v1 serves the same messages as v1alpha3.
	"networking.istio.io/v1/DestinationRule": func() any {
		return &istioObject{Spec: &istionet.DestinationRule{}}
	},
	// envoy/'s gRPC examples: the Istio route of a gRPC method and the Envoy Gateway GRPCRoute.
	"networking.istio.io/v1/VirtualService": func() any {
		return &istioObject{Spec: &istionet.VirtualService{}}
	},
	"gateway.networking.k8s.io/v1/GRPCRoute": func() any { return &gwapiv1.GRPCRoute{} },
}

// decodeStrict decodes a rendered YAML document into the API type of its apiVersion and kind.
// Unknown fields, fields in the wrong case and duplicate keys are errors, as they are for a
// strict kubectl apply; so is a kind the chart is not expected to render.
func decodeStrict(m manifest) (object, error) {
	js, err := yaml.YAMLToJSONStrict([]byte(m.yaml))
	if err != nil {
		return object{}, fmt.Errorf("%s: %w", m.template, err)
	}
	var tm metav1.TypeMeta
	if err := json.Unmarshal(js, &tm); err != nil {
		return object{}, fmt.Errorf("%s: %w", m.template, err)
	}
	gvk := tm.APIVersion + "/" + tm.Kind
	newObj, ok := kinds[gvk]
	if !ok {
		return object{}, fmt.Errorf("%s: unexpected kind %s", m.template, gvk)
	}
	o := object{manifest: m, gvk: gvk, obj: newObj()}
	if io, ok := o.obj.(*istioObject); ok {
		var env struct {
			metav1.TypeMeta   `json:",inline"`
			metav1.ObjectMeta `json:"metadata"`
			Spec              json.RawMessage `json:"spec"`
		}
		if err := strict(js, &env); err != nil {
			return object{}, fmt.Errorf("%s: %s: %w", m.template, gvk, err)
		}
		if err := protojson.Unmarshal(env.Spec, io.Spec); err != nil {
			return object{}, fmt.Errorf("%s: %s spec: %w", m.template, gvk, err)
		}
		io.TypeMeta, io.ObjectMeta = env.TypeMeta, env.ObjectMeta
		o.meta = env.ObjectMeta
		return o, nil
	}
	if err := strict(js, o.obj); err != nil {
		return object{}, fmt.Errorf("%s: %s: %w", m.template, gvk, err)
	}
	o.meta = objectMeta(o.obj)
	return o, nil
}

// strict is sigs.k8s.io/json's strict decoding, the one the API server uses for
// fieldValidation=Strict: field names are case-sensitive, unknown and duplicate fields are
// errors.
func strict(js []byte, v any) error {
	strictErrs, err := sigsjson.UnmarshalStrict(js, v)
	if err != nil {
		return err
	}
	return errors.Join(strictErrs...)
}

func objectMeta(v any) metav1.ObjectMeta {
	if a, ok := v.(interface{ GetObjectMeta() metav1.Object }); ok {
		if m, ok := a.GetObjectMeta().(*metav1.ObjectMeta); ok {
			return *m
		}
	}
	return metav1.ObjectMeta{}
}

// decodeAll decodes every manifest strictly.
func decodeAll(ms []manifest) ([]object, error) {
	var objs []object
	var errs []error
	for _, m := range ms {
		o, err := decodeStrict(m)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		objs = append(objs, o)
	}
	return objs, errors.Join(errs...)
}

// find returns the objects of one apiVersion/kind.
func find[T any](objs []object, gvk string) []T {
	var out []T
	for _, o := range objs {
		if o.gvk == gvk {
			out = append(out, o.obj.(T))
		}
	}
	return out
}

// The Envoy Gateway and Istio resources of envoy/ that the chart also renders, or that only envoy/
// ships (the EnvoyProxy with the access log and filter order), decode strictly into their API
// types: a field Envoy Gateway or Istio does not know would be dropped or refused on apply.
func TestShippedMeshResourcesDecode(t *testing.T) {
	for file, want := range map[string][]string{
		"envoy-gateway.yaml":      {"EnvoyExtensionPolicy", "ClientTrafficPolicy", "BackendTrafficPolicy", "EnvoyProxy"},
		"istio-envoyfilter.yaml":  {"EnvoyFilter", "DestinationRule", "VirtualService"},
		"envoy-gateway-grpc.yaml": {"GRPCRoute", "EnvoyExtensionPolicy"},
	} {
		data, err := os.ReadFile(filepath.Join(repoRoot, "envoy", file))
		require.NoError(t, err)
		seen := map[string]int{}
		for i, doc := range strings.Split(string(data), "\n---\n") {
			var tm metav1.TypeMeta
			require.NoError(t, yaml.Unmarshal([]byte(doc), &tm))
			if !slices.Contains(want, tm.Kind) {
				continue
			}
			_, err := decodeStrict(manifest{template: fmt.Sprintf("envoy/%s document %d", file, i+1), yaml: doc})
			require.NoError(t, err)
			seen[tm.Kind]++
		}
		for _, k := range want {
			require.Positive(t, seen[k], "%s has a %s", file, k)
		}
	}
}
