package check

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// deploymentFindings are the findings of one deployment under p (whose needs are n): CheckSpec's
// and CheckProtection's, then the rules that weigh the policy's timings and sizes against
// Envoy's, and the warnings.
func deploymentFindings(d Deployment, p *policy.Policy, n policyNeeds) []Finding {
	out := specFindings(d, p, n)
	if err := checkProtection(d, n); err != nil {
		refusals := refusalsIn(err)
		if len(refusals) == 0 {
			out = append(out, Finding{File: d.File, Resource: d.Resource, Field: d.FilterPath, Kind: kindNoExtProc, Problem: err.Error(), Fix: "-"})
		}
		for _, r := range refusals {
			out = append(out, refusalFinding(d, r))
		}
	}
	out = append(out, timingFindings(d, p)...)
	out = append(out, bodyFindings(d, p, n)...)
	out = append(out, warnings(d)...)
	out = append(out, istioJWTFindings(d, n)...)
	out = append(out, numericClaimFindings(d, p)...)
	if d.Platform == platformEnvoyGateway {
		for i := range out {
			egTerms(&out[i], d.FilterPath)
		}
	}
	return out
}

// specFindings are CheckSpec's refusals of d's filter as findings, weighed against the policy:
// CheckSpec knows no policy, and a policy whose enabled routes read no request body (their
// fingerprints omit it, no body-hash keys) is claimed at request_headers whatever the request
// body and trailer modes, and one that stores no response body needs none.
func specFindings(d Deployment, p *policy.Policy, n policyNeeds) []Finding {
	var out []Finding
	storesBodies := slices.ContainsFunc(enabledRoutes(p), func(r *policy.Route) bool { return r.StoreBody })
	mode := d.Filter.GetProcessingMode()
	for _, e := range specErrors(CheckSpec(d.Filter, p.StoreTimeout)) {
		switch {
		case !n.anyBody && e.Field == "processing_mode.request_body_mode" && mode.GetRequestBodyMode() == filterextproc.ProcessingMode_NONE,
			!n.anyBody && e.Field == "processing_mode.request_trailer_mode" && mode.GetRequestBodyMode() != filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED,
			!storesBodies && e.Field == "processing_mode.response_body_mode" && mode.GetResponseBodyMode() == filterextproc.ProcessingMode_NONE:
			continue
		}
		out = append(out, specFinding(d, e, n))
	}
	return out
}

// specFinding is one refusal of CheckSpec as a finding, its kind the cheaper one where the
// policy makes the setting cost less, and Envoy Gateway's request trailers its own kind.
func specFinding(d Deployment, e *specError, n policyNeeds) Finding {
	f := Finding{File: d.File, Resource: d.Resource, Field: d.FilterPath + "." + e.Field, Kind: e.Kind, Problem: e.Problem, Fix: e.Fix}
	if e.Breaks != "" {
		f.Problem += ": " + e.Breaks
	}
	switch {
	case e.Kind == kindCodeDetailsMissing && !n.envoyStatusStored && n.unknownReleases:
		f.Kind = kindCodeDetailsCost
		f.Problem += "; under this policy (unknown_outcome: release, no 4xx or 5xx stored) such a response releases the key either way, and only the processor's log says it could not tell"
	case e.Kind == kindAttemptCountMissing && n.unknownReleases:
		f.Kind = kindAttemptCountCost
		f.Problem += "; under this policy (unknown_outcome: release on every route) such a response releases the key either way, and only the release reason differs"
	}
	if d.Platform == platformEnvoyGateway && errors.Is(e, errRequestTrailersSkipped) {
		// Envoy Gateway cannot express SEND but under FullDuplexStreamed (buildProcessingMode
		// in envoyproxy/gateway internal/xds/translator/extproc.go); the processor counts
		// what reaches the upstream unclaimed.
		f.Kind = kindGatewayRequestTrailers
		f.Problem = "Envoy Gateway sends request trailers to the processor only under FullDuplexStreamed: a covered request that carries trailers and no body reaches the upstream before its key is claimed, and may run twice (the processor counts it as idempotency_envoy_misconfig_total{kind=\"unclaimed_request\"})"
		f.Fix = "use body: FullDuplexStreamed on routes whose clients send request trailers"
	}
	return f
}

