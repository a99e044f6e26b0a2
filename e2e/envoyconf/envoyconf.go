// Package envoyconf loads the Envoy, Istio and Envoy Gateway configuration shipped in envoy/ into
// go-control-plane messages, holds them to the Envoy side of the product contract (SPEC §5), and
// prepares them for the end-to-end tests: the settings an Envoy-compatible test proxy needs, a
// loopback copy of the bootstrap for a real envoy binary, and a helper that runs that binary.
//
// Everything here is test support. Functions are safe for concurrent use; none keeps state.
package envoyconf

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"

	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/anypb"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"

	// Every type a typed_config (google.protobuf.Any) in envoy/ may name must be linked in, so
	// that protojson can resolve its "@type" through the global registry.
	_ "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/file/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/stream/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
)

// Load reads an Envoy bootstrap YAML (or JSON) file into a Bootstrap. It fails like Parse.
func Load(path string) (*bootstrapv3.Bootstrap, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	b, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return b, nil
}

// Parse decodes one YAML (or JSON) document into a Bootstrap the way Envoy does: field names in
// snake_case or lowerCamelCase, every typed_config resolved by its "@type" into the concrete
// message. Unknown fields, unknown "@type"s, bad enum names and bad durations are errors, and so
// is a second YAML document. Parse does not run the proto validation rules; see Validate.
func Parse(yamlBytes []byte) (*bootstrapv3.Bootstrap, error) {
	js, err := yamlToJSON(yamlBytes)
	if err != nil {
		return nil, err
	}
	b := &bootstrapv3.Bootstrap{}
	if err := protojson.Unmarshal(js, b); err != nil {
		return nil, fmt.Errorf("bootstrap: %w", err)
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

// yamlToJSON converts exactly one YAML document to JSON. Anchors, aliases and merge keys are
// resolved by the YAML decoder; timestamps stay strings; non-string mapping keys are rejected.
func yamlToJSON(data []byte) ([]byte, error) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var v any
	if err := dec.Decode(&v); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, errors.New("empty YAML document")
		}
		return nil, err
	}
	var extra any
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		if err != nil {
			return nil, err
		}
		return nil, errors.New("more than one YAML document")
	}
	return toJSON(v)
}

func toJSON(v any) ([]byte, error) {
	clean, err := jsonable(v, "")
	if err != nil {
		return nil, err
	}
	return json.Marshal(clean)
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
