package check

import (
	"regexp"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"go.yaml.in/yaml/v3"
)

// goDuration is a duration as Go's time.ParseDuration writes it ("200ms", "1m30s"), which
// Istio accepts wherever its resources hold a google.protobuf.Duration; protojson takes only
// seconds ("0.2s").
var goDuration = regexp.MustCompile(`^-?([0-9]+(\.[0-9]*)?(ns|us|µs|ms|s|m|h))+$`)

// protoDuration is protojson's form of a duration.
var protoDuration = regexp.MustCompile(`^-?[0-9]+(\.[0-9]+)?s$`)

// istioDurations rewrites, in n (a YAML value read as a message of type md), every
// google.protobuf.Duration written as Go writes it into protojson's seconds, as Istio reads it.
// Fields are found by their proto or JSON names, typed_configs by "@type"; other values are left
// alone. Line numbers stay.
func istioDurations(n *yaml.Node, md protoreflect.MessageDescriptor) {
	n = resolve(n)
	if n == nil || n.Kind != yaml.MappingNode || md == nil {
		return
	}
	if md.FullName() == "google.protobuf.Any" {
		t := mapValue(n, "@type")
		if t == nil {
			return
		}
		mt, err := protoregistry.GlobalTypes.FindMessageByURL(t.Value)
		if err != nil {
			return
		}
		md = mt.Descriptor()
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, val := n.Content[i].Value, resolve(n.Content[i+1])
		fd := md.Fields().ByJSONName(k)
		if fd == nil {
			fd = md.Fields().ByName(protoreflect.Name(k))
		}
		if fd == nil || fd.Message() == nil || val == nil {
			continue
		}
		switch {
		case fd.IsMap():
			if val.Kind == yaml.MappingNode && fd.MapValue().Message() != nil {
				for j := 1; j < len(val.Content); j += 2 {
					istioDuration(val.Content[j], fd.MapValue().Message())
				}
			}
		case fd.IsList():
			if val.Kind == yaml.SequenceNode {
				for _, item := range val.Content {
					istioDuration(item, fd.Message())
				}
			}
		default:
			istioDuration(val, fd.Message())
		}
	}
}

// istioDuration is istioDurations for one value of message type md.
func istioDuration(v *yaml.Node, md protoreflect.MessageDescriptor) {
	v = resolve(v)
	if v == nil {
		return
	}
	if md.FullName() == "google.protobuf.Duration" {
		if v.Kind == yaml.ScalarNode {
			v.Value = goToProtoDuration(v.Value)
		}
		return
	}
	istioDurations(v, md)
}

// goToProtoDuration returns s in protojson's form when it is a Go duration, else s unchanged.
func goToProtoDuration(s string) string {
	if protoDuration.MatchString(s) || !goDuration.MatchString(s) {
		return s
	}
	d, err := time.ParseDuration(strings.ReplaceAll(s, "µs", "us"))
	if err != nil {
		return s
	}
	return strconv.FormatFloat(d.Seconds(), 'f', -1, 64) + "s"
}
