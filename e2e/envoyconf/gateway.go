package envoyconf

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	accesslogv3 "github.com/envoyproxy/go-control-plane/envoy/config/accesslog/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	accesslogfilev3 "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/file/v3"
	accesslogstreamv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/stream/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
)

// Envoy Gateway's defaults (internal/xds/translator): every listener and cluster buffer is
// 32 KiB, circuit breaker thresholds are 1024, and the ext_proc gRPC timeout is fixed at 10s.
const (
	egDefaultBufferLimit = 32768
	egDefaultThreshold   = 1024
	egGRPCTimeout        = 10 * time.Second
)

// EGLimits are the buffer limits Envoy Gateway applies around the ext_proc filters it generates
// from envoy/envoy-gateway.yaml, with Envoy Gateway's defaults for what the policies leave unset.
type EGLimits struct {
	// ClientBufferLimit is the ClientTrafficPolicy's connection.bufferLimit in bytes, the listener
	// buffer that limits BUFFERED request bodies (default 32 KiB).
	ClientBufferLimit uint32
	// BackendBufferLimit is the BackendTrafficPolicy's connection.bufferLimit in bytes, the
	// upstream cluster buffer that limits BUFFERED response bodies (default 32 KiB).
	BackendBufferLimit uint32
}

// EGPolicy is one EnvoyExtensionPolicy of an Envoy Gateway file, translated.
type EGPolicy struct {
	// Name is the policy's namespace/name.
	Name string
	// Deployment holds the ExternalProcessor Envoy Gateway generates from the policy's extProc
	// entry, and as Routes the xDS routes it enables the filter on, named as Envoy Gateway names
	// them (httproute/<namespace>/<name>/rule/<i>/match/<j>/<host, dots as underscores>), each
	// with the empty per-route config with which Envoy Gateway enables the filter.
	Deployment Deployment
	// CircuitBreaker holds backendSettings.circuitBreaker of the extProc entry: maxConnections,
	// maxPendingRequests, maxParallelRequests (max_requests), maxParallelRetries (max_retries).
	// Envoy Gateway's default is 1024 for each.
	CircuitBreaker Thresholds
}

// k8sDoc is one Kubernetes object of a multi-document YAML file; Spec is decoded per kind.
type k8sDoc struct {
	APIVersion string `yaml:"apiVersion"`
	Kind       string `yaml:"kind"`
	Metadata   struct {
		Name        string            `yaml:"name"`
		Namespace   string            `yaml:"namespace"`
		Labels      map[string]string `yaml:"labels"`
		Annotations map[string]string `yaml:"annotations"`
	} `yaml:"metadata"`
	Spec yaml.Node `yaml:"spec"`

	file  []byte // the whole file, for decodeSpec
	index int    // the position of this document in file, empty documents included
}

// readDocs reads every non-empty document of a Kubernetes YAML file.
func readDocs(path string) ([]k8sDoc, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	var docs []k8sDoc
	for i := 0; ; i++ {
		var d k8sDoc
		err := dec.Decode(&d)
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("%s: document %d: %w", path, i+1, err)
		}
		if d.Kind == "" {
			continue // an empty document
		}
		d.file, d.index = data, i
		docs = append(docs, d)
	}
}

// decodeSpec decodes the spec of d into a T, rejecting fields T does not declare. It decodes
// from the file itself, so the line numbers of its errors are the file's.
func decodeSpec[T any](d *k8sDoc) (T, error) {
	var doc struct {
		APIVersion string    `yaml:"apiVersion"`
		Kind       string    `yaml:"kind"`
		Metadata   yaml.Node `yaml:"metadata"`
		Spec       T         `yaml:"spec"`
	}
	dec := yaml.NewDecoder(bytes.NewReader(d.file))
	dec.KnownFields(true)
	for i := 0; i < d.index; i++ {
		var skip yaml.Node
		if err := dec.Decode(&skip); err != nil {
			return doc.Spec, err
		}
	}
	err := dec.Decode(&doc)
	return doc.Spec, err
}

// only returns the single document of the given API group ("" for the core group) and kind,
// nil when there is none, and an error when there are several.
func only(docs []k8sDoc, apiGroup, kind string) (*k8sDoc, error) {
	var found *k8sDoc
	for i := range docs {
		d := &docs[i]
		group, _, ok := strings.Cut(d.APIVersion, "/")
		if !ok {
			group = ""
		}
		if d.Kind != kind || group != apiGroup {
			continue
		}
		if found != nil {
			return nil, fmt.Errorf("more than one %s", kind)
		}
		found = d
	}
	return found, nil
}

// egPolicySpec mirrors the EnvoyExtensionPolicy spec (api/v1alpha1/envoyextensionypolicy_types.go);
// only extProc is translated.
type egPolicySpec struct {
	TargetRefs      []egTargetRef `yaml:"targetRefs"`
	TargetRef       *egTargetRef  `yaml:"targetRef"`
	TargetSelectors any           `yaml:"targetSelectors"`
	MergeType       any           `yaml:"mergeType"`
	ExtProc         []egExtProc   `yaml:"extProc"`
	Wasm            any           `yaml:"wasm"`
	Lua             any           `yaml:"lua"`
	DynamicModule   any           `yaml:"dynamicModule"`
}

// egTargetRef is Gateway API's LocalPolicyTargetReferenceWithSectionName. For an HTTPRoute,
// sectionName names one of its rules (HTTPRouteRule.name).
type egTargetRef struct {
	Group       string `yaml:"group"`
	Kind        string `yaml:"kind"`
	Name        string `yaml:"name"`
	SectionName string `yaml:"sectionName"`
}

// egExtProc mirrors the fields of Envoy Gateway's v1alpha1.ExtProc (api/v1alpha1/ext_proc_types.go,
// v1.9, BackendCluster inlined). It is decoded strictly: a field it does not know is one this
// translation would silently ignore.
type egExtProc struct {
	BackendRef      any                `yaml:"backendRef"` // deprecated, refused by Envoy Gateway's CEL rules
	BackendRefs     []egBackendRef     `yaml:"backendRefs"`
	BackendSettings egBackendSettings  `yaml:"backendSettings"`
	MessageTimeout  string             `yaml:"messageTimeout"`
	FailOpen        *bool              `yaml:"failOpen"`
	ProcessingMode  *egProcessingMode  `yaml:"processingMode"`
	ShadowMode      *bool              `yaml:"shadowMode"`
	Metadata        *egExtProcMetadata `yaml:"metadata"`
	StatusOnError   *int32             `yaml:"statusOnError"`
}

