package check

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"

	"github.com/idempotency-extproc/idempotency-extproc/extproc"
)

// passThroughMode and noStoreMode are the two mode_override values the processor sends:
// allowed_override_modes must list exactly these.
var (
	passThroughMode = extproc.PassThroughMode
	noStoreMode     = extproc.NoStoreMode
)

// The response attributes the processor reads: response.code_details tells an Envoy-made
// response from an upstream one, and upstream.request_attempt_count tells whether an Envoy-made
// one came before the request was sent upstream (release) or after (an unknown outcome).
var requiredResponseAttributes = []string{"response.code_details", "upstream.request_attempt_count"}

// CheckSpec returns every way f departs from the Envoy side of the contract (the filter settings
// the processor relies on, with the body modes it claims requests under), each a *specError,
// joined with errors.Join, or nil. Each error names the field. The rules:
//
//   - processing_mode spells out every field (DEFAULT is reported: the project spells every
//     mode out) with request_header_mode and response_header_mode SEND;
//   - request_body_mode is BUFFERED, STREAMED, BUFFERED_PARTIAL or FULL_DUPLEX_STREAMED, the
//     modes in which the processor claims a request that carries a body. NONE is refused: under
//     it a covered request with a body gets 500 body-not-available unless its route's
//     fingerprint omits the body, which this check, having no policy, cannot know
//     (CheckProtection allows NONE per route where the policy needs no body). GRPC is not
//     implemented by Envoy;
//   - response_body_mode is BUFFERED, STREAMED or FULL_DUPLEX_STREAMED, the modes that capture a
//     whole response for replay. NONE and BUFFERED_PARTIAL keep requests at most once but store
//     some or all responses without their body (duplicates get 409 response-not-replayable):
//     CheckProtection accepts them per route, not for a whole filter;
//   - request_trailer_mode is SEND in every body mode: a request that carries trailers and no
//     data gets no body message from Envoy, and under SKIP no trailers message either
//     (Filter::onTrailers in ext_proc.cc returns Continue when it has nothing buffered and
//     sendTrailers() is false), so it would reach the upstream before the processor claimed its
//     key. response_trailer_mode is SKIP or SEND; FULL_DUPLEX_STREAMED needs it SEND (Envoy
//     refuses the config otherwise);
//   - allow_mode_override is true, and allowed_override_modes is empty or exactly PassThroughMode
//     and NoStoreMode, every field equal (Envoy compares raw values, so DEFAULT is not SKIP);
//   - response_attributes contains response.code_details and upstream.request_attempt_count;
//   - failure_mode_allow is false;
//   - message_timeout (Envoy default 200ms) is above storeTimeout;
//   - the filter uses grpc_service, and nothing disables what the processor relies on:
//     observability_mode, disable_immediate_response and
//     send_body_without_waiting_for_header_response (which makes Envoy ignore mode_override)
//     are false.
//
// The shipped configurations use BUFFERED in both directions; the other modes are accepted
// because the processor handles them, not because they are recommended.
func CheckSpec(f *filterextproc.ExternalProcessor, storeTimeout time.Duration) error {
	if f == nil {
		return errors.New("no ext_proc filter config")
	}
	var rs specRefusals
	if f.GetGrpcService() == nil {
		rs.bad(kindGRPCServiceMissing, "grpc_service", "is not set (http_service cannot carry bodies)", "",
			"set grpc_service (envoy_grpc to the processor's cluster)")
	}
	pm := f.GetProcessingMode()
	if pm == nil {
		rs.bad(kindProcessingModeMissing, "processing_mode", "is not set", "", "spell out processing_mode as envoy/envoy.yaml does")
		pm = &filterextproc.ProcessingMode{}
	}
	rs.headerModes(pm)
	rs.bodyModes(pm)
	rs.trailerModes(pm)
	rs.overrides(f)
	rs.answers(f, storeTimeout)
	return errors.Join(rs...)
}

// specRefusals are CheckSpec's refusals, in the order of its rules.
type specRefusals []error

// bad adds the refusal of field, of kind, with what is wrong with it, what that breaks and the
// fix.
func (rs *specRefusals) bad(kind Kind, field, problem, breaks, fix string) {
	*rs = append(*rs, &specError{Kind: kind, Field: field, Problem: problem, Breaks: breaks, Fix: fix})
}

