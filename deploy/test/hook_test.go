package deploytest

import (
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
)

// existingSecretContent is what the test puts in a key of a Secret the values name as existing
// (the chart does not render it): a valid value of each kind.
var existingSecretContent = map[string]string{
	"url":    "redis://default:s3cret@redis.example:6379/0",
	"keys":   "k1:" + base64.StdEncoding.EncodeToString([]byte(strings.Repeat("k", 32))) + "\n",
	"hmac":   strings.Repeat("h", 40) + "\n",
	"token":  "admin-token\n",
	"ca.crt": "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
}

// pod is what a rendered pod's container needs to run here: its files under root (each volume
// mount's ConfigMap, Secret or emptyDir written where it is mounted), its arguments and
// environment with every absolute path moved under root.
type pod struct {
	root string
	args []string
	env  []string
}

// materialize lays out the container c of a pod with volumes under a new temporary root. A
// Secret comes from the rendered objects or, when the values name it as existing, from
// existingSecretContent; an environment variable from a Secret likewise. A Secret neither
// rendered nor known fails t: the test then does not know what the pod would hold.
func materialize(t *testing.T, objs []object, c corev1.Container, volumes []corev1.Volume) pod {
	t.Helper()
	root := t.TempDir()
	secret := func(name, key string) []byte {
		for _, s := range find[*corev1.Secret](objs, "v1/Secret") {
			if s.Name == name {
				v, ok := s.Data[key]
				require.True(t, ok, "Secret %s has no key %s", name, key)
				return v
			}
		}
		v, ok := existingSecretContent[key]
		require.True(t, ok, "Secret %s key %s: no test content for an existing Secret's key %q", name, key, key)
		return []byte(v)
	}
	configMap := func(name string) map[string]string {
		for _, cm := range find[*corev1.ConfigMap](objs, "v1/ConfigMap") {
			if cm.Name == name {
				return cm.Data
			}
		}
		t.Fatalf("ConfigMap %s is not rendered", name)
		return nil
	}
	for _, m := range c.VolumeMounts {
		dir := filepath.Join(root, m.MountPath)
		require.NoError(t, os.MkdirAll(dir, 0o700))
		var v *corev1.Volume
		for i := range volumes {
			if volumes[i].Name == m.Name {
				v = &volumes[i]
			}
		}
		require.NotNil(t, v, "volume %s", m.Name)
		switch {
		case v.ConfigMap != nil:
			data := configMap(v.ConfigMap.Name)
			for k, text := range data {
				path := k
				for _, it := range v.ConfigMap.Items {
					if it.Key == k {
						path = it.Path
					}
				}
				require.NoError(t, os.WriteFile(filepath.Join(dir, path), []byte(text), 0o600))
			}
		case v.Secret != nil:
			require.NotEmpty(t, v.Secret.Items, "volume %s: the chart names each key", m.Name)
			for _, it := range v.Secret.Items {
				require.NoError(t, os.WriteFile(filepath.Join(dir, it.Path), secret(v.Secret.SecretName, it.Key), 0o600))
			}
		case v.EmptyDir != nil:
		default:
			t.Fatalf("volume %s: a kind the test does not lay out", m.Name)
		}
	}
	under := func(s string) string {
		if name, v, ok := strings.Cut(s, "="); ok && strings.HasPrefix(v, "/") {
			return name + "=" + filepath.Join(root, v)
		}
		return s
	}
	p := pod{root: root}
	for _, a := range c.Args {
		p.args = append(p.args, under(a))
	}
	for _, e := range c.Env {
		v := e.Value
		if e.ValueFrom != nil {
			ref := e.ValueFrom.SecretKeyRef
			require.NotNil(t, ref, "env %s: a source the test does not resolve", e.Name)
			v = string(secret(ref.Name, ref.Key))
		}
		p.env = append(p.env, under(e.Name+"="+v))
	}
	return p
}

// started runs the server as the pod would (its arguments and environment, nothing of the
// test's environment), its listeners moved to unix sockets here, and reports whether it started
// (both listeners open) or, with its output, why not (it exited first). A server that started is
// stopped with SIGTERM.
func started(t *testing.T, bin string, p pod) (bool, string) {
	t.Helper()
	sockets, err := os.MkdirTemp("", "idem") // short: a socket path holds at most 107 bytes
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(sockets) })
	grpcSock, adminSock := filepath.Join(sockets, "g.sock"), filepath.Join(sockets, "a.sock")
	args := make([]string, 0, len(p.args))
	for _, a := range p.args {
		switch {
		case strings.HasPrefix(a, "--grpc-addr="):
			a = "--grpc-addr=unix://" + grpcSock
		case strings.HasPrefix(a, "--admin-addr="):
			a = "--admin-addr=unix://" + adminSock
		}
		args = append(args, a)
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = p.env
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	// A deadline for a hung process only: a server starts or refuses its configuration in well
	// under a second.
	deadline := time.After(time.Minute)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-exited:
			require.Error(t, err, "the server exited 0 before it listened:\n%s", out.String())
			return false, out.String()
		case <-tick.C:
			_, e1 := os.Stat(grpcSock)
			_, e2 := os.Stat(adminSock)
			if e1 == nil && e2 == nil {
				require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
				require.NoError(t, <-exited, "SIGTERM after start-up:\n%s", out.String())
				return true, out.String()
			}
		case <-deadline:
			_ = cmd.Process.Kill()
			t.Fatalf("the server neither listened nor exited within a minute:\n%s", out.String())
		}
	}
}

