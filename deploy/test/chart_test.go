package deploytest

import (
	"fmt"
	"path"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"helm.sh/helm/v3/pkg/chartutil"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// Every value set lints clean (warnings included), renders, and decodes strictly.
func TestChartLintsRendersAndDecodes(t *testing.T) {
	for _, name := range valueSets {
		t.Run(name, func(t *testing.T) {
			vals := readValues(t, name)
			require.Empty(t, lintChart(vals), "helm lint --strict")
			_, err := decodeAll(mustRender(t, vals))
			require.NoError(t, err)
		})
	}
}

// rendered is one value set's objects, decoded, and its values with the chart's defaults.
type rendered struct {
	vals map[string]any
	objs []object
}

func renderSet(t *testing.T, name string) rendered {
	t.Helper()
	vals := readValues(t, name)
	objs, err := decodeAll(mustRender(t, vals))
	require.NoError(t, err)
	all, err := chartutil.CoalesceValues(loadChart(t), vals)
	require.NoError(t, err)
	return rendered{all, objs}
}

// value returns the value at a dotted path of the set's values, or nil.
func (r rendered) value(p string) any {
	var v any = r.vals
	for _, k := range strings.Split(p, ".") {
		m, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = m[k]
	}
	return v
}

// the returns the single object of a kind; it fails t when there is not exactly one.
func the[T any](t *testing.T, r rendered, gvk string) T {
	t.Helper()
	all := find[T](r.objs, gvk)
	require.Len(t, all, 1, "want exactly one %s", gvk)
	return all[0]
}

func (r rendered) deployment(t *testing.T) (*appsv1.Deployment, *corev1.Container) {
	t.Helper()
	d := the[*appsv1.Deployment](t, r, "apps/v1/Deployment")
	require.Len(t, d.Spec.Template.Spec.Containers, 1)
	return d, &d.Spec.Template.Spec.Containers[0]
}

// arg returns the value of --name=value in args, and whether it is there.
func arg(args []string, name string) (string, bool) {
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v, true
		}
	}
	return "", false
}

func port(c *corev1.Container, name string) int32 {
	for _, p := range c.Ports {
		if p.Name == name {
			return p.ContainerPort
		}
	}
	return 0
}

// The pod runs the binary on the ports it names, with the probes on the admin port, non-root on
// a read-only root file system with no capabilities.
func TestChartPodSpec(t *testing.T) {
	for _, name := range valueSets {
		t.Run(name, func(t *testing.T) {
			r := renderSet(t, name)
			d, c := r.deployment(t)
			pod := d.Spec.Template.Spec

			grpcPort, adminPort := port(c, "grpc"), port(c, "http-admin")
			require.NotZero(t, grpcPort)
			require.NotZero(t, adminPort)
			v, _ := arg(c.Args, "grpc-addr")
			require.Equal(t, fmt.Sprintf(":%d", grpcPort), v)
			v, _ = arg(c.Args, "admin-addr")
			require.Equal(t, fmt.Sprintf(":%d", adminPort), v)

			for probe, want := range map[*corev1.Probe]string{c.LivenessProbe: "/healthz", c.ReadinessProbe: "/readyz"} {
				require.NotNil(t, probe)
				require.NotNil(t, probe.HTTPGet)
				require.Equal(t, want, probe.HTTPGet.Path)
				require.Equal(t, "http-admin", probe.HTTPGet.Port.String())
			}

			ps, cs := pod.SecurityContext, c.SecurityContext
			require.NotNil(t, ps)
			require.NotNil(t, cs)
			require.True(t, *ps.RunAsNonRoot)
			require.NotZero(t, *ps.RunAsUser)
			require.Equal(t, corev1.SeccompProfileTypeRuntimeDefault, ps.SeccompProfile.Type)
			require.True(t, *cs.ReadOnlyRootFilesystem)
			require.False(t, *cs.AllowPrivilegeEscalation)
			require.Equal(t, []corev1.Capability{"ALL"}, cs.Capabilities.Drop)
			require.Empty(t, cs.Capabilities.Add)
			require.Equal(t, corev1.SeccompProfileTypeRuntimeDefault, cs.SeccompProfile.Type)
			require.False(t, *pod.AutomountServiceAccountToken)
			require.NotNil(t, c.Resources.Limits.Memory())

			// The drain (15 s) and the preStop sleep fit in the grace period.
			grace := *pod.TerminationGracePeriodSeconds
			var sleep int64
			if c.Lifecycle != nil && c.Lifecycle.PreStop != nil {
				require.NotNil(t, c.Lifecycle.PreStop.Sleep)
				sleep = c.Lifecycle.PreStop.Sleep.Seconds
			}
			require.Greater(t, grace, 15+sleep)

			for _, tsc := range pod.TopologySpreadConstraints {
				require.NotNil(t, tsc.LabelSelector, "a spread constraint without a selector counts no pods")
				sel, err := metav1.LabelSelectorAsSelector(tsc.LabelSelector)
				require.NoError(t, err)
				require.True(t, sel.Matches(labels.Set(d.Spec.Template.Labels)), "topology spread selector %v", tsc.LabelSelector)
			}
		})
	}
}

