package check

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// covered is what the inputs show of the Envoy routes the ext_proc filter runs on: their names,
// the policy routes Envoy names outright (x-idempotency-route), and whether some routes could not
// be read (RDS, targets outside the inputs), in which case nothing can be said to match nothing.
type covered struct {
	names   []string
	named   map[string]bool
	partial bool
	// count is the number of routes the filter runs on, for the summary line.
	count int
}

// coveredRoutes gathers covered from ds.
func coveredRoutes(ds []Deployment) covered {
	c := covered{named: map[string]bool{}}
	seen := map[string]bool{}
	for _, d := range ds {
		if d.RoutesUnknown != "" {
			c.partial = true
		}
		for _, e := range d.Routes {
			if e.Config.GetDisabled() || d.FilterDisabled && e.Config == nil {
				continue
			}
			if e.Partial {
				c.partial = true
				continue
			}
			for _, h := range e.Config.GetOverrides().GetGrpcInitialMetadata() {
				if strings.EqualFold(h.GetKey(), routeMetadataKey) {
					c.named[headerValueString(h)] = true
				}
			}
			if e.Name == "" {
				continue
			}
			c.names = append(c.names, e.Name)
			if k := d.File + "\x00" + e.Name; !seen[k] {
				seen[k] = true
				c.count++
			}
		}
	}
	return c
}

// routeNameFindings refuses an enabled policy route matched by route_name_* that matches no
// Envoy route of the inputs on which the filter runs, and that no route names outright: its
// requests never get it, so it protects nothing (they get another policy route, or pass).
func routeNameFindings(p *policy.Policy, c covered, policyFile string, files []string) []Finding {
	if c.partial {
		return nil
	}
	var out []Finding
	for i, r := range p.Routes {
		if !r.Enabled || !r.MatchesRouteName() || c.named[r.Name] {
			continue
		}
		matched := false
		for _, n := range c.names {
			if r.MatchesName(n) {
				matched = true
				break
			}
		}
		if matched {
			continue
		}
		out = append(out, Finding{File: policyFile, Resource: "policy route " + strconv.Quote(r.Name), Field: fmt.Sprintf("routes[%d].match", i),
			Kind: kindRouteNameMatchesNothing,
			Problem: fmt.Sprintf("matches no route of %s on which the ext_proc filter runs (Envoy's route names there: %s): the policy route protects nothing, and its requests get another policy route or pass through",
				strings.Join(files, ", "), quoteList(c.names)),
			Fix: "name the Envoy routes it should cover (name: on an Envoy route, http[].name in a VirtualService, the HTTPRoute rule for Envoy Gateway), or correct the matcher"})
	}
	return out
}

func quoteList(names []string) string {
	if len(names) == 0 {
		return "none"
	}
	var q []string
	for i, n := range names {
		if i == 8 {
			q = append(q, fmt.Sprintf("and %d more", len(names)-i))
			break
		}
		q = append(q, strconv.Quote(n))
	}
	return strings.Join(q, ", ")
}

// gwRoute is a Gateway API HTTPRoute or GRPCRoute as far as its retries matter.
type gwRoute struct {
	Rules []struct {
		Name    string    `yaml:"name"`
		Matches []gwMatch `yaml:"matches"`
		Retry   *struct {
			Attempts *int  `yaml:"attempts"`
			Codes    []int `yaml:"codes"`
		} `yaml:"retry"`
	} `yaml:"rules"`
}

// gwMatch is an HTTPRoute match's path or a GRPCRoute match's method.
type gwMatch struct {
	Path *struct {
		Value string `yaml:"value"`
	} `yaml:"path"`
	Method *struct {
		Type    string `yaml:"type"`
		Service string `yaml:"service"`
		Method  string `yaml:"method"`
	} `yaml:"method"`
}

// path is the request path the match selects, as a request to it carries: an HTTPRoute's path
// value, or the path Envoy Gateway matches for a GRPCRoute's method (internal/gatewayapi/route.go):
// exact /service/method, or the prefix /service/ for a service alone. ok is false for a method
// without a service and for regular expressions: no one path stands for them.
func (m gwMatch) path() (string, bool) {
	switch g := m.Method; {
	case g != nil && g.Type != "" && g.Type != "Exact", g != nil && g.Service == "" && g.Method != "":
		return "", false
	case g != nil && g.Service != "":
		return "/" + g.Service + "/" + g.Method, true
	case m.Path != nil && m.Path.Value != "":
		return m.Path.Value, true
	}
	return "/", true
}