type egBackendRef struct {
	Group     string `yaml:"group"`
	Kind      string `yaml:"kind"`
	Name      string `yaml:"name"`
	Namespace string `yaml:"namespace"`
	Port      int    `yaml:"port"`
	Fallback  *bool  `yaml:"fallback"`
}

type egBackendSettings struct {
	CircuitBreaker *egCircuitBreaker `yaml:"circuitBreaker"`
	// Accepted but not translated: they do not affect the contract.
	LoadBalancer  any `yaml:"loadBalancer"`
	Retry         any `yaml:"retry"`
	ProxyProtocol any `yaml:"proxyProtocol"`
	TCPKeepalive  any `yaml:"tcpKeepalive"`
	HealthCheck   any `yaml:"healthCheck"`
	Timeout       any `yaml:"timeout"`
	Connection    any `yaml:"connection"`
	DNS           any `yaml:"dns"`
	HTTP2         any `yaml:"http2"`
}

type egCircuitBreaker struct {
	MaxConnections           *uint32 `yaml:"maxConnections"`
	MaxPendingRequests       *uint32 `yaml:"maxPendingRequests"`
	MaxParallelRequests      *uint32 `yaml:"maxParallelRequests"`
	MaxParallelRetries       *uint32 `yaml:"maxParallelRetries"`
	MaxRequestsPerConnection *uint32 `yaml:"maxRequestsPerConnection"`
	PerEndpoint              any     `yaml:"perEndpoint"`
}

type egProcessingMode struct {
	AllowModeOverride bool           `yaml:"allowModeOverride"`
	Request           *egModeOptions `yaml:"request"`
	Response          *egModeOptions `yaml:"response"`
}

type egExtProcMetadata struct {
	AccessibleNamespaces []string `yaml:"accessibleNamespaces"`
	WritableNamespaces   []string `yaml:"writableNamespaces"`
}

type egModeOptions struct {
	Body       string   `yaml:"body"`
	Attributes []string `yaml:"attributes"`
}

// egTrafficPolicy is the part of a ClientTrafficPolicy or BackendTrafficPolicy spec that matters
// here; other fields are ignored.
type egTrafficPolicy struct {
	TargetRefs []egTargetRef `yaml:"targetRefs"`
	Connection struct {
		BufferLimit string `yaml:"bufferLimit"`
	} `yaml:"connection"`
	// Retry is a BackendTrafficPolicy's retry (the router's retry_policy on its routes).
	Retry *struct {
		NumRetries *uint32 `yaml:"numRetries"`
		RetryOn    *struct {
			Triggers        []string `yaml:"triggers"`
			HTTPStatusCodes []uint32 `yaml:"httpStatusCodes"`
		} `yaml:"retryOn"`
	} `yaml:"retry"`
}

// egRetryPolicy is the retry_policy Envoy Gateway builds from a BackendTrafficPolicy's retry
// (internal/xds/translator/route.go, buildRetryPolicy): 2 retries by default; without retryOn,
// the same default conditions as Istio's, 503 included.
func egRetryPolicy(tp egTrafficPolicy) *routev3.RetryPolicy {
	r := tp.Retry
	if r == nil {
		return nil
	}
	p := &routev3.RetryPolicy{NumRetries: wrapperspb.UInt32(2), RetryOn: istioDefaultRetryOn, RetriableStatusCodes: istioDefaultRetryCodes}
	if r.NumRetries != nil {
		p.NumRetries = wrapperspb.UInt32(*r.NumRetries)
	}
	if o := r.RetryOn; o != nil {
		p.RetryOn, p.RetriableStatusCodes = strings.Join(o.Triggers, ","), o.HTTPStatusCodes
		if len(o.HTTPStatusCodes) > 0 && !slices.Contains(o.Triggers, "retriable-status-codes") {
			p.RetryOn = strings.Join(append(slices.Clone(o.Triggers), "retriable-status-codes"), ",")
		}
	}
	return p
}

