package check

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"

	// Every type a typed_config (google.protobuf.Any) the checks read may name must be linked in,
	// so that protojson can resolve its "@type" through the global registry. A type of a proto
	// package none of these links is read as an opaque google.protobuf.Struct (see opaqueAnys).
	_ "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/file/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/stream/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/jwt_authn/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
)

// Envoy's defaults for what a bootstrap leaves unset.
const (
	// defaultBufferLimit is per_connection_buffer_limit_bytes of listeners and clusters.
	defaultBufferLimit = 1 << 20
	// defaultMessageTimeout is ExternalProcessor.message_timeout.
	defaultMessageTimeout = 200 * time.Millisecond
	defaultMaxRequests    = 1024 // max_connections, max_pending_requests, max_requests
	defaultMaxRetries     = 3    // max_retries
)

// Parse decodes one YAML (or JSON) document into a Bootstrap the way Envoy does: field names in
// snake_case or lowerCamelCase, every typed_config resolved by its "@type" into the concrete
// message. Unknown fields, bad enum names and bad durations are errors, and so is a second YAML
// document, and an unknown "@type" of a proto package the checks link in (a misspelt
// ExtProcPerRoute); a type of another package is kept opaque. Each error names the line of the
// field where it can be found. Parse does not run the proto validation rules; see Validate.
func Parse(yamlBytes []byte) (*bootstrapv3.Bootstrap, error) {
	dec := yaml.NewDecoder(bytes.NewReader(yamlBytes))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, errors.New("empty YAML document")
		}
		return nil, err
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		if err != nil {
			return nil, err
		}
		return nil, fmt.Errorf("line %d: more than one YAML document", extra.Line)
	}
	return parseBootstrap(&doc)
}

// parseBootstrap decodes one YAML document node into a Bootstrap, as Parse.
func parseBootstrap(doc *yaml.Node) (*bootstrapv3.Bootstrap, error) {
	js, err := nodeToJSON(doc)
	if err != nil {
		return nil, err
	}
	b := &bootstrapv3.Bootstrap{}
	if err := protojson.Unmarshal(js, b); err != nil {
		return nil, protoError("bootstrap", doc, err)
	}
	return b, nil
}

// Validate runs the protoc-gen-validate rules (ValidateAll) on m and on the message inside every
// google.protobuf.Any it contains, at any depth: ValidateAll alone stops at an Any, so a Bootstrap
// passes it whatever its HTTP connection manager or ext_proc filter holds. All violations are
// returned together.
func Validate(m proto.Message) error {
	var errs []error
	validate(m, "", &errs)
	return errors.Join(errs...)
}

func validate(m proto.Message, where string, errs *[]error) {
	name := string(m.ProtoReflect().Descriptor().FullName())
	if where == "" {
		where = name
	}
	if v, ok := m.(interface{ ValidateAll() error }); ok {
		if err := v.ValidateAll(); err != nil {
			*errs = append(*errs, fmt.Errorf("%s: %w", where, err))
		}
	}
	walkAnys(m.ProtoReflect(), where, func(a *anypb.Any, path string) {
		inner, err := a.UnmarshalNew()
		if err != nil {
			*errs = append(*errs, fmt.Errorf("%s: %w", path, err))
			return
		}
		validate(inner, path+"<"+string(inner.ProtoReflect().Descriptor().FullName())+">", errs)
	})
}

// walkAnys calls fn for every google.protobuf.Any reachable from m without crossing another Any.
func walkAnys(m protoreflect.Message, path string, fn func(*anypb.Any, string)) {
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if fd.Message() == nil {
			return true
		}
		p := path + "." + string(fd.Name())
		visit := func(child protoreflect.Message, p string) {
			if child.Descriptor().FullName() == "google.protobuf.Any" {
				if a, ok := child.Interface().(*anypb.Any); ok {
					fn(a, p)
				}
				return
			}
			walkAnys(child, p, fn)
		}
		switch {
		case fd.IsList():
			l := v.List()
			for i := 0; i < l.Len(); i++ {
				visit(l.Get(i).Message(), p+"["+strconv.Itoa(i)+"]")
			}
		case fd.IsMap():
			if fd.MapValue().Message() == nil {
				return true
			}
			v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
				visit(mv.Message(), p+"["+k.String()+"]")
				return true
			})
		default:
			visit(v.Message(), p)
		}
		return true
	})
}

