package proxy

import (
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"unicode"

	accesslogv3 "github.com/envoyproxy/go-control-plane/envoy/config/accesslog/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// localReply is what a filter, the router or the filter manager passes to
// StreamFilterCallbacks::sendLocalReply.
type localReply struct {
	code       int
	body       string
	modify     func(*headerList) // the caller's modify_headers (ext_proc: the ImmediateResponse mutations)
	grpcStatus *uint32           // the ImmediateResponse's grpc_status
	details    string            // %RESPONSE_CODE_DETAILS%
	flags      string            // %RESPONSE_FLAGS% letters, "" for none
	flagBits   uint64            // the same as the response.flags bit vector
	immediate  bool              // an ext_proc ImmediateResponse (or error reply), for the stats
	drain      bool              // read what is left of the request body first (413)
}

// preparedReply is Utility::PreparedLocalReply: the headers and body that go out.
type preparedReply struct {
	headers headerList
	body    []byte
	// headersOnly is a trailers-only gRPC reply or the reply to HEAD: the headers end the stream.
	headersOnly bool
}

// replyContext is what the local reply rewrite and its formatters can read.
type replyContext struct {
	reqHeaders headerList
	metadata   map[string]*structpb.Struct
	details    string
	flags      string
	protocol   string
	grpc, head bool
}

// prepareLocalReply is Utility::prepareLocalReply (source/common/http/utility.cc), in Envoy's
// order: a header
// map holding only :status; the caller's modify_headers; the connection manager's
// local_reply_config rewrite; the gRPC conversion when the request is gRPC; then, with a body,
// content-length and content-type (the rewrite's, text/plain by default) only when none is set
// or the rewrite changed the body without setting one; without a body, no content-length and
// no content-type.
func prepareLocalReply(lr localReply, lrc *localReplyConfig, rc replyContext) preparedReply {
	code := lr.code
	body := lr.body
	h := headerList{{name: ":status", value: strconv.Itoa(code)}}
	if lr.modify != nil {
		lr.modify(&h)
	}
	before, _ := h.get("content-type")
	contentType := "text/plain"
	lrc.rewrite(&h, &code, &body, &contentType, rc)
	after, _ := h.get("content-type")
	customContentType := before != after

	if rc.grpc {
		h.set(":status", "200")
		h.set("content-type", "application/grpc")
		if !h.has("grpc-status") {
			status := grpcStatusFromHTTP(code)
			if lr.grpcStatus != nil {
				status = *lr.grpcStatus
			}
			h.set("grpc-status", strconv.FormatUint(uint64(status), 10))
		}
		if body != "" && !rc.head {
			// JsonFormatter adds a newline that has no place in a header value.
			if contentType == "application/json" && strings.HasSuffix(body, "\n") {
				body = body[:len(body)-1]
			}
			h.set("grpc-message", percentEncode(body))
		}
		h.del("content-length")
		return preparedReply{headers: h, headersOnly: true}
	}
	if body != "" {
		h.set("content-length", strconv.Itoa(len(body)))
		if !h.has("content-type") || (body != lr.body && !customContentType) {
			h.set("content-type", contentType)
		}
	} else {
		h.del("content-length")
		h.del("content-type")
	}
	if rc.head {
		return preparedReply{headers: h, headersOnly: true}
	}
	return preparedReply{headers: h, body: []byte(body), headersOnly: body == ""}
}

// grpcStatusFromHTTP is Grpc::Utility::httpToGrpcStatus.
func grpcStatusFromHTTP(code int) uint32 {
	switch code {
	case http.StatusBadRequest:
		return 13 // Internal
	case http.StatusUnauthorized:
		return 16 // Unauthenticated
	case http.StatusForbidden:
		return 7 // PermissionDenied
	case http.StatusNotFound:
		return 12 // Unimplemented
	case http.StatusTooManyRequests, http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return 14 // Unavailable
	}
	return 2 // Unknown
}

// percentEncode is Http::Utility::PercentEncoding::encode with its default reserved set ("%"):
// characters outside ' '..'~' and '%' become %XX.
func percentEncode(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < ' ' || c > '~' || c == '%' {
			fmt.Fprintf(&b, "%%%02X", c)
			continue
		}
		b.WriteByte(c)
	}
	return b.String()
}

