package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// shipped returns the path of a file of envoy/.
func shipped(name string) string { return filepath.Join("..", "..", "envoy", name) }

// runCheck runs the check subcommand as dispatch does, with stdin and an empty environment, and
// returns its output and exit status (0 on success).
func runCheck(t *testing.T, stdin string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	return runCheckEnv(t, nil, stdin, args...)
}

// runCheckEnv is runCheck with the environment variables of environ.
func runCheckEnv(t *testing.T, environ map[string]string, stdin string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errOut bytes.Buffer
	err := checkCommand(args, env(environ), strings.NewReader(stdin), &out, &errOut)
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
	place := regexp.MustCompile(`^` + regexp.QuoteMeta(shipped("envoy-gateway.yaml")) + `:[0-9]+:[0-9]+: EnvoyExtensionPolicy payments/idempotency-`)
	for _, l := range lines[:2] {
		require.Contains(t, l, ": warning: ")
		require.Regexp(t, place, l)
	}
	require.Equal(t, "skipped (kinds check does not read): Gateway payments/payments-gateway ("+shipped("istio-envoyfilter.yaml")+
		"), RequestAuthentication istio-system/payments-jwt ("+shipped("istio-envoyfilter.yaml")+
		"), Service idempotency/idempotency-extproc ("+shipped("istio-envoyfilter.yaml")+")", lines[2])

	out, _, code = runCheck(t, "", "--config", shipped("policy.yaml"), shipped("envoy.yaml"))
	require.Zero(t, code)
	require.Equal(t, "ok: 4 routes protected in 1 file\n", out, "no finding: one line saying what was checked")

	out, _, code = runCheck(t, "", "--config", shipped("policy.yaml"), shipped("envoy.yaml"), shipped("istio-envoyfilter.yaml"))
	require.Zero(t, code)
	require.True(t, strings.HasPrefix(out, "ok: 10 routes protected in 2 files\n"), out)
}

// A broken setting is an error: one line naming file, resource and field, exit 1.
func TestCheckFindsErrors(t *testing.T) {
	text, err := os.ReadFile(shipped("envoy.yaml"))
	require.NoError(t, err)
	broken := writeNamed(t, "envoy.yaml", strings.Replace(string(text), "failure_mode_allow: false", "failure_mode_allow: true", 1))
	out, msg, code := runCheck(t, "", "--config", shipped("policy.yaml"), broken)
	require.Equal(t, checkFound, code)
	before := string(text[:strings.Index(string(text), "failure_mode_allow: false")])
	line, column := 1+strings.Count(before, "\n"), len(before)-strings.LastIndex(before, "\n")
	require.Equal(t, fmt.Sprintf("%s:%d:%d", broken, line, column)+`: listener "ingress_http": filter_chains[0].filters[0].typed_config.http_filters[envoy.filters.http.ext_proc].typed_config.failure_mode_allow: error: `+
		"is true, want false (requests would bypass idempotency when the processor fails): a covered request may run twice; set false\n", out)
	require.Contains(t, msg, "check: 1 error(s)")
}

// JSON output is an array of {file, resource, field, severity, problem, fix}, [] when empty.
func TestCheckJSON(t *testing.T) {
	text, err := os.ReadFile(shipped("envoy.yaml"))
	require.NoError(t, err)
	broken := strings.Replace(string(text), "failure_mode_allow: false", "failure_mode_allow: true", 1)
	out, _, code := runCheck(t, broken, "--config", shipped("policy.yaml"), "--format", "json", "--envoy-version", "1.38", "-")
	require.Equal(t, checkFound, code)
	var findings []map[string]any
	dec := json.NewDecoder(strings.NewReader(out))
	dec.DisallowUnknownFields()
	require.NoError(t, dec.Decode(&findings))
	require.Len(t, findings, 3)
	for i, f := range findings {
		want := []string{"file", "line", "column", "resource", "field", "severity", "kind", "problem", "fix"}
		if f["resource"] == "Envoy 1.38" {
			want = []string{"file", "resource", "field", "severity", "kind", "problem", "fix"} // no place in a file
		}
		require.ElementsMatch(t, want, keys(f), "finding %d", i)
		for k, v := range f {
			require.NotEmpty(t, v, k)
		}
	}
	require.Equal(t, "<stdin>", findings[0]["file"], "standard input is named <stdin>")
	require.Equal(t, "error", findings[0]["severity"])
	require.Equal(t, "failure-mode-allow", findings[0]["kind"])
	require.Positive(t, findings[0]["line"])
	require.True(t, strings.HasSuffix(findings[0]["field"].(string), ".failure_mode_allow"), findings[0]["field"])
	require.Equal(t, []any{"warning", "warning"}, []any{findings[1]["severity"], findings[2]["severity"]})

	out, _, code = runCheck(t, "", "--config", shipped("policy.yaml"), "--format", "json", shipped("envoy.yaml"))
	require.Zero(t, code)
	require.Equal(t, "[]\n", out)
}