// nodeToJSON converts one YAML node to JSON. Anchors, aliases and merge keys are resolved by the
// YAML decoder; timestamps stay strings; non-string mapping keys are rejected; a typed_config of
// an unlinked proto package becomes opaque (opaqueAnys).
func nodeToJSON(n *yaml.Node) ([]byte, error) {
	var v any
	if err := n.Decode(&v); err != nil {
		return nil, err
	}
	clean, err := jsonable(v, "")
	if err != nil {
		return nil, err
	}
	return json.Marshal(opaqueAnys(clean))
}

// jsonable rewrites what the YAML decoder produced into values encoding/json accepts.
func jsonable(v any, path string) (any, error) {
	switch t := v.(type) {
	case map[string]any:
		out := make(map[string]any, len(t))
		for k, e := range t {
			c, err := jsonable(e, path+"."+k)
			if err != nil {
				return nil, err
			}
			out[k] = c
		}
		return out, nil
	case map[any]any:
		out := make(map[string]any, len(t))
		for k, e := range t {
			ks, ok := k.(string)
			if !ok {
				return nil, fmt.Errorf("%s: mapping key %v is not a string", path, k)
			}
			c, err := jsonable(e, path+"."+ks)
			if err != nil {
				return nil, err
			}
			out[ks] = c
		}
		return out, nil
	case []any:
		out := make([]any, len(t))
		for i, e := range t {
			c, err := jsonable(e, path+"["+strconv.Itoa(i)+"]")
			if err != nil {
				return nil, err
			}
			out[i] = c
		}
		return out, nil
	default:
		return v, nil
	}
}

// opaqueAnys replaces, in a JSON value, every google.protobuf.Any whose "@type" belongs to a
// proto package no linked file declares by a google.protobuf.Struct holding the same fields: a
// bootstrap may name any of Envoy's hundreds of extensions, and the checks read only the few
// linked in above. An unknown type of a linked package stays, so that protojson refuses it as
// Envoy would.
func opaqueAnys(v any) any {
	switch t := v.(type) {
	case map[string]any:
		for k, e := range t {
			t[k] = opaqueAnys(e)
		}
		url, ok := t["@type"].(string)
		if !ok || linked(url) {
			return t
		}
		// The Struct keeps the fields, "@type" included: anyType reads it back.
		return map[string]any{"@type": structType, "value": t}
	case []any:
		for i, e := range t {
			t[i] = opaqueAnys(e)
		}
	}
	return v
}

// structType is the type URL of google.protobuf.Struct, which holds an opaque typed_config.
const structType = "type.googleapis.com/google.protobuf.Struct"

// anyType returns the full name of the message a (possibly opaque) typed_config holds.
func anyType(a *anypb.Any) string {
	url := a.GetTypeUrl()
	if url == structType {
		if st := (&structpb.Struct{}); a.UnmarshalTo(st) == nil {
			if t, ok := st.GetFields()["@type"]; ok {
				url = t.GetStringValue()
			}
		}
	}
	return url[strings.LastIndexByte(url, '/')+1:]
}

// linked reports whether the type an Any's type URL names is registered, or belongs to a proto
// package that some linked file declares.
func linked(url string) bool {
	name := protoreflect.FullName(url[strings.LastIndexByte(url, '/')+1:])
	if _, err := protoregistry.GlobalTypes.FindMessageByName(name); err == nil {
		return true
	}
	found := false
	protoregistry.GlobalFiles.RangeFilesByPackage(name.Parent(), func(protoreflect.FileDescriptor) bool {
		found = true
		return false
	})
	return found
}

// bootstrapExtProc returns the ext_proc filter config of the first HTTP connection manager of the first
// listener, or an error when there is none.
func bootstrapExtProc(b *bootstrapv3.Bootstrap) (*filterextproc.ExternalProcessor, error) {
	f, _, err := extProcFilter(b)
	return f, err
}

// extProcFilter returns the ext_proc filter config of the first HTTP connection manager of the
// first listener and the http filter that holds it, or an error when there is none.
func extProcFilter(b *bootstrapv3.Bootstrap) (*filterextproc.ExternalProcessor, *hcmv3.HttpFilter, error) {
	hcm, err := firstHCM(b)
	if err != nil {
		return nil, nil, err
	}
	hf := extProcHTTPFilter(hcm)
	if hf == nil {
		return nil, nil, errors.New("no ext_proc filter (typed_config ExternalProcessor) in the first HTTP connection manager")
	}
	f := &filterextproc.ExternalProcessor{}
	if err := hf.GetTypedConfig().UnmarshalTo(f); err != nil {
		return nil, nil, fmt.Errorf("http filter %q: %w", hf.GetName(), err)
	}
	return f, hf, nil
}