// sanitizeDetails replaces whitespace with '_', as StringUtil::replaceAllEmptySpace does for
// response code details (Filter::sendImmediateResponse in
// source/extensions/filters/http/ext_proc/ext_proc.cc).
func sanitizeDetails(s string) string {
	return strings.Map(func(r rune) rune {
		if unicode.IsSpace(r) {
			return '_'
		}
		return r
	}, s)
}

// localReplyConfig is a compiled LocalReplyConfig (LocalReply::LocalReplyImpl). The zero value
// (and nil) is Envoy's default: no mapper and the body formatter %LOCAL_REPLY_BODY%.
type localReplyConfig struct {
	mappers []*responseMapper
	format  *bodyFormatter
}

type responseMapper struct {
	filter     *replyFilter
	statusCode int // 0: unchanged
	body       *string
	headers    []*corev3.HeaderValueOption
	format     *bodyFormatter
}

func compileLocalReplyConfig(c *hcmv3.LocalReplyConfig) (*localReplyConfig, error) {
	out := &localReplyConfig{}
	if c == nil {
		return out, nil
	}
	for i, m := range c.GetMappers() {
		f, err := compileReplyFilter(m.GetFilter())
		if err != nil {
			return nil, fmt.Errorf("local_reply_config.mappers[%d].filter: %w", i, err)
		}
		rm := &responseMapper{filter: f, headers: m.GetHeadersToAdd()}
		if sc := m.GetStatusCode(); sc != nil {
			rm.statusCode = int(sc.GetValue())
		}
		if b := m.GetBody(); b != nil {
			s, err := dataSourceString(b)
			if err != nil {
				return nil, fmt.Errorf("local_reply_config.mappers[%d].body: %w", i, err)
			}
			rm.body = &s
		}
		if bf := m.GetBodyFormatOverride(); bf != nil {
			if rm.format, err = compileBodyFormat(bf); err != nil {
				return nil, fmt.Errorf("local_reply_config.mappers[%d].body_format_override: %w", i, err)
			}
		}
		for _, h := range rm.headers {
			if h.GetHeader() == nil || strings.Contains(h.GetHeader().GetValue(), "%") {
				return nil, fmt.Errorf("local_reply_config.mappers[%d].headers_to_add: only literal values are supported", i)
			}
		}
		out.mappers = append(out.mappers, rm)
	}
	if bf := c.GetBodyFormat(); bf != nil {
		f, err := compileBodyFormat(bf)
		if err != nil {
			return nil, fmt.Errorf("local_reply_config.body_format: %w", err)
		}
		out.format = f
	}
	return out, nil
}

func dataSourceString(d *corev3.DataSource) (string, error) {
	switch s := d.GetSpecifier().(type) {
	case *corev3.DataSource_InlineString:
		return s.InlineString, nil
	case *corev3.DataSource_InlineBytes:
		return string(s.InlineBytes), nil
	}
	return "", fmt.Errorf("only inline_string and inline_bytes are supported")
}

// rewrite is LocalReplyImpl::rewrite: :status (and the response code) set to code, the first
// matching mapper applied (status, body, headers_to_add, its body format), then the body
// formatted by the mapper's format or the configuration's.
func (c *localReplyConfig) rewrite(h *headerList, code *int, body, contentType *string, rc replyContext) {
	h.set(":status", strconv.Itoa(*code))
	format := (*bodyFormatter)(nil)
	if c != nil {
		for _, m := range c.mappers {
			if !m.filter.match(*code, rc) {
				continue
			}
			if m.body != nil {
				*body = *m.body
			}
			for _, hv := range m.headers {
				applyHeaderValueOption(h, hv)
			}
			if m.statusCode != 0 && m.statusCode != *code {
				*code = m.statusCode
				h.set(":status", strconv.Itoa(*code))
			}
			format = m.format
			break
		}
		if format == nil {
			format = c.format
		}
	}
	if format == nil {
		return // %LOCAL_REPLY_BODY% as text/plain: the body stays
	}
	*body = format.format(*body, *code, *h, rc)
	*contentType = format.contentType
}

