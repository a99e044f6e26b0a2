package proxy

import (
	"fmt"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// --- Building ProcessingRequests ---

// headerRequest is Filter::buildHeaderRequest: attributes, metadata_context, then the headers
// filtered by forward_rules.
func (x *exchange) headerRequest(s *dirState, eos, _ bool) *extprocv3.ProcessingRequest {
	req := x.newRequest(s)
	hh := &extprocv3.HttpHeaders{Headers: s.hdrs.headerMap(x.p.forward), EndOfStream: eos}
	if s.dir == dirRequest {
		req.Request = &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: hh}
	} else {
		req.Request = &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: hh}
	}
	return req
}

// bodyRequest is Filter::setupBodyChunk.
func (x *exchange) bodyRequest(s *dirState, data []byte, eos bool) *extprocv3.ProcessingRequest {
	req := x.newRequest(s)
	b := &extprocv3.HttpBody{Body: slices.Clone(data), EndOfStream: eos}
	if b.Body == nil {
		b.Body = []byte{}
	}
	if s.dir == dirRequest {
		req.Request = &extprocv3.ProcessingRequest_RequestBody{RequestBody: b}
	} else {
		req.Request = &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: b}
	}
	return req
}

// trailersRequest is the message Filter::sendTrailers builds.
func (x *exchange) trailersRequest(s *dirState, t headerList, _ bool) *extprocv3.ProcessingRequest {
	req := x.newRequest(s)
	tr := &extprocv3.HttpTrailers{Trailers: t.headerMap(x.p.forward)}
	if s.dir == dirRequest {
		req.Request = &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: tr}
	} else {
		req.Request = &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: tr}
	}
	return req
}

// newRequest starts every message the way Envoy does: addAttributes (the direction's first
// message only), then addDynamicMetadata (every message).
func (x *exchange) newRequest(s *dirState) *extprocv3.ProcessingRequest {
	req := &extprocv3.ProcessingRequest{}
	if !s.attrsSent {
		names := x.filter.GetRequestAttributes()
		if s.dir == dirResponse {
			names = x.filter.GetResponseAttributes()
		}
		if len(names) > 0 {
			s.attrsSent = true
			req.Attributes = map[string]*structpb.Struct{filterName: x.attributes(names)}
		}
	}
	req.MetadataContext = x.metadataContext()
	return req
}

// observeData is Filter::sendDataInObservabilityMode: only STREAMED bodies are sent.
func (x *exchange) observeData(s *dirState, data []byte, eos bool) {
	if s.bodyMode != modeStreamed {
		return
	}
	if x.openStream(s) == openOK {
		x.sendRequest(x.bodyRequest(s, data, eos))
	}
}

// --- metadata_options ---

// metadataContext is Filter::addDynamicMetadata: the forwarding namespaces present in the
// stream's dynamic metadata (no connection-level metadata is modelled). It is set, possibly
// empty, on every message.
func (x *exchange) metadataContext() *corev3.Metadata {
	md := &corev3.Metadata{}
	for _, ns := range x.forwardNS {
		if s, ok := x.metadata[ns]; ok {
			if md.FilterMetadata == nil {
				md.FilterMetadata = map[string]*structpb.Struct{}
			}
			md.FilterMetadata[ns] = proto.Clone(s).(*structpb.Struct)
		}
	}
	return md
}

// setDynamicMetadata is Filter::setDynamicMetadata: dynamic_metadata is written only for the
// receiving namespaces (others are dropped); fields merge into what the namespace holds
// (StreamInfoImpl::setDynamicMetadata uses MergeFrom).
func (x *exchange) setDynamicMetadata(resp *extprocv3.ProcessingResponse) {
	dm := resp.GetDynamicMetadata()
	if dm == nil || len(x.receiveNS) == 0 {
		return
	}
	for ns, v := range dm.GetFields() {
		if !slices.Contains(x.receiveNS, ns) {
			continue
		}
		x.setMetadata(ns, v.GetStructValue())
	}
}