// EnvoyGateway translates every EnvoyExtensionPolicy of the Envoy Gateway file at path into the
// ExternalProcessor Envoy Gateway would generate for its extProc entry
// (internal/xds/translator/extproc.go): every phase starts SKIP/NONE; a present request
// (response) block sets the request (response) header mode to SEND, its body sets the body mode
// (FullDuplexStreamed also sends that direction's trailers) and its attributes the request
// (response) attributes; allowModeOverride, failOpen (failure_mode_allow), shadowMode
// (observability_mode), statusOnError and messageTimeout (default 200ms) are copied;
// metadata.accessibleNamespaces and writableNamespaces become metadata_options'
// forwarding_namespaces and receiving_namespaces; the gRPC timeout is 10s. The policy's
// targetRefs are resolved against the HTTPRoutes of the same file: each policy's Deployment lists
// the xDS routes it enables the filter on. A policy targeting a rule (sectionName) wins over one
// targeting the whole HTTPRoute, as in Envoy Gateway. It also returns the buffer limits of the
// ClientTrafficPolicy and BackendTrafficPolicy in the file.
//
// It fails where Envoy Gateway would refuse or ignore the policy: an extProc entry with unknown
// fields, more than one entry per policy (this translation models one), a target that is not an
// HTTPRoute of the file or a sectionName that names none of its rules, two policies on one rule,
// an attribute outside the prefixes Envoy Gateway allows, a writable namespace starting with
// envoy.filters.http, or FullDuplexStreamed with failOpen.
func EnvoyGateway(path string) ([]EGPolicy, EGLimits, error) {
	docs, err := readDocs(path)
	if err != nil {
		return nil, EGLimits{}, err
	}
	const group = "gateway.envoyproxy.io"
	routes, err := egHTTPRoutes(docs)
	if err != nil {
		return nil, EGLimits{}, fmt.Errorf("%s: %w", path, err)
	}
	var out []EGPolicy
	var targets [][]egTargetRef
	for i := range docs {
		d := &docs[i]
		if d.Kind != "EnvoyExtensionPolicy" || !strings.HasPrefix(d.APIVersion, group+"/") {
			continue
		}
		name := d.Metadata.Namespace + "/" + d.Metadata.Name
		spec, err := decodeSpec[egPolicySpec](d)
		if err != nil {
			return nil, EGLimits{}, fmt.Errorf("%s: EnvoyExtensionPolicy %s: %w", path, name, err)
		}
		if len(spec.ExtProc) != 1 {
			return nil, EGLimits{}, fmt.Errorf("%s: EnvoyExtensionPolicy %s: want exactly one extProc entry, have %d", path, name, len(spec.ExtProc))
		}
		f, cb, err := translateEG(spec.ExtProc[0], d.Metadata.Namespace, d.Metadata.Name)
		if err != nil {
			return nil, EGLimits{}, fmt.Errorf("%s: EnvoyExtensionPolicy %s: extProc[0]: %w", path, name, err)
		}
		refs := spec.TargetRefs
		if spec.TargetRef != nil {
			refs = append(refs, *spec.TargetRef)
		}
		if len(refs) == 0 {
			return nil, EGLimits{}, fmt.Errorf("%s: EnvoyExtensionPolicy %s: no targetRefs (targetSelectors are not modelled)", path, name)
		}
		filterName := "envoy.filters.http.ext_proc/envoyextensionpolicy/" + name + "/extproc/0"
		out = append(out, EGPolicy{
			Name:           name,
			CircuitBreaker: cb,
			Deployment: Deployment{
				Source:     path + ": EnvoyExtensionPolicy " + name,
				Filter:     f,
				FilterPath: "extProc[0]",
				FilterName: filterName,
			},
		})
		targets = append(targets, refs)
	}
	if len(out) == 0 {
		return nil, EGLimits{}, fmt.Errorf("%s: no EnvoyExtensionPolicy", path)
	}
	if err := egAttach(out, targets, routes); err != nil {
		return nil, EGLimits{}, fmt.Errorf("%s: %w", path, err)
	}

	var limits EGLimits
	for kind, dst := range map[string]*uint32{
		"ClientTrafficPolicy":  &limits.ClientBufferLimit,
		"BackendTrafficPolicy": &limits.BackendBufferLimit,
	} {
		*dst = egDefaultBufferLimit
		d, err := only(docs, group, kind)
		if err != nil {
			return nil, EGLimits{}, fmt.Errorf("%s: %w", path, err)
		}
		if d == nil {
			continue
		}
		var tp egTrafficPolicy
		if err := d.Spec.Decode(&tp); err != nil {
			return nil, EGLimits{}, fmt.Errorf("%s: %s: %w", path, kind, err)
		}
		if rp := egRetryPolicy(tp); rp != nil && kind == "BackendTrafficPolicy" {
			// The retry applies to the xDS routes of the HTTPRoutes it targets (their names
			// start with httproute/<namespace>/<name>/), or to every route under a Gateway.
			var prefixes []string
			for _, ref := range tp.TargetRefs {
				switch {
				case ref.SectionName != "":
					return nil, EGLimits{}, fmt.Errorf("%s: %s %s: a retry targeting a sectionName is not modelled", path, kind, d.Metadata.Name)
				case ref.Kind == "HTTPRoute":
					prefixes = append(prefixes, "httproute/"+d.Metadata.Namespace+"/"+ref.Name+"/")
				case ref.Kind == "Gateway":
					prefixes = append(prefixes, "")
				}
			}
			for i := range out {
				for j := range out[i].Deployment.Routes {
					e := &out[i].Deployment.Routes[j]
					if slices.ContainsFunc(prefixes, func(p string) bool { return strings.HasPrefix(e.Name, p) }) {
						e.Retry, e.RetryPath = rp, kind+" "+d.Metadata.Namespace+"/"+d.Metadata.Name+".retry"
					}
				}
			}
		}
		if tp.Connection.BufferLimit == "" {
			continue
		}
		if *dst, err = parseQuantity(tp.Connection.BufferLimit); err != nil {
			return nil, EGLimits{}, fmt.Errorf("%s: %s connection.bufferLimit: %w", path, kind, err)
		}
	}
	return out, limits, nil
}

// egHTTPRoute is the part of a Gateway API HTTPRoute that names Envoy Gateway's xDS routes.
type egHTTPRoute struct {
	namespace, name string
	Hostnames       []string `yaml:"hostnames"`
	Rules           []struct {
		Name    string `yaml:"name"`
		Matches []any  `yaml:"matches"`
	} `yaml:"rules"`
}

// egHTTPRoutes returns the HTTPRoutes of docs by namespace/name.
func egHTTPRoutes(docs []k8sDoc) (map[string]*egHTTPRoute, error) {
	out := map[string]*egHTTPRoute{}
	for i := range docs {
		d := &docs[i]
		if d.Kind != "HTTPRoute" || !strings.HasPrefix(d.APIVersion, "gateway.networking.k8s.io/") {
			continue
		}
		r := &egHTTPRoute{namespace: d.Metadata.Namespace, name: d.Metadata.Name}
		if err := d.Spec.Decode(r); err != nil {
			return nil, fmt.Errorf("HTTPRoute %s/%s: %w", r.namespace, r.name, err)
		}
		out[r.namespace+"/"+r.name] = r
	}
	return out, nil
}

// egRouteNames returns the xDS route names of rule i of r: Envoy Gateway makes one route per
// match (index -1 for a rule without matches) and hostname ("*" without hostnames), and replaces
// the dots of the hostname by underscores (internal/gatewayapi/route.go). Hostnames are taken
// from the HTTPRoute: the intersection with the listener's is not modelled.
func egRouteNames(r *egHTTPRoute, i int) []string {
	hosts := r.Hostnames
	if len(hosts) == 0 {
		hosts = []string{"*"}
	}
	matches := len(r.Rules[i].Matches)
	var names []string
	for _, h := range hosts {
		for j := range max(matches, 1) {
			if matches == 0 {
				j = -1
			}
			names = append(names, fmt.Sprintf("httproute/%s/%s/rule/%d/match/%d/%s",
				r.namespace, r.name, i, j, strings.ReplaceAll(h, ".", "_")))
		}
	}
	return names
}