// applyHeaderValueOption is Router::HeaderParser's handling of one headers_to_add entry.
func applyHeaderValueOption(h *headerList, o *corev3.HeaderValueOption) {
	name := strings.ToLower(o.GetHeader().GetKey())
	value := o.GetHeader().GetValue()
	action := o.GetAppendAction()
	//lint:ignore SA1019 the deprecated append, when set, decides as in HeaderParser.
	if a := o.GetAppend(); a != nil {
		action = corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD
		if a.GetValue() {
			action = corev3.HeaderValueOption_APPEND_IF_EXISTS_OR_ADD
		}
	}
	switch action {
	case corev3.HeaderValueOption_ADD_IF_ABSENT:
		if !h.has(name) {
			h.add(name, value)
		}
	case corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD:
		h.set(name, value)
	case corev3.HeaderValueOption_OVERWRITE_IF_EXISTS:
		if h.has(name) {
			h.set(name, value)
		}
	default:
		h.add(name, value)
	}
}

// replyFilter is the subset of AccessLogFilter that mappers use: status_code_filter,
// header_filter, response_flag_filter, not_health_check_filter, and_filter and or_filter.
type replyFilter struct {
	kind     string
	op       accesslogv3.ComparisonFilter_Op
	value    int
	header   *routev3.HeaderMatcher
	strMatch *stringMatcher
	flags    []string
	children []*replyFilter
}

func compileReplyFilter(f *accesslogv3.AccessLogFilter) (*replyFilter, error) {
	switch s := f.GetFilterSpecifier().(type) {
	case *accesslogv3.AccessLogFilter_StatusCodeFilter:
		c := s.StatusCodeFilter.GetComparison()
		if c.GetValue().GetRuntimeKey() != "" {
			return nil, fmt.Errorf("runtime keys are not supported")
		}
		return &replyFilter{kind: "status", op: c.GetOp(), value: int(c.GetValue().GetDefaultValue())}, nil
	case *accesslogv3.AccessLogFilter_HeaderFilter:
		hm := s.HeaderFilter.GetHeader()
		rf := &replyFilter{kind: "header", header: hm}
		switch m := hm.GetHeaderMatchSpecifier().(type) {
		case *routev3.HeaderMatcher_StringMatch:
			sm, err := compileStringMatcher(m.StringMatch)
			if err != nil {
				return nil, err
			}
			rf.strMatch = sm
		case *routev3.HeaderMatcher_PresentMatch, nil:
		default:
			return nil, fmt.Errorf("header_filter: only string_match and present_match are supported")
		}
		return rf, nil
	case *accesslogv3.AccessLogFilter_ResponseFlagFilter:
		return &replyFilter{kind: "flags", flags: s.ResponseFlagFilter.GetFlags()}, nil
	case *accesslogv3.AccessLogFilter_NotHealthCheckFilter:
		return &replyFilter{kind: "true"}, nil
	case *accesslogv3.AccessLogFilter_AndFilter, *accesslogv3.AccessLogFilter_OrFilter:
		rf := &replyFilter{kind: "and"}
		subs := f.GetAndFilter().GetFilters()
		if o := f.GetOrFilter(); o != nil {
			rf.kind, subs = "or", o.GetFilters()
		}
		for _, sub := range subs {
			c, err := compileReplyFilter(sub)
			if err != nil {
				return nil, err
			}
			rf.children = append(rf.children, c)
		}
		return rf, nil
	case nil:
		return nil, fmt.Errorf("a mapper needs a filter")
	default:
		return nil, fmt.Errorf("filter %T is not supported", s)
	}
}

