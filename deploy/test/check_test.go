package deploytest

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// checkBinary is the binary built once for the tests that run `idempotency-extproc check`, the
// command the chart's hook runs (an internal package of the main module cannot be imported from
// this one).
var checkBinary = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "idempotency-extproc-check")
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "idempotency-extproc")
	build := exec.Command("go", "build", "-o", bin, "./cmd/idempotency-extproc")
	build.Dir = repoRoot
	if out, err := build.CombinedOutput(); err != nil {
		return "", errors.New("go build: " + err.Error() + "\n" + string(out))
	}
	return bin, nil
})

// runChecker runs the built binary's check subcommand with args and stdin, and returns its
// standard output, standard error and exit status.
func runChecker(t *testing.T, stdin string, args ...string) (string, string, int) {
	t.Helper()
	bin, err := checkBinary()
	require.NoError(t, err)
	cmd := exec.Command(bin, append([]string{"check"}, args...)...)
	cmd.Stdin = strings.NewReader(stdin)
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err = cmd.Run()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return stdout.String(), stderr.String(), exit.ExitCode()
	}
	require.NoError(t, err)
	return stdout.String(), stderr.String(), 0
}

// isHook reports whether a rendered object is a Helm hook.
func isHook(o object) bool { _, ok := o.meta.Annotations["helm.sh/hook"]; return ok }

// withoutHooks drops the hooks of objs: what `helm install` applies as the release.
func withoutHooks(objs []object) []object {
	var out []object
	for _, o := range objs {
		if !isHook(o) {
			out = append(out, o)
		}
	}
	return out
}

// policyCheck returns the policy check hook of a rendered set: the Job and the policy file its
// container reads, followed through its volume to the hook's ConfigMap. Nil when the set
// renders none.
func (r rendered) policyCheck(t *testing.T) (*batchv1.Job, *corev1.ConfigMap, string) {
	t.Helper()
	jobs := find[*batchv1.Job](r.objs, "batch/v1/Job")
	if len(jobs) == 0 {
		return nil, nil, ""
	}
	require.Len(t, jobs, 1)
	job := jobs[0]
	pod := job.Spec.Template.Spec
	require.Len(t, pod.Containers, 1)
	c := pod.Containers[0]
	require.Equal(t, []string{"check"}, c.Args[:1], "the hook runs the check subcommand")
	var file string
	for _, a := range c.Args[1:] {
		if v, ok := strings.CutPrefix(a, "--config="); ok {
			file = v
		}
	}
	require.NotEmpty(t, file, "check --config: %v", c.Args)
	dir, base := path.Split(file)
	var cmName string
	for _, m := range c.VolumeMounts {
		if m.MountPath == strings.TrimSuffix(dir, "/") {
			require.True(t, m.ReadOnly)
			for _, v := range pod.Volumes {
				if v.Name == m.Name && v.ConfigMap != nil {
					cmName = v.ConfigMap.Name
				}
			}
		}
	}
	require.NotEmpty(t, cmName, "no ConfigMap is mounted at %s", dir)
	for _, o := range r.objs {
		if cm, ok := o.obj.(*corev1.ConfigMap); ok && cm.Name == cmName {
			require.True(t, isHook(o), "the hook's policy ConfigMap is a hook too: the release's still holds the old policy at pre-upgrade")
			policy, ok := cm.Data[base]
			require.True(t, ok, "ConfigMap %s has no %s", cmName, base)
			return job, cm, policy
		}
	}
	t.Fatalf("ConfigMap %s is not rendered", cmName)
	return nil, nil, ""
}

