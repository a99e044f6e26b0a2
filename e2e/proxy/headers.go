package proxy

import (
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"
)

// field is one header entry. Names are lower case, as in Envoy's header maps (the HTTP/1 codec
// lower-cases them: ConnectionImpl::completeLastHeader in source/common/http/http1/codec_impl.cc).
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

// has reports whether name is present.
func (h headerList) has(name string) bool {
	_, ok := h.get(name)
	return ok
}

// add appends an entry (Envoy's addCopy).
func (h *headerList) add(name, value string) {
	*h = append(*h, field{name: name, value: value})
}

// set removes every entry of name and appends one (Envoy's HeaderMapImpl::setCopy: remove,
// then addCopy).
func (h *headerList) set(name, value string) {
	h.del(name)
	h.add(name, value)
}

// del removes every entry of name.
func (h *headerList) del(name string) {
	*h = slices.DeleteFunc(*h, func(f field) bool { return f.name == name })
}

// headerMap converts the list for a ProcessingRequest, keeping only the names fw lets through
// (MutationUtils::headersToProto). Values go in raw_value only; value stays empty.
func (h headerList) headerMap(fw *forwardRules) *corev3.HeaderMap {
	m := &corev3.HeaderMap{Headers: make([]*corev3.HeaderValue, 0, len(h))}
	for _, f := range h {
		if !fw.forwarded(f.name) {
			continue
		}
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
// deterministic; the values of a repeated header keep their order, one entry each, as
// MutationUtils::headersToProto sends them.
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

// stringMatcher is a compiled envoy.type.matcher.v3.StringMatcher (Matchers::StringMatcherImpl):
// exact, prefix, suffix, contains (each optionally case-insensitive) or safe_regex (full match).
type stringMatcher struct {
	kind       string
	pattern    string
	ignoreCase bool
	re         *regexp.Regexp
}

func compileStringMatcher(m *matcherv3.StringMatcher) (*stringMatcher, error) {
	sm := &stringMatcher{ignoreCase: m.GetIgnoreCase()}
	switch p := m.GetMatchPattern().(type) {
	case *matcherv3.StringMatcher_Exact:
		sm.kind, sm.pattern = "exact", p.Exact
	case *matcherv3.StringMatcher_Prefix:
		sm.kind, sm.pattern = "prefix", p.Prefix
	case *matcherv3.StringMatcher_Suffix:
		sm.kind, sm.pattern = "suffix", p.Suffix
	case *matcherv3.StringMatcher_Contains:
		sm.kind, sm.pattern = "contains", p.Contains
	case *matcherv3.StringMatcher_SafeRegex:
		re, err := regexp.Compile("^(?:" + p.SafeRegex.GetRegex() + ")$")
		if err != nil {
			return nil, err
		}
		sm.kind, sm.re = "regex", re
	default:
		return nil, fmt.Errorf("unsupported string matcher %T", p)
	}
	if sm.ignoreCase {
		sm.pattern = strings.ToLower(sm.pattern)
	}
	return sm, nil
}

func (m *stringMatcher) match(s string) bool {
	if m.kind == "regex" {
		return m.re.MatchString(s)
	}
	if m.ignoreCase {
		s = strings.ToLower(s)
	}
	switch m.kind {
	case "exact":
		return s == m.pattern
	case "prefix":
		return strings.HasPrefix(s, m.pattern)
	case "suffix":
		return strings.HasSuffix(s, m.pattern)
	default:
		return strings.Contains(s, m.pattern)
	}
}

// forwardRules are the filter's forward_rules. A nil *forwardRules forwards everything.
type forwardRules struct {
	allowed, disallowed []*stringMatcher
}

func compileForwardRules(allowed, disallowed []*matcherv3.StringMatcher) (*forwardRules, error) {
	fw := &forwardRules{}
	for _, m := range allowed {
		sm, err := compileStringMatcher(m)
		if err != nil {
			return nil, fmt.Errorf("forward_rules.allowed_headers: %w", err)
		}
		fw.allowed = append(fw.allowed, sm)
	}
	for _, m := range disallowed {
		sm, err := compileStringMatcher(m)
		if err != nil {
			return nil, fmt.Errorf("forward_rules.disallowed_headers: %w", err)
		}
		fw.disallowed = append(fw.disallowed, sm)
	}
	return fw, nil
}

// forwarded is MutationUtils::headerCanBeForwarded: a name on the disallowed list is never sent;
// otherwise an empty allowed list, or a match on it, lets it through. Pseudo-headers are subject
// to the same rules.
func (fw *forwardRules) forwarded(name string) bool {
	if fw == nil {
		return true
	}
	if slices.ContainsFunc(fw.disallowed, func(m *stringMatcher) bool { return m.match(name) }) {
		return false
	}
	return len(fw.allowed) == 0 || slices.ContainsFunc(fw.allowed, func(m *stringMatcher) bool { return m.match(name) })
}