// setMetadata merges s into the namespace ns.
func (x *exchange) setMetadata(ns string, s *structpb.Struct) {
	cur := x.metadata[ns]
	if cur == nil {
		cur = &structpb.Struct{Fields: map[string]*structpb.Value{}}
		x.metadata[ns] = cur
	}
	for k, v := range s.GetFields() {
		cur.Fields[k] = proto.Clone(v).(*structpb.Value)
	}
}

func cloneMetadata(m map[string]*structpb.Struct) map[string]*structpb.Struct {
	out := make(map[string]*structpb.Struct, len(m))
	for k, v := range m {
		out[k] = proto.Clone(v).(*structpb.Struct)
	}
	return out
}

// mergeHeaderValue is mergeHeaderValuesField in ext_proc.cc: entries with the same key are
// replaced, others appended.
func mergeHeaderValue(md []*corev3.HeaderValue, hv *corev3.HeaderValue) []*corev3.HeaderValue {
	out := slices.Clone(md)
	found := false
	for i, d := range out {
		if d.GetKey() == hv.GetKey() {
			out[i] = hv
			found = true
		}
	}
	if !found {
		out = append(out, hv)
	}
	return out
}

// --- Attributes ---

// headerAttr matches request.headers['name'] and response.headers['name'].
var headerAttr = regexp.MustCompile(`^(request|response)\.headers\[['"]([^'"]+)['"]\]$`)

// attributes evaluates the attribute expressions (ExpressionManager::evaluateAttributes): bools
// stay bools, integers become numbers, messages their ShortDebugString, everything else a
// string; a failing expression is left out. Only plain attribute paths (and header lookups)
// are understood; any other expression fails, as an unknown attribute does in Envoy.
func (x *exchange) attributes(names []string) *structpb.Struct {
	s := &structpb.Struct{Fields: make(map[string]*structpb.Value, len(names))}
	for _, name := range names {
		if v := x.attribute(name); v != nil {
			s.Fields[name] = v
		}
	}
	return s
}

func num(n uint64) *structpb.Value { return structpb.NewNumberValue(float64(n)) }

// attribute evaluates one attribute against the stream as it is now (the activation of
// Filter::addAttributes: stream info, request headers, response headers).
func (x *exchange) attribute(name string) *structpb.Value {
	h := x.dec.hdrs
	str := func(header string) *structpb.Value {
		if v, ok := h.get(header); ok {
			return structpb.NewStringValue(v)
		}
		return nil
	}
	if m := headerAttr.FindStringSubmatch(name); m != nil {
		src := h
		if m[1] == "response" {
			if x.res == nil {
				return nil
			}
			src = x.enc.hdrs
		}
		if v, ok := src.get(strings.ToLower(m[2])); ok {
			return structpb.NewStringValue(v)
		}
		return nil
	}
	path, _ := h.get(":path")
	switch name {
	case "request.id":
		return str("x-request-id")
	case "request.path":
		return str(":path")
	case "request.url_path":
		p, _, _ := strings.Cut(path, "?")
		return structpb.NewStringValue(p)
	case "request.query":
		_, q, _ := strings.Cut(path, "?")
		q, _, _ = strings.Cut(q, "#")
		return structpb.NewStringValue(q)
	case "request.method":
		return str(":method")
	case "request.host":
		return str(":authority")
	case "request.scheme":
		return str(":scheme")
	case "request.useragent":
		return str("user-agent")
	case "request.referer":
		return str("referer")
	case "request.protocol":
		return structpb.NewStringValue(x.r.Proto)
	case "xds.route_name":
		if x.route == nil {
			return nil
		}
		return structpb.NewStringValue(x.route.Name)
	case "xds.route_metadata":
		if x.route == nil {
			return nil
		}
		return structpb.NewStringValue(shortDebugMetadata(x.route.Metadata))
	case "upstream.request_attempt_count":
		// StreamInfo::attemptCount().value_or(0): set by the router before it asks for a
		// connection.
		return num(uint64(x.attempts))
	case "connection.mtls":
		return structpb.NewBoolValue(x.r.TLS != nil && len(x.r.TLS.PeerCertificates) > 0)
	case "connection.uri_san_peer_certificate":
		if x.r.TLS == nil || len(x.r.TLS.PeerCertificates) == 0 || len(x.r.TLS.PeerCertificates[0].URIs) == 0 {
			return nil
		}
		return structpb.NewStringValue(x.r.TLS.PeerCertificates[0].URIs[0].String())
	case "connection.requested_server_name":
		if x.r.TLS == nil {
			return structpb.NewStringValue("")
		}
		return structpb.NewStringValue(x.r.TLS.ServerName)
	}
	if x.res == nil {
		return nil
	}
	switch name {
	case "response.code":
		return num(uint64(x.res.status))
	case "response.code_details":
		return structpb.NewStringValue(x.res.details)
	case "response.flags":
		return num(x.res.flags)
	}
	return nil
}