// The policy ConfigMap holds a policy the processor accepts, mounted where --config points.
func TestChartPolicy(t *testing.T) {
	for _, name := range valueSets {
		t.Run(name, func(t *testing.T) {
			r := renderSet(t, name)
			_, c := r.deployment(t)
			cfg, ok := arg(c.Args, "config")
			require.True(t, ok)
			cmName, key := r.mountedFile(t, cfg)
			require.Equal(t, "policy.yaml", key)
			var cm *corev1.ConfigMap
			for _, x := range find[*corev1.ConfigMap](r.objs, "v1/ConfigMap") {
				if x.Name == cmName {
					cm = x
				}
			}
			require.NotNil(t, cm, "ConfigMap %s is not rendered", cmName)
			p, err := policy.Parse([]byte(cm.Data[key]))
			require.NoError(t, err, "the rendered policy:\n%s", cm.Data[key])
			if want, ok := r.value("policy.store_timeout").(string); ok {
				require.Equal(t, want, p.StoreTimeout.String())
			}
		})
	}
}

// mountedFile returns the ConfigMap or Secret name and key behind the file at path in the
// container, following its volume mount and the volume's items.
func (r rendered) mountedFile(t *testing.T, file string) (source, key string) {
	t.Helper()
	d, c := r.deployment(t)
	dir, base := path.Split(file)
	dir = strings.TrimSuffix(dir, "/")
	var vm *corev1.VolumeMount
	for i := range c.VolumeMounts {
		if c.VolumeMounts[i].MountPath == dir {
			vm = &c.VolumeMounts[i]
		}
	}
	require.NotNil(t, vm, "no volume is mounted at %s", dir)
	require.True(t, vm.ReadOnly, "%s is mounted read-write", dir)
	for _, v := range d.Spec.Template.Spec.Volumes {
		if v.Name != vm.Name {
			continue
		}
		var items []corev1.KeyToPath
		switch {
		case v.ConfigMap != nil:
			source, items = v.ConfigMap.Name, v.ConfigMap.Items
		case v.Secret != nil:
			source, items = v.Secret.SecretName, v.Secret.Items
		default:
			t.Fatalf("volume %s is neither a ConfigMap nor a Secret", v.Name)
		}
		if len(items) == 0 {
			return source, base
		}
		for _, it := range items {
			if it.Path == base {
				return source, it.Key
			}
		}
		t.Fatalf("volume %s has no item for %s", v.Name, base)
	}
	t.Fatalf("no volume %s", vm.Name)
	return "", ""
}

// secretHolds reports whether the set renders Secret name with key (holding want, when want is
// not ""), or names name as an existing Secret in its values.
func (r rendered) secretHolds(t *testing.T, name, key, want string) {
	t.Helper()
	for _, s := range find[*corev1.Secret](r.objs, "v1/Secret") {
		if s.Name == name {
			require.Contains(t, s.Data, key, "Secret %s", name)
			if want != "" {
				require.Equal(t, want, string(s.Data[key]), "Secret %s key %s", name, key)
			}
			return
		}
	}
	for _, p := range []string{"store.redis", "store.redis.ca", "adminToken", "recordKeys", "keyHashSecret"} {
		secretKey := "existingSecret"
		if strings.HasSuffix(p, ".ca") {
			p, secretKey = strings.TrimSuffix(p, ".ca"), "caSecret"
		}
		if r.value(p+"."+secretKey) == name {
			keyField := strings.TrimSuffix(secretKey, "Secret") + "SecretKey"
			if secretKey == "existingSecret" {
				keyField = "existingSecretKey"
			}
			require.Equal(t, key, r.value(p+"."+keyField), "the key of existing Secret %s", name)
			return
		}
	}
	t.Fatalf("Secret %s is neither rendered nor named as an existing Secret in the values", name)
}

