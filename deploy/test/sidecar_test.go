package deploytest

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	egv1a1 "github.com/envoyproxy/gateway/api/v1alpha1"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
)

// sidecarSets are the value sets of sidecar mode, by name.
var sidecarSets = []string{"sidecar-envoy-gateway", "sidecar-istio"}

// socketURL is where the processor listens in sidecar mode and Envoy connects.
const socketURL = "unix:///var/run/idempotency/extproc.sock"

// sidecarPod returns the processor's container, the Envoy container (envoy, or istio-proxy
// before injection) and the volumes of the gateway pod sidecar mode renders: the patch of the
// EnvoyProxy for Envoy Gateway, decoded as a Deployment, or the Istio gateway Deployment.
func sidecarPod(t *testing.T, r rendered) (processor, envoy corev1.Container, volumes []corev1.Volume, replicas int32) {
	t.Helper()
	var spec corev1.PodSpec
	if eps := find[*egv1a1.EnvoyProxy](r.objs, "gateway.envoyproxy.io/v1alpha1/EnvoyProxy"); len(eps) > 0 {
		require.Len(t, eps, 1)
		k := eps[0].Spec.Provider.Kubernetes
		require.NotNil(t, k.EnvoyDeployment.Patch)
		require.Equal(t, egv1a1.StrategicMerge, *k.EnvoyDeployment.Patch.Type)
		var d appsv1.Deployment
		require.NoError(t, strict(k.EnvoyDeployment.Patch.Value.Raw, &d), "the patch is a Deployment")
		spec, replicas = d.Spec.Template.Spec, *k.EnvoyDeployment.Replicas
		if r.value("store.type") == "memory" {
			require.Zero(t, k.EnvoyDeployment.Strategy.RollingUpdate.MaxSurge.IntValue(), "two memory stores at once split the records")
		}
	} else {
		d := the[*appsv1.Deployment](t, r, "apps/v1/Deployment")
		require.Equal(t, "gateway", d.Spec.Template.Annotations["inject.istio.io/templates"])
		require.Equal(t, "true", d.Spec.Template.Labels["sidecar.istio.io/inject"])
		spec, replicas = d.Spec.Template.Spec, *d.Spec.Replicas
		if r.value("store.type") == "memory" {
			require.Zero(t, d.Spec.Strategy.RollingUpdate.MaxSurge.IntValue(), "two memory stores at once split the records")
		}
	}
	for _, c := range spec.Containers {
		switch c.Name {
		case "idempotency-extproc":
			processor = c
		case "envoy", "istio-proxy":
			envoy = c
		}
	}
	// The processor makes the socket writable by its group only: Envoy, as another user (Istio's
	// proxy is 1337), connects through the pod's fsGroup.
	require.NotNil(t, spec.SecurityContext, "no pod security context")
	require.NotNil(t, spec.SecurityContext.FSGroup, "no fsGroup: Envoy cannot connect to the socket as another user")
	require.NotEmpty(t, processor.Name, "no processor container")
	require.NotEmpty(t, envoy.Name, "no Envoy container")
	return processor, envoy, spec.Volumes, replicas
}

// In sidecar mode the processor listens on the unix socket, on an emptyDir the Envoy container
// mounts at the same place, and nothing of the chart's own Deployment is rendered.
func TestChartSidecar(t *testing.T) {
	for _, name := range sidecarSets {
		t.Run(name, func(t *testing.T) {
			vals := readValues(t, name)
			require.Empty(t, lintChart(vals), "helm lint --strict")
			r := renderSet(t, name)
			p, envoy, volumes, replicas := sidecarPod(t, r)
			v, _ := arg(p.Args, "grpc-addr")
			require.Equal(t, socketURL, v)
			var mount string
			for _, m := range p.VolumeMounts {
				for _, vol := range volumes {
					if vol.Name == m.Name && vol.EmptyDir != nil && strings.HasPrefix(strings.TrimPrefix(socketURL, "unix://"), m.MountPath+"/") {
						mount = m.MountPath
						for _, em := range envoy.VolumeMounts {
							if em.Name == m.Name {
								require.Equal(t, m.MountPath, em.MountPath, "Envoy's container mounts the socket's volume elsewhere")
							}
						}
					}
				}
			}
			require.NotEmpty(t, mount, "the socket is on no emptyDir")
			require.Contains(t, envoy.VolumeMounts, corev1.VolumeMount{Name: "idempotency-socket", MountPath: mount})
			require.EqualValues(t, r.value("sidecar.gatewayReplicas"), replicas)
			for _, o := range r.objs {
				require.NotContains(t, []string{"v1/Service", "policy/v1/PodDisruptionBudget", "v1/ServiceAccount", "networking.istio.io/v1/DestinationRule"}, o.gvk,
					"sidecar mode renders no %s", o.gvk)
			}
		})
	}
}

