// Package check holds Envoy, Istio and Envoy Gateway configuration to what the processor needs
// from it. It reads Envoy bootstraps and Kubernetes objects (Istio's EnvoyFilter, VirtualService
// and DestinationRule; Envoy Gateway's EnvoyExtensionPolicy, HTTPRoute, BackendTrafficPolicy,
// ClientTrafficPolicy and EnvoyProxy) into go-control-plane's messages, translating Istio's and
// Envoy Gateway's objects as their source does, and finds every setting that silently breaks
// idempotency under a policy: Run reports each as a Finding that names the file, the resource and
// the field, says what breaks and how to fix it. The check subcommand of idempotency-extproc runs
// it on the user's files, and the project's configuration tests on envoy/ and the Helm chart.
//
// Functions are safe for concurrent use; none keeps state.
package check

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// Severity says whether a finding breaks protection (Error) or costs something the user should
// know (Warning).
type Severity string

// The severities.
const (
	Error   Severity = "error"
	Warning Severity = "warning"
)

// Finding is one setting of the inputs that breaks protection or costs something.
type Finding struct {
	// File is the input that holds the setting, as the user named it ("-" is standard input).
	File string `json:"file"`
	// Line and Column are where the field is in File (1-based), or where it would go when it is
	// missing; 0 when the finding is about no place in a file (--envoy-version).
	Line   int `json:"line,omitempty"`
	Column int `json:"column,omitempty"`
	// Resource is the resource that holds it: `listener "ingress"`, "EnvoyFilter ns/name".
	Resource string `json:"resource"`
	// Field is the setting's path in the resource.
	Field    string   `json:"field"`
	Severity Severity `json:"severity"`
	// Kind names what the finding is about; it decides Severity (Kinds).
	Kind Kind `json:"kind"`
	// Problem says what is wrong and what it breaks; Fix what to set instead.
	Problem string `json:"problem"`
	Fix     string `json:"fix"`
}

// String is the finding's line of the text output:
// FILE:LINE:COLUMN: RESOURCE: FIELD: severity: problem; fix.
func (f Finding) String() string {
	return fmt.Sprintf("%s: %s: %s: %s: %s; %s", f.Place(), f.Resource, f.Field, f.Severity, f.Problem, f.Fix)
}

// Place is FILE:LINE:COLUMN, or FILE when the line is not known.
func (f Finding) Place() string {
	if f.Line <= 0 {
		return f.File
	}
	return fmt.Sprintf("%s:%d:%d", f.File, f.Line, max(f.Column, 1))
}

// Input is one file to check: its name as the user gave it ("-" for standard input) and its
// content, an Envoy bootstrap (YAML or JSON) or Kubernetes objects (one or many YAML documents,
// List kinds included).
type Input struct {
	Name string
	Data []byte
}

// Options are the settings of a check.
type Options struct {
	// EnvoyVersion is the Envoy version the deployment runs ("1.38", "v1.39.1"); it adds the
	// warnings of that version's known ext_proc defects. Empty: none.
	EnvoyVersion string
	// Policy is the policy file as read, for the findings about its routes to name their lines;
	// its Name is how they name the file ("--config" when empty).
	Policy Input
	// MaxInputBytes bounds each input, and the values and nesting of its YAML (yamllimit);
	// 0 is DefaultMaxInputBytes.
	MaxInputBytes int64
}

// DefaultMaxInputBytes is the size of input Run reads unless Options say otherwise.
const DefaultMaxInputBytes = 4 << 20

// Report is what Run found.
type Report struct {
	// Findings are the errors, then the warnings, each in the order of the inputs.
	Findings []Finding
	// Routes is the number of Envoy routes of the inputs the ext_proc filter runs on, and Files
	// the number of inputs: what a report without findings says was checked.
	Routes, Files int
	// Skipped names the objects of the inputs whose kinds the check does not read, as
	// "Kind namespace/name (FILE)".
	Skipped []string
}

// Errors returns the number of findings of severity Error.
func (r Report) Errors() int {
	n := 0
	for _, f := range r.Findings {
		if f.Severity == Error {
			n++
		}
	}
	return n
}

// The kinds Run reads, by API group.
var knownKinds = map[string][]string{
	istioGroup: {"EnvoyFilter", "VirtualService", "DestinationRule"},
	egGroup:    {"EnvoyExtensionPolicy", "BackendTrafficPolicy", "ClientTrafficPolicy", "EnvoyProxy", "SecurityPolicy"},
	gwGroup:    {"HTTPRoute", "GRPCRoute"},
}