// runHook runs the hook's container command line with its environment, and returns its exit
// status and output.
func runHook(t *testing.T, bin string, p pod) (int, string) {
	t.Helper()
	cmd := exec.Command(bin, p.args...)
	cmd.Env = p.env
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return exit.ExitCode(), string(out)
	}
	require.NoError(t, err)
	return 0, string(out)
}

// hookPod returns the hook Job's container and volumes, and checks that the Job needs nothing
// the release creates but its own ConfigMap: no Secret as a volume, an environment variable or
// envFrom (on a first install the release's Secrets do not exist yet when the hook runs).
func hookPod(t *testing.T, r rendered) (corev1.Container, []corev1.Volume) {
	t.Helper()
	job := the[*batchv1.Job](t, r, "batch/v1/Job")
	spec := job.Spec.Template.Spec
	require.Len(t, spec.Containers, 1)
	c := spec.Containers[0]
	for _, v := range spec.Volumes {
		require.Nil(t, v.Secret, "the hook mounts Secret volume %s", v.Name)
		require.Nil(t, v.Projected, "the hook mounts projected volume %s", v.Name)
	}
	require.Empty(t, c.EnvFrom)
	for _, e := range c.Env {
		if e.ValueFrom != nil {
			require.Nil(t, e.ValueFrom.SecretKeyRef, "the hook reads %s from a Secret", e.Name)
		}
	}
	return c, spec.Volumes
}

// The hook checks the configuration the pods start with: for each store (memory, Redis
// standalone, Sentinel, Cluster), with and without durability, and with and without the secret
// files (admin token, record keys, key-hash secret), the rendered hook command line, run with
// its environment against the rendered policy and none of the release's Secrets (as on a first
// install), passes exactly when the server, run with the rendered Deployment's arguments,
// environment and files, starts. Durability on the memory store is the one that does not: the
// hook fails with the server's own message.
func TestChartHookPassesExactlyWhenThePodsStart(t *testing.T) {
	bin, err := checkBinary()
	require.NoError(t, err)
	stores := map[string]string{
		"memory":     `store: { type: memory }`,
		"standalone": `store: { type: redis, redis: { url: "redis://default:pw@redis.example:6379/0" } }`,
		"sentinel":   `store: { type: redis, redis: { existingSecret: redis-credentials, sentinelAddrs: [s0.example:26379, s1.example:26379], sentinelMaster: payments } }`,
		"cluster":    `store: { type: redis, redis: { existingSecret: redis-credentials, clusterAddrs: [r0.example:6379, r1.example:6379], caSecret: redis-ca } }`,
	}
	secrets := `
adminToken: { enabled: true, value: admin-token-value }
recordKeys: { enabled: true, existingSecret: record-keys }
keyHashSecret: { enabled: true, value: "` + strings.Repeat("s", 32) + `" }
extraEnv:
  - { name: APP_PLAIN, value: plain }
  - { name: APP_SECRET, valueFrom: { secretKeyRef: { name: app-secret, key: token } } }
`
	for _, store := range []string{"memory", "standalone", "sentinel", "cluster"} {
		for _, durable := range []bool{false, true} {
			for _, withSecrets := range []bool{false, true} {
				name := fmt.Sprintf("%s/durability=%t/secrets=%t", store, durable, withSecrets)
				t.Run(name, func(t *testing.T) {
					text := stores[store] + "\npolicy: { store_timeout: 100ms }\n"
					if durable {
						text = stores[store] + "\npolicy: { store_timeout: 100ms, durability: { replicas: 1, timeout: 50ms } }\n"
					}
					if withSecrets {
						text += secrets
					}
					vals := parseValues(t, text)
					objs, err := decodeAll(mustRender(t, vals))
					require.NoError(t, err)
					r := rendered{vals: vals, objs: objs}

					d := the[*appsv1.Deployment](t, r, "apps/v1/Deployment")
					server := materialize(t, withoutHooks(objs), d.Spec.Template.Spec.Containers[0], d.Spec.Template.Spec.Volumes)
					hc, hv := hookPod(t, r)
					hook := materialize(t, objs, hc, hv)
					require.Equal(t, "check", hook.args[0])
					require.Equal(t, strip(server.args, server.root), strip(hook.args[1:], hook.root), "the hook's arguments are the Deployment's")
					if withSecrets {
						require.Contains(t, server.env, "APP_SECRET=admin-token\n")
						require.Contains(t, hook.env, "APP_PLAIN=plain", "the hook has the pods' environment")
						require.Contains(t, server.env, "APP_PLAIN=plain")
					}

					ok, serverOut := started(t, bin, server)
					code, hookOut := runHook(t, bin, hook)
					require.Equal(t, !(durable && store == "memory"), ok, "the server starts unless durability is on with the memory store:\n%s", serverOut)
					if ok {
						require.Zero(t, code, "the server starts, and the hook refuses:\n%s", hookOut)
						if withSecrets {
							require.Contains(t, hookOut, "admin-token-file: "+hook.root+"/var/run/secrets/idempotency-extproc/admin-token/token is not there to look at")
						}
						return
					}
					require.Equal(t, 2, code, "the server refuses the configuration, and the hook passes it:\n%s", hookOut)
					// The same message: the hook runs the server's start-up validation.
					msg := strings.TrimPrefix(strings.TrimSpace(serverOut), "idempotency-extproc: ")
					require.Contains(t, msg, "durability.replicas")
					require.Contains(t, strings.ReplaceAll(hookOut, hook.root, server.root), "idempotency-extproc: check: "+msg)
				})
			}
		}
	}
}

