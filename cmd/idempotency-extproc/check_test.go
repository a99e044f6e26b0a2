package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// shipped returns the path of a file of envoy/.
func shipped(name string) string { return filepath.Join("..", "..", "envoy", name) }

// runCheck runs the check subcommand as dispatch does, with stdin, and returns its output and
// exit status (0 on success).
func runCheck(t *testing.T, stdin string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errOut bytes.Buffer
	err := checkCommand(args, strings.NewReader(stdin), &out, &errOut)
	if err != nil {
		var ee *exitError
		require.ErrorAs(t, err, &ee, "check ends with an exit status: %v", err)
		return out.String(), err.Error(), ee.ExitCode()
	}
	return out.String(), errOut.String(), 0
}

// The shipped files pass: exit 0, only the warnings of Envoy Gateway's request trailers, and
// the kinds check does not read named on the last line.
func TestCheckShippedFiles(t *testing.T) {
	out, _, code := runCheck(t, "", "--config", shipped("policy.yaml"),
		shipped("envoy.yaml"), shipped("istio-envoyfilter.yaml"), shipped("envoy-gateway.yaml"))
	require.Zero(t, code, out)
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	require.Len(t, lines, 3, out)
	for _, l := range lines[:2] {
		require.Contains(t, l, ": warning: ")
		require.True(t, strings.HasPrefix(l, shipped("envoy-gateway.yaml")+": EnvoyExtensionPolicy payments/idempotency-"), l)
	}
	require.Equal(t, "skipped (kinds check does not read): Gateway payments/payments-gateway ("+shipped("istio-envoyfilter.yaml")+
		"), RequestAuthentication istio-system/payments-jwt ("+shipped("istio-envoyfilter.yaml")+
		"), Service idempotency/idempotency-extproc ("+shipped("istio-envoyfilter.yaml")+")", lines[2])

	out, _, code = runCheck(t, "", "--config", shipped("policy.yaml"), shipped("envoy.yaml"))
	require.Zero(t, code)
	require.Empty(t, out, "no finding, no line")
}

// A broken setting is an error: one line naming file, resource and field, exit 1.
func TestCheckFindsErrors(t *testing.T) {
	text, err := os.ReadFile(shipped("envoy.yaml"))
	require.NoError(t, err)
	broken := writeNamed(t, "envoy.yaml", strings.Replace(string(text), "failure_mode_allow: false", "failure_mode_allow: true", 1))
	out, msg, code := runCheck(t, "", "--config", shipped("policy.yaml"), broken)
	require.Equal(t, checkFound, code)
	require.Equal(t, broken+`: listener "ingress_http": filter_chains[0].filters[0].typed_config.http_filters[envoy.filters.http.ext_proc].typed_config.failure_mode_allow: error: `+
		"is true, want false (requests would bypass idempotency when the processor fails): a covered request may run twice; set false\n", out)
	require.Contains(t, msg, "check: 1 error(s)")
}

// JSON output is an array of {file, resource, field, severity, problem, fix}, [] when empty.
func TestCheckJSON(t *testing.T) {
	text, err := os.ReadFile(shipped("envoy.yaml"))
	require.NoError(t, err)
	broken := strings.Replace(string(text), "allow_mode_override: true", "allow_mode_override: false", 1)
	out, _, code := runCheck(t, broken, "--config", shipped("policy.yaml"), "--format", "json", "--envoy-version", "1.38", "-")
	require.Equal(t, checkFound, code)
	var findings []map[string]string
	dec := json.NewDecoder(strings.NewReader(out))
	dec.DisallowUnknownFields()
	require.NoError(t, dec.Decode(&findings))
	require.Len(t, findings, 3)
	for _, f := range findings {
		require.ElementsMatch(t, []string{"file", "resource", "field", "severity", "problem", "fix"}, keys(f))
		for k, v := range f {
			require.NotEmpty(t, v, k)
		}
	}
	require.Equal(t, "-", findings[0]["file"], "standard input is named -")
	require.Equal(t, "error", findings[0]["severity"])
	require.True(t, strings.HasSuffix(findings[0]["field"], ".allow_mode_override"), findings[0]["field"])
	require.Equal(t, []string{"warning", "warning"}, []string{findings[1]["severity"], findings[2]["severity"]})

	out, _, code = runCheck(t, "", "--config", shipped("policy.yaml"), "--format", "json", shipped("envoy.yaml"))
	require.Zero(t, code)
	require.Equal(t, "[]\n", out)
}

