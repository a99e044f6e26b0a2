package proxy

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"

	mutationrulesv3 "github.com/envoyproxy/go-control-plane/envoy/config/common/mutation_rules/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// checkOp and checkResult are Filters::Common::MutationRules::CheckOperation and CheckResult.
type checkOp int

const (
	opSet checkOp = iota
	opAppend
	opRemove
)

type checkResult int

const (
	checkOK checkResult = iota
	checkIgnore
	checkFail
)

// mutationRules is a compiled HeaderMutationRules, Envoy's MutationRules::Checker. The zero
// value is the default rules.
type mutationRules struct {
	allowAllRouting, allowEnvoy, disallowSystem, disallowAll, disallowIsError bool
	allowExpr, disallowExpr                                                   *regexp.Regexp
}

func compileMutationRules(r *mutationrulesv3.HeaderMutationRules) (*mutationRules, error) {
	m := &mutationRules{
		allowAllRouting: r.GetAllowAllRouting().GetValue(),
		allowEnvoy:      r.GetAllowEnvoy().GetValue(),
		disallowSystem:  r.GetDisallowSystem().GetValue(),
		disallowAll:     r.GetDisallowAll().GetValue(),
		disallowIsError: r.GetDisallowIsError().GetValue(),
	}
	var err error
	// Envoy's Regex::Utility::parseRegex matchers match the whole string.
	if e := r.GetAllowExpression(); e != nil {
		if m.allowExpr, err = regexp.Compile("^(?:" + e.GetRegex() + ")$"); err != nil {
			return nil, fmt.Errorf("mutation_rules.allow_expression: %w", err)
		}
	}
	if e := r.GetDisallowExpression(); e != nil {
		if m.disallowExpr, err = regexp.Compile("^(?:" + e.GetRegex() + ")$"); err != nil {
			return nil, fmt.Errorf("mutation_rules.disallow_expression: %w", err)
		}
	}
	return m, nil
}

// routingHeaders are Checker's "extra routing headers": host, :authority, :method, :scheme.
func routingHeader(name string) bool {
	return name == "host" || name == ":authority" || name == ":method" || name == ":scheme"
}

// check is Checker::check: OK when the operation is allowed and the value valid, else FAIL
// with disallow_is_error and IGNORE without.
func (m *mutationRules) check(op checkOp, name, value string) checkResult {
	if m.allowed(op, name) && (op == opRemove || validMutationValue(name, value)) {
		return checkOK
	}
	if m.disallowIsError {
		return checkFail
	}
	return checkIgnore
}

// allowed is Checker::isAllowed, in its order of precedence.
func (m *mutationRules) allowed(op checkOp, name string) bool {
	// HeaderUtility::isModifiableHeader: "host" and ':' headers can never be removed.
	if op == opRemove && (strings.HasPrefix(name, ":") || name == "host") {
		return false
	}
	if m.disallowExpr != nil && m.disallowExpr.MatchString(name) {
		return false
	}
	if m.allowExpr != nil && m.allowExpr.MatchString(name) {
		return true
	}
	if m.disallowAll {
		return false
	}
	if !m.allowAllRouting && routingHeader(name) {
		return false
	}
	if strings.HasPrefix(name, ":") && (op == opAppend || m.disallowSystem) {
		return false
	}
	// Http::Headers::get().prefix() is "x-envoy" unless the bootstrap changes it.
	if !m.allowEnvoy && strings.HasPrefix(name, "x-envoy") {
		return false
	}
	return true
}

// validMutationValue is Checker::isValidValue.
func validMutationValue(name, value string) bool {
	if !strings.HasPrefix(name, ":") && !validValue(value) {
		return false
	}
	switch name {
	case "host", ":authority":
		return value != "" && validValue(value) && !strings.ContainsAny(value, " /?#@")
	case ":scheme":
		return value == "http" || value == "https"
	case ":status":
		n, err := strconv.ParseUint(value, 10, 32)
		return err == nil && n >= 200
	}
	return true
}