// refusalFinding turns a refusal of CheckProtection into a Finding. A refusal of a field of
// another resource (an Istio VirtualService's retries, an Envoy Gateway BackendTrafficPolicy's)
// names that resource, and the field as that resource spells it.
func refusalFinding(d Deployment, r *refusal) Finding {
	f := Finding{File: d.File, Resource: d.Resource, Field: r.Field, Kind: r.Kind, Problem: r.Reason, Fix: r.Fix}
	if r.Resource == "" {
		return f
	}
	f.File, f.Resource = r.File, r.Resource
	field := strings.TrimLeft(strings.TrimPrefix(r.Field, r.Resource), " .")
	switch d.Platform {
	case platformIstio:
		if head, ok := strings.CutSuffix(field, " (no retries: Istio's default retry policy).retry_policy.retry_on"); ok {
			field = head + ".retries"
			f.Problem = "is not set, so Istio's default retry policy applies, which " + f.Problem
		} else {
			field = strings.Replace(field, ".retries.retry_policy.retry_on", ".retries.retryOn", 1)
		}
		f.Fix = strings.ReplaceAll(f.Fix, "num_retries 0", "attempts: 0")
		if r.Fix == retryFix {
			f.Fix = "set retries.retryOn to connect-failure,refused-stream on covered routes (or retries.attempts: 0)"
		}
	case platformEnvoyGateway:
		field = strings.Replace(field, "retry.retry_policy.retry_on", "retry.retryOn", 1)
		f.Fix = strings.ReplaceAll(f.Fix, "num_retries 0", "numRetries: 0")
		if r.Fix == retryFix {
			f.Fix = "set retry.retryOn.triggers to [connect-failure, refused-stream] on covered routes (or numRetries: 0)"
		}
	}
	f.Field = field
	return f
}

// enabledRoutes returns p's enabled routes, the default last.
func enabledRoutes(p *policy.Policy) []*policy.Route {
	var out []*policy.Route
	for _, r := range append(slices.Clone(p.Routes), p.Default) {
		if r.Enabled {
			out = append(out, r)
		}
	}
	return out
}

// timingFindings refuses a message_timeout that a duplicate's in_flight_wait outlasts: the
// processor holds its answer to the request_headers message while the duplicate waits, and
// Envoy gives up on the message after message_timeout (ext_proc.cc, Filter::onMessageTimeout),
// answering 504.
func timingFindings(d Deployment, p *policy.Policy) []Finding {
	var longest *policy.Route
	for _, r := range enabledRoutes(p) {
		if r.InFlightWait > 0 && (longest == nil || r.InFlightWait > longest.InFlightWait) {
			longest = r
		}
	}
	if longest == nil {
		return nil
	}
	mt := defaultMessageTimeout
	if t := d.Filter.GetMessageTimeout(); t != nil {
		mt = t.AsDuration()
	}
	need := p.StoreTimeout + longest.InFlightWait
	if mt <= p.StoreTimeout || mt > need {
		return nil // CheckSpec reports the first; the second is fine
	}
	return []Finding{{
		File: d.File, Resource: d.Resource, Field: d.FilterPath + ".message_timeout", Kind: kindMessageTimeoutInFlight,
		Problem: fmt.Sprintf("%v is not above store_timeout %v plus in_flight_wait %v (route %q): a duplicate waiting for its replay holds Envoy's message open that long, so Envoy answers 504 first",
			mt, p.StoreTimeout, longest.InFlightWait, longest.Name),
		Fix: fmt.Sprintf("raise message_timeout above %v, or lower in_flight_wait", need),
	}}
}

// bodyFindings refuses the response body settings that keep a stored response from being
// replayed: a per-route response_body_mode NONE where the policy route stores bodies, and a
// BUFFERED response path whose buffer limit is below the policy's max_response_bytes (Envoy
// answers 500 to a larger response after the upstream ran it).
func bodyFindings(d Deployment, p *policy.Policy, n policyNeeds) []Finding {
	var out []Finding
	reported := map[string]bool{}
	filterMode := d.Filter.GetProcessingMode().GetResponseBodyMode()
	for _, e := range d.Routes {
		if e.Config.GetDisabled() || d.FilterDisabled && e.Config == nil {
			continue
		}
		storing := storingRoute(e, p)
		if storing == nil {
			continue
		}
		o := e.Config.GetOverrides()
		mode := filterMode
		if pm := o.GetProcessingMode(); pm != nil {
			mode = pm.GetResponseBodyMode()
			if mode == filterextproc.ProcessingMode_NONE {
				out = append(out, Finding{
					File: d.File, Resource: d.Resource, Field: e.Path + ".overrides.processing_mode.response_body_mode", Kind: kindRouteResponseBodyNone,
					Problem: fmt.Sprintf("is NONE, but policy route %q stores response bodies: responses are stored without their body, and duplicates get 409 response-not-replayable instead of a replay", storing.Name),
					Fix:     "set BUFFERED or STREAMED, or store_body: false on the policy route",
				})
				continue
			}
		}
		l := e.ResponseBuffer
		if mode != filterextproc.ProcessingMode_BUFFERED || l == nil || int64(l.Bytes) >= int64(storing.MaxResponseBytes) {
			continue
		}
		key := l.File + "|" + l.Resource + "|" + l.Field
		if reported[key] {
			continue
		}
		reported[key] = true
		out = append(out, bufferLimitFinding(d, storing, l))
	}
	return out
}

