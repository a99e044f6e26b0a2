package check

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// An Istio gRPC route is the VirtualService's http route and the HTTP_ROUTE patch that MERGEs the
// gRPC processing modes into it: check reads the two as one route, as Istio builds it. The
// shipped file under envoy/grpc-policy.yaml has no gRPC finding; without the patch (the
// filter-level modes apply) or with a patch that withholds the response trailers, the route's
// trailers are refused where they are set.
func TestRunIstioGRPCRoutePatch(t *testing.T) {
	shipped := readEnvoyFile(t, "istio-envoyfilter.yaml")
	grpcPolicy := readEnvoyFile(t, "grpc-policy.yaml")
	cases := []struct {
		name, file string
		want       map[Kind]string // kind → its field
	}{
		{"shipped", shipped, map[Kind]string{}},
		{"the patch names another route", mutate(t, shipped, "            name: payments-grpc\n    patch:", "            name: payments-grpc-other\n    patch:", 1),
			map[Kind]string{
				kindGRPCResponseTrailers: istioFilterPath + ".processing_mode.response_trailer_mode",
				kindGRPCReplayRefused:    istioFilterPath + ".processing_mode.request_body_mode",
			}},
		{"the patch withholds the response trailers", mutate(t, shipped, "                response_trailer_mode: SEND\n", "                response_trailer_mode: SKIP\n", 1),
			map[Kind]string{
				kindGRPCResponseTrailers: "configPatches[3].patch.value.typed_per_filter_config[envoy.filters.http.ext_proc].overrides.processing_mode.response_trailer_mode",
			}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rep, err := Run(parsePolicy(t, grpcPolicy), []Input{{Name: "istio.yaml", Data: []byte(c.file)}}, Options{EnvoyVersion: "1.39.1"})
			require.NoError(t, err)
			for _, k := range []Kind{kindGRPCResponseTrailers, kindGRPCRouterRetry, kindGRPCReplayRefused, kindGRPCStreamedReplay} {
				got := findingsOfKind(rep, k)
				field, want := c.want[k]
				if !want {
					require.Empty(t, got, "%s: %v", k, got)
					continue
				}
				require.Len(t, got, 1, "%s: %v", k, rep.Findings)
				require.Equal(t, field, got[0].Field)
				require.Equal(t, istioResource, got[0].Resource)
				require.NotZero(t, got[0].Line, "located in the file: %v", got[0])
			}
		})
	}
}
