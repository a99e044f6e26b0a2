package proxy

import (
	"fmt"
	"net/http"
	"slices"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// field is one header entry. Names are lower case, as in Envoy's header maps (reference §2.4).
type field struct {
	name  string
	value string
}

// headerList is an ordered header map that keeps repeated entries, like Envoy's HeaderMap.
type headerList []field

// get returns the first value of name.
func (h headerList) get(name string) (string, bool) {
	for _, f := range h {
		if f.name == name {
			return f.value, true
		}
	}
	return "", false
}

// add appends an entry (Envoy's addCopy).
func (h *headerList) add(name, value string) {
	*h = append(*h, field{name: name, value: value})
}

// set removes every entry of name and appends one (Envoy's setCopy).
func (h *headerList) set(name, value string) {
	h.del(name)
	h.add(name, value)
}

// del removes every entry of name.
func (h *headerList) del(name string) {
	*h = slices.DeleteFunc(*h, func(f field) bool { return f.name == name })
}

// headerMap converts the list for a ProcessingRequest. Values go in raw_value only; value stays
// empty (reference §2.4).
func (h headerList) headerMap() *corev3.HeaderMap {
	m := &corev3.HeaderMap{Headers: make([]*corev3.HeaderValue, 0, len(h))}
	for _, f := range h {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: f.name, RawValue: []byte(f.value)})
	}
	return m
}

// writeTo copies the regular (non-pseudo) entries into an http.Header, skipping the names in skip.
func (h headerList) writeTo(dst http.Header, skip ...string) {
	for _, f := range h {
		if strings.HasPrefix(f.name, ":") || slices.Contains(skip, f.name) {
			continue
		}
		dst.Add(f.name, f.value)
	}
}

// hopByHop lists the connection-specific headers that Envoy's codecs consume and never pass to
// filters or forward.
var hopByHop = []string{"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te", "trailer"}

// fromHTTP appends the entries of hdr with lower-cased names, sorted by name so the order is
// deterministic; the values of a repeated header keep their order (reference §2.4).
func (h *headerList) fromHTTP(hdr http.Header, skip ...string) {
	names := make([]string, 0, len(hdr))
	for name := range hdr {
		names = append(names, name)
	}
	slices.SortFunc(names, func(a, b string) int { return strings.Compare(strings.ToLower(a), strings.ToLower(b)) })
	for _, name := range names {
		lower := strings.ToLower(name)
		if slices.Contains(hopByHop, lower) || slices.Contains(skip, lower) {
			continue
		}
		for _, v := range hdr[name] {
			h.add(lower, v)
		}
	}
}

// mutationError is a header or body mutation that Envoy rejects with a local reply
// (reference §2.7, §5).
type mutationError struct{ msg string }

func (e *mutationError) Error() string { return e.msg }

// applyMutation applies m to h the way Envoy's MutationUtils::applyHeaderMutations does with the
// default mutation rules: removals first, then sets (reference §2.7). Disallowed names are
// silently ignored and counted; invalid names or values, or a HeaderValue with both value and
// raw_value, are errors. It returns the number of ignored mutations.
func applyMutation(h *headerList, m *extprocv3.HeaderMutation) (rejected int, err error) {
	if m == nil {
		return 0, nil
	}
	for _, name := range m.GetRemoveHeaders() {
		if !validName(name) {
			return rejected, &mutationError{msg: "Invalid character in remove_headers mutation."}
		}
		lower := strings.ToLower(name)
		// Default rules: pseudo-headers, host and x-envoy-* cannot be removed (reference §2.7).
		if !mutable(lower) {
			rejected++
			continue
		}
		h.del(lower)
	}
	for _, opt := range m.GetSetHeaders() {
		hv := opt.GetHeader()
		if hv == nil {
			continue
		}
		if !validName(hv.GetKey()) {
			return rejected, &mutationError{msg: "Invalid character in set_headers mutation."}
		}
		// Setting both value and raw_value is an error (reference §0.3, §2.7).
		if hv.GetValue() != "" && len(hv.GetRawValue()) > 0 {
			return rejected, &mutationError{msg: "Only one of value or raw_value in the HeaderValue message should be set."}
		}
		// Envoy reads raw_value only: a mutation that sets only value yields an empty header
		// (reference §0.3, §2.7).
		value := string(hv.GetRawValue())
		if !validValue(value) {
			return rejected, &mutationError{msg: "Invalid character in set_headers mutation."}
		}
		lower := strings.ToLower(hv.GetKey())
		if !mutable(lower) {
			rejected++
			continue
		}
		// The deprecated append BoolValue: unset or false overwrites, true adds; append_action is
		// not honoured by ext_proc (reference §2.7).
		//lint:ignore SA1019 ext_proc honours only the deprecated append (reference §2.7).
		if opt.GetAppend().GetValue() {
			h.add(lower, value)
		} else {
			h.set(lower, value)
		}
	}
	return rejected, nil
}

// mutable reports whether the default HeaderMutationRules let a processor change name: not
// x-envoy-*, host, :authority, :scheme, :method or any other pseudo-header (reference §2.6,
// §2.7, §4.1 mutation_rules).
func mutable(name string) bool {
	return !strings.HasPrefix(name, ":") && name != "host" && !strings.HasPrefix(name, "x-envoy")
}

// validName reports whether name is a valid header name: an RFC 9110 token, or a pseudo-header
// name (reference §2.7, headerNameIsValid).
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

// validValue reports whether v is a valid header value: no NUL, CR or LF (reference §2.7,
// headerValueIsValid).
func validValue(v string) bool {
	return !strings.ContainsAny(v, "\x00\r\n")
}

// contentLengthMismatch reports the error Envoy raises when a body mutation does not match the
// content-length header that BUFFERED mode keeps (reference §3 content-length).
func contentLengthMismatch(h headerList, bodyLen int) error {
	v, ok := h.get("content-length")
	if !ok {
		return nil
	}
	if v != fmt.Sprint(bodyLen) {
		return &mutationError{msg: "mismatch between content length and the length of the mutated body"}
	}
	return nil
}
