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
	kindGRPCServiceMissing      Kind = "grpc-service-missing"
	kindProcessingModeMissing   Kind = "processing-mode-missing"
	kindRequestHeaderMode       Kind = "request-header-mode"
	kindResponseHeaderMode      Kind = "response-header-mode"
	kindHeaderModeDefault       Kind = "header-mode-default"
	kindRequestBodyMode         Kind = "request-body-mode"
	kindResponseBodyMode        Kind = "response-body-mode"
	kindRequestTrailerMode      Kind = "request-trailer-mode"
	kindGatewayRequestTrailers  Kind = "gateway-request-trailers"
	kindDuplexTrailerMode       Kind = "duplex-trailer-mode"
	kindResponseTrailerDefault  Kind = "response-trailer-mode-default"
	kindModeOverrideRefused     Kind = "mode-override-refused"
	kindOverrideModes           Kind = "allowed-override-modes"
	kindCodeDetailsMissing      Kind = "code-details-missing"
	kindCodeDetailsCost         Kind = "code-details-missing-release"
	kindAttemptCountMissing     Kind = "attempt-count-missing"
	kindAttemptCountCost        Kind = "attempt-count-missing-release"
	kindFailureModeAllow        Kind = "failure-mode-allow"
	kindMessageTimeout          Kind = "message-timeout"
	kindMessageTimeoutInFlight  Kind = "message-timeout-in-flight-wait"
	kindObservabilityMode       Kind = "observability-mode"
	kindImmediateResponseOff    Kind = "disable-immediate-response"
	kindBodyWithoutHeaderAnswer Kind = "send-body-without-waiting"
	kindLocalReplyConfig        Kind = "local-reply-config"
	kindForwardRulesHide        Kind = "forward-rules-hide"
	kindMutationDisallowIsError Kind = "mutation-disallow-is-error"
	kindMutationRulesRefuse     Kind = "mutation-rules-refuse"
	kindRulesNotEvaluable       Kind = "rules-not-evaluable"
	kindRequestModifier         Kind = "processing-request-modifier"
	kindRouteNameAttribute      Kind = "route-name-attribute-missing"
	kindPeerIdentityAttribute   Kind = "peer-identity-attribute-missing"
	kindJWTNotForwarded         Kind = "jwt-payload-not-forwarded"
	kindOutcomeNotReceived      Kind = "outcome-not-received"
	kindJWTAuthnMissing         Kind = "jwt-authn-missing"
	kindJWTPayloadMissing       Kind = "jwt-payload-missing"
	kindJWTPayloadKey           Kind = "jwt-payload-key"
	kindIstioJWTPayloadKey      Kind = "istio-jwt-payload-key"
	kindNumericClaim            Kind = "numeric-jwt-claim"
	kindGatewayJWTProvider      Kind = "gateway-jwt-provider"
	kindUnknownPolicyRoute      Kind = "unknown-policy-route"
	kindRouteRequestHeaderSkip  Kind = "route-request-header-skip"
	kindRouteResponseHeaderSkip Kind = "route-response-header-skip"
	kindRouteRequestBodyNone    Kind = "route-request-body-none"
	kindRouteBodyModeGRPC       Kind = "route-body-mode-grpc"
	kindRouteResponseBodyNone   Kind = "route-response-body-none"
	kindResponseBufferLimit     Kind = "response-buffer-limit"
	kindRouterRetry             Kind = "router-retry"
	kindRouterRetryStatus       Kind = "router-retry-stored-status"
	kindHedge                   Kind = "hedge-policy"
	kindGatewayAPIRetry         Kind = "gateway-api-retry"
	kindRouteNameMatchesNothing Kind = "route-name-matches-nothing"
	kindPolicyTargetsNothing    Kind = "extension-policy-targets-nothing"
	kindNoExtProc               Kind = "no-ext-proc"
	kindRoutesUnknown           Kind = "routes-unknown"
	kindFilterAfterExtProc      Kind = "filter-after-ext-proc"
	kindCircuitBreakers         Kind = "processor-circuit-breakers"
	kindEnvoyVersion            Kind = "envoy-version"
	kindGRPCResponseTrailers    Kind = "grpc-response-trailers"
	kindGRPCRouterRetry         Kind = "grpc-router-retry"
	kindGRPCReplayRefused       Kind = "grpc-replay-refused"
	kindGRPCStreamedReplay      Kind = "grpc-streamed-replay-unsupported"
	kindUnreadable              Kind = "unreadable-value"
)