// The policy check hook runs `check --config` on the policy the release mounts, before the
// release's objects and on every upgrade, with the image and the security context of the
// Deployment, in a pod no selector of the chart selects; policyCheck.enabled false renders none.
func TestChartPolicyCheckHook(t *testing.T) {
	for _, name := range append(valueSets, "policy from a file", "disabled") {
		t.Run(name, func(t *testing.T) {
			if name == "policy from a file" { // --set-file policy=FILE: a string, written verbatim
				vals := readValues(t, "memory")
				vals["policy"] = "# ours\ndefaults:\n  ttl: 1h\nstore_timeout: 150ms\n"
				objs, err := decodeAll(mustRender(t, vals))
				require.NoError(t, err)
				_, _, policy := rendered{vals: vals, objs: objs}.policyCheck(t)
				require.Equal(t, strings.TrimSpace(vals["policy"].(string)), strings.TrimSpace(policy))
				return
			}
			if name == "disabled" {
				vals := readValues(t, "memory")
				vals["policyCheck"] = map[string]any{"enabled": false}
				objs, err := decodeAll(mustRender(t, vals))
				require.NoError(t, err)
				job, _, _ := rendered{vals: vals, objs: objs}.policyCheck(t)
				require.Nil(t, job)
				for _, o := range objs {
					require.False(t, isHook(o), "%s %s", o.gvk, o.meta.Name)
				}
				return
			}
			r := renderSet(t, name)
			job, hookCM, hookPolicy := r.policyCheck(t)
			require.NotNil(t, job, "on by default")

			// The same policy as the release's ConfigMap, the one the Deployment mounts.
			d, c := r.deployment(t)
			cfg, _ := arg(c.Args, "config")
			mainCM, key := r.mountedFile(t, cfg)
			var releasePolicy string
			for _, o := range withoutHooks(r.objs) {
				if cm, ok := o.obj.(*corev1.ConfigMap); ok && cm.Name == mainCM {
					releasePolicy = cm.Data[key]
				}
			}
			require.NotEmpty(t, releasePolicy)
			require.Equal(t, releasePolicy, hookPolicy)

			// Hooks of both phases, the ConfigMap first, both deleted once the check passed.
			for _, meta := range []metav1.ObjectMeta{job.ObjectMeta, hookCM.ObjectMeta} {
				require.Equal(t, "pre-install,pre-upgrade", meta.Annotations["helm.sh/hook"])
				require.Equal(t, "before-hook-creation,hook-succeeded", meta.Annotations["helm.sh/hook-delete-policy"])
				require.Equal(t, releaseNS, meta.Namespace)
			}
			require.Less(t, weight(t, hookCM.ObjectMeta), weight(t, job.ObjectMeta))

			pod := job.Spec.Template.Spec
			require.Equal(t, corev1.RestartPolicyNever, pod.RestartPolicy)
			require.Zero(t, *job.Spec.BackoffLimit, "a bad policy stays bad: no retry")
			require.NotNil(t, job.Spec.ActiveDeadlineSeconds)
			check := pod.Containers[0]
			require.Equal(t, c.Image, check.Image)
			require.Equal(t, d.Spec.Template.Spec.SecurityContext, pod.SecurityContext)
			require.Equal(t, c.SecurityContext, check.SecurityContext)
			require.True(t, *pod.SecurityContext.RunAsNonRoot)
			require.True(t, *check.SecurityContext.ReadOnlyRootFilesystem)
			require.False(t, *pod.AutomountServiceAccountToken)
			require.Empty(t, pod.ServiceAccountName, "the release's ServiceAccount does not exist yet at pre-install")
			require.Equal(t, d.Spec.Template.Spec.ImagePullSecrets, pod.ImagePullSecrets)
			require.NotNil(t, check.Resources.Limits.Memory())

			sel, err := metav1.LabelSelectorAsSelector(d.Spec.Selector)
			require.NoError(t, err)
			require.False(t, sel.Matches(labels.Set(job.Spec.Template.Labels)), "the Deployment's selector takes the check's pod")
			svc := the[*corev1.Service](t, r, "v1/Service")
			require.False(t, labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(job.Spec.Template.Labels)), "the Service routes to the check")
		})
	}
}