// egAttach fills each policy's Routes from its targets: rule targets first, then whole-route
// targets on the rules no rule target took.
func egAttach(pols []EGPolicy, targets [][]egTargetRef, routes map[string]*egHTTPRoute) error {
	type ruleKey struct {
		route string
		rule  int
	}
	owner := map[ruleKey]int{}
	whole := map[string]int{} // HTTPRoute → the policy targeting all of it
	attach := func(p int, route *egHTTPRoute, rule int, why string) {
		for _, n := range egRouteNames(route, rule) {
			pols[p].Deployment.Routes = append(pols[p].Deployment.Routes, RouteEntry{
				Name:   n,
				Path:   fmt.Sprintf("HTTPRoute %s/%s rules[%d] (%s)", route.namespace, route.name, rule, why),
				Config: &filterextproc.ExtProcPerRoute{},
			})
		}
	}
	for pass := 0; pass < 2; pass++ {
		for p, refs := range targets {
			ns, _, _ := strings.Cut(pols[p].Name, "/")
			for _, ref := range refs {
				if ref.Kind != "HTTPRoute" || (ref.Group != "" && ref.Group != "gateway.networking.k8s.io") {
					return fmt.Errorf("EnvoyExtensionPolicy %s: target %s %s: only HTTPRoute targets are modelled", pols[p].Name, ref.Kind, ref.Name)
				}
				route := routes[ns+"/"+ref.Name]
				if route == nil {
					return fmt.Errorf("EnvoyExtensionPolicy %s: HTTPRoute %s/%s is not in the file", pols[p].Name, ns, ref.Name)
				}
				key := ns + "/" + ref.Name
				if (ref.SectionName != "") != (pass == 0) {
					continue
				}
				if ref.SectionName == "" {
					if q, taken := whole[key]; taken && q != p {
						return fmt.Errorf("EnvoyExtensionPolicy %s and %s both target HTTPRoute %s", pols[q].Name, pols[p].Name, key)
					}
					whole[key] = p
					for i := range route.Rules {
						if _, taken := owner[ruleKey{key, i}]; !taken {
							owner[ruleKey{key, i}] = p
							attach(p, route, i, "the whole HTTPRoute")
						}
					}
					continue
				}
				found := false
				for i, rule := range route.Rules {
					if rule.Name != ref.SectionName {
						continue
					}
					found = true
					if q, taken := owner[ruleKey{key, i}]; taken {
						return fmt.Errorf("EnvoyExtensionPolicy %s and %s both target rule %q of HTTPRoute %s", pols[q].Name, pols[p].Name, rule.Name, key)
					}
					owner[ruleKey{key, i}] = p
					attach(p, route, i, "sectionName "+ref.SectionName)
				}
				if !found {
					return fmt.Errorf("EnvoyExtensionPolicy %s: sectionName %q names no rule of HTTPRoute %s", pols[p].Name, ref.SectionName, key)
				}
			}
		}
	}
	return nil
}

// egAttribute is the pattern Envoy Gateway's CRD puts on processingMode.*.attributes.
var egAttribute = regexp.MustCompile(`^(connection\.|source\.|destination\.|request\.|response\.|upstream\.|xds\.route_)[a-z_1-9]*$`)

func translateEG(ep egExtProc, namespace, name string) (*filterextproc.ExternalProcessor, Thresholds, error) {
	if ep.BackendRef != nil {
		return nil, Thresholds{}, errors.New("backendRef is not supported, use backendRefs")
	}
	if len(ep.BackendRefs) != 1 {
		return nil, Thresholds{}, fmt.Errorf("want exactly one backendRef, have %d", len(ep.BackendRefs))
	}
	if br := ep.BackendRefs[0]; br.Name == "" || br.Port == 0 {
		return nil, Thresholds{}, errors.New("backendRefs[0] needs a name and a port")
	}
	f := &filterextproc.ExternalProcessor{
		GrpcService: &corev3.GrpcService{
			TargetSpecifier: &corev3.GrpcService_EnvoyGrpc_{EnvoyGrpc: &corev3.GrpcService_EnvoyGrpc{
				ClusterName: fmt.Sprintf("envoyextensionpolicy/%s/%s/extproc/0", namespace, name),
			}},
			Timeout: durationpb.New(egGRPCTimeout),
		},
		ProcessingMode: &filterextproc.ProcessingMode{
			RequestHeaderMode:   filterextproc.ProcessingMode_SKIP,
			ResponseHeaderMode:  filterextproc.ProcessingMode_SKIP,
			RequestBodyMode:     filterextproc.ProcessingMode_NONE,
			ResponseBodyMode:    filterextproc.ProcessingMode_NONE,
			RequestTrailerMode:  filterextproc.ProcessingMode_SKIP,
			ResponseTrailerMode: filterextproc.ProcessingMode_SKIP,
		},
	}
	if ep.FailOpen != nil {
		f.FailureModeAllow = *ep.FailOpen
	}
	if ep.ShadowMode != nil {
		f.ObservabilityMode = *ep.ShadowMode
	}
	if ep.StatusOnError != nil {
		f.StatusOnError = &typev3.HttpStatus{Code: typev3.StatusCode(*ep.StatusOnError)}
	}
	if ep.MessageTimeout != "" {
		d, err := time.ParseDuration(ep.MessageTimeout)
		if err != nil {
			return nil, Thresholds{}, fmt.Errorf("messageTimeout: %w", err)
		}
		f.MessageTimeout = durationpb.New(d)
	}
	if pm := ep.ProcessingMode; pm != nil {
		f.AllowModeOverride = pm.AllowModeOverride
		for _, dir := range []struct {
			field string
			opts  *egModeOptions
			body  *filterextproc.ProcessingMode_BodySendMode
			hdr   *filterextproc.ProcessingMode_HeaderSendMode
			trl   *filterextproc.ProcessingMode_HeaderSendMode
			attrs *[]string
		}{
			{"request", pm.Request, &f.ProcessingMode.RequestBodyMode, &f.ProcessingMode.RequestHeaderMode, &f.ProcessingMode.RequestTrailerMode, &f.RequestAttributes},
			{"response", pm.Response, &f.ProcessingMode.ResponseBodyMode, &f.ProcessingMode.ResponseHeaderMode, &f.ProcessingMode.ResponseTrailerMode, &f.ResponseAttributes},
		} {
			if dir.opts == nil {
				continue
			}
			mode, err := egBodyMode(dir.opts.Body)
			if err != nil {
				return nil, Thresholds{}, fmt.Errorf("processingMode.%s.body: %w", dir.field, err)
			}
			*dir.hdr = filterextproc.ProcessingMode_SEND
			*dir.body = mode
			if mode == filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED {
				*dir.trl = filterextproc.ProcessingMode_SEND
				if f.FailureModeAllow {
					return nil, Thresholds{}, fmt.Errorf("processingMode.%s.body: FullDuplexStreamed needs failOpen false", dir.field)
				}
			}
			for i, a := range dir.opts.Attributes {
				if !egAttribute.MatchString(a) {
					return nil, Thresholds{}, fmt.Errorf("processingMode.%s.attributes[%d]: %q does not match %s", dir.field, i, a, egAttribute)
				}
			}
			*dir.attrs = dir.opts.Attributes
		}
	}
	if md := ep.Metadata; md != nil {
		if len(md.WritableNamespaces) > 8 {
			return nil, Thresholds{}, errors.New("metadata.writableNamespaces: at most 8")
		}
		for i, ns := range md.WritableNamespaces {
			if strings.HasPrefix(ns, "envoy.filters.http") {
				return nil, Thresholds{}, fmt.Errorf("metadata.writableNamespaces[%d]: %q: well-known Envoy HTTP filter namespaces are refused", i, ns)
			}
		}
		f.MetadataOptions = &filterextproc.MetadataOptions{}
		if md.AccessibleNamespaces != nil {
			f.MetadataOptions.ForwardingNamespaces = &filterextproc.MetadataOptions_MetadataNamespaces{Untyped: md.AccessibleNamespaces}
		}
		if md.WritableNamespaces != nil {
			f.MetadataOptions.ReceivingNamespaces = &filterextproc.MetadataOptions_MetadataNamespaces{Untyped: md.WritableNamespaces}
		}
	}
	cb := Thresholds{egDefaultThreshold, egDefaultThreshold, egDefaultThreshold, egDefaultThreshold}
	if c := ep.BackendSettings.CircuitBreaker; c != nil {
		for dst, v := range map[*uint32]*uint32{
			&cb.MaxConnections:     c.MaxConnections,
			&cb.MaxPendingRequests: c.MaxPendingRequests,
			&cb.MaxRequests:        c.MaxParallelRequests,
			&cb.MaxRetries:         c.MaxParallelRetries,
		} {
			if v != nil {
				*dst = *v
			}
		}
	}
	return f, cb, nil
}