// Run checks inputs under p. The error is set when an input cannot be read or parsed, or is a
// configuration Envoy (or the mesh) would refuse: it joins an *InputError per bad input, each
// naming the file and, where known, the line and the field. Otherwise the report holds every
// finding; a report of no ext_proc filter at all holds one error saying so.
func Run(p *policy.Policy, inputs []Input, opts Options) (Report, error) {
	if p == nil {
		return Report{}, errors.New("no policy")
	}
	r, err := readAll(inputs, opts)
	if err != nil {
		return Report{}, err
	}
	var names []string
	for _, in := range inputs {
		names = append(names, in.Name)
	}
	policyFile := cmp.Or(opts.Policy.Name, "--config")
	c := coveredRoutes(r.deployments)
	rep := Report{Routes: c.count, Files: len(inputs), Skipped: r.skipped}
	rep.Findings = r.findings(p, c, policyFile, names)
	loc := newLocator(append(slices.Clone(inputs), Input{Name: policyFile, Data: opts.Policy.Data}), r.kube, cmp.Or(opts.MaxInputBytes, DefaultMaxInputBytes))
	for i := range rep.Findings {
		loc.locate(&rep.Findings[i])
		rep.Findings[i].Severity = severityOf(rep.Findings[i].Kind)
	}
	// A resource several deployments share (a BackendTrafficPolicy, a cluster) is reported once.
	seen := map[Finding]bool{}
	rep.Findings = slices.DeleteFunc(rep.Findings, func(f Finding) bool {
		dup := seen[f]
		seen[f] = true
		return dup
	})
	slices.SortStableFunc(rep.Findings, func(a, b Finding) int {
		return cmp.Compare(severityRank(a.Severity), severityRank(b.Severity))
	})
	return rep, nil
}

// reading is what Run read from its inputs: the deployments, the Kubernetes objects of kinds
// it reads and the names of the others, what Envoy Gateway's filter order and JWT providers
// showed, and the Envoy version.
type reading struct {
	deployments []Deployment
	kube        []*object
	skipped     []string
	egOrders    []Finding
	egJWT       egJWT
	version     *envoyVersion
}

// readAll reads the inputs and the Envoy version of opts; its error joins a *fileError per bad
// input, a filter Envoy would refuse included.
func readAll(inputs []Input, opts Options) (reading, error) {
	var r reading
	var errs []error
	var objs []*object
	version, err := parseVersion(opts.EnvoyVersion)
	if err != nil {
		errs = append(errs, &fileError{File: "--envoy-version", Err: err})
	}
	r.version = version
	for _, in := range inputs {
		ds, read, err := readInput(in, cmp.Or(opts.MaxInputBytes, DefaultMaxInputBytes))
		if err != nil {
			errs = append(errs, inputError(in.Name, err))
			continue
		}
		r.deployments = append(r.deployments, ds...)
		objs = append(objs, read...)
	}
	for _, o := range objs {
		if slices.Contains(knownKinds[o.group()], o.Kind) {
			r.kube = append(r.kube, o)
		} else {
			r.skipped = append(r.skipped, o.ref()+" ("+o.File+")")
		}
	}
	ds, egOrders, err := kubeDeployments(r.kube)
	errs = append(errs, err)
	r.egOrders = egOrders
	r.egJWT, err = egJWTProviders(r.kube)
	errs = append(errs, egInputError(err))
	r.deployments = append(r.deployments, ds...)
	for _, d := range r.deployments {
		if err := Validate(d.Filter); err != nil {
			errs = append(errs, &fileError{File: d.File, Where: d.Resource, Field: d.FilterPath,
				Err: fmt.Errorf("the filter fails Envoy's validation, so Envoy would refuse it: %w", err)})
		}
	}
	return r, errors.Join(errs...)
}

// findings are the findings of what was read under p, in the order of the rules; c are the
// routes the deployments cover, names the inputs' names.
func (r reading) findings(p *policy.Policy, c covered, policyFile string, names []string) []Finding {
	n := needsOf(p)
	var out []Finding
	for _, d := range r.deployments {
		out = append(out, deploymentFindings(d, p, n)...)
		out = append(out, grpcFindings(d, p, r.version)...)
	}
	out = append(out, r.egOrders...)
	out = append(out, r.egJWT.findings(n)...)
	if len(r.deployments) == 0 && !slices.ContainsFunc(r.egOrders, func(f Finding) bool { return f.Kind == kindUnreadable }) {
		out = append(out, Finding{
			File: strings.Join(names, ", "), Resource: "-", Field: "ext_proc", Kind: kindNoExtProc,
			Problem: "no ext_proc filter found: no http filter with an ExternalProcessor typed_config, EnvoyFilter patching one in, or EnvoyExtensionPolicy with an extProc entry; nothing reaches the processor",
			Fix:     "add the filter as envoy/envoy.yaml, envoy/istio-envoyfilter.yaml or envoy/envoy-gateway.yaml do, and pass the file that holds it",
		})
	}
	out = append(out, versionFindings(r.version)...)
	if len(r.deployments) > 0 {
		out = append(out, routeNameFindings(p, c, policyFile, names)...)
	}
	out = append(out, gatewayRetryFindings(p, r.kube, r.deployments)...)
	out = append(out, extensionPolicyFindings(p, r.kube, r.deployments)...)
	return out
}