// extProcHTTPFilter returns the first http filter of hcm whose typed_config is an
// ExternalProcessor, or nil.
func extProcHTTPFilter(hcm *hcmv3.HttpConnectionManager) *hcmv3.HttpFilter {
	for _, hf := range hcm.GetHttpFilters() {
		if isExtProc(hf) {
			return hf
		}
	}
	return nil
}

func isExtProc(hf *hcmv3.HttpFilter) bool {
	tc := hf.GetTypedConfig()
	return tc != nil && tc.MessageIs(&filterextproc.ExternalProcessor{})
}

// firstHCM returns the first HTTP connection manager of the first listener of b.
func firstHCM(b *bootstrapv3.Bootstrap) (*hcmv3.HttpConnectionManager, error) {
	_, hcm, err := hcmFilter(b)
	return hcm, err
}

// hcmFilter returns the network filter holding the first HTTP connection manager of the first
// listener, and the manager decoded.
func hcmFilter(b *bootstrapv3.Bootstrap) (*listenerv3.Filter, *hcmv3.HttpConnectionManager, error) {
	ls := b.GetStaticResources().GetListeners()
	if len(ls) == 0 {
		return nil, nil, errors.New("no static listener")
	}
	for _, fc := range filterChains(ls[0]) {
		for _, nf := range fc.GetFilters() {
			tc := nf.GetTypedConfig()
			if tc == nil || !tc.MessageIs(&hcmv3.HttpConnectionManager{}) {
				continue
			}
			hcm := &hcmv3.HttpConnectionManager{}
			if err := tc.UnmarshalTo(hcm); err != nil {
				return nil, nil, fmt.Errorf("listener %q: %w", ls[0].GetName(), err)
			}
			return nf, hcm, nil
		}
	}
	return nil, nil, fmt.Errorf("listener %q has no http_connection_manager", ls[0].GetName())
}

// filterChains returns l's filter chains, its default filter chain last.
func filterChains(l *listenerv3.Listener) []*listenerv3.FilterChain {
	chains := l.GetFilterChains()
	if dc := l.GetDefaultFilterChain(); dc != nil {
		chains = append(chains[:len(chains):len(chains)], dc)
	}
	return chains
}

// staticCluster returns the static cluster of b named name, or nil.
func staticCluster(b *bootstrapv3.Bootstrap, name string) *clusterv3.Cluster {
	for _, c := range b.GetStaticResources().GetClusters() {
		if c.GetName() == name {
			return c
		}
	}
	return nil
}

// BufferLimit returns the per_connection_buffer_limit_bytes of a listener or cluster, with
// Envoy's default.
func BufferLimit(m interface {
	GetPerConnectionBufferLimitBytes() *wrapperspb.UInt32Value
}) uint32 {
	if v := m.GetPerConnectionBufferLimitBytes(); v != nil {
		return v.GetValue()
	}
	return defaultBufferLimit
}

// Thresholds are the DEFAULT-priority circuit breaker thresholds of a cluster, with Envoy's
// defaults (1024, 1024, 1024, 3) filled in for unset fields.
type Thresholds struct {
	MaxConnections     uint32
	MaxPendingRequests uint32
	MaxRequests        uint32
	MaxRetries         uint32
}

// ClusterThresholds returns c's DEFAULT-priority circuit breaker thresholds.
func ClusterThresholds(c *clusterv3.Cluster) Thresholds {
	t := Thresholds{defaultMaxRequests, defaultMaxRequests, defaultMaxRequests, defaultMaxRetries}
	for _, th := range c.GetCircuitBreakers().GetThresholds() {
		if th.GetPriority() != corev3.RoutingPriority_DEFAULT {
			continue
		}
		for dst, v := range map[*uint32]*wrapperspb.UInt32Value{
			&t.MaxConnections:     th.GetMaxConnections(),
			&t.MaxPendingRequests: th.GetMaxPendingRequests(),
			&t.MaxRequests:        th.GetMaxRequests(),
			&t.MaxRetries:         th.GetMaxRetries(),
		} {
			if v != nil {
				*dst = v.GetValue()
			}
		}
	}
	return t
}