// mutationError is a header or body mutation that Envoy rejects (the error status of
// MutationUtils::applyHeaderMutations in source/extensions/filters/http/ext_proc/mutation_utils.cc,
// or of ProcessorState::handleBodyResponse): a CONTINUE answer carrying one fails the request
// with status_on_error (Filter::handleErrorResponse in ext_proc.cc).
type mutationError struct{ msg string }

func (e *mutationError) Error() string { return e.msg }

// mutationOptions qualify one applyMutation call.
type mutationOptions struct {
	// replacing is CONTINUE_AND_REPLACE: :method may then be changed whatever the rules say.
	replacing bool
	// noContentLength ignores a content-length the mutation sets, when the body mode removes it
	// (ProcessorState::processHeaderMutation passes shouldRemoveContentLength()).
	noContentLength bool
}

// applyMutation is MutationUtils::applyHeaderMutations: removals first, then sets, each checked
// against rules. Disallowed entries are ignored and counted (or fail with disallow_is_error);
// invalid names or values, or a HeaderValue with both value and raw_value, fail. Entries before
// a failing one stay applied. It returns the number of rejected entries.
func applyMutation(h *headerList, m *extprocv3.HeaderMutation, rules *mutationRules, o mutationOptions) (rejected int, err error) {
	if m == nil {
		return 0, nil
	}
	for _, name := range m.GetRemoveHeaders() {
		if !validName(name) {
			return rejected + 1, &mutationError{msg: "Invalid character in remove_headers mutation."}
		}
		lower := strings.ToLower(name)
		switch rules.check(opRemove, lower, "") {
		case checkOK:
			h.del(lower)
		case checkIgnore:
			rejected++
		case checkFail:
			return rejected + 1, &mutationError{msg: "Invalid attempt to remove " + lower}
		}
	}
	for _, opt := range m.GetSetHeaders() {
		hv := opt.GetHeader()
		if hv == nil {
			continue
		}
		// Setting both value and raw_value is an error (MutationUtils::applyHeaderMutations in
		// source/extensions/filters/http/ext_proc/mutation_utils.cc).
		if hv.GetValue() != "" && len(hv.GetRawValue()) > 0 {
			return rejected + 1, &mutationError{msg: "Only one of value or raw_value in the HeaderValue message should be set."}
		}
		// Envoy reads raw_value only (send_header_raw_value; the same applyHeaderMutations): a
		// mutation that sets only value yields an empty header.
		value := string(hv.GetRawValue())
		if !validName(hv.GetKey()) || !validValue(value) {
			return rejected + 1, &mutationError{msg: "Invalid character in set_headers mutation."}
		}
		lower := strings.ToLower(hv.GetKey())
		if o.noContentLength && lower == "content-length" {
			continue
		}
		// The deprecated append BoolValue: unset or false overwrites, true adds; append_action is
		// not read.
		//lint:ignore SA1019 ext_proc honours only the deprecated append (MutationUtils::applyHeaderMutations).
		appendIt := opt.GetAppend().GetValue()
		op := opSet
		if appendIt && h.has(lower) {
			op = opAppend
		}
		res := rules.check(op, lower, value)
		if o.replacing && lower == ":method" {
			res = checkOK
		}
		switch res {
		case checkOK:
			if appendIt {
				h.add(lower, value)
			} else {
				h.set(lower, value)
			}
		case checkIgnore:
			rejected++
		case checkFail:
			return rejected + 1, &mutationError{msg: "Invalid attempt to modify " + lower}
		}
	}
	return rejected, nil
}

// validName reports whether name is a valid header name: an RFC 9110 token, or a pseudo-header
// name (HeaderUtility::headerNameIsValid).
func validName(name string) bool {
	name = strings.TrimPrefix(name, ":")
	if name == "" {
		return false
	}
	for i := 0; i < len(name); i++ {
		if !isTokenChar(name[i]) {
			return false
		}
	}
	return true
}

func isTokenChar(c byte) bool {
	switch {
	case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}

// validValue reports whether v is a valid header value: no NUL, CR or LF
// (HeaderUtility::headerValueIsValid).
func validValue(v string) bool {
	return !strings.ContainsAny(v, "\x00\r\n")
}