// kindSeverity is the severity of every kind. A finding's severity is its kind's, set in one
// place (Run), so that a kind cannot be an error in one file and a warning in another.
var kindSeverity = map[Kind]Severity{
	kindGRPCServiceMissing:      Error,   // Envoy refuses http_service with bodies; without, none to claim
	kindProcessingModeMissing:   Error,   // Envoy's default modes send no body: 500 body-not-available
	kindRequestHeaderMode:       Error,   // the processor sees no request: unprotected
	kindResponseHeaderMode:      Error,   // no record completes: duplicates get 409 until lock_ttl
	kindHeaderModeDefault:       Warning, // DEFAULT sends headers: spelled out for readers only
	kindRequestBodyMode:         Error,   // 500 body-not-available
	kindResponseBodyMode:        Error,   // 409 response-not-replayable instead of a replay
	kindRequestTrailerMode:      Error,   // a request with trailers and no body runs unclaimed
	kindGatewayRequestTrailers:  Warning, // Envoy Gateway cannot express SEND; counted by the processor
	kindDuplexTrailerMode:       Error,   // Envoy refuses the filter; per route, requests with trailers run twice
	kindResponseTrailerDefault:  Warning, // DEFAULT skips response trailers, as SKIP does
	kindModeOverrideRefused:     Warning, // the processor handles a refused override: slower
	kindOverrideModes:           Warning, // the same, for the modes Envoy allows
	kindCodeDetailsMissing:      Error,   // an Envoy-made response is stored and replayed
	kindCodeDetailsCost:         Warning, // under release and 2xx-only storing, nothing changes
	kindAttemptCountMissing:     Error,   // keep/record: a request that never ran is blocked
	kindAttemptCountCost:        Warning, // under release the key is released either way
	kindFailureModeAllow:        Error,   // a request passes unprotected when the processor fails
	kindMessageTimeout:          Error,   // 504 to a request the store would have claimed
	kindMessageTimeoutInFlight:  Error,   // 504 to a duplicate waiting for its replay
	kindObservabilityMode:       Error,   // Envoy ignores the answers: duplicates run again
	kindImmediateResponseOff:    Error,   // no replay can be sent: duplicates run again
	kindBodyWithoutHeaderAnswer: Warning, // Envoy ignores mode_override: slower
	kindLocalReplyConfig:        Error,   // replays and problems are rewritten
	kindForwardRulesHide:        Error,   // a key, scope or stored header never reaches the processor
	kindMutationDisallowIsError: Error,   // 500 after the upstream ran
	kindMutationRulesRefuse:     Error,   // replays lose a header
	kindRulesNotEvaluable:       Warning, // check could not evaluate the rules
	kindRequestModifier:         Warning, // may rename what the processor reads: not shown to break
	kindRouteNameAttribute:      Error,   // route_name_* matchers never match: unprotected
	kindPeerIdentityAttribute:   Error,   // every mTLS peer shares one scope
	kindJWTNotForwarded:         Error,   // the claims are empty
	kindOutcomeNotReceived:      Warning, // the outcome is missing from access logs
	kindJWTAuthnMissing:         Error,   // the claims are empty
	kindJWTPayloadMissing:       Error,   // the claims are empty
	kindJWTPayloadKey:           Error,   // the claims are empty
	kindIstioJWTPayloadKey:      Warning, // depends on the Istio version, which check cannot see
	kindNumericClaim:            Warning, // depends on the issuer's tokens; refused with 400, never merged
	kindGatewayJWTProvider:      Error,   // the claims are empty
	kindUnknownPolicyRoute:      Error,   // 500 unknown-idempotency-route
	kindRouteRequestHeaderSkip:  Error,   // the processor sees no request: unprotected
	kindRouteResponseHeaderSkip: Error,   // no record completes
	kindRouteRequestBodyNone:    Error,   // 500 body-not-available
	kindRouteBodyModeGRPC:       Error,   // Envoy sends no body: the request runs unclaimed
	kindRouteResponseBodyNone:   Error,   // 409 response-not-replayable instead of a replay
	kindResponseBufferLimit:     Error,   // 500 after the upstream ran
	kindRouterRetry:             Error,   // the router runs a claimed request again
	kindRouterRetryStatus:       Error,   // the router runs a request whose outcome is stored
	kindHedge:                   Error,   // hedge_on_per_try_timeout runs a claimed request twice at once
	kindGatewayAPIRetry:         Error,   // the router runs a claimed request again
	kindRouteNameMatchesNothing: Error,   // a policy route protects nothing
	kindPolicyTargetsNothing:    Error,   // the filter runs on none of the policy's routes
	kindNoExtProc:               Error,   // nothing reaches the processor
	kindRoutesUnknown:           Warning,
	kindFilterAfterExtProc:      Warning,
	kindCircuitBreakers:         Warning,
	kindEnvoyVersion:            Warning,
	kindGRPCResponseTrailers:    Error,   // no call's grpc-status is seen: nothing is stored
	kindGRPCRouterRetry:         Error,   // the router runs a claimed call again
	kindGRPCReplayRefused:       Warning, // a retry gets ALREADY_EXISTS, not the first message
	kindGRPCStreamedReplay:      Error,   // Envoy before 1.37 refuses the replay: the retry fails
	kindUnreadable:              Error,   // Istio refuses it too: the filter it adds does not run
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