func egBodyMode(s string) (filterextproc.ProcessingMode_BodySendMode, error) {
	switch s {
	case "":
		return filterextproc.ProcessingMode_NONE, nil
	case "Streamed":
		return filterextproc.ProcessingMode_STREAMED, nil
	case "Buffered":
		return filterextproc.ProcessingMode_BUFFERED, nil
	case "BufferedPartial":
		return filterextproc.ProcessingMode_BUFFERED_PARTIAL, nil
	case "FullDuplexStreamed":
		return filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED, nil
	}
	return 0, fmt.Errorf("unknown body mode %q (want Streamed, Buffered, BufferedPartial or FullDuplexStreamed)", s)
}

// parseQuantity parses a Kubernetes resource quantity of bytes ("1Mi", "32768", "1M") that fits
// Envoy's uint32 buffer limit fields.
func parseQuantity(s string) (uint32, error) {
	mult := uint64(1)
	num := s
	for _, u := range []struct {
		suffix string
		mult   uint64
	}{{"Ki", 1 << 10}, {"Mi", 1 << 20}, {"Gi", 1 << 30}, {"k", 1e3}, {"M", 1e6}, {"G", 1e9}} {
		if n, ok := strings.CutSuffix(s, u.suffix); ok {
			num, mult = n, u.mult
			break
		}
	}
	n, err := strconv.ParseUint(num, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("quantity %q: want an integer with an optional Ki, Mi, Gi, k, M or G suffix", s)
	}
	if n*mult/mult != n || n*mult > 1<<32-1 {
		return 0, fmt.Errorf("quantity %q does not fit in 32 bits", s)
	}
	return uint32(n * mult), nil
}

// istioSpec mirrors the EnvoyFilter spec fields the file may use; it is decoded strictly.
type istioSpec struct {
	WorkloadSelector *istioWorkloadSelector `yaml:"workloadSelector"`
	TargetRefs       any                    `yaml:"targetRefs"`
	Priority         int                    `yaml:"priority"`
	ConfigPatches    []istioPatch           `yaml:"configPatches"`
}

type istioWorkloadSelector struct {
	Labels map[string]string `yaml:"labels"`
}

type istioPatch struct {
	ApplyTo string     `yaml:"applyTo"`
	Match   istioMatch `yaml:"match"`
	Patch   struct {
		Operation   string    `yaml:"operation"`
		Value       yaml.Node `yaml:"value"`
		FilterClass string    `yaml:"filterClass"`
	} `yaml:"patch"`
}

type istioMatch struct {
	Context            string                        `yaml:"context"`
	Proxy              any                           `yaml:"proxy"`
	Listener           *istioListenerMatch           `yaml:"listener"`
	RouteConfiguration *istioRouteConfigurationMatch `yaml:"routeConfiguration"`
	Cluster            any                           `yaml:"cluster"`
}

// istioRouteConfigurationMatch is EnvoyFilter.RouteConfigurationMatch, for HTTP_ROUTE patches.
type istioRouteConfigurationMatch struct {
	PortNumber int    `yaml:"portNumber"`
	PortName   string `yaml:"portName"`
	Gateway    string `yaml:"gateway"`
	Name       string `yaml:"name"`
	Vhost      *struct {
		Name       string `yaml:"name"`
		DomainName string `yaml:"domainName"`
		Route      *struct {
			Name   string `yaml:"name"`
			Action string `yaml:"action"`
		} `yaml:"route"`
	} `yaml:"vhost"`
}

type istioListenerMatch struct {
	PortNumber  int              `yaml:"portNumber"`
	Name        string           `yaml:"name"`
	FilterChain istioFilterChain `yaml:"filterChain"`
}

type istioFilterChain struct {
	Name                 string      `yaml:"name"`
	Sni                  string      `yaml:"sni"`
	TransportProtocol    string      `yaml:"transportProtocol"`
	ApplicationProtocols string      `yaml:"applicationProtocols"`
	DestinationPort      int         `yaml:"destinationPort"`
	Filter               istioFilter `yaml:"filter"`
}

