package main

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The shipped gRPC examples pass under their policy, envoy/grpc-policy.yaml: the standalone
// bootstrap, the Istio file (its payments-grpc VirtualService route and the HTTP_ROUTE patch
// that gives it the gRPC processing modes) and the Envoy Gateway GRPCRoute with its
// EnvoyExtensionPolicy. Each gRPC route is held to what a gRPC route needs: with its response
// trailers withheld, or the Istio route's retries left to Istio's default policy, the same file
// fails.
func TestCheckShippedGRPCFiles(t *testing.T) {
	files := []string{shipped("envoy-grpc.yaml"), shipped("istio-envoyfilter.yaml"), shipped("envoy-gateway-grpc.yaml")}
	out, msg, code := runCheck(t, "", append([]string{"--config", shipped("grpc-policy.yaml"), "--envoy-version", "1.39.1"}, files...)...)
	require.Zero(t, code, "%s\n%s", out, msg)
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	require.Equal(t, "ok: 9 routes protected in 3 files", lines[0], out)
	require.Len(t, lines, 2, "no finding: what was checked, and the kinds check does not read")
	require.True(t, strings.HasPrefix(lines[1], "skipped (kinds check does not read): Gateway payments/payments-gateway"), out)

	for _, tc := range []struct {
		name, file, old, new, kind string
	}{
		{"Envoy route without response trailers", "envoy-grpc.yaml",
			"response_trailer_mode: SEND", "response_trailer_mode: SKIP", "response_trailer_mode: error: is SKIP on a gRPC route"},
		{"Istio route without response trailers", "istio-envoyfilter.yaml",
			"                response_trailer_mode: SEND", "                response_trailer_mode: SKIP", "response_trailer_mode: error: is SKIP on a gRPC route"},
		{"Istio route under Istio's default retries", "istio-envoyfilter.yaml",
			"    retries: { attempts: 0 }\n", "", `VirtualService payments/payments-grpc: http[0].retries: error: is not set, so Istio's default retry policy applies, which has "unavailable" on a gRPC route`},
		{"Envoy Gateway response body Streamed", "envoy-gateway-grpc.yaml",
			"body: FullDuplexStreamed   # the only mode", "body: Streamed   # the only mode", "processingMode.response.body: error: is Streamed on a gRPC route, and Envoy Gateway sends response trailers only with FullDuplexStreamed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			text := readShipped(t, tc.file)
			require.Equal(t, 1, strings.Count(text, tc.old), "the edit applies to exactly one place")
			broken := writeNamed(t, tc.file, strings.Replace(text, tc.old, tc.new, 1))
			out, msg, code := runCheck(t, "", "--config", shipped("grpc-policy.yaml"), broken)
			require.Equal(t, checkFound, code, "%s\n%s", out, msg)
			require.Contains(t, out, tc.kind)
		})
	}
}

// Under Envoy before 1.37 the shipped gRPC route cannot replay a call: check says so.
func TestCheckShippedGRPCBefore137(t *testing.T) {
	out, _, code := runCheck(t, "", "--config", shipped("grpc-policy.yaml"), "--envoy-version", "1.36", shipped("envoy-grpc.yaml"))
	require.Equal(t, checkFound, code)
	require.Contains(t, out, "request_body_mode: error: is FULL_DUPLEX_STREAMED on a gRPC route, under which the processor replays a completed call as a streamed immediate response, which Envoy 1.36 does not know")
}

func readShipped(t *testing.T, name string) string {
	t.Helper()
	text, err := os.ReadFile(shipped(name))
	require.NoError(t, err)
	return string(text)
}