// headerModes refuses header modes other than SEND: the processor claims at the request's
// headers and settles at the response's.
func (rs *specRefusals) headerModes(pm *filterextproc.ProcessingMode) {
	if m := pm.GetRequestHeaderMode(); m == filterextproc.ProcessingMode_DEFAULT {
		rs.bad(kindHeaderModeDefault, "processing_mode.request_header_mode", "is DEFAULT, which Envoy reads as SEND",
			"", "spell it out: set SEND")
	} else if m != filterextproc.ProcessingMode_SEND {
		rs.bad(kindRequestHeaderMode, "processing_mode.request_header_mode", fmt.Sprintf("is %s, want SEND", m),
			"the processor would see no request, and covered requests would run unprotected", "set SEND")
	}
	if m := pm.GetResponseHeaderMode(); m == filterextproc.ProcessingMode_DEFAULT {
		rs.bad(kindHeaderModeDefault, "processing_mode.response_header_mode", "is DEFAULT, which Envoy reads as SEND",
			"", "spell it out: set SEND")
	} else if m != filterextproc.ProcessingMode_SEND {
		rs.bad(kindResponseHeaderMode, "processing_mode.response_header_mode", fmt.Sprintf("is %s, want SEND", m),
			"the processor would see no response: each stream ends with the outcome unknown, so a retry runs again (unknown_outcome: release) or gets 409 until lock_ttl ends (keep)", "set SEND")
	}
}

// bodyModes refuses the body modes under which the processor cannot see a request's body or
// store a response's.
func (rs *specRefusals) bodyModes(pm *filterextproc.ProcessingMode) {
	reqBody, respBody := pm.GetRequestBodyMode(), pm.GetResponseBodyMode()
	switch reqBody {
	case filterextproc.ProcessingMode_BUFFERED, filterextproc.ProcessingMode_STREAMED,
		filterextproc.ProcessingMode_BUFFERED_PARTIAL, filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED:
	default:
		rs.bad(kindRequestBodyMode, "processing_mode.request_body_mode", fmt.Sprintf("is %s, want BUFFERED, STREAMED, BUFFERED_PARTIAL or FULL_DUPLEX_STREAMED", reqBody),
			"the processor cannot claim a covered request with a body: it gets 500 body-not-available",
			"set BUFFERED (or STREAMED, BUFFERED_PARTIAL, FULL_DUPLEX_STREAMED); routes whose fingerprint omits the body may set NONE per route")
	}
	switch respBody {
	case filterextproc.ProcessingMode_BUFFERED, filterextproc.ProcessingMode_STREAMED,
		filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED:
	default:
		rs.bad(kindResponseBodyMode, "processing_mode.response_body_mode", fmt.Sprintf("is %s, want BUFFERED, STREAMED or FULL_DUPLEX_STREAMED", respBody),
			"responses are stored without their body: duplicates get 409 response-not-replayable instead of a replay",
			"set BUFFERED, or STREAMED for responses that can outgrow the buffer limit")
	}
}

// trailerModes refuses request trailers the processor does not see and response trailer modes
// Envoy reads otherwise than written or refuses.
func (rs *specRefusals) trailerModes(pm *filterextproc.ProcessingMode) {
	fullDuplex, respBody := filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED, pm.GetResponseBodyMode()
	if m := pm.GetRequestTrailerMode(); m != filterextproc.ProcessingMode_SEND {
		*rs = append(*rs, &specError{Kind: kindRequestTrailerMode, Field: "processing_mode.request_trailer_mode", Problem: fmt.Sprintf("is %s, want SEND (%s)", m, trailerWhy),
			Fix: "set SEND", wrapped: errRequestTrailersSkipped})
	}
	// SEND lets the processor see the end of a STREAMED response whose upstream sends trailers:
	// its last chunk then has end_of_stream false.
	switch m := pm.GetResponseTrailerMode(); {
	case respBody == fullDuplex && m != filterextproc.ProcessingMode_SEND:
		rs.bad(kindDuplexTrailerMode, "processing_mode.response_trailer_mode", fmt.Sprintf("is %s, want SEND with response_body_mode FULL_DUPLEX_STREAMED", m),
			"Envoy refuses FULL_DUPLEX_STREAMED without it", "set SEND")
	case m != filterextproc.ProcessingMode_SKIP && m != filterextproc.ProcessingMode_SEND:
		rs.bad(kindResponseTrailerDefault, "processing_mode.response_trailer_mode", fmt.Sprintf("is %s, which Envoy reads as SKIP", m), "", "set SKIP, or SEND for upstreams that send trailers")
	}
}

