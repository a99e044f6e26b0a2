package check

import (
	"maps"
)

// Kind names what a finding is about, whatever file or resource holds the setting: one kind,
// one severity (kindSeverity).
type Kind string

// The kinds of finding. An error kind names a way a covered request runs twice, is not
// protected, or is answered wrongly under the setting; each has a test that runs a request
// through the setting and sees that harm. A warning kind costs something (the outcome missing
// from the access log, a slower mode, a setting check could not read) and breaks nothing.
const (
	// Filter-level settings (CheckSpec).
	KindGRPCServiceMissing      Kind = "grpc-service-missing"
	KindProcessingModeMissing   Kind = "processing-mode-missing"
	KindRequestHeaderMode       Kind = "request-header-mode"
	KindResponseHeaderMode      Kind = "response-header-mode"
	KindHeaderModeDefault       Kind = "header-mode-default"
	KindRequestBodyMode         Kind = "request-body-mode"
	KindResponseBodyMode        Kind = "response-body-mode"
	KindRequestTrailerMode      Kind = "request-trailer-mode"
	KindGatewayRequestTrailers  Kind = "gateway-request-trailers"
	KindDuplexTrailerMode       Kind = "duplex-trailer-mode"
	KindResponseTrailerDefault  Kind = "response-trailer-mode-default"
	KindModeOverrideRefused     Kind = "mode-override-refused"
	KindOverrideModes           Kind = "allowed-override-modes"
	KindCodeDetailsMissing      Kind = "code-details-missing"
	KindCodeDetailsCost         Kind = "code-details-missing-release"
	KindAttemptCountMissing     Kind = "attempt-count-missing"
	KindAttemptCountCost        Kind = "attempt-count-missing-release"
	KindFailureModeAllow        Kind = "failure-mode-allow"
	KindMessageTimeout          Kind = "message-timeout"
	KindMessageTimeoutInFlight  Kind = "message-timeout-in-flight-wait"
	KindObservabilityMode       Kind = "observability-mode"
	KindImmediateResponseOff    Kind = "disable-immediate-response"
	KindBodyWithoutHeaderAnswer Kind = "send-body-without-waiting"
	KindLocalReplyConfig        Kind = "local-reply-config"
	KindForwardRulesHide        Kind = "forward-rules-hide"
	KindMutationDisallowIsError Kind = "mutation-disallow-is-error"
	KindMutationRulesRefuse     Kind = "mutation-rules-refuse"
	KindRulesNotEvaluable       Kind = "rules-not-evaluable"
	KindRequestModifier         Kind = "processing-request-modifier"
	KindRouteNameAttribute      Kind = "route-name-attribute-missing"
	KindPeerIdentityAttribute   Kind = "peer-identity-attribute-missing"
	KindJWTNotForwarded         Kind = "jwt-payload-not-forwarded"
	KindOutcomeNotReceived      Kind = "outcome-not-received"
	KindJWTAuthnMissing         Kind = "jwt-authn-missing"
	KindJWTPayloadMissing       Kind = "jwt-payload-missing"
	KindJWTPayloadKey           Kind = "jwt-payload-key"
	KindIstioJWTPayloadKey      Kind = "istio-jwt-payload-key"
	KindNumericClaim            Kind = "numeric-jwt-claim"
	KindGatewayJWTProvider      Kind = "gateway-jwt-provider"
	KindUnknownPolicyRoute      Kind = "unknown-policy-route"
	KindRouteRequestHeaderSkip  Kind = "route-request-header-skip"
	KindRouteResponseHeaderSkip Kind = "route-response-header-skip"
	KindRouteRequestBodyNone    Kind = "route-request-body-none"
	KindRouteBodyModeGRPC       Kind = "route-body-mode-grpc"
	KindRouteResponseBodyNone   Kind = "route-response-body-none"
	KindResponseBufferLimit     Kind = "response-buffer-limit"
	KindRouterRetry             Kind = "router-retry"
	KindRouterRetryStatus       Kind = "router-retry-stored-status"
	KindHedge                   Kind = "hedge-policy"
	KindGatewayAPIRetry         Kind = "gateway-api-retry"
	KindRouteNameMatchesNothing Kind = "route-name-matches-nothing"
	KindPolicyTargetsNothing    Kind = "extension-policy-targets-nothing"
	KindNoExtProc               Kind = "no-ext-proc"
	KindRoutesUnknown           Kind = "routes-unknown"
	KindFilterAfterExtProc      Kind = "filter-after-ext-proc"
	KindCircuitBreakers         Kind = "processor-circuit-breakers"
	KindEnvoyVersion            Kind = "envoy-version"
	KindGRPCResponseTrailers    Kind = "grpc-response-trailers"
	KindGRPCRouterRetry         Kind = "grpc-router-retry"
	KindGRPCReplayRefused       Kind = "grpc-replay-refused"
	KindGRPCStreamedReplay      Kind = "grpc-streamed-replay-unsupported"
	KindUnreadable              Kind = "unreadable-value"
)