func keys(m map[string]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// What cannot be read or parsed is exit 2, naming the file, and the line where the decoder
// knows it.
func TestCheckUnreadable(t *testing.T) {
	good := shipped("envoy.yaml")
	for _, tc := range []struct {
		name string
		args []string
		want []string
	}{
		{"missing file", []string{"--config", shipped("policy.yaml"), good, "nope.yaml"}, []string{"check: nope.yaml: no such file or directory"}},
		{"malformed YAML", []string{"--config", shipped("policy.yaml"), writeNamed(t, "bad.yaml", "static_resources:\n  listeners: [\n")},
			[]string{"bad.yaml: line 2: YAML: did not find expected node content"}},
		{"malformed JSON", []string{"--config", shipped("policy.yaml"), writeNamed(t, "bad.json", "{\n  \"admin\": {\n    \"address\": ]\n}\n")},
			[]string{"bad.json: line 2: YAML: did not find expected node content"}},
		{"an unknown field", []string{"--config", shipped("policy.yaml"), writeNamed(t, "odd.yaml", "admin: {}\nstatic_resources:\n  listenerz: []\n")},
			[]string{"odd.yaml: line 3: static_resources.listenerz: unknown field \"listenerz\""}},
		{"missing policy", []string{"--config", "nope-policy.yaml", good}, []string{"config (flag --config): open nope-policy.yaml: no such file or directory"}},
		{"bad policy", []string{"--config", writeNamed(t, "policy.yaml", "defaults:\n  ttl: 24h\n  tll: 1h\n"), good},
			[]string{"policy.yaml", "defaults.tll", "(line 3)"}},
		{"no --config", []string{good}, []string{"--config is required"}},
		{"bad format", []string{"--config", shipped("policy.yaml"), "--format", "yaml", good}, []string{"--format must be text or json"}},
		{"bad version", []string{"--config", shipped("policy.yaml"), "--envoy-version", "latest", good}, []string{`--envoy-version: "latest" is not an Envoy version`}},
		{"unknown flag", []string{"--config", shipped("policy.yaml"), "--strict", good}, []string{"flag provided but not defined: -strict"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, msg, code := runCheck(t, "", tc.args...)
			require.Equal(t, checkBadFile, code, msg)
			require.Empty(t, out)
			for _, w := range tc.want {
				require.Contains(t, msg, w)
			}
		})
	}
}

// Without a FILE, check validates the policy exactly as the server does at start-up: it fails
// when loadConfig fails, with the same message, and the environment plays no part.
func TestCheckPolicyAlone(t *testing.T) {
	for _, tc := range []struct{ name, policy string }{
		{"shipped", ""},
		{"unknown field", "routes:\n  - name: a\n    match: { path_prefix: /a }\n    ttll: 1h\n"},
		{"bad setting in the file", "store: redis\nredis_url: http://x\n"},
		{"bad regex", "routes:\n  - name: a\n    match: { path_regex: '(' }\n"},
		{"defaults only", "store_timeout: 150ms\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := shipped("policy.yaml")
			if tc.policy != "" {
				path = writeNamed(t, "policy.yaml", tc.policy)
			}
			_, serverErr := loadConfig([]string{"--config", path}, env(nil))
			out, msg, code := runCheck(t, "", "--config", path)
			if serverErr == nil {
				require.Zero(t, code, msg)
				require.Equal(t, path+": the policy is valid\n", out)
				return
			}
			require.Equal(t, checkBadFile, code)
			require.Equal(t, "check: "+serverErr.Error(), msg)
		})
	}
	// The server's environment does not leak into the check.
	t.Setenv("IDEMPOTENCY_STORE", "nonsense")
	_, _, code := runCheck(t, "", "--config", shipped("policy.yaml"))
	require.Zero(t, code)
}

func TestCheckHelp(t *testing.T) {
	out, msg, code := runCheck(t, "", "--help")
	require.Zero(t, code, msg)
	require.True(t, strings.HasPrefix(out, "usage: idempotency-extproc check --config POLICY"), out)
	for _, flag := range []string{"-config", "-format", "-envoy-version"} {
		require.Contains(t, out, flag)
	}
}

// The process exits with check's status, and dispatch routes "check" to it.
func TestCheckBinaryExitStatus(t *testing.T) {
	bin, err := binary()
	require.NoError(t, err)
	text, err := os.ReadFile(shipped("envoy.yaml"))
	require.NoError(t, err)
	for _, tc := range []struct {
		name  string
		args  []string
		stdin string
		want  int
	}{
		{"good", []string{"--config", shipped("policy.yaml"), "-"}, string(text), 0},
		{"an error", []string{"--config", shipped("policy.yaml"), "-"}, strings.Replace(string(text), "failure_mode_allow: false", "failure_mode_allow: true", 1), 1},
		{"unreadable", []string{"--config", shipped("policy.yaml"), "-"}, "{{{", 2},
		{"an unknown flag", []string{"--bogus"}, "", 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cmd := exec.Command(bin, append([]string{"check"}, tc.args...)...)
			cmd.Stdin = strings.NewReader(tc.stdin)
			out, err := cmd.CombinedOutput()
			code := 0
			var exit *exec.ExitError
			if errors.As(err, &exit) {
				code = exit.ExitCode()
			} else {
				require.NoError(t, err)
			}
			require.Equal(t, tc.want, code, string(out))
		})
	}
}