// shortDebugMetadata renders a Metadata message as C++ Message::ShortDebugString does, which is
// how Filters::Common::Expr::print turns xds.route_metadata into a string: fields in field
// order, map entries by key, one space between tokens. Only filter_metadata is rendered
// (typed_filter_metadata would print Any messages).
func shortDebugMetadata(m *corev3.Metadata) string {
	var b strings.Builder
	keys := make([]string, 0, len(m.GetFilterMetadata()))
	for k := range m.GetFilterMetadata() {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		tok(&b, "filter_metadata {")
		tok(&b, "key: "+quoteC(k))
		tok(&b, "value {")
		debugStruct(&b, m.GetFilterMetadata()[k])
		tok(&b, "}")
		tok(&b, "}")
	}
	return b.String()
}

func tok(b *strings.Builder, s string) {
	if b.Len() > 0 {
		b.WriteByte(' ')
	}
	b.WriteString(s)
}

func debugStruct(b *strings.Builder, s *structpb.Struct) {
	keys := make([]string, 0, len(s.GetFields()))
	for k := range s.GetFields() {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		tok(b, "fields {")
		tok(b, "key: "+quoteC(k))
		tok(b, "value {")
		debugValue(b, s.GetFields()[k])
		tok(b, "}")
		tok(b, "}")
	}
}

func debugValue(b *strings.Builder, v *structpb.Value) {
	switch k := v.GetKind().(type) {
	case *structpb.Value_NullValue:
		tok(b, "null_value: NULL_VALUE")
	case *structpb.Value_NumberValue:
		tok(b, "number_value: "+formatDouble(k.NumberValue))
	case *structpb.Value_StringValue:
		tok(b, "string_value: "+quoteC(k.StringValue))
	case *structpb.Value_BoolValue:
		tok(b, "bool_value: "+strconv.FormatBool(k.BoolValue))
	case *structpb.Value_StructValue:
		tok(b, "struct_value {")
		debugStruct(b, k.StructValue)
		tok(b, "}")
	case *structpb.Value_ListValue:
		tok(b, "list_value {")
		for _, e := range k.ListValue.GetValues() {
			tok(b, "values {")
			debugValue(b, e)
			tok(b, "}")
		}
		tok(b, "}")
	}
}

// formatDouble prints a double as protobuf's SimpleDtoa: the shortest form that reads back.
func formatDouble(f float64) string {
	switch {
	case math.IsInf(f, 1):
		return "inf"
	case math.IsInf(f, -1):
		return "-inf"
	case math.IsNaN(f):
		return "nan"
	}
	return strconv.FormatFloat(f, 'g', -1, 64)
}

// quoteC quotes s as CEscape does for ASCII: \", \\, \n, \r, \t, \' and octal escapes for the
// other non-printable bytes. UTF-8 text is printed as protobuf's default (escaped bytes).
func quoteC(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch c {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\'':
			b.WriteString(`\'`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		default:
			if c < 0x20 || c >= 0x7f {
				fmt.Fprintf(&b, "\\%03o", c)
			} else {
				b.WriteByte(c)
			}
		}
	}
	b.WriteByte('"')
	return b.String()
}