type istioFilter struct {
	Name      string `yaml:"name"`
	SubFilter struct {
		Name string `yaml:"name"`
	} `yaml:"subFilter"`
}

// IstioExtProc returns the ExternalProcessor embedded in the EnvoyFilter of the file at path: the
// typed_config of its HTTP_FILTER patch, decoded like a bootstrap (unknown fields are errors). The
// patch must insert the filter ahead of the router: INSERT_BEFORE envoy.filters.http.router, or
// INSERT_FIRST, into the http_connection_manager.
func IstioExtProc(path string) (*filterextproc.ExternalProcessor, error) {
	d, err := IstioDeployment(path)
	if err != nil {
		return nil, err
	}
	return d.Filter, nil
}

// IstioDeployment reads the ext_proc deployment of the Istio file at path: the filter of its
// EnvoyFilter (as IstioExtProc), the per-route configs of the EnvoyFilter's HTTP_ROUTE patches
// (each patch value decoded as a Route; its route name is the patch's
// routeConfiguration.vhost.route.name), and the route names the file's VirtualServices give
// Envoy: an http route's name, or name.matchName for a match with a name (Istio's translateRoute).
// Istio builds the connection manager itself and sets no local_reply_config.
func IstioDeployment(path string) (Deployment, error) {
	docs, err := readDocs(path)
	if err != nil {
		return Deployment{}, err
	}
	ef, err := only(docs, "networking.istio.io", "EnvoyFilter")
	if err != nil {
		return Deployment{}, fmt.Errorf("%s: %w", path, err)
	}
	if ef == nil {
		return Deployment{}, fmt.Errorf("%s: no EnvoyFilter", path)
	}
	spec, err := decodeSpec[istioSpec](ef)
	if err != nil {
		return Deployment{}, fmt.Errorf("%s: EnvoyFilter %s: %w", path, ef.Metadata.Name, err)
	}
	d := Deployment{Source: path + ": EnvoyFilter " + ef.Metadata.Namespace + "/" + ef.Metadata.Name}
	var routePatches []int
	var filterContext string // the ext_proc patch's match context
	for i, cp := range spec.ConfigPatches {
		if cp.ApplyTo == "HTTP_ROUTE" {
			routePatches = append(routePatches, i)
			continue
		}
		if cp.ApplyTo != "HTTP_FILTER" {
			continue
		}
		hf := &hcmv3.HttpFilter{}
		if err := decodePatch(&cp, hf); err != nil {
			return Deployment{}, fmt.Errorf("%s: configPatches[%d].patch.value: %w", path, i, err)
		}
		if !hf.GetTypedConfig().MessageIs(&filterextproc.ExternalProcessor{}) {
			continue
		}
		if d.Filter != nil {
			return Deployment{}, fmt.Errorf("%s: more than one ext_proc patch", path)
		}
		l := cp.Match.Listener
		if l == nil || l.FilterChain.Filter.Name != "envoy.filters.network.http_connection_manager" {
			return Deployment{}, fmt.Errorf("%s: configPatches[%d] does not match the http_connection_manager", path, i)
		}
		switch op := cp.Patch.Operation; {
		case op == "INSERT_FIRST":
		case op == "INSERT_BEFORE" && l.FilterChain.Filter.SubFilter.Name == "envoy.filters.http.router":
		default:
			return Deployment{}, fmt.Errorf("%s: configPatches[%d] must INSERT_BEFORE envoy.filters.http.router (or INSERT_FIRST), have %s %q",
				path, i, op, l.FilterChain.Filter.SubFilter.Name)
		}
		d.Filter = &filterextproc.ExternalProcessor{}
		if err := hf.GetTypedConfig().UnmarshalTo(d.Filter); err != nil {
			return Deployment{}, fmt.Errorf("%s: configPatches[%d]: %w", path, i, err)
		}
		d.FilterName = hf.GetName()
		d.FilterPath = fmt.Sprintf("configPatches[%d].patch.value.typed_config", i)
		filterContext = cp.Match.Context
	}
	if d.Filter == nil {
		return Deployment{}, fmt.Errorf("%s: no HTTP_FILTER patch with an ExternalProcessor typed_config", path)
	}

	for _, doc := range docs {
		if doc.Kind != "VirtualService" || !strings.HasPrefix(doc.APIVersion, "networking.istio.io/") {
			continue
		}
		var vs struct {
			HTTP []struct {
				Name  string `yaml:"name"`
				Match []struct {
					Name string `yaml:"name"`
				} `yaml:"match"`
				Retries *istioRetries `yaml:"retries"`
			} `yaml:"http"`
		}
		if err := doc.Spec.Decode(&vs); err != nil {
			return Deployment{}, fmt.Errorf("%s: VirtualService %s: %w", path, doc.Metadata.Name, err)
		}
		for i, h := range vs.HTTP {
			at := fmt.Sprintf("VirtualService %s/%s http[%d]", doc.Metadata.Namespace, doc.Metadata.Name, i)
			retry, retryAt := h.Retries.policy(), at+".retries"
			if h.Retries == nil {
				retryAt = at + " (no retries: Istio's default retry policy)"
			}
			if filterContext == "SIDECAR_INBOUND" {
				// The VirtualService's retries run in the caller's outbound sidecar: a retry
				// reaches this filter as a new request with the same key (a duplicate).
				retry, retryAt = nil, ""
			}
			entry := func(name string) RouteEntry {
				return RouteEntry{Name: name, Path: at, Retry: retry, RetryPath: retryAt}
			}
			named := false
			for _, m := range h.Match {
				if m.Name != "" {
					d.Routes = append(d.Routes, entry(h.Name+"."+m.Name))
				} else if !named {
					d.Routes = append(d.Routes, entry(h.Name))
					named = true
				}
			}
			if len(h.Match) == 0 {
				d.Routes = append(d.Routes, entry(h.Name))
			}
		}
	}

	for _, i := range routePatches {
		cp := &spec.ConfigPatches[i]
		rc := cp.Match.RouteConfiguration
		if rc == nil || rc.Vhost == nil || rc.Vhost.Route == nil || rc.Vhost.Route.Name == "" {
			return Deployment{}, fmt.Errorf("%s: configPatches[%d]: an HTTP_ROUTE patch must match routeConfiguration.vhost.route.name", path, i)
		}
		r := &routev3.Route{}
		if err := decodePatch(cp, r); err != nil {
			return Deployment{}, fmt.Errorf("%s: configPatches[%d].patch.value: %w", path, i, err)
		}
		e := RouteEntry{Name: rc.Vhost.Route.Name, Path: fmt.Sprintf("configPatches[%d].patch.value", i)}
		if a, ok := r.GetTypedPerFilterConfig()[d.FilterName]; ok {
			e.Path += ".typed_per_filter_config[" + d.FilterName + "]"
			if e.Config, err = deployedPerRoute(a); err != nil {
				return Deployment{}, fmt.Errorf("%s: %s: %w", path, e.Path, err)
			}
		}
		d.Routes = append(d.Routes, e)
	}
	return d, nil
}