// gatewayRetryFindings refuses a Gateway API retry (HTTPRoute or GRPCRoute rules[].retry,
// GEP-1731) on a rule the ext_proc filter runs on while the policy covers requests: the router
// retries after ext_proc, so the processor sees one request and one lease while the upstream
// may run it again.
func gatewayRetryFindings(p *policy.Policy, objs []*object, ds []Deployment) []Finding {
	if len(enabledRoutes(p)) == 0 {
		return nil
	}
	var out []Finding
	for _, o := range objs {
		if !o.is(gwGroup, "HTTPRoute") && !o.is(gwGroup, "GRPCRoute") {
			continue
		}
		spec, err := decodeLoose[gwRoute](o)
		if err != nil {
			out = append(out, unreadable(o, err))
			continue
		}
		for i, rule := range spec.Rules {
			if rule.Retry == nil || rule.Retry.Attempts != nil && *rule.Retry.Attempts == 0 {
				continue
			}
			prefix := fmt.Sprintf("%s/%s/%s/rule/%d/", strings.ToLower(o.Kind), o.Namespace, o.Name, i)
			if !filterRunsOn(ds, prefix) {
				continue
			}
			attempts := "the implementation's default attempts"
			if a := rule.Retry.Attempts; a != nil {
				attempts = fmt.Sprintf("%d attempts", *a)
			}
			f := Finding{File: o.File, Resource: o.ref(), Field: fmt.Sprintf("rules[%d].retry", i), Kind: kindGatewayAPIRetry,
				Problem: fmt.Sprintf("retries the rule's requests (codes %v, %s): the router retries after ext_proc, which never sees the retry, so a claimed request the upstream ran (and answered with one of the codes, or reset) runs again under the same lease", rule.Retry.Codes, attempts),
				Fix:     "remove retry from rules the policy covers (or set attempts: 0): clients retry with the same key, and get the replay"}
			if n := specPath(o.Spec, "rules", i, "retry"); n != nil {
				f.Line, f.Column = n.Line, n.Column
			}
			out = append(out, f)
		}
	}
	return out
}

// filterRunsOn reports whether an ext_proc filter of ds runs on the xDS routes whose names start
// with prefix: an Envoy Gateway policy resolved to them, or one whose targets were not read (a
// Gateway, an HTTPRoute outside the inputs), or an Istio filter (Istio's gateways read Gateway
// API routes too, and the filter runs on every route).
func filterRunsOn(ds []Deployment, prefix string) bool {
	for _, d := range ds {
		if d.Platform == platformIstio && !d.FilterDisabled {
			return true
		}
		if d.Platform != platformEnvoyGateway {
			continue
		}
		for _, e := range d.Routes {
			if e.Config.GetDisabled() {
				continue
			}
			if strings.HasPrefix(e.Name, prefix) || e.Partial && strings.HasPrefix(prefix, e.Name) {
				return true
			}
		}
	}
	return false
}

// extensionPolicyFindings refuses an EnvoyExtensionPolicy whose targets all resolve to routes of
// the inputs and none of which a policy route other than the default covers (by route name, or
// by the path of the rule's match): the filter it adds runs where the policy names no route.
func extensionPolicyFindings(p *policy.Policy, objs []*object, ds []Deployment) []Finding {
	var named []*policy.Route
	for _, r := range p.Routes {
		if r.Enabled {
			named = append(named, r)
		}
	}
	if len(named) == 0 {
		return nil
	}
	routes := map[string]gwRoute{}
	for _, o := range objs {
		if o.is(gwGroup, "HTTPRoute") || o.is(gwGroup, "GRPCRoute") {
			if spec, err := decodeLoose[gwRoute](o); err == nil {
				routes[egRouteKey(o.Kind, o.Namespace, o.Name)] = spec
			}
		}
	}
	var out []Finding
	done := map[string]bool{}
	for _, d := range ds {
		if d.Platform != platformEnvoyGateway || done[d.Resource] {
			continue
		}
		done[d.Resource] = true
		var names []string
		partial := false
		for _, e := range d.Routes {
			if e.Partial || e.Name == "" {
				partial = true
			}
			names = append(names, e.Name)
		}
		if partial || len(names) == 0 || slices.ContainsFunc(names, func(n string) bool { return reaches(n, routes, named, p) }) {
			continue
		}
		f := Finding{File: d.File, Resource: d.Resource, Field: "targetRefs", Kind: kindPolicyTargetsNothing,
			Problem: fmt.Sprintf("reaches only routes no policy route names (%s): the policy's routes run where this filter does not, unprotected", quoteList(names)),
			Fix:     "target the HTTPRoute rules the policy's routes cover, or match these routes in the policy"}
		out = append(out, f)
	}
	return out
}

// reaches reports whether xDS route name (httproute/ns/name/rule/i/match/j/host, or grpcroute/…)
// is covered by one of the named policy routes: by its route name, or by the path its match
// sets. A GRPCRoute match no one path stands for (a regular expression) is taken as reached.
func reaches(name string, routes map[string]gwRoute, named []*policy.Route, p *policy.Policy) bool {
	for _, r := range named {
		if r.MatchesName(name) {
			return true
		}
	}
	parts := strings.Split(name, "/")
	if len(parts) < 7 || parts[0] != "httproute" && parts[0] != "grpcroute" {
		return false
	}
	rule, err1 := strconv.Atoi(parts[4])
	match, err2 := strconv.Atoi(parts[6])
	spec, ok := routes[strings.Join(parts[:3], "/")]
	if err1 != nil || err2 != nil || !ok || rule >= len(spec.Rules) {
		return false
	}
	path := "/"
	if ms := spec.Rules[rule].Matches; match >= 0 && match < len(ms) {
		if path, ok = ms[match].path(); !ok {
			return true
		}
	}
	r, _, err := p.Select(policy.Selector{Path: path, RouteName: name})
	return err == nil && r != p.Default && r.Enabled
}
