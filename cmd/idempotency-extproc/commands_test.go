package main

import (
	"bytes"
	"flag"
	"io"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/structpb"
)

// key-hash prints the key_hash the server gives a request: the same as its log line, for a
// route scoped by a header, a path parameter and a verified claim, under a key-hash secret.
func TestKeyHashCommandMatchesTheServer(t *testing.T) {
	policyFile := writeFile(t, `
routes:
  - name: ledger
    match: {path_regex: '^/v1/orgs/(?P<org>[^/]+)/tx'}
    scope: [{header: authorization}, {path_param: org}, {jwt_claim: sub}]
`)
	secret := writeNamed(t, "secret", strings.Repeat("S", 40))
	mr := miniredis.RunT(t)
	logs, ready, _, _ := runOnMiniredis(t, mr, runOptions{}, "--config", policyFile, "--key-hash-secret-file", secret)

	payload, err := structpb.NewStruct(map[string]any{"p": map[string]any{"sub": "alice"}})
	require.NoError(t, err)
	s, err := extprocv3.NewExternalProcessorClient(dial(t, ready["grpc_addr"].(string))).Process(t.Context())
	require.NoError(t, err)
	require.NoError(t, s.Send(&extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
				{Key: ":method", RawValue: []byte("POST")},
				{Key: ":path", RawValue: []byte("/v1/orgs/acme/tx?x=1")},
				{Key: "authorization", RawValue: []byte("Bearer t0k")},
				{Key: "idempotency-key", RawValue: []byte(`"order-1"`)},
			}},
			EndOfStream: true,
		}},
		MetadataContext: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy.filters.http.jwt_authn": payload}},
	}))
	_, err = s.Recv()
	require.NoError(t, err)
	require.NoError(t, s.Send(created()))
	_, err = s.Recv()
	require.NoError(t, err)
	_ = s.CloseSend()
	line := logs.wait(t, "request", 5*time.Second)
	logged := line["key_hash"].(string)
	require.Len(t, logged, 64)

	require.Equal(t, policyFile, ready["config"])
	require.Equal(t, []any{"ledger", "default"}, ready["routes"])

	// The hash alone on one line, so that records get "$(idempotency-extproc key-hash …)" works;
	// --verbose says on stderr where it came from, without a scope value.
	var out, stderr bytes.Buffer
	require.NoError(t, dispatch(t.Context(), []string{"key-hash", "--config", policyFile, "--key-hash-secret-file", secret,
		"--path", "/v1/orgs/acme/tx", "--key", `"order-1"`, "--header", "Authorization: Bearer t0k", "--jwt-claim", "sub=alice"}, env(nil), &out, &stderr))
	require.Equal(t, logged+"\n", out.String())
	require.Empty(t, stderr.String())
	out.Reset()
	require.NoError(t, dispatch(t.Context(), []string{"key-hash", "--config", policyFile, "--key-hash-secret-file", secret, "--verbose",
		"--path", "/v1/orgs/acme/tx", "--key", `"order-1"`, "--header", "Authorization: Bearer t0k", "--jwt-claim", "sub=alice"}, env(nil), &out, &stderr))
	require.Equal(t, logged+"\n", out.String(), "--verbose writes to stderr only")
	require.Equal(t, `route: ledger
hash: HMAC-SHA256 under the key-hash secret
scope: header authorization (given by --header)
scope: path_param org (from --path)
scope: jwt_claim sub (given by --jwt-claim)
`, stderr.String())
	stderr.Reset()
	require.NoError(t, dispatch(t.Context(), []string{"key-hash", "--config", policyFile, "--verbose", "--route", "ledger", "--path", "/v1/orgs/acme/tx", "--key", "k"}, env(nil), &out, &stderr))
	require.Equal(t, `route: ledger
hash: SHA-256 (no key-hash secret)
scope: header authorization (not given)
scope: path_param org (from --path)
scope: jwt_claim sub (not given)
`, stderr.String())

	out.Reset()

	out.Reset()
	require.NoError(t, dispatch(t.Context(), []string{"key-hash", "--config", policyFile, "--key-hash-secret-file", secret,
		"--route", "ledger", "--path", "/v1/orgs/other/tx", "--key", "order-1", "--header", "authorization: Bearer t0k", "--jwt-claim", "sub=alice"}, env(nil), &out, &bytes.Buffer{}))
	require.NotContains(t, out.String(), logged, "another org is another record")
}