// strip removes root from each argument, for comparing the hook's with the Deployment's.
func strip(args []string, root string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = strings.ReplaceAll(a, root, "")
	}
	return out
}

// In sidecar mode too, the hook passes exactly when the processor's container in the gateway
// pod starts, on its unix socket; the memory store with durability fails both.
func TestChartSidecarHookPassesExactlyWhenTheProcessorStarts(t *testing.T) {
	bin := mustBinary(t)
	for _, name := range sidecarSets {
		for _, durable := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/durability=%t", name, durable), func(t *testing.T) {
				vals := readValues(t, name)
				pol := map[string]any{"store_timeout": "100ms"}
				if durable {
					pol["durability"] = map[string]any{"replicas": 1, "timeout": "50ms"}
				}
				vals["policy"] = pol
				objs, err := decodeAll(mustRender(t, vals))
				require.NoError(t, err)
				r := rendered{vals: vals, objs: objs}
				c, _, volumes, _ := sidecarPod(t, r)
				server := materialize(t, withoutHooks(objs), c, volumes)
				hc, hv := hookPod(t, r)
				hook := materialize(t, objs, hc, hv)
				require.Equal(t, strip(server.args, server.root), strip(hook.args[1:], hook.root), "the hook's arguments are the sidecar's")

				memory := r.value("store.type") == nil || r.value("store.type") == "memory"
				ok, serverOut := started(t, bin, server)
				code, hookOut := runHook(t, bin, hook)
				require.Equal(t, !(durable && memory), ok, serverOut)
				if ok {
					require.Zero(t, code, hookOut)
					return
				}
				require.Equal(t, 2, code, hookOut)
				require.Contains(t, hookOut, "durability.replicas")
			})
		}
	}
}

// What extraArgs and extraEnv carry is checked as the pods check it: a setting start-up refuses
// fails the hook with start-up's message.
func TestChartHookRefusesExtraSettingsStartUpRefuses(t *testing.T) {
	bin, err := checkBinary()
	require.NoError(t, err)
	for _, tc := range []struct{ name, values, want string }{
		{"a log level by flag", "extraArgs: [--log-level=loud]\n", "log-level"},
		{"a stream limit by environment", "extraEnv: [{ name: IDEMPOTENCY_MAX_STREAMS, value: \"-1\" }]\n", "IDEMPOTENCY_MAX_STREAMS"},
		{"an OTLP protocol", "extraEnv: [{ name: OTEL_EXPORTER_OTLP_ENDPOINT, value: \"http://collector:4318\" }, { name: OTEL_EXPORTER_OTLP_PROTOCOL, value: http/json }]\n", "OTEL_EXPORTER_OTLP_PROTOCOL"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vals := parseValues(t, "store: { type: memory }\npolicy: { store_timeout: 100ms }\n"+tc.values)
			objs, err := decodeAll(mustRender(t, vals))
			require.NoError(t, err)
			r := rendered{vals: vals, objs: objs}
			d := the[*appsv1.Deployment](t, r, "apps/v1/Deployment")
			server := materialize(t, withoutHooks(objs), d.Spec.Template.Spec.Containers[0], d.Spec.Template.Spec.Volumes)
			hc, hv := hookPod(t, r)
			hook := materialize(t, objs, hc, hv)
			ok, serverOut := started(t, bin, server)
			require.False(t, ok, "the server starts:\n%s", serverOut)
			code, hookOut := runHook(t, bin, hook)
			require.Equal(t, 2, code, "the server refuses the configuration, and the hook passes it:\n%s", hookOut)
			msg := strings.TrimPrefix(strings.TrimSpace(serverOut), "idempotency-extproc: ")
			require.Contains(t, msg, tc.want)
			require.Contains(t, strings.ReplaceAll(hookOut, hook.root, server.root), "idempotency-extproc: check: "+msg)
		})
	}
}