func weight(t *testing.T, m metav1.ObjectMeta) int {
	t.Helper()
	var w int
	require.NoError(t, json.Unmarshal([]byte(m.Annotations["helm.sh/hook-weight"]), &w))
	return w
}

// The hook's check passes on the policy of every value set and fails, exit 2 naming the file
// and the line, on a policy the server would refuse: the install or upgrade stops there.
func TestChartPolicyCheckRuns(t *testing.T) {
	for _, name := range valueSets {
		t.Run(name, func(t *testing.T) {
			_, _, policy := renderSet(t, name).policyCheck(t)
			file := filepath.Join(t.TempDir(), "policy.yaml")
			require.NoError(t, os.WriteFile(file, []byte(policy), 0o600))
			out, stderr, code := runChecker(t, "", "--config", file)
			require.Zero(t, code, stderr)
			require.Equal(t, file+": the policy is valid\n", out)
		})
	}
	for _, tc := range []struct{ name, policy, want string }{
		{"an unknown field", "defaults:\n  ttl: 24h\n  tll: 1h\n", "defaults.tll"},
		{"a bad duration", "store_timeout: fast\n", "store_timeout"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vals := readValues(t, "memory")
			vals["policy"] = tc.policy // as --set-file policy=FILE gives it
			objs, err := decodeAll(mustRender(t, vals))
			require.NoError(t, err, "the chart renders the policy as it is: the hook is what refuses it")
			_, _, policy := rendered{vals: vals, objs: objs}.policyCheck(t)
			file := filepath.Join(t.TempDir(), "policy.yaml")
			require.NoError(t, os.WriteFile(file, []byte(policy), 0o600))
			out, stderr, code := runChecker(t, "", "--config", file)
			require.Equal(t, 2, code, stderr)
			require.Empty(t, out)
			require.Contains(t, stderr, file)
			require.Contains(t, stderr, tc.want)
			require.Regexp(t, `\(line \d+\)`, stderr)
		})
	}
}

// The chart's rendered mesh resources pass the check users run, against the policy the chart
// renders: as `helm template ... | idempotency-extproc check --config POLICY -`, the objects of
// other kinds skipped and named, and as a file of the Istio and Envoy Gateway objects alone.
func TestChartMeshResourcesPassTheCheck(t *testing.T) {
	for _, name := range meshSets {
		t.Run(name, func(t *testing.T) {
			r := renderSet(t, name)
			_, _, policy := r.policyCheck(t)
			policyFile := filepath.Join(t.TempDir(), "policy.yaml")
			require.NoError(t, os.WriteFile(policyFile, []byte(policy), 0o600))

			var all strings.Builder
			for _, o := range r.objs {
				all.WriteString("---\n# Source: " + o.template + "\n" + o.yaml + "\n")
			}
			out, stderr, code := runChecker(t, all.String(), "--config", policyFile, "--format", "json", "-")
			require.Zero(t, code, "%s\n%s", out, stderr)
			var findings []struct{ File, Resource, Field, Severity, Problem, Fix string }
			require.NoError(t, json.Unmarshal([]byte(out), &findings))
			for _, f := range findings {
				require.Equal(t, "warning", f.Severity, "%+v", f)
			}
			require.NotEmpty(t, findings, "Envoy Gateway's request trailers are a warning")

			meshes := writeDocs(t, r, "networking.istio.io/v1alpha3/EnvoyFilter", "networking.istio.io/v1/DestinationRule",
				"gateway.envoyproxy.io/v1alpha1/EnvoyExtensionPolicy", "gateway.envoyproxy.io/v1alpha1/ClientTrafficPolicy",
				"gateway.envoyproxy.io/v1alpha1/BackendTrafficPolicy")
			out, stderr, code = runChecker(t, "", "--config", policyFile, meshes)
			require.Zero(t, code, "%s\n%s", out, stderr)
			require.NotContains(t, out, ": error: ")
			require.NotContains(t, out, "skipped", "every kind of the file is read")
		})
	}
}