// match evaluates the filter for a local reply with code (the response code the rewrite set).
func (f *replyFilter) match(code int, rc replyContext) bool {
	switch f.kind {
	case "status":
		switch f.op {
		case accesslogv3.ComparisonFilter_GE:
			return code >= f.value
		case accesslogv3.ComparisonFilter_LE:
			return code <= f.value
		default:
			return code == f.value
		}
	case "header":
		v, ok := rc.reqHeaders.get(strings.ToLower(f.header.GetName()))
		res := ok
		if ok && f.strMatch != nil {
			res = f.strMatch.match(v)
		}
		if pm, isPresent := f.header.GetHeaderMatchSpecifier().(*routev3.HeaderMatcher_PresentMatch); isPresent && !pm.PresentMatch {
			res = !ok
		}
		if f.header.GetInvertMatch() {
			res = !res
		}
		return res
	case "flags":
		if rc.flags == "" || rc.flags == "-" {
			return false
		}
		if len(f.flags) == 0 {
			return true
		}
		for _, fl := range strings.Split(rc.flags, ",") {
			if slices.Contains(f.flags, fl) {
				return true
			}
		}
		return false
	case "and":
		for _, c := range f.children {
			if !c.match(code, rc) {
				return false
			}
		}
		return true
	case "or":
		for _, c := range f.children {
			if c.match(code, rc) {
				return true
			}
		}
		return false
	}
	return true
}

// bodyFormatter is LocalReply::BodyFormatter over a SubstitutionFormatString: text_format,
// text_format_source.inline_string or json_format, with content_type (default text/plain, or
// application/json for json_format).
type bodyFormatter struct {
	text        []formatPart
	json        *structpb.Struct
	contentType string
	omitEmpty   bool
}

// formatPart is literal text or one command.
type formatPart struct {
	literal string
	cmd     string // LOCAL_REPLY_BODY, RESPONSE_CODE, REQ, ...
	arg     string
}

var formatCommand = regexp.MustCompile(`%([A-Z_]+)(?:\(([^)]*)\))?%`)

func parseFormat(s string) ([]formatPart, error) {
	var parts []formatPart
	last := 0
	for _, m := range formatCommand.FindAllStringSubmatchIndex(s, -1) {
		if m[0] > last {
			parts = append(parts, formatPart{literal: s[last:m[0]]})
		}
		cmd := s[m[2]:m[3]]
		arg := ""
		if m[4] >= 0 {
			arg = s[m[4]:m[5]]
		}
		switch cmd {
		case "LOCAL_REPLY_BODY", "RESPONSE_CODE", "RESPONSE_CODE_DETAILS", "RESPONSE_FLAGS", "PROTOCOL",
			"REQ", "RESP", "DYNAMIC_METADATA":
		default:
			return nil, fmt.Errorf("format command %%%s%% is not supported", cmd)
		}
		parts = append(parts, formatPart{cmd: cmd, arg: arg})
		last = m[1]
	}
	if last < len(s) {
		parts = append(parts, formatPart{literal: s[last:]})
	}
	return parts, nil
}

func compileBodyFormat(f *corev3.SubstitutionFormatString) (*bodyFormatter, error) {
	bf := &bodyFormatter{contentType: f.GetContentType(), omitEmpty: f.GetOmitEmptyValues()}
	if len(f.GetFormatters()) > 0 {
		return nil, fmt.Errorf("formatter extensions are not supported")
	}
	var text string
	switch s := f.GetFormat().(type) {
	case *corev3.SubstitutionFormatString_TextFormat:
		//lint:ignore SA1019 Envoy still reads text_format.
		text = s.TextFormat
	case *corev3.SubstitutionFormatString_TextFormatSource:
		t, err := dataSourceString(s.TextFormatSource)
		if err != nil {
			return nil, err
		}
		text = t
	case *corev3.SubstitutionFormatString_JsonFormat:
		bf.json = s.JsonFormat
		if bf.contentType == "" {
			bf.contentType = "application/json"
		}
		if err := checkJSONFormat(s.JsonFormat); err != nil {
			return nil, err
		}
		return bf, nil
	default:
		return nil, fmt.Errorf("a format is required")
	}
	parts, err := parseFormat(text)
	if err != nil {
		return nil, err
	}
	bf.text = parts
	if bf.contentType == "" {
		bf.contentType = "text/plain"
	}
	return bf, nil
}