// overrides refuses the settings that keep Envoy from honouring the processor's mode_override.
func (rs *specRefusals) overrides(f *filterextproc.ExternalProcessor) {
	if !f.GetAllowModeOverride() {
		rs.bad(kindModeOverrideRefused, "allow_mode_override", "is false, want true (Envoy would ignore the processor's mode_override)",
			"requests the processor passes through still stream their bodies to it, and responses it will not store are still buffered", "set true")
	}
	if f.GetSendBodyWithoutWaitingForHeaderResponse() {
		rs.bad(kindBodyWithoutHeaderAnswer, "send_body_without_waiting_for_header_response", "is true (Envoy would ignore mode_override)",
			"requests the processor passes through still stream their bodies to it", "set false")
	}
	*rs = append(*rs, checkOverrideModes(f.GetAllowedOverrideModes())...)
}

// answers refuses the settings that keep the processor's answers from counting: attributes it
// needs missing, failing open, a message_timeout at or below storeTimeout, Envoy ignoring or
// unable to send its answers.
func (rs *specRefusals) answers(f *filterextproc.ExternalProcessor, storeTimeout time.Duration) {
	for _, a := range requiredResponseAttributes {
		if !slices.Contains(f.GetResponseAttributes(), a) {
			rs.bad(attributeKind[a], "response_attributes", fmt.Sprintf("lacks %q (%s)", a, attributeWhy[a]), "",
				fmt.Sprintf("add %q to response_attributes", a))
		}
	}
	if f.GetFailureModeAllow() {
		rs.bad(kindFailureModeAllow, "failure_mode_allow", "is true, want false (requests would bypass idempotency when the processor fails)",
			"a covered request may run twice", "set false")
	}
	mt := defaultMessageTimeout
	if d := f.GetMessageTimeout(); d != nil {
		mt = d.AsDuration()
	}
	if mt <= storeTimeout {
		rs.bad(kindMessageTimeout, "message_timeout", fmt.Sprintf("%v is not above store_timeout %v", mt, storeTimeout),
			"Envoy gives up on the processor's answer before a slow store call ends: the client gets 504 and the key's outcome is unknown",
			fmt.Sprintf("raise message_timeout above %v (Envoy's default is 200ms)", storeTimeout))
	}
	if f.GetObservabilityMode() {
		rs.bad(kindObservabilityMode, "observability_mode", "is true (Envoy ignores the processor's answers)", "duplicates run again instead of being replayed", "set false")
	}
	if f.GetDisableImmediateResponse() {
		rs.bad(kindImmediateResponseOff, "disable_immediate_response", "is true (replays and errors could not be sent)", "duplicates run again instead of being replayed", "set false")
	}
}

// specError is one way a filter departs from the contract (CheckSpec).
type specError struct {
	// Kind names what is wrong, whatever the field's value.
	Kind Kind
	// Field is the field's path in the ExternalProcessor.
	Field string
	// Problem says what is wrong with the field; Breaks what that breaks, "" when Problem says.
	Problem, Breaks string
	// Fix says what to set.
	Fix     string
	wrapped error
}

func (e *specError) Error() string {
	msg := e.Field + " " + e.Problem
	if e.wrapped != nil {
		msg += ": " + e.wrapped.Error()
	}
	return msg
}

func (e *specError) Unwrap() error { return e.wrapped }

// specErrors returns every *specError in err, in order.
func specErrors(err error) []*specError { return collect[*specError](err) }

// errRequestTrailersSkipped is wrapped by CheckSpec's refusal of a request_trailer_mode other
// than SEND. Envoy Gateway cannot express SEND except under FullDuplexStreamed, so
// WithoutGatewayGaps drops it from the verdict on Envoy Gateway's configs.
var errRequestTrailersSkipped = errors.New("request trailers skip the processor")

// trailerWhy says what request_trailer_mode SKIP costs a route that needs the request body.
const trailerWhy = "under SKIP a request with trailers and no body skips the body phase (Filter::onTrailers continues without a message), so it reaches the upstream before its key is claimed, and may run twice"

// attributeWhy says what the processor loses without each attribute it reads.
var attributeWhy = map[string]string{
	"response.code_details":               "the processor could not tell Envoy-generated responses from upstream ones",
	"upstream.request_attempt_count":      "every Envoy-generated response would count as an unknown outcome, even one made before the request was sent upstream",
	"xds.route_name":                      "route_name_* matchers would never match: requests would get another policy route",
	"connection.uri_san_peer_certificate": "the peer_identity scope would be empty: every mTLS peer would share one scope",
}