// decodePatch decodes an EnvoyFilter patch value into m as Envoy would read it: unknown fields
// and unknown "@type"s are errors.
func decodePatch(cp *istioPatch, m proto.Message) error {
	var v any
	if err := cp.Patch.Value.Decode(&v); err != nil {
		return err
	}
	js, err := toJSON(v)
	if err != nil {
		return err
	}
	return protojson.Unmarshal(js, m)
}

// egDefaultOrder is Envoy Gateway's default order of HTTP filter types
// (internal/xds/translator/httpfilters.go, newOrderedHTTPFilter): authentication before ext_proc,
// RBAC and rate limits after it. The router is always last and cannot be moved.
var egDefaultOrder = []string{
	"envoy.filters.http.custom_response", "envoy.filters.http.health_check", "envoy.filters.http.fault",
	"envoy.filters.http.cors", "envoy.filters.http.csrf", "envoy.filters.http.header_mutation",
	"envoy.filters.http.ext_authz", "envoy.filters.http.api_key_auth", "envoy.filters.http.basic_auth",
	"envoy.filters.http.oauth2", "envoy.filters.http.jwt_authn", "envoy.filters.http.stateful_session",
	"envoy.filters.http.buffer", "envoy.filters.http.lua", "envoy.filters.http.ext_proc",
	"envoy.filters.http.wasm", "envoy.filters.http.dynamic_modules", "envoy.filters.http.geoip",
	"envoy.filters.http.rbac", "envoy.filters.http.local_ratelimit", "envoy.filters.http.ratelimit",
	"envoy.filters.http.bandwidth_limit", "envoy.filters.http.grpc_web", "envoy.filters.http.grpc_stats",
	"envoy.filters.http.credential_injector", "envoy.filters.http.compressor",
	"envoy.filters.http.dynamic_forward_proxy", "envoy.filters.http.router",
}

// EGFilterPosition is one entry of an EnvoyProxy's spec.filterOrder: filter type Name moves
// before the first filter of type Before, or after the last of type After.
type EGFilterPosition struct {
	Name   string `yaml:"name"`
	Before string `yaml:"before"`
	After  string `yaml:"after"`
}

// EnvoyGatewayFilterOrder returns spec.filterOrder of the EnvoyProxy in the file at path, nil
// when the file has none. Each entry must name filter types Envoy Gateway knows (the router
// excluded) and exactly one of before and after, as Envoy Gateway's CRD requires.
func EnvoyGatewayFilterOrder(path string) ([]EGFilterPosition, error) {
	docs, err := readDocs(path)
	if err != nil {
		return nil, err
	}
	d, err := only(docs, "gateway.envoyproxy.io", "EnvoyProxy")
	if err != nil || d == nil {
		return nil, err
	}
	var spec struct {
		FilterOrder []EGFilterPosition `yaml:"filterOrder"`
	}
	if err := d.Spec.Decode(&spec); err != nil {
		return nil, fmt.Errorf("%s: EnvoyProxy %s: %w", path, d.Metadata.Name, err)
	}
	known := func(n string) bool {
		return n != "envoy.filters.http.router" && slices.Contains(egDefaultOrder, n)
	}
	for i, p := range spec.FilterOrder {
		if !known(p.Name) {
			return nil, fmt.Errorf("%s: EnvoyProxy %s: filterOrder[%d].name %q is not a filter type Envoy Gateway orders", path, d.Metadata.Name, i, p.Name)
		}
		if (p.Before == "") == (p.After == "") {
			return nil, fmt.Errorf("%s: EnvoyProxy %s: filterOrder[%d] needs exactly one of before and after", path, d.Metadata.Name, i)
		}
		if o := p.Before + p.After; !known(o) {
			return nil, fmt.Errorf("%s: EnvoyProxy %s: filterOrder[%d]: %q is not a filter type Envoy Gateway orders", path, d.Metadata.Name, i, o)
		}
	}
	return spec.FilterOrder, nil
}

// EGFilterChain returns the filter types of present (each once) in the order Envoy Gateway puts
// them in a connection manager: its default order, then each filterOrder entry applied in turn as
// internal/xds/translator/httpfilters.go (sortHTTPFilters) does; an entry whose filter or anchor
// is not present changes nothing.
func EGFilterChain(present []string, order []EGFilterPosition) ([]string, error) {
	var chain []string
	for _, n := range egDefaultOrder {
		if slices.Contains(present, n) {
			chain = append(chain, n)
		}
	}
	for _, n := range present {
		if !slices.Contains(egDefaultOrder, n) {
			return nil, fmt.Errorf("%q is not a filter type Envoy Gateway orders", n)
		}
	}
	for _, p := range order {
		i := slices.Index(chain, p.Name)
		anchor := p.Before + p.After
		if i < 0 || !slices.Contains(chain, anchor) {
			continue
		}
		chain = slices.Delete(chain, i, i+1)
		j := slices.Index(chain, anchor) // each type is once in chain: first and last are one
		if p.After != "" {
			j++
		}
		chain = slices.Insert(chain, j, p.Name)
	}
	return chain, nil
}

// WithoutGatewayGaps returns err without the refusals an Envoy Gateway config cannot avoid: its
// translator sets request_trailer_mode SEND only for FullDuplexStreamed and SKIP for every other
// body mode (buildProcessingMode in envoyproxy/gateway internal/xds/translator/extproc.go), and
// EnvoyExtensionPolicy has no field for it. Under Buffered, Streamed or BufferedPartial a
// covered request that carries trailers and no data therefore reaches the upstream unclaimed;
// the processor counts it (idempotency_envoy_misconfig_total{kind="unclaimed_request"}) and the
// README says so, with FullDuplexStreamed as the cure for clients that send request trailers.
func WithoutGatewayGaps(err error) error {
	var keep []error
	var walk func(error)
	walk = func(e error) {
		if e == nil || errors.Is(e, ErrRequestTrailersSkipped) && !isJoin(e) {
			return
		}
		if j, ok := e.(interface{ Unwrap() []error }); ok {
			for _, x := range j.Unwrap() {
				walk(x)
			}
			return
		}
		keep = append(keep, e)
	}
	walk(err)
	return errors.Join(keep...)
}