// key-hash reads a key the body carries, as the server does: the same record as the header key,
// and a body-hash key from the method, the path and the body.
func TestKeyHashFromTheBody(t *testing.T) {
	policyFile := writeFile(t, "routes: [{name: api, match: {path_prefix: /api}, key_json: [/id]}, {name: hashed, match: {path_prefix: /h}, missing_key: body-hash}]\n")
	hash := func(args ...string) string {
		var out bytes.Buffer
		require.NoError(t, dispatch(t.Context(), append([]string{"key-hash", "--config", policyFile}, args...), env(nil), &out, &bytes.Buffer{}))
		return strings.TrimSpace(out.String())
	}
	require.Equal(t, hash("--path", "/api", "--key", "k-1", "--body", `{"id":"k-1","n":1}`), hash("--path", "/api", "--body", `{"id":"k-1","n":1}`))
	require.NotEqual(t, hash("--path", "/h", "--body", "a=1"), hash("--path", "/h", "--body", "a=2"))
	require.Equal(t, hash("--path", "/h", "--body", "a=1"), hash("--path", "/h", "--body", "a=1", "--method", "POST"))
	require.NotEqual(t, hash("--path", "/h", "--body", "a=1"), hash("--path", "/h", "--body", "a=1", "--method", "PUT"))
}

// The subcommands' mistakes are answered with what to do.
func TestCommandErrors(t *testing.T) {
	policyFile := writeFile(t, "routes: [{name: pay, match: {path_prefix: /pay}}]\n")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"key-hash", "--config", policyFile, "--path", "/pay"}, "it carries no key"},
		{[]string{"key-hash", "--config", policyFile, "--key", "k"}, "give --route"},
		{[]string{"key-hash", "--config", policyFile, "--route", "nope", "--key", "k"}, "nope"},
		{[]string{"key-hash", "--config", policyFile, "--path", "/pay", "--key", "bad key"}, "400 invalid-idempotency-key"},
		{[]string{"key-hash", "--config", policyFile, "--path", "/pay", "--key", "k", "--header", "novalue"}, "'name: value'"},
		{[]string{"records"}, "say get, purge or list"},
		{[]string{"records", "lsit"}, `"lsit" is neither get, purge nor list`},
		{[]string{"records", "list"}, "--token-file is required"},
		{[]string{"records", "list", "--limit", "0"}, "--limit 0: give a count of 1 or more"},
		{[]string{"records", "list", "extra"}, `unexpected arguments ["extra"]`},
		{[]string{"records", "get", "abc"}, "not a key_hash"},
		{[]string{"records", "get", strings.Repeat("a", 64)}, "--token-file is required"},
		{[]string{"records", "get", strings.Repeat("a", 64), "--token-file", writeNamed(t, "tok", "t"), "--admin-url", "ftp://x"}, "not an http(s) URL"},
		{[]string{"records", "get", strings.Repeat("a", 64), "--token-file", writeNamed(t, "tok2", "t"), "--admin-url", "http://" + freeLoopbackAddr(t)}, "cannot reach the admin listener"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			err := dispatch(t.Context(), tc.args, env(nil), &bytes.Buffer{}, &bytes.Buffer{})
			require.ErrorContains(t, err, tc.want)
			require.NotContains(t, err.Error(), "novalue", "a malformed header may be a credential: not echoed")
		})
	}
}

// help, -h and --help print the usage on stdout and succeed: the commands, check included,
// and every flag of the server; a command's --help prints its own. A mistake goes to the
// error, which main prints on stderr before it exits 1, and prints nothing on stdout.
func TestHelp(t *testing.T) {
	server := []string{"usage: idempotency-extproc [COMMAND] [flags]", "check a policy and Envoy/Istio/Envoy Gateway files before deploying them"}
	for _, c := range []string{"serve", "check", "key-hash", "records", "version", "help"} {
		server = append(server, "\n  "+c+" ")
	}
	for _, s := range allSettings {
		server = append(server, "\n  -"+s.name+" ", "(env "+s.env()+")")
	}
	keyHash := []string{"usage: idempotency-extproc key-hash", "\n  -verbose\n", "\n  -route name\n"}
	records := []string{"usage: idempotency-extproc records get|purge", "\n  -token-file file\n"}
	version := []string{"usage: idempotency-extproc version\n", "Prints the version"}
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"help"}, server},
		{[]string{"-h"}, server},
		{[]string{"-help"}, server},
		{[]string{"--help"}, server},
		{[]string{"serve", "--help"}, server},
		{[]string{"--store", "redis", "-h"}, server},
		{[]string{"help", "key-hash"}, keyHash},
		{[]string{"key-hash", "--help"}, keyHash},
		{[]string{"key-hash", "-h"}, keyHash},
		{[]string{"help", "records"}, records},
		{[]string{"records", "--help"}, records},
		{[]string{"records", "get", "--help"}, records},
		{[]string{"version", "--help"}, version},
		{[]string{"version", "-h"}, version},
		{[]string{"help", "version"}, version},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			require.NoError(t, dispatch(t.Context(), tc.args, env(nil), &stdout, &stderr))
			for _, w := range tc.want {
				require.Contains(t, stdout.String(), w)
			}
			require.Empty(t, stderr.String())
		})
	}

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--colour"}, "flag provided but not defined: -colour (idempotency-extproc help lists the flags)"},
		{[]string{"serve", "extra"}, `unexpected arguments ["extra"]: the server takes flags only (idempotency-extproc help lists the commands and flags)`},
		{[]string{"recods", "get"}, `unknown command "recods" (idempotency-extproc help lists the commands)`},
		{[]string{"key-hash", "--colour"}, "key-hash: flag provided but not defined: -colour (idempotency-extproc key-hash --help lists the flags)"},
		{[]string{"records", "get", "--colour"}, "records: flag provided but not defined: -colour (idempotency-extproc records --help lists the flags)"},
		{[]string{"version", "--colour"}, "version: flag provided but not defined: -colour (idempotency-extproc version --help lists the flags)"},
		{[]string{"version", "now"}, `version: unexpected arguments ["now"]`},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var stdout bytes.Buffer
			err := dispatch(t.Context(), tc.args, env(nil), &stdout, io.Discard)
			require.EqualError(t, err, tc.want)
			require.Empty(t, stdout.String())
		})
	}
}