// The memory store in more than one gateway pod protects nothing across pods: the chart refuses
// it, and sidecar mode needs exactly one gateway to run in.
func TestChartSidecarRefuses(t *testing.T) {
	eg := "envoyGateway: { enabled: true, namespace: p, targetRefs: [{group: gateway.networking.k8s.io, kind: HTTPRoute, name: r}], clientTrafficPolicy: { gatewayName: eg } }\n"
	for _, tc := range []struct{ name, values, want string }{
		{"memory with two gateway pods", "sidecar: { enabled: true, gatewayReplicas: 2 }\n" + eg, "use store.type redis"},
		{"no gateway", "sidecar: { enabled: true }\n", "enable one of envoyGateway.enabled and istio.enabled"},
		{"istio sidecars", "sidecar: { enabled: true }\nistio: { enabled: true, namespace: p, workloadSelector: { a: b } }\n", "istio.context must be GATEWAY"},
		{"the HPA", "sidecar: { enabled: true }\nstore: { type: redis, redis: { existingSecret: s } }\nautoscaling: { enabled: true }\n" + eg, "autoscaling.enabled"},
		{"istio's namespace is not the release's", "sidecar: { enabled: true }\nistio: { enabled: true, namespace: other, context: GATEWAY, workloadSelector: { a: b } }\n", "install the release in istio.namespace"},
		{"no fsGroup", "sidecar: { enabled: true }\npodSecurityContext: { fsGroup: null }\n" + eg, "needs podSecurityContext.fsGroup"},
		{"a grace period shorter than the drains", "sidecar: { enabled: true }\nterminationGracePeriodSeconds: 10\nistio: { enabled: true, namespace: idempotency, context: GATEWAY, workloadSelector: { a: b } }\n", "terminationGracePeriodSeconds 10 is shorter"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := render(loadChart(t), parseValues(t, tc.values))
			require.ErrorContains(t, err, tc.want)
		})
	}
	vals := readValues(t, "sidecar-envoy-gateway")
	vals["store"] = map[string]any{"type": "redis", "redis": map[string]any{"existingSecret": "s"}}
	_, err := render(loadChart(t), vals)
	require.NoError(t, err, "two gateway pods share the Redis store")
}

// The rendered sidecar manifests pass check, as users run it on helm template output, with the
// hook's arguments: Envoy Gateway's Backend on the unix socket and Istio's cluster on the pipe
// address are the processor.
func TestChartSidecarPassesTheCheck(t *testing.T) {
	for _, name := range sidecarSets {
		t.Run(name, func(t *testing.T) {
			r := renderSet(t, name)
			hc, hv := hookPod(t, r)
			hook := materialize(t, r.objs, hc, hv)
			v, _ := arg(hook.args, "grpc-addr")
			require.Equal(t, socketURL, v, "the hook checks the socket the sidecar listens on")
			var all strings.Builder
			for _, o := range r.objs {
				all.WriteString("---\n# Source: " + o.template + "\n" + o.yaml + "\n")
			}
			file := filepath.Join(t.TempDir(), "rendered.yaml")
			require.NoError(t, os.WriteFile(file, []byte(all.String()), 0o600))
			p := hook
			p.args = append(append(append([]string{}, hook.args...), "--format=json"), file)
			code, out := runHook(t, mustBinary(t), p)
			require.Zero(t, code, out)
			jsonOut := out[strings.Index(out, "["):]
			var findings []struct{ File, Resource, Field, Severity, Problem, Fix string }
			require.NoError(t, json.Unmarshal([]byte(jsonOut), &findings), out)
			for _, f := range findings {
				require.Equal(t, "warning", f.Severity, "%+v", f)
			}
		})
	}
}

