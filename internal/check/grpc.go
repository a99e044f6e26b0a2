package check

import (
	"fmt"
	"strings"

	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// gRPC routes. A route of the deployment serves gRPC calls when its match has grpc: {} (or it
// comes from a GRPCRoute), or when the policy route it names (x-idempotency-route) or whose
// route-name matcher selects it says grpc: true. On such a route the call's outcome is
// grpc-status in the response trailers, the router's gRPC retry conditions run a claimed call
// again, and whether a retry gets the first call's message depends on the request body mode and
// the Envoy version.

// grpcRetryOn are the retry_on conditions that fire on a gRPC response's grpc-status
// (router/retry_state_impl.cc): the upstream answered, so the call may have run.
var grpcRetryOn = map[string]bool{
	"cancelled": true, "deadline-exceeded": true, "internal": true, "resource-exhausted": true, "unavailable": true,
}

// grpcFindings checks the gRPC routes of d under p. v is --envoy-version, nil when not given.
func grpcFindings(d Deployment, p *policy.Policy, v *envoyVersion) []Finding {
	var out []Finding
	for _, e := range d.Routes {
		if e.Config.GetDisabled() || d.FilterDisabled && e.Config == nil || !grpcRoute(e, p) {
			continue
		}
		out = append(out, grpcRouteFindings(d, e, v)...)
	}
	if d.Platform == platformEnvoyGateway {
		for i := range out {
			egGRPCTerms(&out[i], d.FilterPath)
		}
	}
	return out
}

// egGRPCTerms rewrites a finding on a gRPC route of an Envoy Gateway filter in
// EnvoyExtensionPolicy's terms: its processingMode has no trailer modes, a FullDuplexStreamed
// body sends that direction's trailers (internal/xds/translator/extproc.go).
func egGRPCTerms(f *Finding, filterPath string) {
	egTerms(f, filterPath)
	switch f.Kind {
	case kindGRPCReplayRefused:
		f.Fix = "set processingMode.request.body: FullDuplexStreamed (Envoy 1.37 or later) and processingMode.response.body: FullDuplexStreamed: the processor then holds the headers until the message came and replays the stored call"
	case kindGRPCStreamedReplay:
		f.Fix = "run Envoy 1.37 or later, or set processingMode.request.body: Buffered (a retry then gets ALREADY_EXISTS)"
	}
}

// grpcRoute reports whether e serves gRPC calls the policy covers.
func grpcRoute(e routeEntry, p *policy.Policy) bool {
	if e.GRPC {
		return true
	}
	for _, h := range e.Config.GetOverrides().GetGrpcInitialMetadata() {
		if strings.EqualFold(h.GetKey(), routeMetadataKey) {
			r, _, err := p.Select(policy.Selector{Named: headerValueString(h)})
			return err == nil && r.GRPC
		}
	}
	if e.Name == "" {
		return false
	}
	r, _, err := p.Select(policy.Selector{RouteName: e.Name})
	return err == nil && r.GRPC && r.MatchesRouteName()
}

// grpcRouteFindings checks one gRPC route: its response trailers, its retries and its replays.
func grpcRouteFindings(d Deployment, e routeEntry, v *envoyVersion) []Finding {
	mode, modePath := d.Filter.GetProcessingMode(), d.FilterPath+".processing_mode"
	if pm := e.Config.GetOverrides().GetProcessingMode(); pm != nil {
		mode, modePath = pm, e.Path+".overrides.processing_mode"
	}
	at := func(field string, kind Kind, problem, fix string) Finding {
		return Finding{File: d.File, Resource: d.Resource, Field: field, Kind: kind, Problem: problem, Fix: fix}
	}
	var out []Finding
	if mode.GetResponseTrailerMode() != filterextproc.ProcessingMode_SEND {
		harm := "a call's grpc-status comes in the response trailers, which never reach the processor, so no call is stored and every retry runs again (unknown_outcome)"
		problem, fix := fmt.Sprintf("is %s on a gRPC route: %s", mode.GetResponseTrailerMode(), harm), "set response_trailer_mode: SEND on this route"
		if d.Platform == platformEnvoyGateway {
			problem = fmt.Sprintf("is %s on a gRPC route, and Envoy Gateway sends response trailers only with FullDuplexStreamed: %s", mode.GetResponseBodyMode(), harm)
			fix = "set processingMode.response.body: FullDuplexStreamed: Envoy Gateway sends response trailers to the processor only then"
		}
		out = append(out, at(modePath+".response_trailer_mode", kindGRPCResponseTrailers, problem, fix))
	}
	out = append(out, grpcRetryFindings(d, e)...)
	body := mode.GetRequestBodyMode()
	streamable := body == filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED || body == filterextproc.ProcessingMode_NONE
	switch {
	case !streamable:
		out = append(out, at(modePath+".request_body_mode", kindGRPCReplayRefused,
			fmt.Sprintf("is %s on a gRPC route: a call is claimed at its headers, its fingerprint without the message (another message under a used key is taken for a retry), and a retry of a completed call gets ALREADY_EXISTS with the first call's status instead of its message", body),
			"set request_body_mode: FULL_DUPLEX_STREAMED with both trailer modes SEND on this route (Envoy 1.37 or later): the processor then holds the headers until the message came and replays the stored call"))
	case v != nil && v.before(1, 37, 0):
		out = append(out, at(modePath+".request_body_mode", kindGRPCStreamedReplay,
			fmt.Sprintf("is %s on a gRPC route, under which the processor replays a completed call as a streamed immediate response, which Envoy %s does not know (1.37 and later): from Envoy 1.35 the retry fails instead of getting the first call's message (or, under failure_mode_allow, runs again), and before 1.35 it runs again", body, v.text),
			"run Envoy 1.37 or later, or set request_body_mode: BUFFERED on this route (a retry then gets ALREADY_EXISTS)"))
	}
	return out
}

// grpcRetryFindings refuses the router's gRPC retry conditions on the gRPC route e, where they
// are set: the route, an Istio VirtualService's retries or an Envoy Gateway
// BackendTrafficPolicy's retry.
func grpcRetryFindings(d Deployment, e routeEntry) []Finding {
	rp := e.Retry
	if rp == nil || rp.GetNumRetries() != nil && rp.GetNumRetries().GetValue() == 0 {
		return nil
	}
	fix := "remove the gRPC conditions from retry_on on covered gRPC routes (connect-failure and refused-stream are safe); clients retry under the same key instead"
	switch {
	case e.RetryResource != "" && d.Platform == platformEnvoyGateway:
		fix = "remove the gRPC triggers from retry.retryOn.triggers of covered gRPC routes (connect-failure and refused-stream are safe); clients retry under the same key instead"
	case e.RetryResource != "" && d.Platform == platformIstio:
		fix = "remove the gRPC conditions from retries.retryOn of covered gRPC routes (connect-failure and refused-stream are safe); clients retry under the same key instead"
	}
	var out []Finding
	for _, cond := range strings.Split(rp.GetRetryOn(), ",") {
		if cond = strings.TrimSpace(cond); grpcRetryOn[cond] {
			out = append(out, refusalFinding(d, &refusal{Kind: kindGRPCRouterRetry, Field: e.RetryPath + ".retry_policy.retry_on",
				Reason:   fmt.Sprintf("has %q on a gRPC route: the router retries a call the upstream answered, so a claimed call may run twice under one lease", cond),
				Fix:      fix,
				Resource: e.RetryResource, File: e.RetryFile}))
		}
	}
	return out
}