// Each secret file flag points at a read-only mounted Secret key that the chart makes from the
// value, or that the values name as an existing Secret; the Redis URL comes from a Secret in the
// environment, never from the arguments.
func TestChartSecrets(t *testing.T) {
	files := []struct{ flag, values string }{
		{"admin-token-file", "adminToken"},
		{"record-keys-file", "recordKeys"},
		{"key-hash-secret-file", "keyHashSecret"},
	}
	for _, name := range valueSets {
		t.Run(name, func(t *testing.T) {
			r := renderSet(t, name)
			_, c := r.deployment(t)
			for _, f := range files {
				file, ok := arg(c.Args, f.flag)
				enabled, _ := r.value(f.values + ".enabled").(bool)
				require.Equal(t, enabled, ok, "--%s", f.flag)
				if !ok {
					continue
				}
				secret, key := r.mountedFile(t, file)
				want, _ := r.value(f.values + ".value").(string)
				r.secretHolds(t, secret, key, want)
			}

			for _, a := range c.Args {
				require.NotContains(t, a, "redis://")
				require.NotContains(t, a, "rediss://")
				require.NotContains(t, a, "token-value")
			}
			store, _ := arg(c.Args, "store")
			require.Equal(t, r.value("store.type"), store)
			var url *corev1.EnvVar
			for i := range c.Env {
				if c.Env[i].Name == "IDEMPOTENCY_REDIS_URL" {
					url = &c.Env[i]
				}
			}
			if store == "memory" {
				require.Nil(t, url)
				require.Len(t, find[*corev1.Secret](r.objs, "v1/Secret"), 0)
				return
			}
			require.NotNil(t, url)
			require.Empty(t, url.Value)
			ref := url.ValueFrom.SecretKeyRef
			require.NotNil(t, ref)
			want, _ := r.value("store.redis.url").(string)
			r.secretHolds(t, ref.Name, ref.Key, want)

			if ca, _ := r.value("store.redis.caSecret").(string); ca != "" {
				var file string
				for _, e := range c.Env {
					if e.Name == "SSL_CERT_FILE" {
						file = e.Value
					}
				}
				secret, key := r.mountedFile(t, file)
				require.Equal(t, ca, secret)
				require.Equal(t, r.value("store.redis.caSecretKey"), key)
			}
		})
	}
}

// The Service has a port named grpc (appProtocol grpc, which Istio needs for HTTP/2) and the
// admin port, on the container's ports; every selector of the chart selects the pods.
func TestChartServiceAndSelectors(t *testing.T) {
	for _, name := range valueSets {
		t.Run(name, func(t *testing.T) {
			r := renderSet(t, name)
			d, c := r.deployment(t)
			pods := labels.Set(d.Spec.Template.Labels)
			sel, err := metav1.LabelSelectorAsSelector(d.Spec.Selector)
			require.NoError(t, err)
			require.True(t, sel.Matches(pods))

			svc := the[*corev1.Service](t, r, "v1/Service")
			require.True(t, labels.SelectorFromSet(svc.Spec.Selector).Matches(pods))
			byName := map[string]corev1.ServicePort{}
			for _, p := range svc.Spec.Ports {
				byName[p.Name] = p
				require.NotZero(t, port(c, p.TargetPort.String()), "Service port %s targets %s, not a container port", p.Name, p.TargetPort.String())
			}
			require.Contains(t, byName, "grpc")
			require.Equal(t, "grpc", *byName["grpc"].AppProtocol)
			require.Equal(t, "grpc", byName["grpc"].TargetPort.StrVal)
			require.Contains(t, byName, "http-admin")

			for _, pdb := range find[*policyv1.PodDisruptionBudget](r.objs, "policy/v1/PodDisruptionBudget") {
				s, err := metav1.LabelSelectorAsSelector(pdb.Spec.Selector)
				require.NoError(t, err)
				require.True(t, s.Matches(pods), "PodDisruptionBudget selector")
			}
			for _, np := range find[*networkingv1.NetworkPolicy](r.objs, "networking.k8s.io/v1/NetworkPolicy") {
				s, err := metav1.LabelSelectorAsSelector(&np.Spec.PodSelector)
				require.NoError(t, err)
				require.True(t, s.Matches(pods), "NetworkPolicy podSelector")
				var ports []string
				for _, rule := range np.Spec.Ingress {
					for _, p := range rule.Ports {
						ports = append(ports, p.Port.String())
					}
				}
				require.ElementsMatch(t, []string{"grpc", "http-admin"}, ports, "NetworkPolicy ingress ports")
			}
			for _, sm := range find[*monitoringv1.ServiceMonitor](r.objs, "monitoring.coreos.com/v1/ServiceMonitor") {
				s, err := metav1.LabelSelectorAsSelector(&sm.Spec.Selector)
				require.NoError(t, err)
				require.True(t, s.Matches(labels.Set(svc.Labels)), "ServiceMonitor selector must select the Service")
				require.Len(t, sm.Spec.Endpoints, 1)
				require.Contains(t, byName, sm.Spec.Endpoints[0].Port)
				require.Equal(t, "/metrics", sm.Spec.Endpoints[0].Path)
			}
		})
	}
}