func mustBinary(t *testing.T) string {
	t.Helper()
	bin, err := checkBinary()
	require.NoError(t, err)
	return bin
}

// sidecarSpec returns the gateway pod's spec sidecar mode renders: the EnvoyProxy's patch,
// decoded as a Deployment, or the Istio gateway Deployment.
func sidecarSpec(t *testing.T, r rendered) corev1.PodSpec {
	t.Helper()
	if eps := find[*egv1a1.EnvoyProxy](r.objs, "gateway.envoyproxy.io/v1alpha1/EnvoyProxy"); len(eps) > 0 {
		var d appsv1.Deployment
		require.NoError(t, strict(eps[0].Spec.Provider.Kubernetes.EnvoyDeployment.Patch.Value.Raw, &d))
		return d.Spec.Template.Spec
	}
	return the[*appsv1.Deployment](t, r, "apps/v1/Deployment").Spec.Template.Spec
}

// The processor in a gateway's pod must not make the gateway unready when the store is down (the
// gateway's every route would fail, fail_mode open or not), and must not close its socket while
// Envoy, in the same pod, still drains: its preStop sleep lasts Envoy's drain (Envoy Gateway's
// drainTimeout, 60 s by default; Istio's terminationDrainDuration, 5 s), and the grace period
// covers that and the processor's own 15 s drain.
func TestChartSidecarReadinessAndShutdown(t *testing.T) {
	const processorDrain = 15
	for _, tc := range []struct {
		set        string
		envoyDrain int32
	}{
		{"sidecar-envoy-gateway", 60},
		{"sidecar-istio", 5},
	} {
		t.Run(tc.set, func(t *testing.T) {
			r := renderSet(t, tc.set)
			p, _, _, _ := sidecarPod(t, r)
			require.NotNil(t, p.ReadinessProbe)
			require.NotNil(t, p.ReadinessProbe.HTTPGet)
			require.Equal(t, "/healthz", p.ReadinessProbe.HTTPGet.Path, "a store-dependent readiness makes the whole gateway unready")
			require.NotNil(t, p.Lifecycle, "no preStop: the socket closes while Envoy drains")
			require.NotNil(t, p.Lifecycle.PreStop)
			require.NotNil(t, p.Lifecycle.PreStop.Sleep)
			require.GreaterOrEqual(t, p.Lifecycle.PreStop.Sleep.Seconds, int64(tc.envoyDrain))
			spec := sidecarSpec(t, r)
			if r.value("envoyGateway.enabled") == true {
				// Envoy Gateway sets drainTimeout + 300 s; a grace period in the patch would replace it.
				require.Nil(t, spec.TerminationGracePeriodSeconds, "the patch overrides Envoy Gateway's grace period")
				return
			}
			require.NotNil(t, spec.TerminationGracePeriodSeconds)
			require.GreaterOrEqual(t, *spec.TerminationGracePeriodSeconds, p.Lifecycle.PreStop.Sleep.Seconds+processorDrain)
		})
	}
	r := renderSet(t, "redis-full")
	_, c := r.deployment(t)
	require.Equal(t, "/readyz", c.ReadinessProbe.HTTPGet.Path, "the chart's own Deployment is ready with its store")
}

// The gateway's pod mounts its ServiceAccount's token, which the gateway may need; the processor
// needs none, and its container gets an empty volume at the token's path, so that the
// ServiceAccount admission controller does not add the token to it.
func TestChartSidecarProcessorHasNoToken(t *testing.T) {
	const tokenDir = "/var/run/secrets/kubernetes.io/serviceaccount"
	for _, name := range sidecarSets {
		t.Run(name, func(t *testing.T) {
			p, _, volumes, _ := sidecarPod(t, renderSet(t, name))
			var masked bool
			for _, m := range p.VolumeMounts {
				if m.MountPath != tokenDir {
					continue
				}
				for _, v := range volumes {
					if v.Name == m.Name {
						require.NotNil(t, v.EmptyDir, "the volume at the token's path is not empty: %+v", v)
						masked = true
					}
				}
			}
			require.True(t, masked, "the processor's container would get the pod's ServiceAccount token")
		})
	}
}