// Every flag of every command shows a placeholder that says what its value is (or none, for a
// switch): the flag package takes the first back-quoted word of a description as the
// placeholder, and a description that quotes code (`/metrics`, `memory`) showed that instead.
func TestFlagPlaceholders(t *testing.T) {
	allowed := []string{"", "file", "address", "addresses", "url", "kind", "name", "bool", "bytes", "level", "format",
		"path", "key", "uri", "header", "claim", "number", "count", "body", "method"}
	flagLine := regexp.MustCompile(`(?m)^  -([a-z-]+)(?: (.*))?$`)
	for _, args := range [][]string{{"help"}, {"key-hash", "--help"}, {"records", "--help"}} {
		var out bytes.Buffer
		require.NoError(t, dispatch(t.Context(), args, env(nil), &out, io.Discard))
		flags := flagLine.FindAllStringSubmatch(out.String(), -1)
		require.NotEmpty(t, flags, args)
		for _, f := range flags {
			require.Contains(t, allowed, f[2], "%v: -%s shows the placeholder %q", args, f[1], f[2])
		}
		require.NotContains(t, out.String(), "`", "%v: a back quote left in a description", args)
		require.NotRegexp(t, `\{[a-z]+\}`, out.String(), "%v: a placeholder mark left in a description", args)
	}
	fs, _ := serverFlags(allSettings)
	fs.VisitAll(func(f *flag.Flag) {
		name, _ := flag.UnquoteUsage(f)
		require.Contains(t, allowed, name, "-%s", f.Name)
		require.NotEqual(t, "string", name, "-%s has no placeholder of its own", f.Name)
	})
}

// version and --version print the version alone on stdout.
func TestVersionCommand(t *testing.T) {
	for _, args := range [][]string{{"version"}, {"--version"}, {"-version"}} {
		var stdout, stderr bytes.Buffer
		require.NoError(t, dispatch(t.Context(), args, env(nil), &stdout, &stderr))
		require.Equal(t, currentBuild().version+"\n", stdout.String())
		require.Empty(t, stderr.String())
	}
}

// key-hash reads a JSON route's body as the stream does: the route match.json chooses, and the
// json scope values.
func TestKeyHashOfAJSONRoute(t *testing.T) {
	policyFile := writeFile(t, "routes:\n  - name: tools\n    match: {path_prefix: /mcp, json: {/method: tools/call}}\n    key_json: [/params/_meta/idempotencyKey]\n    scope: [{json: /params/name}]\n")
	call := `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"send_mail","_meta":{"idempotencyKey":"k"}}}`
	keyHash := func(body string) (string, string) {
		var out, stderr bytes.Buffer
		require.NoError(t, dispatch(t.Context(), []string{"key-hash", "--config", policyFile, "--verbose", "--path", "/mcp", "--key", "k", "--body", body}, env(nil), &out, &stderr))
		return strings.TrimSpace(out.String()), stderr.String()
	}
	hash, explained := keyHash(call)
	require.Len(t, hash, 64)
	require.Equal(t, "route: tools\nhash: SHA-256 (no key-hash secret)\nscope: json /params/name (from --body)\n", explained)
	other, _ := keyHash(strings.Replace(call, "send_mail", "charge_card", 1))
	require.NotEqual(t, hash, other, "another tool is another scope")
	_, explained = keyHash(`{"method":"tools/list"}`)
	require.Contains(t, explained, "route: default", "a body match.json does not take goes to the next route")
}