func checkJSONFormat(s *structpb.Struct) error {
	for _, v := range s.GetFields() {
		switch k := v.GetKind().(type) {
		case *structpb.Value_StringValue:
			if _, err := parseFormat(k.StringValue); err != nil {
				return err
			}
		case *structpb.Value_StructValue:
			if err := checkJSONFormat(k.StructValue); err != nil {
				return err
			}
		}
	}
	return nil
}

// command evaluates one command; ok is false when its value is missing ("-" in text).
func command(p formatPart, body string, code int, resp headerList, rc replyContext) (any, bool) {
	switch p.cmd {
	case "LOCAL_REPLY_BODY":
		return body, true
	case "RESPONSE_CODE":
		return code, true
	case "RESPONSE_CODE_DETAILS":
		return rc.details, rc.details != ""
	case "RESPONSE_FLAGS":
		if rc.flags == "" {
			return "-", true
		}
		return rc.flags, true
	case "PROTOCOL":
		return rc.protocol, true
	case "REQ", "RESP":
		src := rc.reqHeaders
		if p.cmd == "RESP" {
			src = resp
		}
		for _, name := range strings.Split(p.arg, "?") {
			if v, ok := src.get(strings.ToLower(name)); ok {
				return v, true
			}
		}
		return nil, false
	case "DYNAMIC_METADATA":
		keys := strings.Split(p.arg, ":")
		s := rc.metadata[keys[0]]
		if s == nil {
			return nil, false
		}
		v := structpb.NewStructValue(s)
		for _, k := range keys[1:] {
			f, ok := v.GetStructValue().GetFields()[k]
			if !ok {
				return nil, false
			}
			v = f
		}
		return v.AsInterface(), true
	}
	return nil, false
}

func (f *bodyFormatter) format(body string, code int, resp headerList, rc replyContext) string {
	if f.json != nil {
		out, _ := json.Marshal(f.jsonValue(f.json, body, code, resp, rc))
		return string(out) + "\n"
	}
	var b strings.Builder
	for _, p := range f.text {
		if p.cmd == "" {
			b.WriteString(p.literal)
			continue
		}
		v, ok := command(p, body, code, resp, rc)
		switch {
		case !ok:
			if !f.omitEmpty {
				b.WriteString("-")
			}
		case isString(v):
			b.WriteString(v.(string))
		default:
			js, _ := json.Marshal(v)
			b.Write(js)
		}
	}
	return b.String()
}

func isString(v any) bool { _, ok := v.(string); return ok }

// jsonValue renders a json_format Struct. A value that is exactly one command keeps the
// command's type (RESPONSE_CODE is a number); a missing value is null (omitted with
// omit_empty_values).
func (f *bodyFormatter) jsonValue(s *structpb.Struct, body string, code int, resp headerList, rc replyContext) map[string]any {
	out := make(map[string]any, len(s.GetFields()))
	for k, v := range s.GetFields() {
		switch kv := v.GetKind().(type) {
		case *structpb.Value_StructValue:
			out[k] = f.jsonValue(kv.StructValue, body, code, resp, rc)
		case *structpb.Value_StringValue:
			parts, _ := parseFormat(kv.StringValue)
			if len(parts) == 1 && parts[0].cmd != "" {
				val, ok := command(parts[0], body, code, resp, rc)
				if !ok {
					if !f.omitEmpty {
						out[k] = nil
					}
					continue
				}
				out[k] = val
				continue
			}
			tf := &bodyFormatter{text: parts, omitEmpty: f.omitEmpty}
			out[k] = tf.format(body, code, resp, rc)
		default:
			out[k] = v.AsInterface()
		}
	}
	return out
}