func keys(m map[string]any) []string {
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
			[]string{"bad.yaml:2: YAML: did not find expected node content"}},
		{"malformed JSON", []string{"--config", shipped("policy.yaml"), writeNamed(t, "bad.json", "{\n  \"admin\": {\n    \"address\": ]\n}\n")},
			[]string{"bad.json:2: YAML: did not find expected node content"}},
		{"an unknown field", []string{"--config", shipped("policy.yaml"), writeNamed(t, "odd.yaml", "admin: {}\nstatic_resources:\n  listenerz: []\n")},
			[]string{"odd.yaml:3:3: static_resources.listenerz: unknown field \"listenerz\""}},
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
// when start-up fails, with the same message.
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
			_, serverErr := startupConfig([]string{"--config", path}, env(nil), false)
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
}

// check takes every flag and environment variable of serve, with serve's precedence, and
// passes exactly when start-up's validation does, with start-up's message when it does not:
// the store, the Redis modes and durability are checked together, as the server checks them.
func TestCheckTakesTheServerSettings(t *testing.T) {
	durable := writeNamed(t, "policy.yaml", "durability: { replicas: 1, timeout: 50ms }\n")
	durableRedis := writeNamed(t, "redis.yaml", "store: redis\ndurability: { replicas: 1, timeout: 50ms }\n")
	plain := shipped("policy.yaml")
	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
		ok   bool
	}{
		{"durability on the memory store", []string{"--config", durable}, nil, false},
		{"durability on the memory store by flag", []string{"--config", durable, "--store", "memory"}, map[string]string{"IDEMPOTENCY_STORE": "redis"}, false},
		{"durability on redis by flag", []string{"--config", durable, "--store=redis"}, nil, true},
		{"durability on redis by environment", []string{"--config", durable}, map[string]string{"IDEMPOTENCY_STORE": "redis"}, true},
		{"durability on redis by the file", []string{"--config", durableRedis}, nil, true},
		{"the file's redis overridden by the environment", []string{"--config", durableRedis}, map[string]string{"IDEMPOTENCY_STORE": "memory"}, false},
		{"durability on sentinel", []string{"--config", durable, "--store", "redis", "--redis-sentinel-addrs", "s0:26379,s1:26379", "--redis-sentinel-master", "payments"}, nil, true},
		{"durability on cluster", []string{"--config", durable}, map[string]string{"IDEMPOTENCY_STORE": "redis", "IDEMPOTENCY_REDIS_CLUSTER_ADDRS": "r0:6379,r1:6379"}, true},
		{"the config from the environment", nil, map[string]string{"IDEMPOTENCY_CONFIG": plain}, true},
		{"a store that does not exist", []string{"--config", plain}, map[string]string{"IDEMPOTENCY_STORE": "nonsense"}, false},
		{"cluster and sentinel", []string{"--config", plain, "--store", "redis", "--redis-cluster-addrs", "a:1", "--redis-sentinel-addrs", "b:2"}, nil, false},
		{"a redis URL redis refuses", []string{"--config", plain, "--store", "redis"}, map[string]string{"IDEMPOTENCY_REDIS_URL": "http://redis:6379"}, false},
		{"a unix socket", []string{"--config", plain, "--grpc-addr", "unix:///var/run/idempotency/extproc.sock"}, nil, true},
		{"a bad listener", []string{"--config", plain, "--admin-addr", "nowhere"}, nil, false},
		{"a bad log level", []string{"--config", plain}, map[string]string{"IDEMPOTENCY_LOG_LEVEL": "loud"}, false},
		{"an OTLP protocol the processor does not export", []string{"--config", plain}, map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, false},
		{"an OTLP traces protocol", []string{"--config", plain}, map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, true},
		{"a protocol without an endpoint", []string{"--config", plain}, map[string]string{"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, serverErr := startupConfig(tc.args, env(tc.env), false)
			require.Equal(t, tc.ok, serverErr == nil, "start-up: %v", serverErr)
			out, msg, code := runCheckEnv(t, tc.env, "", tc.args...)
			if tc.ok {
				require.Zero(t, code, msg)
				require.Contains(t, out, "the policy is valid")
				return
			}
			require.Equal(t, checkBadFile, code)
			require.Equal(t, "check: "+serverErr.Error(), msg)
		})
	}
	// The start-up message names the setting, the routes and the store's source.
	_, msg, _ := runCheck(t, "", "--config", durable)
	require.Contains(t, msg, "durability.replicas")
	require.Contains(t, msg, "memory store (store, default)")
}