// attributeKind is the kind of a missing response attribute (CheckSpec); deploymentFindings
// weighs it against the policy.
var attributeKind = map[string]Kind{
	"response.code_details":          kindCodeDetailsMissing,
	"upstream.request_attempt_count": kindAttemptCountMissing,
}

// overrideModesFix is the fix of every allowed_override_modes error.
const overrideModesFix = "list exactly the two modes envoy/envoy.yaml lists, or none"

func checkOverrideModes(modes []*filterextproc.ProcessingMode) []error {
	if len(modes) == 0 {
		return nil
	}
	want := []struct {
		name string
		mode *filterextproc.ProcessingMode
	}{{"pass-through", passThroughMode()}, {"no-store", noStoreMode()}}
	var errs []error
	seen := make([]bool, len(want)) // an entry equals want[j]
	near := make([]bool, len(want)) // a broken entry is closest to want[j], already reported
	for i, m := range modes {
		best, bestDiff := 0, []string(nil)
		for j, w := range want {
			d := modeDiff(m, w.mode)
			if len(d) == 0 {
				seen[j] = true
				best, bestDiff = j, nil
				break
			}
			if bestDiff == nil || len(d) < len(bestDiff) {
				best, bestDiff = j, d
			}
		}
		if bestDiff != nil {
			near[best] = true
			errs = append(errs, &specError{Kind: kindOverrideModes, Field: fmt.Sprintf("allowed_override_modes[%d]", i),
				Problem: fmt.Sprintf("is not one of the processor's modes: %s (closest: the %s mode)", strings.Join(bestDiff, ", "), want[best].name),
				Breaks:  "Envoy refuses the processor's mode_override", Fix: overrideModesFix})
		}
	}
	for j, w := range want {
		if !seen[j] && !near[j] {
			errs = append(errs, &specError{Kind: kindOverrideModes, Field: "allowed_override_modes", Problem: fmt.Sprintf("lacks the %s mode %s", w.name, formatMode(w.mode)),
				Breaks: "Envoy refuses the processor's mode_override", Fix: overrideModesFix})
		}
	}
	if len(modes) > len(want) && len(errs) == 0 {
		errs = append(errs, &specError{Kind: kindOverrideModes, Field: "allowed_override_modes", Problem: fmt.Sprintf("has %d entries, want exactly the processor's two modes", len(modes)),
			Fix: overrideModesFix})
	}
	return errs
}

// modeDiff lists the fields where got differs from want, as "field is X, want Y".
func modeDiff(got, want *filterextproc.ProcessingMode) []string {
	if proto.Equal(got, want) {
		return nil
	}
	var d []string
	h := func(field string, g, w filterextproc.ProcessingMode_HeaderSendMode) {
		if g != w {
			d = append(d, fmt.Sprintf("%s is %s, want %s", field, g, w))
		}
	}
	b := func(field string, g, w filterextproc.ProcessingMode_BodySendMode) {
		if g != w {
			d = append(d, fmt.Sprintf("%s is %s, want %s", field, g, w))
		}
	}
	h("request_header_mode", got.GetRequestHeaderMode(), want.GetRequestHeaderMode())
	b("request_body_mode", got.GetRequestBodyMode(), want.GetRequestBodyMode())
	h("request_trailer_mode", got.GetRequestTrailerMode(), want.GetRequestTrailerMode())
	h("response_header_mode", got.GetResponseHeaderMode(), want.GetResponseHeaderMode())
	b("response_body_mode", got.GetResponseBodyMode(), want.GetResponseBodyMode())
	h("response_trailer_mode", got.GetResponseTrailerMode(), want.GetResponseTrailerMode())
	if len(d) == 0 {
		d = append(d, "fields other than the six modes are set")
	}
	return d
}

func formatMode(m *filterextproc.ProcessingMode) string {
	return fmt.Sprintf("{request_header_mode: %s, request_body_mode: %s, request_trailer_mode: %s, response_header_mode: %s, response_body_mode: %s, response_trailer_mode: %s}",
		m.GetRequestHeaderMode(), m.GetRequestBodyMode(), m.GetRequestTrailerMode(),
		m.GetResponseHeaderMode(), m.GetResponseBodyMode(), m.GetResponseTrailerMode())
}