// storingRoute is the enabled policy route of e that stores the largest response bodies (the
// one its x-idempotency-route metadata names, else any), nil when none stores bodies.
func storingRoute(e routeEntry, p *policy.Policy) *policy.Route {
	routes := enabledRoutes(p)
	for _, h := range e.Config.GetOverrides().GetGrpcInitialMetadata() {
		if strings.EqualFold(h.GetKey(), routeMetadataKey) {
			if r, _, err := p.Select(policy.Selector{Named: headerValueString(h)}); err == nil {
				routes = nil
				if r.Enabled {
					routes = []*policy.Route{r}
				}
			}
		}
	}
	var storing *policy.Route
	for _, r := range routes {
		if r.StoreBody && (storing == nil || r.MaxResponseBytes > storing.MaxResponseBytes) {
			storing = r
		}
	}
	return storing
}

// bufferLimitFinding refuses the buffer limit l of d's BUFFERED responses, below what the policy
// route storing stores: on the setting when something sets it, else on the filter's mode.
func bufferLimitFinding(d Deployment, storing *policy.Route, l *limitSetting) Finding {
	problem := fmt.Sprintf("BUFFERED responses of policy route %q may reach max_response_bytes %d, above the %d-byte upstream buffer: Envoy answers 500 to a larger one after the upstream ran it, so a retry may run it again",
		storing.Name, storing.MaxResponseBytes, l.Bytes)
	if !l.Default {
		return Finding{File: l.File, Resource: l.Resource, Field: l.Field, Kind: kindResponseBufferLimit, Problem: problem,
			Fix: fmt.Sprintf("raise it to at least %d, or use STREAMED responses", storing.MaxResponseBytes)}
	}
	where := l.Field
	if l.Resource != "" {
		where += " of " + l.Resource
	}
	return Finding{File: d.File, Resource: d.Resource, Field: d.FilterPath + ".processing_mode.response_body_mode", Kind: kindResponseBufferLimit,
		Problem: problem + " (nothing sets " + where + ": the default applies)",
		Fix:     fmt.Sprintf("set %s to at least %d, or use STREAMED responses", where, storing.MaxResponseBytes)}
}

// istioPayloadKey is where Istio 1.21 and later write the payload its jwt_authn verified, for
// every RequestAuthentication (EnvoyJwtFilterPayload in istio/istio
// pilot/pkg/xds/filters/filters.go); earlier versions wrote it under the issuer.
const istioPayloadKey = "payload"

// istioJWTFindings warns, on an Istio deployment, of a route whose jwt_payload_key is another
// name than Istio's: its claims would be empty on Istio 1.21 and later.
func istioJWTFindings(d Deployment, n policyNeeds) []Finding {
	if d.Platform != platformIstio {
		return nil
	}
	var out []Finding
	for _, k := range n.jwtKeys {
		if k.key != "" && k.key != istioPayloadKey {
			out = append(out, Finding{File: d.File, Resource: d.Resource, Field: d.FilterPath + ".metadata_options.forwarding_namespaces", Kind: kindIstioJWTPayloadKey,
				Problem: fmt.Sprintf("forwards jwt_authn's payloads, which Istio 1.21 and later write under %q (earlier versions: under the issuer), while route %q reads %q (its jwt_payload_key): %s", istioPayloadKey, k.route, k.key, claimsEmpty),
				Fix:     fmt.Sprintf("unset the route's jwt_payload_key (Istio writes one payload), or set it to %q", istioPayloadKey)})
		}
	}
	return out
}

// protectedFilterTypes are the filters that must see a request before ext_proc does: a replay
// is answered by ext_proc, and the filters after it never see the request.
var protectedFilterTypes = map[string]string{
	"envoy.extensions.filters.http.rbac.v3.RBAC":                      "authorization (RBAC)",
	"envoy.extensions.filters.http.ext_authz.v3.ExtAuthz":             "authorization (ext_authz)",
	"envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication":    "JWT verification (jwt_authn)",
	"envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit": "rate limiting (local_ratelimit)",
	"envoy.extensions.filters.http.ratelimit.v3.RateLimit":            "rate limiting (ratelimit)",
}

