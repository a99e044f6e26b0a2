package policy

import (
	"encoding/json"
	"mime"
	"slices"
	"strings"
	"text/template"

	"go.yaml.in/yaml/v3"
)

// templateFuncs are the functions a problem body template may call besides text/template's own.
func templateFuncs() template.FuncMap {
	return template.FuncMap{
		// json writes its argument as JSON: {"message": {{json .Detail}}}.
		"json": func(v any) (string, error) {
			b, err := json.Marshal(v)
			return string(b), err
		},
	}
}

// problems reads a problems mapping: problem code to {status, content_type, body}.
func (d *decoder) problems(v *yaml.Node, path string) map[string]*Problem {
	out := map[string]*Problem{}
	d.fields(v, path, func(code string, k, pv *yaml.Node, at string) {
		if !slices.Contains(ProblemCodes, code) {
			d.unknown(k, at, ProblemCodes)
			return
		}
		if p := d.problem(code, pv, at); p != nil {
			out[code] = p
		}
	})
	return out
}

// problem reads one problems entry; nil if it is bad.
func (d *decoder) problem(code string, v *yaml.Node, path string) *Problem {
	p := &Problem{ContentType: DefaultProblemContentType}
	bad := false
	var contentType *yaml.Node
	fields := []string{"status", "content_type", "body"}
	d.fields(v, path, func(key string, k, fv *yaml.Node, at string) {
		switch key {
		case "status":
			if n, ok := d.intIn(fv, at, 200, 599, "an HTTP status from 200 to 599"); ok {
				p.Status = n
			} else {
				bad = true
			}
		case "content_type":
			contentType = fv
			bad = !d.problemContentType(p, fv, at) || bad
		case "body":
			bad = !d.problemBody(p, code, fv, at) || bad
		default:
			d.unknown(k, at, fields)
			bad = true
		}
	})
	switch {
	case bad || v.Kind != yaml.MappingNode:
		return nil
	case p.Status == 0 && p.Body == nil && contentType == nil:
		d.fail(v, path, "sets none of status, content_type and body")
		return nil
	case contentType != nil && p.Body == nil:
		d.fail(contentType, path+".content_type", "needs a body: the built-in body is problem+json")
		return nil
	}
	return p
}

// problemContentType reads a problems entry's content_type into p.
func (d *decoder) problemContentType(p *Problem, v *yaml.Node, path string) bool {
	s, ok := d.str(v, path)
	if !ok {
		return false
	}
	if mt, _, err := mime.ParseMediaType(s); err != nil || !isMediaType(mt) {
		d.fail(v, path, "%q is not a media type", s)
		return false
	}
	p.ContentType = s
	return true
}

// problemBody reads a problems entry's body template into p and renders it once, so that a
// field ProblemData lacks fails now rather than on a client's request.
func (d *decoder) problemBody(p *Problem, code string, v *yaml.Node, path string) bool {
	s, ok := d.str(v, path)
	if !ok {
		return false
	}
	t, err := template.New("body").Option("missingkey=error").Funcs(templateFuncs()).Parse(s)
	if err != nil {
		d.fail(v, path, "invalid template: %v", err)
		return false
	}
	p.Body = t
	status := p.Status
	if status == 0 {
		status = 500
	}
	if _, err := p.Render(ProblemData{Code: code, Title: "Internal Server Error", Detail: "A sample detail.", Status: status}); err != nil {
		d.fail(v, path, "the template fails: %v", err)
		return false
	}
	return true
}

// isMediaType reports whether mt is type/subtype.
func isMediaType(mt string) bool {
	typ, sub, ok := strings.Cut(mt, "/")
	return ok && typ != "" && sub != ""
}