// Replicas: the memory store runs exactly one; the HPA (Redis only) owns the count when on.
func TestChartReplicas(t *testing.T) {
	for _, name := range valueSets {
		t.Run(name, func(t *testing.T) {
			r := renderSet(t, name)
			d, _ := r.deployment(t)
			hpas := find[*autoscalingv2.HorizontalPodAutoscaler](r.objs, "autoscaling/v2/HorizontalPodAutoscaler")
			if on, _ := r.value("autoscaling.enabled").(bool); on {
				require.Nil(t, d.Spec.Replicas, "the HPA owns the replica count")
				require.Len(t, hpas, 1)
				require.Equal(t, "Deployment", hpas[0].Spec.ScaleTargetRef.Kind)
				require.Equal(t, d.Name, hpas[0].Spec.ScaleTargetRef.Name)
				return
			}
			require.Empty(t, hpas)
			require.NotNil(t, d.Spec.Replicas)
			if r.value("store.type") == "memory" {
				require.EqualValues(t, 1, *d.Spec.Replicas)
				require.Zero(t, d.Spec.Strategy.RollingUpdate.MaxSurge.IntValue(), "two memory stores at once split the records")
			}
		})
	}
}

// Values that cannot work are refused at render time, naming the value to change.
func TestChartRefuses(t *testing.T) {
	for _, tc := range []struct {
		name, values, want string
	}{
		{"memory store with two replicas", "replicas: 2", "replicas must be 1"},
		{"memory store with the HPA", "autoscaling: { enabled: true }", "autoscaling.enabled needs store.type redis"},
		{"redis without a URL", "store: { type: redis }", "store.redis.existingSecret"},
		{"redis URL twice", "store: { type: redis, redis: { url: 'redis://r:6379', existingSecret: s } }", "not both"},
		{"cluster and sentinel", "store: { type: redis, redis: { existingSecret: s, clusterAddrs: [a:1], sentinelAddrs: [b:2] } }", "set one"},
		{"admin token without a source", "adminToken: { enabled: true }", "adminToken.existingSecret or adminToken.value"},
		{"unknown store", "store: { type: etcd }", "store/type"},
		{"misspelt key", "replica: 1", "replica"},
		{"misspelt nested key", "store: { redis: { urls: x } }", "urls"},
		{"not a redis URL", "store: { type: redis, redis: { url: 'http://r' } }", "store/redis/url"},
		{"default circuit breaker", "extProc: { circuitBreakerThreshold: 1024 }", "circuitBreakerThreshold"},
		{"unknown body mode", "extProc: { responseBodyMode: NONE }", "responseBodyMode"},
		{"istio without namespace", "istio: { enabled: true }", "istio.namespace"},
		{"grpcRoutes at a sidecar", "istio: { enabled: true, namespace: payments, workloadSelector: { app: payments }, grpcRoutes: [payments-grpc] }",
			`istio.grpcRoutes needs istio.context GATEWAY, got "SIDECAR_INBOUND"`},
		{"envoy gateway without routes", "envoyGateway: { enabled: true, namespace: payments }", "envoyGateway.targetRefs"},
		{"envoy gateway without gateway", "envoyGateway: { enabled: true, namespace: payments, targetRefs: [{group: g, kind: HTTPRoute, name: r}] }",
			"clientTrafficPolicy.gatewayName"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := render(loadChart(t), parseValues(t, tc.values))
			require.Error(t, err)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// The image is the chart's appVersion unless a tag or a digest is given.
func TestChartImage(t *testing.T) {
	ch := loadChart(t)
	for values, want := range map[string]string{
		"{}":                 "ghcr.io/idempotency-extproc/idempotency-extproc:" + ch.Metadata.AppVersion,
		"image: { tag: v9 }": "ghcr.io/idempotency-extproc/idempotency-extproc:v9",
		"image: { repository: r.example/x, tag: v9, digest: 'sha256:" + strings.Repeat("ab", 32) + "' }": "r.example/x@sha256:" + strings.Repeat("ab", 32),
	} {
		r := rendered{vals: parseValues(t, values)}
		var err error
		r.objs, err = decodeAll(mustRender(t, r.vals))
		require.NoError(t, err)
		_, c := r.deployment(t)
		require.Equal(t, want, c.Image, values)
	}
	require.True(t, slices.Contains(ch.Metadata.Keywords, "envoy"))
}

// A policy given as a string (helm install --set-file policy=FILE) is written verbatim.
func TestChartPolicyFromFile(t *testing.T) {
	const file = "# ours\ndefaults:\n  ttl: 1h\nstore_timeout: 150ms\n"
	objs, err := decodeAll(mustRender(t, map[string]any{"policy": file}))
	require.NoError(t, err)
	cms := find[*corev1.ConfigMap](withoutHooks(objs), "v1/ConfigMap") // the policy check hook has its copy
	require.Len(t, cms, 1)
	require.Equal(t, strings.TrimSpace(file), strings.TrimSpace(cms[0].Data["policy.yaml"]))
	p, err := policy.Parse([]byte(cms[0].Data["policy.yaml"]))
	require.NoError(t, err)
	require.Equal(t, "150ms", p.StoreTimeout.String())
}

// The Secrets the chart makes from values are checked at render time as start-up checks their
// files, with start-up's messages and never the secret in them: the hook, which reads no
// secret, cannot catch them.
func TestChartRefusesSecretValuesStartUpRefuses(t *testing.T) {
	key := "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=" // base64 of 32 bytes
	for _, tc := range []struct {
		name, values, want, secret string
	}{
		{"a token with spaces", "adminToken: { enabled: true, value: 'two words' }", "the token holds spaces or control characters", "two words"},
		{"a token over two lines", "adminToken: { enabled: true, value: \"a\\nb\\n\" }", "the token holds spaces or control characters", ""},
		{"a short key-hash secret", "keyHashSecret: { enabled: true, value: short-secret }", "keyHashSecret.value holds 12 bytes; at least 32 are needed", "short-secret"},
		{"record keys without a colon", "recordKeys: { enabled: true, value: \"# keys\\n" + key + "\\n\" }", "line 2: want <id>:<base64 of 32 bytes>, found no ':'", key},
		{"a record key of 16 bytes", "recordKeys: { enabled: true, value: 'k1:AAECAwQFBgcICQoLDA0ODw==' }", `line 1: key "k1": want the standard base64 of 32 bytes`, "AAECAwQFBgcICQoLDA0ODw"},
		{"a record key id with spaces", "recordKeys: { enabled: true, value: 'k 1:" + key + "' }", "the key id (3 characters before the ':')", key},
		{"no record keys", "recordKeys: { enabled: true, value: '# none' }", "no keys", ""},
		{"a database under Cluster", "store: { type: redis, redis: { url: 'redis://:pw@r:6379/3', clusterAddrs: [a:1, b:2] } }", "Cluster has only database 0, the url selects 3", "pw"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := render(loadChart(t), parseValues(t, tc.values))
			require.ErrorContains(t, err, tc.want)
			if tc.secret != "" {
				require.NotContains(t, err.Error(), tc.secret, "the message shows the secret")
			}
		})
	}
	for _, ok := range []string{
		"adminToken: { enabled: true, value: \"token\\n\" }",
		"keyHashSecret: { enabled: true, value: '" + strings.Repeat("s", 32) + "' }",
		"recordKeys: { enabled: true, value: \"\\ufeff# active first\\nk2 : " + key + "\\r\\nk1:" + strings.TrimSuffix(key, "=") + "\\n\" }",
		"recordKeys: { enabled: true, existingSecret: keys }",
		"store: { type: redis, redis: { url: 'redis://r:6379/0', clusterAddrs: [a:1] } }",
		"store: { type: redis, redis: { url: 'redis://r:6379/3' } }",
	} {
		_, err := render(loadChart(t), parseValues(t, ok))
		require.NoError(t, err, ok)
	}
}