// kindSeverity is the severity of every kind. A finding's severity is its kind's, set in one
// place (Run), so that a kind cannot be an error in one file and a warning in another.
var kindSeverity = map[Kind]Severity{
	KindGRPCServiceMissing:      Error,   // Envoy refuses http_service with bodies; without, none to claim
	KindProcessingModeMissing:   Error,   // Envoy's default modes send no body: 500 body-not-available
	KindRequestHeaderMode:       Error,   // the processor sees no request: unprotected
	KindResponseHeaderMode:      Error,   // no record completes: duplicates get 409 until lock_ttl
	KindHeaderModeDefault:       Warning, // DEFAULT sends headers: spelled out for readers only
	KindRequestBodyMode:         Error,   // 500 body-not-available
	KindResponseBodyMode:        Error,   // 409 response-not-replayable instead of a replay
	KindRequestTrailerMode:      Error,   // a request with trailers and no body runs unclaimed
	KindGatewayRequestTrailers:  Warning, // Envoy Gateway cannot express SEND; counted by the processor
	KindDuplexTrailerMode:       Error,   // Envoy refuses the filter; per route, requests with trailers run twice
	KindResponseTrailerDefault:  Warning, // DEFAULT skips response trailers, as SKIP does
	KindModeOverrideRefused:     Warning, // the processor handles a refused override: slower
	KindOverrideModes:           Warning, // the same, for the modes Envoy allows
	KindCodeDetailsMissing:      Error,   // an Envoy-made response is stored and replayed
	KindCodeDetailsCost:         Warning, // under release and 2xx-only storing, nothing changes
	KindAttemptCountMissing:     Error,   // keep/record: a request that never ran is blocked
	KindAttemptCountCost:        Warning, // under release the key is released either way
	KindFailureModeAllow:        Error,   // a request passes unprotected when the processor fails
	KindMessageTimeout:          Error,   // 504 to a request the store would have claimed
	KindMessageTimeoutInFlight:  Error,   // 504 to a duplicate waiting for its replay
	KindObservabilityMode:       Error,   // Envoy ignores the answers: duplicates run again
	KindImmediateResponseOff:    Error,   // no replay can be sent: duplicates run again
	KindBodyWithoutHeaderAnswer: Warning, // Envoy ignores mode_override: slower
	KindLocalReplyConfig:        Error,   // replays and problems are rewritten
	KindForwardRulesHide:        Error,   // a key, scope or stored header never reaches the processor
	KindMutationDisallowIsError: Error,   // 500 after the upstream ran
	KindMutationRulesRefuse:     Error,   // replays lose a header
	KindRulesNotEvaluable:       Warning, // check could not evaluate the rules
	KindRequestModifier:         Warning, // may rename what the processor reads: not shown to break
	KindRouteNameAttribute:      Error,   // route_name_* matchers never match: unprotected
	KindPeerIdentityAttribute:   Error,   // every mTLS peer shares one scope
	KindJWTNotForwarded:         Error,   // the claims are empty
	KindOutcomeNotReceived:      Warning, // the outcome is missing from access logs
	KindJWTAuthnMissing:         Error,   // the claims are empty
	KindJWTPayloadMissing:       Error,   // the claims are empty
	KindJWTPayloadKey:           Error,   // the claims are empty
	KindIstioJWTPayloadKey:      Warning, // depends on the Istio version, which check cannot see
	KindNumericClaim:            Warning, // depends on the issuer's tokens; refused with 400, never merged
	KindGatewayJWTProvider:      Error,   // the claims are empty
	KindUnknownPolicyRoute:      Error,   // 500 unknown-idempotency-route
	KindRouteRequestHeaderSkip:  Error,   // the processor sees no request: unprotected
	KindRouteResponseHeaderSkip: Error,   // no record completes
	KindRouteRequestBodyNone:    Error,   // 500 body-not-available
	KindRouteBodyModeGRPC:       Error,   // Envoy sends no body: the request runs unclaimed
	KindRouteResponseBodyNone:   Error,   // 409 response-not-replayable instead of a replay
	KindResponseBufferLimit:     Error,   // 500 after the upstream ran
	KindRouterRetry:             Error,   // the router runs a claimed request again
	KindRouterRetryStatus:       Error,   // the router runs a request whose outcome is stored
	KindHedge:                   Error,   // hedge_on_per_try_timeout runs a claimed request twice at once
	KindGatewayAPIRetry:         Error,   // the router runs a claimed request again
	KindRouteNameMatchesNothing: Error,   // a policy route protects nothing
	KindPolicyTargetsNothing:    Error,   // the filter runs on none of the policy's routes
	KindNoExtProc:               Error,   // nothing reaches the processor
	KindRoutesUnknown:           Warning,
	KindFilterAfterExtProc:      Warning,
	KindCircuitBreakers:         Warning,
	KindEnvoyVersion:            Warning,
	KindGRPCResponseTrailers:    Error,   // no call's grpc-status is seen: nothing is stored
	KindGRPCRouterRetry:         Error,   // the router runs a claimed call again
	KindGRPCReplayRefused:       Warning, // a retry gets ALREADY_EXISTS, not the first message
	KindGRPCStreamedReplay:      Error,   // Envoy before 1.37 refuses the replay: the retry fails
	KindUnreadable:              Error,   // Istio refuses it too: the filter it adds does not run
}

// Kinds returns every kind of finding with its severity.
func Kinds() map[Kind]Severity { return maps.Clone(kindSeverity) }

// severityOf is k's severity; a kind missing from the table is an error, so that a new kind
// is never quietly a warning (a test holds the table complete).
func severityOf(k Kind) Severity {
	if s, ok := kindSeverity[k]; ok {
		return s
	}
	return Error
}
