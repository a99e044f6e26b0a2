package envoyconf

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/durationpb"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
)

// Envoy Gateway's defaults (internal/xds/translator): every listener and cluster buffer is
// 32 KiB, circuit breaker thresholds are 1024, and the ext_proc gRPC timeout is fixed at 10s.
const (
	egDefaultBufferLimit = 32768
	egDefaultThreshold   = 1024
	egGRPCTimeout        = 10 * time.Second
)

// EGLimits are the limits Envoy Gateway applies around the ext_proc filter it generates from
// envoy/envoy-gateway.yaml, with Envoy Gateway's defaults for what the policies leave unset.
type EGLimits struct {
	// CircuitBreaker holds backendSettings.circuitBreaker of the extProc block: maxConnections,
	// maxPendingRequests, maxParallelRequests (max_requests), maxParallelRetries (max_retries).
	// Envoy Gateway's default is 1024 for each.
	CircuitBreaker Thresholds
	// ClientBufferLimit is the ClientTrafficPolicy's connection.bufferLimit in bytes, the listener
	// buffer that limits BUFFERED request bodies (default 32 KiB).
	ClientBufferLimit uint32
	// BackendBufferLimit is the BackendTrafficPolicy's connection.bufferLimit in bytes, the
	// upstream cluster buffer that limits BUFFERED response bodies (default 32 KiB).
	BackendBufferLimit uint32
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

// egPolicySpec mirrors the EnvoyExtensionPolicy spec; only extProc is translated.
type egPolicySpec struct {
	TargetRefs      []map[string]string `yaml:"targetRefs"`
	TargetRef       map[string]string   `yaml:"targetRef"`
	TargetSelectors any                 `yaml:"targetSelectors"`
	ExtProc         []egExtProc         `yaml:"extProc"`
	Wasm            any                 `yaml:"wasm"`
	Lua             any                 `yaml:"lua"`
}

// egExtProc mirrors the fields of Envoy Gateway's v1alpha1.ExtProc. It is decoded strictly: a
// field it does not know is one this translation would silently ignore.
type egExtProc struct {
	BackendRefs     []egBackendRef     `yaml:"backendRefs"`
	BackendSettings egBackendSettings  `yaml:"backendSettings"`
	Stage           string             `yaml:"stage"`
	MessageTimeout  string             `yaml:"messageTimeout"`
	FailOpen        *bool              `yaml:"failOpen"`
	ProcessingMode  *egProcessingMode  `yaml:"processingMode"`
	Metadata        *egExtProcMetadata `yaml:"metadata"`
}

type egBackendRef struct {
	Group     string `yaml:"group"`
	Kind      string `yaml:"kind"`
	Name      string `yaml:"name"`
	Namespace string `yaml:"namespace"`
	Port      int    `yaml:"port"`
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
	Connection struct {
		BufferLimit string `yaml:"bufferLimit"`
	} `yaml:"connection"`
}

// EnvoyGatewayExtProc translates the extProc block of the EnvoyExtensionPolicy in the file at
// path into the ExternalProcessor Envoy Gateway would generate (internal/xds/translator/extproc.go):
// every phase starts SKIP/NONE; a present request (response) block sets the request (response)
// header mode to SEND, its body sets the body mode (FullDuplexStreamed also sends trailers) and its
// attributes the request (response) attributes; allowModeOverride, failOpen (failure_mode_allow)
// and messageTimeout (default 200ms) are copied; the gRPC timeout is 10s. It also returns the
// circuit breaker thresholds and the buffer limits of the ClientTrafficPolicy and
// BackendTrafficPolicy in the same file. The file must hold one EnvoyExtensionPolicy with one
// extProc entry at stage Route; unknown fields in that entry are errors.
func EnvoyGatewayExtProc(path string) (*filterextproc.ExternalProcessor, EGLimits, error) {
	docs, err := readDocs(path)
	if err != nil {
		return nil, EGLimits{}, err
	}
	const group = "gateway.envoyproxy.io"
	pol, err := only(docs, group, "EnvoyExtensionPolicy")
	if err != nil {
		return nil, EGLimits{}, err
	}
	if pol == nil {
		return nil, EGLimits{}, fmt.Errorf("%s: no EnvoyExtensionPolicy", path)
	}
	spec, err := decodeSpec[egPolicySpec](pol)
	if err != nil {
		return nil, EGLimits{}, fmt.Errorf("%s: EnvoyExtensionPolicy %s: %w", path, pol.Metadata.Name, err)
	}
	if len(spec.ExtProc) != 1 {
		return nil, EGLimits{}, fmt.Errorf("%s: want exactly one extProc entry, have %d", path, len(spec.ExtProc))
	}
	f, limits, err := translateEG(spec.ExtProc[0], pol.Metadata.Namespace, pol.Metadata.Name)
	if err != nil {
		return nil, EGLimits{}, fmt.Errorf("%s: extProc[0]: %w", path, err)
	}
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
		if tp.Connection.BufferLimit == "" {
			continue
		}
		if *dst, err = parseQuantity(tp.Connection.BufferLimit); err != nil {
			return nil, EGLimits{}, fmt.Errorf("%s: %s connection.bufferLimit: %w", path, kind, err)
		}
	}
	return f, limits, nil
}