// check looks at the secret files serve would read without reading them: a file that is not
// there yet (the Secret of a release not installed yet) is a note on stderr, not a failure; one
// that is there is refused only for what start-up refuses without reading it (not a regular
// file, empty, too large), never for its content.
func TestCheckSecretFilesUnread(t *testing.T) {
	dir := t.TempDir()
	absent := filepath.Join(dir, "absent")
	plain := shipped("policy.yaml")
	badToken := writeNamed(t, "token", "a token with spaces\n") // start-up refuses its content
	empty := writeNamed(t, "empty", "")
	for _, tc := range []struct {
		name  string
		args  []string
		env   map[string]string
		code  int
		notes []string
		err   string
	}{
		{"absent files", []string{"--config", plain, "--admin-token-file", absent + "/token", "--record-keys-file", absent + "/keys"},
			map[string]string{"IDEMPOTENCY_KEY_HASH_SECRET_FILE": absent + "/hmac", "SSL_CERT_FILE": absent + "/ca.crt"}, 0,
			[]string{"note: admin-token-file: " + absent + "/token is not there", "note: record-keys-file: " + absent + "/keys is not there",
				"note: key-hash-secret-file: " + absent + "/hmac is not there", "note: environment variable SSL_CERT_FILE: " + absent + "/ca.crt is not there"}, ""},
		{"content never read", []string{"--config", plain, "--admin-token-file", badToken}, nil, 0, nil, ""},
		{"a directory", []string{"--config", plain, "--record-keys-file", dir}, nil, checkBadFile, nil, "record-keys-file (flag --record-keys-file): " + dir + ": not a regular file (a directory)"},
		{"an empty file", []string{"--config", plain}, map[string]string{"IDEMPOTENCY_ADMIN_TOKEN_FILE": empty}, checkBadFile, nil, empty + " is empty"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, msg, code := runCheckEnv(t, tc.env, "", tc.args...)
			require.Equal(t, tc.code, code, msg)
			if tc.code != 0 {
				require.Contains(t, msg, tc.err)
				_, serverErr := startupConfig(tc.args, env(tc.env), false)
				require.ErrorContains(t, serverErr, tc.err, "start-up refuses it too")
				return
			}
			require.Equal(t, plain+": the policy is valid\n", out)
			for _, n := range tc.notes {
				require.Contains(t, msg, n)
			}
			if tc.notes == nil {
				require.Empty(t, msg)
			}
		})
	}
	_, err := startupConfig([]string{"--config", plain, "--admin-token-file", badToken}, env(nil), false)
	require.ErrorContains(t, err, "spaces", "start-up reads the token the check leaves unread")
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

// An Istio duration written as Istio accepts it (200ms) does not stop the check: a retry on a
// covered route is still reported, exit 1 (not 2).
func TestCheckIstioDurationAndRetry(t *testing.T) {
	text, err := os.ReadFile(shipped("istio-envoyfilter.yaml"))
	require.NoError(t, err)
	const route = "  - name: transfers\n    match:\n    - uri: { prefix: /v1/transfers }\n    route:\n    - destination: { host: payments-api.payments.svc.cluster.local, port: { number: 8080 } }\n    timeout: 30s\n"
	require.Contains(t, string(text), route)
	edited := strings.Replace(string(text), route, strings.Replace(route, "timeout: 30s", "timeout: 200ms\n    retries: { attempts: 2, perTryTimeout: 200ms, retryOn: 5xx }", 1), 1)
	edited = strings.Replace(edited, "message_timeout: 0.5s", "message_timeout: 500ms", 1)
	file := writeNamed(t, "istio.yaml", edited)
	out, msg, code := runCheck(t, "", "--config", shipped("policy.yaml"), file)
	require.Equal(t, checkFound, code, "%s\n%s", out, msg)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Regexp(t, `^`+regexp.QuoteMeta(file)+`:[0-9]+:[0-9]+: VirtualService payments/payments-api: http\[0\]\.retries\.retryOn: error: has "5xx"`, lines[0])
	require.Contains(t, msg, "check: 1 error(s)")
}