// isJoin reports whether e joins several errors (errors.Join).
func isJoin(e error) bool {
	_, ok := e.(interface{ Unwrap() []error })
	return ok
}

// istioRetries is a VirtualService HTTPRoute's retries.
type istioRetries struct {
	Attempts              *uint32 `yaml:"attempts"`
	RetryOn               string  `yaml:"retryOn"`
	PerTryTimeout         string  `yaml:"perTryTimeout"`
	RetryRemoteLocalities *bool   `yaml:"retryRemoteLocalities"`
	Backoff               string  `yaml:"backoff"`
}

// istioDefaultRetryOn and istioDefaultRetryCodes are Istio's default retry policy, applied to
// every HTTP route whose VirtualService sets no retries (pilot/pkg/networking/core/route/retry,
// DefaultPolicy: 2 retries).
const istioDefaultRetryOn = "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes"

var istioDefaultRetryCodes = []uint32{503}

// policy is the router retry policy Istio builds from r (retry.ConvertPolicy): nil retries get
// the default policy, attempts 0 none; a retryOn replaces the default conditions, its numbers
// becoming retriable status codes.
func (r *istioRetries) policy() *routev3.RetryPolicy {
	p := &routev3.RetryPolicy{NumRetries: wrapperspb.UInt32(2), RetryOn: istioDefaultRetryOn, RetriableStatusCodes: istioDefaultRetryCodes}
	if r == nil {
		return p
	}
	if r.Attempts != nil {
		if *r.Attempts == 0 {
			return nil
		}
		p.NumRetries = wrapperspb.UInt32(*r.Attempts)
	}
	if r.RetryOn != "" {
		var conds []string
		p.RetriableStatusCodes = nil
		for _, c := range strings.Split(r.RetryOn, ",") {
			c = strings.TrimSpace(c)
			if n, err := strconv.ParseUint(c, 10, 32); err == nil {
				p.RetriableStatusCodes = append(p.RetriableStatusCodes, uint32(n))
				continue
			}
			conds = append(conds, c)
		}
		if len(p.RetriableStatusCodes) > 0 && !slices.Contains(conds, "retriable-status-codes") {
			conds = append(conds, "retriable-status-codes")
		}
		p.RetryOn = strings.Join(conds, ",")
	}
	return p
}

// IstioAccessLogFormats returns the text formats of the access logs the Istio file at path adds
// to the connection manager: its NETWORK_FILTER patches that MERGE an HttpConnectionManager
// typed_config with access_log entries (stdout or file loggers).
func IstioAccessLogFormats(path string) ([]string, error) {
	ef, err := theDoc(path, "networking.istio.io", "EnvoyFilter")
	if err != nil {
		return nil, err
	}
	spec, err := decodeSpec[istioSpec](ef)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	var out []string
	for i, cp := range spec.ConfigPatches {
		if cp.ApplyTo != "NETWORK_FILTER" || cp.Patch.Operation != "MERGE" {
			continue
		}
		f := &listenerv3.Filter{}
		if err := decodePatch(&cp, f); err != nil {
			return nil, fmt.Errorf("%s: configPatches[%d].patch.value: %w", path, i, err)
		}
		hcm := &hcmv3.HttpConnectionManager{}
		if err := f.GetTypedConfig().UnmarshalTo(hcm); err != nil {
			return nil, fmt.Errorf("%s: configPatches[%d]: %w", path, i, err)
		}
		formats, err := accessLogFormats(hcm.GetAccessLog())
		if err != nil {
			return nil, fmt.Errorf("%s: configPatches[%d]: %w", path, i, err)
		}
		out = append(out, formats...)
	}
	return out, nil
}

// accessLogFormats returns the text format of each stdout or file access log in logs.
func accessLogFormats(logs []*accesslogv3.AccessLog) ([]string, error) {
	var out []string
	for _, l := range logs {
		m, err := l.GetTypedConfig().UnmarshalNew()
		if err != nil {
			return nil, err
		}
		switch c := m.(type) {
		case *accesslogstreamv3.StdoutAccessLog:
			out = append(out, c.GetLogFormat().GetTextFormatSource().GetInlineString())
		case *accesslogfilev3.FileAccessLog:
			out = append(out, c.GetLogFormat().GetTextFormatSource().GetInlineString())
		}
	}
	return out, nil
}

// EnvoyGatewayAccessLogFormats returns the text formats of the EnvoyProxy's
// telemetry.accessLog settings in the Envoy Gateway file at path.
func EnvoyGatewayAccessLogFormats(path string) ([]string, error) {
	d, err := theDoc(path, "gateway.envoyproxy.io", "EnvoyProxy")
	if err != nil {
		return nil, err
	}
	var spec struct {
		Telemetry struct {
			AccessLog struct {
				Settings []struct {
					Format struct {
						Type string `yaml:"type"`
						Text string `yaml:"text"`
					} `yaml:"format"`
				} `yaml:"settings"`
			} `yaml:"accessLog"`
		} `yaml:"telemetry"`
	}
	if err := d.Spec.Decode(&spec); err != nil {
		return nil, fmt.Errorf("%s: EnvoyProxy %s: %w", path, d.Metadata.Name, err)
	}
	var out []string
	for _, s := range spec.Telemetry.AccessLog.Settings {
		if s.Format.Type == "Text" {
			out = append(out, s.Format.Text)
		}
	}
	return out, nil
}

// theDoc returns the one document of group and kind in the file at path, and an error when the
// file has none or several.
func theDoc(path, group, kind string) (*k8sDoc, error) {
	docs, err := readDocs(path)
	if err != nil {
		return nil, err
	}
	d, err := only(docs, group, kind)
	switch {
	case err != nil:
		return nil, fmt.Errorf("%s: %w", path, err)
	case d == nil:
		return nil, fmt.Errorf("%s: no %s", path, kind)
	}
	return d, nil
}