func translateEG(ep egExtProc, namespace, name string) (*filterextproc.ExternalProcessor, EGLimits, error) {
	if len(ep.BackendRefs) != 1 {
		return nil, EGLimits{}, fmt.Errorf("want exactly one backendRef, have %d", len(ep.BackendRefs))
	}
	if br := ep.BackendRefs[0]; br.Name == "" || br.Port == 0 {
		return nil, EGLimits{}, errors.New("backendRefs[0] needs a name and a port")
	}
	if ep.Stage != "" && ep.Stage != "Route" {
		return nil, EGLimits{}, fmt.Errorf("stage %q: only Route (the HTTP connection manager filter) is modelled", ep.Stage)
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
	if ep.MessageTimeout != "" {
		d, err := time.ParseDuration(ep.MessageTimeout)
		if err != nil {
			return nil, EGLimits{}, fmt.Errorf("messageTimeout: %w", err)
		}
		f.MessageTimeout = durationpb.New(d)
	}
	if pm := ep.ProcessingMode; pm != nil {
		f.AllowModeOverride = pm.AllowModeOverride
		if r := pm.Request; r != nil {
			mode, err := egBodyMode(r.Body)
			if err != nil {
				return nil, EGLimits{}, fmt.Errorf("processingMode.request.body: %w", err)
			}
			f.ProcessingMode.RequestHeaderMode = filterextproc.ProcessingMode_SEND
			f.ProcessingMode.RequestBodyMode = mode
			if mode == filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED {
				f.ProcessingMode.RequestTrailerMode = filterextproc.ProcessingMode_SEND
			}
			f.RequestAttributes = r.Attributes
		}
		if r := pm.Response; r != nil {
			mode, err := egBodyMode(r.Body)
			if err != nil {
				return nil, EGLimits{}, fmt.Errorf("processingMode.response.body: %w", err)
			}
			f.ProcessingMode.ResponseHeaderMode = filterextproc.ProcessingMode_SEND
			f.ProcessingMode.ResponseBodyMode = mode
			if mode == filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED {
				f.ProcessingMode.ResponseTrailerMode = filterextproc.ProcessingMode_SEND
			}
			f.ResponseAttributes = r.Attributes
		}
	}
	limits := EGLimits{CircuitBreaker: Thresholds{egDefaultThreshold, egDefaultThreshold, egDefaultThreshold, egDefaultThreshold}}
	if cb := ep.BackendSettings.CircuitBreaker; cb != nil {
		for dst, v := range map[*uint32]*uint32{
			&limits.CircuitBreaker.MaxConnections:     cb.MaxConnections,
			&limits.CircuitBreaker.MaxPendingRequests: cb.MaxPendingRequests,
			&limits.CircuitBreaker.MaxRequests:        cb.MaxParallelRequests,
			&limits.CircuitBreaker.MaxRetries:         cb.MaxParallelRetries,
		} {
			if v != nil {
				*dst = *v
			}
		}
	}
	return f, limits, nil
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
	Context            string              `yaml:"context"`
	Proxy              any                 `yaml:"proxy"`
	Listener           *istioListenerMatch `yaml:"listener"`
	RouteConfiguration any                 `yaml:"routeConfiguration"`
	Cluster            any                 `yaml:"cluster"`
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
	docs, err := readDocs(path)
	if err != nil {
		return nil, err
	}
	ef, err := only(docs, "networking.istio.io", "EnvoyFilter")
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if ef == nil {
		return nil, fmt.Errorf("%s: no EnvoyFilter", path)
	}
	spec, err := decodeSpec[istioSpec](ef)
	if err != nil {
		return nil, fmt.Errorf("%s: EnvoyFilter %s: %w", path, ef.Metadata.Name, err)
	}
	var found *filterextproc.ExternalProcessor
	for i, cp := range spec.ConfigPatches {
		if cp.ApplyTo != "HTTP_FILTER" {
			continue
		}
		var v any
		if err := cp.Patch.Value.Decode(&v); err != nil {
			return nil, fmt.Errorf("%s: configPatches[%d].patch.value: %w", path, i, err)
		}
		js, err := toJSON(v)
		if err != nil {
			return nil, fmt.Errorf("%s: configPatches[%d].patch.value: %w", path, i, err)
		}
		hf := &hcmv3.HttpFilter{}
		if err := protojson.Unmarshal(js, hf); err != nil {
			return nil, fmt.Errorf("%s: configPatches[%d].patch.value: %w", path, i, err)
		}
		if !hf.GetTypedConfig().MessageIs(&filterextproc.ExternalProcessor{}) {
			continue
		}
		if found != nil {
			return nil, fmt.Errorf("%s: more than one ext_proc patch", path)
		}
		l := cp.Match.Listener
		if l == nil || l.FilterChain.Filter.Name != "envoy.filters.network.http_connection_manager" {
			return nil, fmt.Errorf("%s: configPatches[%d] does not match the http_connection_manager", path, i)
		}
		switch op := cp.Patch.Operation; {
		case op == "INSERT_FIRST":
		case op == "INSERT_BEFORE" && l.FilterChain.Filter.SubFilter.Name == "envoy.filters.http.router":
		default:
			return nil, fmt.Errorf("%s: configPatches[%d] must INSERT_BEFORE envoy.filters.http.router (or INSERT_FIRST), have %s %q",
				path, i, op, l.FilterChain.Filter.SubFilter.Name)
		}
		found = &filterextproc.ExternalProcessor{}
		if err := hf.GetTypedConfig().UnmarshalTo(found); err != nil {
			return nil, fmt.Errorf("%s: configPatches[%d]: %w", path, i, err)
		}
	}
	if found == nil {
		return nil, fmt.Errorf("%s: no HTTP_FILTER patch with an ExternalProcessor typed_config", path)
	}
	return found, nil
}
