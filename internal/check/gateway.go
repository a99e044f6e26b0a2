package check

import (
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
)

// The API groups of Envoy Gateway's and Gateway API's kinds.
const (
	egGroup = "gateway.envoyproxy.io"
	gwGroup = "gateway.networking.k8s.io"
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
// targetRefs are resolved against the HTTPRoutes and GRPCRoutes of the same file: each policy's
// Deployment lists the xDS routes it enables the filter on (a GRPCRoute's are gRPC routes). A
// policy targeting a rule (sectionName) wins over one targeting the whole route, as in Envoy
// Gateway. It also returns the buffer limits of the
// ClientTrafficPolicy and BackendTrafficPolicy in the file.
//
// It fails where Envoy Gateway would refuse or ignore the policy: an extProc entry with unknown
// fields, more than one entry per policy (this translation models one), a target that is not an
// HTTPRoute or GRPCRoute of the file or a sectionName that names none of its rules, two policies on one rule,
// an attribute outside the prefixes Envoy Gateway allows, a writable namespace starting with
// envoy.filters.http, or FullDuplexStreamed with failOpen.
func EnvoyGateway(path string) ([]EGPolicy, EGLimits, error) {
	objs, err := readDocs(path)
	if err != nil {
		return nil, EGLimits{}, err
	}
	pols, limits, _, err := envoyGateway(objs, true)
	if err != nil {
		return nil, EGLimits{}, fmt.Errorf("%s: %w", path, err)
	}
	return pols, limits, nil
}

// envoyGateway translates the EnvoyExtensionPolicies of objs, as EnvoyGateway. Strict is
// EnvoyGateway's reading of one self-contained file. Otherwise, as for the objects of a cluster
// or a chart, each extProc entry is a filter of its own, a policy may hold none, a target outside
// objs (a Gateway, an HTTPRoute of another file, targetSelectors) gets one route entry standing
// for the routes it selects, and each route gets the BackendTrafficPolicy that targets it most
// closely (a rule, then its HTTPRoute, then a Gateway), as Envoy Gateway lets the closest
// policy win.
//
// Not strict, an extProc entry with a value that cannot be read (a messageTimeout that is no
// duration, an unknown body mode or attribute) is left out and becomes a finding on its line: the
// other policies are still translated. What Envoy Gateway refuses outright (its backends) stays
// an error of the input.
func envoyGateway(objs []*object, strict bool) ([]EGPolicy, EGLimits, []Finding, error) {
	routes, err := egHTTPRoutes(objs)
	if err != nil {
		return nil, EGLimits{}, nil, err
	}
	var out []EGPolicy
	var targets [][]egTargetRef
	var unread []Finding
	for _, o := range objs {
		if !o.is(egGroup, "EnvoyExtensionPolicy") {
			continue
		}
		pols, refs, bad, err := egPolicyEntries(o, strict)
		if err != nil {
			return nil, EGLimits{}, nil, err
		}
		for range pols {
			targets = append(targets, refs)
		}
		out = append(out, pols...)
		unread = append(unread, bad...)
	}
	if strict && len(out) == 0 {
		return nil, EGLimits{}, nil, errors.New("no EnvoyExtensionPolicy")
	}
	if err := egAttach(out, targets, routes, strict); err != nil {
		return nil, EGLimits{}, nil, err
	}
	limits, btps, err := egTrafficPolicies(objs, routes, strict)
	if err != nil {
		return nil, EGLimits{}, nil, err
	}
	for i := range out {
		for j := range out[i].Deployment.Routes {
			egApplyBackendPolicy(&out[i].Deployment.Routes[j], btps)
		}
	}
	return out, limits, unread, nil
}

// egPolicyEntries translates the extProc entries of the EnvoyExtensionPolicy o, one EGPolicy
// each, and returns the policy's target references. Not strict, an entry with a value that
// cannot be read is left out and returned as a finding.
func egPolicyEntries(o *object, strict bool) ([]EGPolicy, []egTargetRef, []Finding, error) {
	name := o.Namespace + "/" + o.Name
	spec, err := decodeSpec[egPolicySpec](o)
	if err != nil {
		return nil, nil, nil, &inFile{o.File, fmt.Errorf("EnvoyExtensionPolicy %s: %w", name, err)}
	}
	if strict && len(spec.ExtProc) != 1 {
		return nil, nil, nil, &inFile{o.File, fmt.Errorf("EnvoyExtensionPolicy %s: want exactly one extProc entry, have %d", name, len(spec.ExtProc))}
	}
	refs := spec.TargetRefs
	if spec.TargetRef != nil {
		refs = append(refs, *spec.TargetRef)
	}
	if strict && len(refs) == 0 {
		return nil, nil, nil, &inFile{o.File, fmt.Errorf("EnvoyExtensionPolicy %s: no targetRefs (targetSelectors are not modelled)", name)}
	}
	var out []EGPolicy
	var unread []Finding
	for i, ep := range spec.ExtProc {
		f, cb, err := translateEG(ep, o.Namespace, o.Name, i)
		if err != nil && !strict && (strings.HasPrefix(err.Error(), "messageTimeout:") || strings.HasPrefix(err.Error(), "processingMode.")) {
			field, _, _ := strings.Cut(err.Error(), ":")
			unread = append(unread, Finding{File: o.File, Resource: o.ref(), Field: fmt.Sprintf("extProc[%d].%s", i, field), Kind: kindUnreadable,
				Problem: "cannot be read (" + err.Error() + "): the filter of this entry was not checked, and Envoy Gateway would refuse a value it cannot read either, leaving covered requests without it",
				Fix:     "write the value as the field's type wants it"})
			continue
		}
		if err != nil {
			return nil, nil, nil, &inFile{o.File, fmt.Errorf("EnvoyExtensionPolicy %s: extProc[%d]: %w", name, i, err)}
		}
		cbSet := ep.BackendSettings.CircuitBreaker != nil
		out = append(out, EGPolicy{
			Name:           name,
			CircuitBreaker: cb,
			Deployment: Deployment{
				Processor: &processorLimits{Thresholds: cb, File: o.File, Resource: o.ref(),
					Field: fmt.Sprintf("extProc[%d].backendSettings.circuitBreaker", i), Default: !cbSet},
				Source:     o.File + ": EnvoyExtensionPolicy " + name,
				File:       o.File,
				Resource:   o.ref(),
				Platform:   platformEnvoyGateway,
				Filter:     f,
				FilterPath: fmt.Sprintf("extProc[%d]", i),
				FilterName: fmt.Sprintf("envoy.filters.http.ext_proc/envoyextensionpolicy/%s/extproc/%d", name, i),
			},
		})
	}
	return out, refs, unread, nil
}

// egTrafficPolicies reads the ClientTrafficPolicies and BackendTrafficPolicies of objs: the
// smallest buffer limit each kind sets (Envoy Gateway's default where none does), and the
// BackendTrafficPolicies as they apply to the routes.
func egTrafficPolicies(objs []*object, routes map[string]*egHTTPRoute, strict bool) (EGLimits, []egBackendPolicy, error) {
	limits := EGLimits{ClientBufferLimit: egDefaultBufferLimit, BackendBufferLimit: egDefaultBufferLimit}
	var btps []egBackendPolicy
	for _, kind := range []string{"ClientTrafficPolicy", "BackendTrafficPolicy"} {
		docs, err := egPolicyDocs(objs, kind, strict)
		if err != nil {
			return EGLimits{}, nil, err
		}
		for i, d := range docs {
			tp, err := decodeLoose[egTrafficPolicy](d)
			if err != nil {
				return EGLimits{}, nil, &inFile{d.File, fmt.Errorf("%s: %w", d.ref(), err)}
			}
			limit := uint32(egDefaultBufferLimit)
			if tp.Connection.BufferLimit != "" {
				if limit, err = parseQuantity(tp.Connection.BufferLimit); err != nil {
					return EGLimits{}, nil, &inFile{d.File, fmt.Errorf("%s: spec.connection.bufferLimit: %w", d.ref(), err)}
				}
			}
			dst := &limits.ClientBufferLimit
			if kind == "BackendTrafficPolicy" {
				dst = &limits.BackendBufferLimit
				p := egBackendPolicy{obj: d, retry: egRetryPolicy(tp), limit: limit, limitSet: tp.Connection.BufferLimit != ""}
				if p.targets, err = egPolicyTargets(d, tp.TargetRefs, routes, strict && p.retry != nil); err != nil {
					return EGLimits{}, nil, &inFile{d.File, fmt.Errorf("%s: %w", d.ref(), err)}
				}
				btps = append(btps, p)
			}
			if i == 0 || limit < *dst {
				*dst = limit
			}
		}
	}
	return limits, btps, nil
}

// egPolicyDocs are the objects of kind in objs: strict, at most one, which it refuses more than.
func egPolicyDocs(objs []*object, kind string, strict bool) ([]*object, error) {
	if strict {
		d, err := only(objs, egGroup, kind)
		if err != nil || d == nil {
			return nil, err
		}
		return []*object{d}, nil
	}
	var docs []*object
	for _, o := range objs {
		if o.is(egGroup, kind) {
			docs = append(docs, o)
		}
	}
	return docs, nil
}

// egBackendPolicy is a BackendTrafficPolicy as it applies to xDS routes: the router's
// retry_policy it builds (nil without retry) and its upstream buffer limit.
type egBackendPolicy struct {
	obj      *object
	targets  []egPolicyTarget
	retry    *routev3.RetryPolicy
	limit    uint32
	limitSet bool
}

// egPolicyTarget is the xDS routes a policy target takes, the routes whose names start with
// prefix, and how closely it targets them: 0 a Gateway, 1 an HTTPRoute, 2 one of its rules.
type egPolicyTarget struct {
	prefix    string
	closeness int
}

// egPolicyTargets resolves a traffic policy's targetRefs. A sectionName names a rule of an
// HTTPRoute; when the HTTPRoute is not among the inputs the target takes the whole HTTPRoute.
// noSection refuses sectionNames (EnvoyGateway's reading of a retry).
func egPolicyTargets(d *object, refs []egTargetRef, routes map[string]*egHTTPRoute, noSection bool) ([]egPolicyTarget, error) {
	var out []egPolicyTarget
	for _, ref := range refs {
		key := egRouteKey(ref.Kind, d.Namespace, ref.Name)
		route := key + "/"
		switch {
		case ref.Kind == "Gateway":
			out = append(out, egPolicyTarget{"", 0})
		case !egRouteKind(ref):
		case ref.SectionName == "":
			out = append(out, egPolicyTarget{route, 1})
		case noSection:
			return nil, errors.New("a retry targeting a sectionName is not modelled")
		default:
			r := routes[key]
			i := -1
			if r != nil {
				i = slices.IndexFunc(r.Rules, func(rule egHTTPRouteRule) bool { return rule.Name == ref.SectionName })
			}
			if i < 0 {
				out = append(out, egPolicyTarget{route, 2})
				continue
			}
			out = append(out, egPolicyTarget{route + "rule/" + strconv.Itoa(i) + "/", 2})
		}
	}
	return out, nil
}

// egApplyBackendPolicy gives route e the retry and upstream buffer limit of the
// BackendTrafficPolicy that targets it most closely (the first of equals), Envoy Gateway's
// default buffer limit when none does.
func egApplyBackendPolicy(e *routeEntry, btps []egBackendPolicy) {
	var best *egBackendPolicy
	closeness := -1
	for i := range btps {
		for _, t := range btps[i].targets {
			if strings.HasPrefix(e.Name, t.prefix) && t.closeness > closeness {
				best, closeness = &btps[i], t.closeness
			}
		}
	}
	if best == nil {
		e.ResponseBuffer = &limitSetting{Bytes: egDefaultBufferLimit, Default: true, Field: "BackendTrafficPolicy connection.bufferLimit"}
		return
	}
	if best.retry != nil {
		e.Retry, e.RetryPath = best.retry, best.obj.ref()+".retry"
		e.RetryResource, e.RetryFile = best.obj.ref(), best.obj.File
	}
	e.ResponseBuffer = &limitSetting{Bytes: best.limit, File: best.obj.File, Resource: best.obj.ref(), Field: "connection.bufferLimit", Default: !best.limitSet}
}

// egHTTPRoute is the part of a Gateway API HTTPRoute or GRPCRoute that names Envoy Gateway's xDS
// routes. A GRPCRoute's rules serve gRPC calls: Envoy Gateway matches them by path
// (/package.Service/Method, internal/gatewayapi/route.go).
type egHTTPRoute struct {
	kind, namespace, name string
	Hostnames             []string          `yaml:"hostnames"`
	Rules                 []egHTTPRouteRule `yaml:"rules"`
}

type egHTTPRouteRule struct {
	Name    string `yaml:"name"`
	Matches []any  `yaml:"matches"`
}

// egHTTPRoutes returns the HTTPRoutes and GRPCRoutes of objs by egRouteKey.
func egHTTPRoutes(objs []*object) (map[string]*egHTTPRoute, error) {
	out := map[string]*egHTTPRoute{}
	for _, o := range objs {
		if !o.is(gwGroup, "HTTPRoute") && !o.is(gwGroup, "GRPCRoute") {
			continue
		}
		r, err := decodeLoose[egHTTPRoute](o)
		if err != nil {
			return nil, &inFile{o.File, fmt.Errorf("%s %s/%s: %w", o.Kind, o.Namespace, o.Name, err)}
		}
		r.kind, r.namespace, r.name = o.Kind, o.Namespace, o.Name
		out[egRouteKey(r.kind, r.namespace, r.name)] = &r
	}
	return out, nil
}

// egRouteKey names a route resource as Envoy Gateway's xDS route names start:
// httproute/namespace/name or grpcroute/namespace/name.
func egRouteKey(kind, namespace, name string) string {
	return strings.ToLower(kind) + "/" + namespace + "/" + name
}

// egRouteKind reports whether a target reference names a Gateway API route Envoy Gateway
// translates rule by rule: an HTTPRoute or a GRPCRoute.
func egRouteKind(ref egTargetRef) bool {
	return (ref.Kind == "HTTPRoute" || ref.Kind == "GRPCRoute") && (ref.Group == "" || ref.Group == gwGroup)
}

// egAttach fills each policy's Routes from its targets: rule targets first, then whole-route
// targets on the rules no rule target took. Strict refuses targets it cannot resolve; otherwise
// each gets one entry standing for the routes it takes.
func egAttach(pols []EGPolicy, targets [][]egTargetRef, routes map[string]*egHTTPRoute, strict bool) error {
	at := egAttachment{pols: pols, routes: routes, strict: strict, owner: map[egRuleKey]int{}, whole: map[string]int{}, attached: map[string]bool{}}
	for p, refs := range targets {
		if len(refs) == 0 {
			at.unresolved(p, "", "targetSelectors (the routes they select were not read)")
		}
	}
	for pass := 0; pass < 2; pass++ {
		for p, refs := range targets {
			for _, ref := range refs {
				if (ref.SectionName != "") != (pass == 0) {
					continue
				}
				if err := at.target(p, ref); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// egRuleKey is a rule of an HTTPRoute: its namespace/name and the rule's index.
type egRuleKey struct {
	route string
	rule  int
}

// egAttachment is egAttach's work: the policies whose routes it fills, the HTTPRoutes read, and
// which policy owns each rule and each whole HTTPRoute. The entries of one
// EnvoyExtensionPolicy share its targets: rules are owned by resources.
type egAttachment struct {
	pols     []EGPolicy
	routes   map[string]*egHTTPRoute
	strict   bool
	owner    map[egRuleKey]int
	whole    map[string]int  // HTTPRoute → the policy targeting all of it
	attached map[string]bool // policy index, HTTPRoute, rule index
}

// same says whether policies p and q are entries of one EnvoyExtensionPolicy.
func (at *egAttachment) same(p, q int) bool {
	return at.pols[p].Deployment.Resource == at.pols[q].Deployment.Resource
}

// attach adds the xDS routes of rule of route to policy p, why naming the target that took it.
func (at *egAttachment) attach(p int, route *egHTTPRoute, rule int, why string) {
	k := fmt.Sprintf("%d %s/%s %d", p, route.namespace, route.name, rule)
	if at.attached[k] && why == egWhole {
		return
	}
	at.attached[k] = true
	for _, n := range egRouteNames(route, rule) {
		at.pols[p].Deployment.Routes = append(at.pols[p].Deployment.Routes, routeEntry{
			Name:   n,
			Path:   fmt.Sprintf("%s %s/%s rules[%d] (%s)", route.kind, route.namespace, route.name, rule, why),
			Config: &filterextproc.ExtProcPerRoute{},
			GRPC:   route.kind == "GRPCRoute",
		})
	}
}

// unresolved adds to policy p one entry standing for the routes of a target not read, once.
func (at *egAttachment) unresolved(p int, name, why string) {
	e := routeEntry{Name: name, Path: why, Config: &filterextproc.ExtProcPerRoute{}, Partial: true}
	if !slices.ContainsFunc(at.pols[p].Deployment.Routes, func(r routeEntry) bool { return r.Path == e.Path }) {
		at.pols[p].Deployment.Routes = append(at.pols[p].Deployment.Routes, e)
	}
}

// egWhole is why a rule is attached when its policy targets the whole route.
const egWhole = "the whole route"

// target attaches policy p to the target ref: an HTTPRoute or GRPCRoute read, whole or one rule;
// any other target (strict refuses it) gets one entry.
func (at *egAttachment) target(p int, ref egTargetRef) error {
	pol := at.pols[p]
	ns, _, _ := strings.Cut(pol.Name, "/")
	if !egRouteKind(ref) {
		if at.strict {
			return &inFile{pol.Deployment.File, fmt.Errorf("EnvoyExtensionPolicy %s: target %s %s: only HTTPRoute and GRPCRoute targets are modelled", pol.Name, ref.Kind, ref.Name)}
		}
		at.unresolved(p, "", fmt.Sprintf("%s %s/%s (every route under it)", ref.Kind, ns, ref.Name))
		return nil
	}
	key := egRouteKey(ref.Kind, ns, ref.Name)
	route := at.routes[key]
	if route == nil {
		if at.strict {
			return &inFile{pol.Deployment.File, fmt.Errorf("EnvoyExtensionPolicy %s: %s %s/%s is not in the file", pol.Name, ref.Kind, ns, ref.Name)}
		}
		// Its rules are not read: one entry stands for them (gatewayRetryFindings reads a
		// retry of any route of the inputs).
		at.unresolved(p, key+"/", fmt.Sprintf("%s %s/%s (not in the inputs: its rules were not read)", ref.Kind, ns, ref.Name))
		return nil
	}
	if ref.SectionName == "" {
		return at.wholeRoute(p, key, route)
	}
	return at.rule(p, key, route, ref.SectionName)
}

// wholeRoute attaches policy p to every rule of route (key) that no other policy's rule target
// took; two policies may not both target the whole route.
func (at *egAttachment) wholeRoute(p int, key string, route *egHTTPRoute) error {
	if q, taken := at.whole[key]; taken && !at.same(p, q) {
		return &inFile{at.pols[p].Deployment.File, fmt.Errorf("EnvoyExtensionPolicy %s and %s both target %s %s/%s", at.pols[q].Name, at.pols[p].Name, route.kind, route.namespace, route.name)}
	}
	at.whole[key] = p
	for i := range route.Rules {
		if q, taken := at.owner[egRuleKey{key, i}]; !taken || at.same(p, q) {
			at.owner[egRuleKey{key, i}] = p
			at.attach(p, route, i, egWhole)
		}
	}
	return nil
}

// rule attaches policy p to the rules of route (key) named section; two policies may not both
// target one rule, and section must name one.
func (at *egAttachment) rule(p int, key string, route *egHTTPRoute, section string) error {
	found := false
	for i, rule := range route.Rules {
		if rule.Name != section {
			continue
		}
		found = true
		if q, taken := at.owner[egRuleKey{key, i}]; taken && !at.same(p, q) {
			return &inFile{at.pols[p].Deployment.File, fmt.Errorf("EnvoyExtensionPolicy %s and %s both target rule %q of %s %s/%s", at.pols[q].Name, at.pols[p].Name, rule.Name, route.kind, route.namespace, route.name)}
		}
		at.owner[egRuleKey{key, i}] = p
		at.attach(p, route, i, "sectionName "+section)
	}
	if !found {
		return &inFile{at.pols[p].Deployment.File, fmt.Errorf("EnvoyExtensionPolicy %s: sectionName %q names no rule of %s %s/%s", at.pols[p].Name, section, route.kind, route.namespace, route.name)}
	}
	return nil
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
			names = append(names, fmt.Sprintf("%s/rule/%d/match/%d/%s",
				egRouteKey(r.kind, r.namespace, r.name), i, j, strings.ReplaceAll(h, ".", "_")))
		}
	}
	return names
}

// egAttribute is the pattern Envoy Gateway's CRD puts on processingMode.*.attributes.
var egAttribute = regexp.MustCompile(`^(connection\.|source\.|destination\.|request\.|response\.|upstream\.|xds\.route_)[a-z_1-9]*$`)

func translateEG(ep egExtProc, namespace, name string, index int) (*filterextproc.ExternalProcessor, Thresholds, error) {
	if err := egCheckBackend(ep); err != nil {
		return nil, Thresholds{}, err
	}
	f := &filterextproc.ExternalProcessor{
		GrpcService: &corev3.GrpcService{
			TargetSpecifier: &corev3.GrpcService_EnvoyGrpc_{EnvoyGrpc: &corev3.GrpcService_EnvoyGrpc{
				ClusterName: fmt.Sprintf("envoyextensionpolicy/%s/%s/extproc/%d", namespace, name, index),
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
		if err := egApplyProcessingMode(f, pm); err != nil {
			return nil, Thresholds{}, err
		}
	}
	if md := ep.Metadata; md != nil {
		if err := egApplyMetadata(f, md); err != nil {
			return nil, Thresholds{}, err
		}
	}
	return f, egThresholds(ep.BackendSettings.CircuitBreaker), nil
}

// egCheckBackend refuses the backends Envoy Gateway refuses: the deprecated backendRef, other
// than one backendRefs entry, a Backend outside its group, a Service without a port.
func egCheckBackend(ep egExtProc) error {
	if ep.BackendRef != nil {
		return errors.New("backendRef is not supported, use backendRefs")
	}
	if len(ep.BackendRefs) != 1 {
		return fmt.Errorf("want exactly one backendRef, have %d", len(ep.BackendRefs))
	}
	// A Backend (gateway.envoyproxy.io) needs no port: its endpoints may be a unix socket, the
	// processor next to Envoy (Envoy Gateway's validateBackendPort in internal/gatewayapi).
	switch br := ep.BackendRefs[0]; {
	case br.Kind == "Backend" && br.Group != egGroup:
		return fmt.Errorf("backendRefs[0]: a Backend is in group %s, have %q", egGroup, br.Group)
	case br.Name == "" || (br.Port == 0 && br.Kind != "Backend"):
		return errors.New("backendRefs[0] needs a name and a port (a Backend needs no port)")
	}
	return nil
}

// egApplyProcessingMode sets f's modes and attributes from pm as Envoy Gateway translates them:
// headers sent in a direction pm names, with its body mode and attributes.
func egApplyProcessingMode(f *filterextproc.ExternalProcessor, pm *egProcessingMode) error {
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
			return fmt.Errorf("processingMode.%s.body: %w", dir.field, err)
		}
		*dir.hdr = filterextproc.ProcessingMode_SEND
		*dir.body = mode
		if mode == filterextproc.ProcessingMode_FULL_DUPLEX_STREAMED {
			*dir.trl = filterextproc.ProcessingMode_SEND
			if f.FailureModeAllow {
				return fmt.Errorf("processingMode.%s.body: FullDuplexStreamed needs failOpen false", dir.field)
			}
		}
		for i, a := range dir.opts.Attributes {
			if !egAttribute.MatchString(a) {
				return fmt.Errorf("processingMode.%s.attributes[%d]: %q does not match %s", dir.field, i, a, egAttribute)
			}
		}
		*dir.attrs = dir.opts.Attributes
	}
	return nil
}

// egApplyMetadata sets f's metadata options from md, refusing what Envoy Gateway refuses.
func egApplyMetadata(f *filterextproc.ExternalProcessor, md *egExtProcMetadata) error {
	if len(md.WritableNamespaces) > 8 {
		return errors.New("metadata.writableNamespaces: at most 8")
	}
	for i, ns := range md.WritableNamespaces {
		if strings.HasPrefix(ns, "envoy.filters.http") {
			return fmt.Errorf("metadata.writableNamespaces[%d]: %q: well-known Envoy HTTP filter namespaces are refused", i, ns)
		}
	}
	f.MetadataOptions = &filterextproc.MetadataOptions{}
	if md.AccessibleNamespaces != nil {
		f.MetadataOptions.ForwardingNamespaces = &filterextproc.MetadataOptions_MetadataNamespaces{Untyped: md.AccessibleNamespaces}
	}
	if md.WritableNamespaces != nil {
		f.MetadataOptions.ReceivingNamespaces = &filterextproc.MetadataOptions_MetadataNamespaces{Untyped: md.WritableNamespaces}
	}
	return nil
}

// egThresholds are the circuit breaker thresholds c sets, Envoy Gateway's default for the rest.
func egThresholds(c *egCircuitBreaker) Thresholds {
	cb := Thresholds{egDefaultThreshold, egDefaultThreshold, egDefaultThreshold, egDefaultThreshold}
	if c != nil {
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
	return cb
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

// egFilterPosition is one entry of an EnvoyProxy's spec.filterOrder: filter type Name moves
// before the first filter of type Before, or after the last of type After.
type egFilterPosition struct {
	Name   string `yaml:"name"`
	Before string `yaml:"before"`
	After  string `yaml:"after"`
}

// envoyGatewayFilterOrder returns spec.filterOrder of the EnvoyProxy in the file at path, nil
// when the file has none. Each entry must name filter types Envoy Gateway knows (the router
// excluded) and exactly one of before and after, as Envoy Gateway's CRD requires.
func envoyGatewayFilterOrder(path string) ([]egFilterPosition, error) {
	objs, err := readDocs(path)
	if err != nil {
		return nil, err
	}
	d, err := only(objs, egGroup, "EnvoyProxy")
	if err != nil || d == nil {
		return nil, err
	}
	order, err := egFilterOrder(d)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return order, nil
}

// egFilterOrder returns spec.filterOrder of EnvoyProxy d, as EnvoyGatewayFilterOrder.
func egFilterOrder(d *object) ([]egFilterPosition, error) {
	spec, err := decodeLoose[struct {
		FilterOrder []egFilterPosition `yaml:"filterOrder"`
	}](d)
	if err != nil {
		return nil, fmt.Errorf("EnvoyProxy %s: %w", d.Name, err)
	}
	known := func(n string) bool {
		return n != "envoy.filters.http.router" && slices.Contains(egDefaultOrder, n)
	}
	for i, p := range spec.FilterOrder {
		if !known(p.Name) {
			return nil, fmt.Errorf("EnvoyProxy %s: filterOrder[%d].name %q is not a filter type Envoy Gateway orders", d.Name, i, p.Name)
		}
		if (p.Before == "") == (p.After == "") {
			return nil, fmt.Errorf("EnvoyProxy %s: filterOrder[%d] needs exactly one of before and after", d.Name, i)
		}
		if o := p.Before + p.After; !known(o) {
			return nil, fmt.Errorf("EnvoyProxy %s: filterOrder[%d]: %q is not a filter type Envoy Gateway orders", d.Name, i, o)
		}
	}
	return spec.FilterOrder, nil
}

// egFilterChain returns the filter types of present (each once) in the order Envoy Gateway puts
// them in a connection manager: its default order, then each filterOrder entry applied in turn as
// internal/xds/translator/httpfilters.go (sortHTTPFilters) does; an entry whose filter or anchor
// is not present changes nothing.
func egFilterChain(present []string, order []egFilterPosition) ([]string, error) {
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
// docs/deploying.md says so, with FullDuplexStreamed as the cure for clients that send request trailers.
func WithoutGatewayGaps(err error) error {
	var keep []error
	var walk func(error)
	walk = func(e error) {
		if e == nil || errors.Is(e, errRequestTrailersSkipped) && !isJoin(e) {
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

// envoyGatewayAccessLogFormats returns the text formats of the EnvoyProxy's
// telemetry.accessLog settings in the Envoy Gateway file at path.
func envoyGatewayAccessLogFormats(path string) ([]string, error) {
	d, err := theDoc(path, egGroup, "EnvoyProxy")
	if err != nil {
		return nil, err
	}
	spec, err := decodeLoose[struct {
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
	}](d)
	if err != nil {
		return nil, fmt.Errorf("%s: EnvoyProxy %s: %w", path, d.Name, err)
	}
	var out []string
	for _, s := range spec.Telemetry.AccessLog.Settings {
		if s.Format.Type == "Text" {
			out = append(out, s.Format.Text)
		}
	}
	return out, nil
}

// egJWT is what the SecurityPolicies among the inputs say of verified JWT payloads: the names
// of their JWT providers, under which Envoy Gateway writes each provider's payload
// (buildJWTProvider in envoyproxy/gateway internal/xds/translator/jwt.go, since v1.2; the
// issuer before), and the first SecurityPolicy that has one.
type egJWT struct {
	names []string
	first *object
}

// egJWTProviders reads the JWT providers of the SecurityPolicies of objs.
func egJWTProviders(objs []*object) (egJWT, error) {
	var out egJWT
	for _, o := range objs {
		if !o.is(egGroup, "SecurityPolicy") {
			continue
		}
		sp, err := decodeLoose[struct {
			JWT struct {
				Providers []struct {
					Name string `yaml:"name"`
				} `yaml:"providers"`
			} `yaml:"jwt"`
		}](o)
		if err != nil {
			return egJWT{}, &inFile{o.File, fmt.Errorf("%s: %w", o.ref(), err)}
		}
		for _, p := range sp.JWT.Providers {
			if out.first == nil {
				out.first = o
			}
			if !slices.Contains(out.names, p.Name) {
				out.names = append(out.names, p.Name)
			}
		}
	}
	return out, nil
}

// findings refuses a route's jwt_payload_key that names none of the providers: its claims would
// all be empty. Without SecurityPolicies among the inputs there is nothing to compare with.
func (j egJWT) findings(n policyNeeds) []Finding {
	if j.first == nil {
		return nil
	}
	var out []Finding
	for _, k := range n.jwtKeys {
		if k.key != "" && !slices.Contains(j.names, k.key) {
			out = append(out, Finding{File: j.first.File, Resource: j.first.ref(), Field: "jwt.providers", Kind: kindGatewayJWTProvider,
				Problem: fmt.Sprintf("has no provider named %q, the jwt_payload_key of route %q: Envoy Gateway writes each provider's verified payload under the provider's name: %s", k.key, k.route, claimsEmpty),
				Fix:     fmt.Sprintf("set the route's jwt_payload_key to the name of the provider that verifies its callers (%s), or unset it where one provider verifies them", strings.Join(j.names, ", "))})
		}
	}
	return out
}

// egOrderFinding warns when EnvoyProxy d's filterOrder leaves ext_proc before RBAC or a rate
// limit, as Envoy Gateway's default order does: a replay is answered by ext_proc, and the
// filters after it never see the request.
func egOrderFinding(d *object) ([]Finding, error) {
	order, err := egFilterOrder(d)
	if err != nil {
		return nil, err
	}
	const extProc = "envoy.filters.http.ext_proc"
	later := []string{"envoy.filters.http.rbac", "envoy.filters.http.local_ratelimit", "envoy.filters.http.ratelimit"}
	chain, err := egFilterChain(append([]string{extProc, "envoy.filters.http.router"}, later...), order)
	if err != nil {
		return nil, err
	}
	var after []string
	for _, l := range later {
		if slices.Index(chain, l) > slices.Index(chain, extProc) {
			after = append(after, l)
		}
	}
	if len(after) == 0 {
		return nil, nil
	}
	return []Finding{{File: d.File, Resource: d.ref(), Field: "filterOrder", Kind: kindFilterAfterExtProc,
		Problem: "leaves ext_proc before " + strings.Join(after, ", ") + ": a replay is answered by ext_proc, so replays and 409s skip authorization and rate limits",
		Fix:     "add filterOrder entries that move envoy.filters.http.ext_proc after each of them, as envoy/envoy-gateway.yaml does"}}, nil
}
