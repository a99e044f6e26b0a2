package main

import (
	"bytes"
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

	var out bytes.Buffer
	require.NoError(t, dispatch(t.Context(), []string{"key-hash", "--config", policyFile, "--key-hash-secret-file", secret,
		"--path", "/v1/orgs/acme/tx", "--key", `"order-1"`, "--header", "Authorization: Bearer t0k", "--jwt-claim", "sub=alice"}, env(nil), &out, &bytes.Buffer{}))
	require.Equal(t, logged+"\troute=ledger\n", out.String())

	out.Reset()
	require.NoError(t, dispatch(t.Context(), []string{"key-hash", "--config", policyFile, "--key-hash-secret-file", secret,
		"--route", "ledger", "--path", "/v1/orgs/other/tx", "--key", "order-1", "--header", "authorization: Bearer t0k", "--jwt-claim", "sub=alice"}, env(nil), &out, &bytes.Buffer{}))
	require.NotContains(t, out.String(), logged, "another org is another record")
}

// The subcommands' mistakes are answered with what to do.
func TestCommandErrors(t *testing.T) {
	policyFile := writeFile(t, "routes: [{name: pay, match: {path_prefix: /pay}}]\n")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"key-hash", "--config", policyFile, "--path", "/pay"}, "--key is required"},
		{[]string{"key-hash", "--config", policyFile, "--key", "k"}, "give --route"},
		{[]string{"key-hash", "--config", policyFile, "--route", "nope", "--key", "k"}, "nope"},
		{[]string{"key-hash", "--config", policyFile, "--path", "/pay", "--key", "bad key"}, "not a valid idempotency key"},
		{[]string{"key-hash", "--config", policyFile, "--path", "/pay", "--key", "k", "--header", "novalue"}, "'name: value'"},
		{[]string{"records"}, "say get or purge"},
		{[]string{"records", "list"}, `"list" is neither get nor purge`},
		{[]string{"records", "get", "abc"}, "not a key_hash"},
		{[]string{"records", "get", strings.Repeat("a", 64)}, "--token-file is required"},
		{[]string{"records", "get", strings.Repeat("a", 64), "--token-file", writeNamed(t, "tok", "t"), "--admin-url", "ftp://x"}, "not an http(s) URL"},
		{[]string{"records", "get", strings.Repeat("a", 64), "--token-file", writeNamed(t, "tok2", "t"), "--admin-url", "http://" + freeLoopbackAddr(t)}, "cannot reach the admin listener"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			err := dispatch(t.Context(), tc.args, env(nil), &bytes.Buffer{}, &bytes.Buffer{})
			require.ErrorContains(t, err, tc.want)
		})
	}
	var help bytes.Buffer
	require.NoError(t, dispatch(t.Context(), []string{"key-hash", "--help"}, env(nil), &bytes.Buffer{}, &help))
	require.Contains(t, help.String(), "usage: idempotency-extproc key-hash")
	help.Reset()
	require.NoError(t, dispatch(t.Context(), []string{"records", "--help"}, env(nil), &bytes.Buffer{}, &help))
	require.Contains(t, help.String(), "usage: idempotency-extproc records get|purge")
}