func severityRank(s Severity) int {
	if s == Error {
		return 0
	}
	return 1
}

// readInput reads one input of at most maxBytes: the deployments of a bootstrap, or the objects
// of Kubernetes YAML.
func readInput(in Input, maxBytes int64) ([]Deployment, []*object, error) {
	if int64(len(in.Data)) > maxBytes {
		return nil, nil, fmt.Errorf("%d bytes, more than the %s an input may hold", len(in.Data), byteSize(maxBytes))
	}
	docs, err := yamlDocuments(in.Data, maxBytes)
	if err != nil {
		return nil, nil, err
	}
	if len(docs) == 0 {
		return nil, nil, errors.New("empty: neither an Envoy bootstrap nor Kubernetes objects")
	}
	if slices.ContainsFunc(docs, isKubernetes) {
		objs, err := readObjects(in.Name, docs, false)
		return nil, objs, err
	}
	if len(docs) > 1 {
		return nil, nil, &located{Line: docRoot(docs[1]).Line, Column: docRoot(docs[1]).Column, Err: errors.New("a second YAML document without kind: an Envoy bootstrap is one document, Kubernetes objects have apiVersion and kind")}
	}
	b, err := parseBootstrap(docs[0])
	if err != nil {
		return nil, nil, err
	}
	if err := Validate(b); err != nil {
		err = fmt.Errorf("the bootstrap fails Envoy's validation, so Envoy would refuse it: %w", err)
		path := validationPath(errors.Unwrap(err), string(b.ProtoReflect().Descriptor().FullName()))
		if steps, ok := fieldSteps(path); ok && path != "" {
			if n := walkField(docRoot(docs[0]), steps); n != nil && n.Line > 0 {
				return nil, nil, &located{Line: n.Line, Column: n.Column, Field: path, Err: err}
			}
		}
		return nil, nil, err
	}
	ds, err := bootstrapDeployments(b, in.Name)
	return ds, nil, err
}

// kubeDeployments builds the deployments of the Istio and Envoy Gateway objects of all inputs,
// which may refer to each other across files, and the findings of their EnvoyProxies' filter
// order.
func kubeDeployments(objs []*object) ([]Deployment, []Finding, error) {
	var out []Deployment
	var errs []error
	var findings []Finding
	for _, ef := range objs {
		if !ef.is(istioGroup, "EnvoyFilter") {
			continue
		}
		d, found, err := istioDeployment(ef, objs)
		if l := (*located)(nil); errors.As(err, &l) && l.Line > 0 && !strings.Contains(l.Err.Error(), "unknown field") {
			// A value Istio may read otherwise, or refuse: the other resources are still checked.
			findings = append(findings, unreadable(ef, err))
			continue
		}
		if err != nil {
			errs = append(errs, inputError(ef.File, fmt.Errorf("%s: %w", ef.ref(), err)))
			continue
		}
		if found {
			if d.Processor == nil { // not a cluster the EnvoyFilter adds
				d.Processor = istioProcessorLimits(d.Filter, objs)
			}
			out = append(out, d)
		}
	}
	pols, _, unread, err := envoyGateway(objs, false)
	if err != nil {
		errs = append(errs, egInputError(err))
	}
	findings = append(findings, unread...)
	for _, p := range pols {
		out = append(out, p.Deployment)
	}
	for _, ep := range objs {
		if !ep.is(egGroup, "EnvoyProxy") {
			continue
		}
		f, err := egOrderFinding(ep)
		if err != nil {
			errs = append(errs, inputError(ep.File, err))
			continue
		}
		findings = append(findings, f...)
	}
	return out, findings, errors.Join(errs...)
}

// egInputError names, for an error of envoyGateway, the file of the object it is about.
func egInputError(err error) error {
	var f *inFile
	if errors.As(err, &f) {
		return inputError(f.file, err)
	}
	return err
}

// unreadable is the finding of a value of o that check cannot read: a finding on its line, so
// that the other resources' findings are still reported.
func unreadable(o *object, err error) Finding {
	f := Finding{File: o.File, Resource: o.ref(), Field: "spec", Kind: kindUnreadable, Line: o.Line,
		Problem: "cannot be read (" + err.Error() + "): what the resource sets was not checked, and Istio or Envoy would refuse a value they cannot read either, leaving covered requests without the ext_proc filter it adds",
		Fix:     "write the value as the field's type wants it"}
	var l *located
	if errors.As(err, &l) {
		f.Problem = "cannot be read (" + l.Err.Error() + "): what the resource sets was not checked, and Istio or Envoy would refuse a value they cannot read either, leaving covered requests without the ext_proc filter it adds"
		if l.Line > 0 {
			f.Line, f.Column = l.Line, 0
		}
		if l.Field != "" {
			f.Field = l.Field
		}
	}
	return f
}