// warnings are the costs of d the user should know: routes that could not be read, a filter
// chain that puts authorization or rate limits after ext_proc, processor circuit breakers at
// Envoy's 1024.
func warnings(d Deployment) []Finding {
	var out []Finding
	if d.RoutesUnknown != "" {
		out = append(out, Finding{File: d.File, Resource: d.Resource, Field: d.HCMPath, Kind: kindRoutesUnknown,
			Problem: d.RoutesUnknown + ": per-route configs, retries and buffer limits were not checked",
			Fix:     "check the routes too: pass a bootstrap whose connection manager has an inline route_config"})
	}
	for _, a := range d.After {
		if what, ok := protectedFilterTypes[a.Type]; ok {
			out = append(out, Finding{File: d.File, Resource: d.Resource, Field: d.HCMPath + ".http_filters[" + a.Name + "]", Kind: kindFilterAfterExtProc,
				Problem: fmt.Sprintf("runs after ext_proc: a replay is answered by ext_proc, so replays and 409s skip %s", what),
				Fix:     "move it before the ext_proc filter in http_filters"})
		}
	}
	if c := d.Processor; c != nil {
		var low []string
		for name, v := range map[string]uint32{"max_connections": c.Thresholds.MaxConnections, "max_pending_requests": c.Thresholds.MaxPendingRequests, "max_requests": c.Thresholds.MaxRequests} {
			if v <= 1024 {
				low = append(low, fmt.Sprintf("%s %d", name, v))
			}
		}
		if len(low) > 0 {
			slices.Sort(low)
			field := c.Field
			if c.Default {
				field += " (unset)"
			}
			out = append(out, Finding{File: c.File, Resource: c.Resource, Field: field, Kind: kindCircuitBreakers,
				Problem: "the processor's circuit breakers allow " + strings.Join(low, ", ") + ": each request in flight holds a stream, and beyond them Envoy answers 500 without calling the processor",
				Fix:     "raise them far above the requests in flight (the shipped files use 100000)"})
		}
	}
	return out
}

// egNames are Envoy's field names and values as an EnvoyExtensionPolicy's extProc entry spells
// them (internal/xds/translator/extproc.go), longest first.
var egNames = strings.NewReplacer(
	"processing_mode.request_header_mode", "processingMode.request",
	"processing_mode.response_header_mode", "processingMode.response",
	"processing_mode.request_body_mode", "processingMode.request.body",
	"processing_mode.response_body_mode", "processingMode.response.body",
	"processing_mode.request_trailer_mode", "processingMode.request.body",
	"processing_mode.response_trailer_mode", "processingMode.response.body",
	"metadata_options.forwarding_namespaces.untyped", "metadata.accessibleNamespaces",
	"metadata_options.receiving_namespaces.untyped", "metadata.writableNamespaces",
	"processing_mode", "processingMode",
	"allow_mode_override", "processingMode.allowModeOverride",
	"response_attributes", "processingMode.response.attributes",
	"request_attributes", "processingMode.request.attributes",
	"failure_mode_allow", "failOpen",
	"message_timeout", "messageTimeout",
	"observability_mode", "shadowMode",
	"FULL_DUPLEX_STREAMED", "FullDuplexStreamed",
	"BUFFERED_PARTIAL", "BufferedPartial",
	"BUFFERED", "Buffered",
	"STREAMED", "Streamed",
)

// egTerms rewrites a finding on an Envoy Gateway filter in EnvoyExtensionPolicy's terms.
func egTerms(f *Finding, filterPath string) {
	if rest, ok := strings.CutPrefix(f.Field, filterPath+"."); ok {
		f.Field = filterPath + "." + egNames.Replace(rest)
	}
	f.Fix = strings.TrimSuffix(egNames.Replace(f.Fix), "; routes whose fingerprint omits the body may set NONE per route")
	f.Problem = egNames.Replace(f.Problem)
	switch f.Field {
	case filterPath + ".processingMode.request":
		f.Fix = "add a processingMode.request block"
	case filterPath + ".processingMode.response":
		f.Fix = "add a processingMode.response block: without it Envoy Gateway never sends response headers"
	}
}

// processorLimits are the circuit breaker thresholds of the processor's cluster and where they
// are set.
type processorLimits struct {
	Thresholds Thresholds
	// File, Resource and Field say where they are set; Default is set when nothing sets them.
	File, Resource, Field string
	Default               bool
}

// filterRef is an HTTP filter: its name and the type of its typed_config.
type filterRef struct{ Name, Type string }
