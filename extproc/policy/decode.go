package policy

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/idempotency-extproc/idempotency-extproc/internal/yamllimit"
)

// maxFileBytes is the size of the policy file the YAML bounds are those of.
const maxFileBytes = 4 << 20

// FieldError is one bad field of a policy file.
type FieldError struct {
	// Path names the field as the file writes it: routes[2] (pay).ttl,
	// defaults.scope[1].jwt_claim, problems.request-in-progress.body. Empty for the file as a
	// whole.
	Path string
	// Line is the field's line in the file; 0 when the error is about no line of it.
	Line int
	// Msg says what is wrong.
	Msg string
}

func (e *FieldError) Error() string {
	var b strings.Builder
	b.WriteString("policy: ")
	if e.Path != "" {
		b.WriteString(e.Path + ": ")
	}
	b.WriteString(e.Msg)
	if e.Line > 0 {
		fmt.Fprintf(&b, " (line %d)", e.Line)
	}
	return b.String()
}

// Setting is a top-level key of the policy file that belongs to the program rather than to the
// policy: the settings docs/configuration.md lists with the flags (grpc_addr, redis_url, …).
type Setting struct {
	Key string
	// List accepts a YAML list of strings, given back joined by commas, as well as a string.
	List bool
}

// ParseFile compiles a policy file whose top level may also hold settings. It returns the
// policy, the value of each setting the file gives, by key, and an error that names every bad
// field at once, each as a *FieldError (joined with errors.Join). On error the policy is nil and
// the values hold the settings that were well-formed, so that the caller can check them too.
//
// The file is one YAML document (an empty one gives the defaults). Unknown fields, fields given
// twice and fields without a value (`ttl_header:`, which YAML reads as null and would leave
// inherited) are errors. Anchors, aliases and merge keys (<<) are read as YAML defines them.
func ParseFile(data []byte, settings []Setting) (*Policy, map[string]string, error) {
	// The decoder's nodes cost some 80 times the bytes of short values: a policy file holds no
	// more values than a file of check may at its default bound (yamllimit). Its aliases are
	// bounded as it is read.
	if err := yamllimit.Screen(data, maxFileBytes); err != nil {
		return nil, nil, &FieldError{Msg: err.Error()}
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil && !errors.Is(err, io.EOF) {
		return nil, nil, fmt.Errorf("policy: %w", err)
	}
	if err := dec.Decode(&yaml.Node{}); !errors.Is(err, io.EOF) {
		return nil, nil, &FieldError{Msg: "the file must hold one YAML document"}
	}
	var root *yaml.Node
	if doc.Kind == yaml.DocumentNode && len(doc.Content) == 1 {
		root = doc.Content[0]
	}
	d := &decoder{}
	p, values := d.file(root, settings)
	// In the order of the file; those about no line last.
	slices.SortStableFunc(d.errs, func(a, b error) int { return cmp.Compare(lineOf(a), lineOf(b)) })
	if err := errors.Join(d.errs...); err != nil {
		return nil, values, err
	}
	return p, values, nil
}

func lineOf(err error) int {
	var fe *FieldError
	if errors.As(err, &fe) && fe.Line > 0 {
		return fe.Line
	}
	return math.MaxInt
}

// maxSteps bounds the values one file may expand to through its aliases.
const maxSteps = 1 << 18

// decoder walks one YAML node tree and collects every error with the path of its field.
type decoder struct {
	errs  []error
	steps int
	// durabilities are the durability mappings read, for checkDurability.
	durabilities []durabilityCheck
}

func (d *decoder) fail(n *yaml.Node, path, format string, args ...any) {
	e := &FieldError{Path: path, Msg: fmt.Sprintf(format, args...)}
	if n != nil {
		e.Line = n.Line
	}
	d.errs = append(d.errs, e)
}

// value follows n's aliases and counts it against maxSteps; it returns nil once the file has
// expanded past them (that error is reported once).
func (d *decoder) value(n *yaml.Node) *yaml.Node {
	for n != nil && n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	d.steps++
	if d.steps == maxSteps {
		d.fail(nil, "", "the file expands to more than %d values through its aliases", maxSteps)
	}
	if d.steps >= maxSteps || n == nil {
		return nil
	}
	return n
}

func isNull(n *yaml.Node) bool { return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null" }

// describe names what n is, for "must be X, got Y".
func describe(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	}
	v := n.Value
	if len(v) > 40 {
		v = v[:37] + "..."
	}
	return fmt.Sprintf("%q", v)
}

// present reports whether n has a value, naming its field when it is null.
func (d *decoder) present(n *yaml.Node, path string) bool {
	if isNull(n) {
		d.fail(n, path, "has no value (leave the field out to inherit it; \"\" is the empty string)")
		return false
	}
	return true
}

// scalar reports whether n is a single value; what names what the field takes ("a duration").
func (d *decoder) scalar(n *yaml.Node, path, what string) bool {
	if !d.present(n, path) {
		return false
	}
	if n.Kind != yaml.ScalarNode {
		d.fail(n, path, "must be %s, got %s", what, describe(n))
		return false
	}
	return true
}

func (d *decoder) str(n *yaml.Node, path string) (string, bool) {
	if !d.scalar(n, path, "a string") {
		return "", false
	}
	return n.Value, true
}

func (d *decoder) boolean(n *yaml.Node, path string) (bool, bool) {
	var b bool
	if !d.scalar(n, path, "true or false") {
		return false, false
	}
	if n.Decode(&b) != nil {
		d.fail(n, path, "must be true or false, got %s", describe(n))
		return false, false
	}
	return b, true
}

func (d *decoder) integer(n *yaml.Node, path string) (int64, bool) {
	var i int64
	if !d.scalar(n, path, "a whole number") {
		return 0, false
	}
	if n.ShortTag() != "!!int" || n.Decode(&i) != nil {
		d.fail(n, path, "must be a whole number, got %s", describe(n))
		return 0, false
	}
	return i, true
}

// intIn reads a whole number from lo to hi; range says which in the error, e.g. "between 0 and
// 10".
func (d *decoder) intIn(n *yaml.Node, path string, lo, hi int64, rangeSays string) (int, bool) {
	i, ok := d.integer(n, path)
	switch {
	case !ok:
		return 0, false
	case i < lo || i > hi:
		d.fail(n, path, "must be %s, got %d", rangeSays, i)
		return 0, false
	}
	return int(i), true
}

// duration reads a Go duration between least and most.
func (d *decoder) duration(n *yaml.Node, path string, least, most time.Duration, mostSays string) (time.Duration, bool) {
	s, ok := d.str(n, path)
	if !ok {
		return 0, false
	}
	v, err := time.ParseDuration(s)
	switch {
	case err != nil:
		d.fail(n, path, "invalid duration %q (use units such as 300ms, 30s, 24h)", s)
	case v < least && least == 0:
		d.fail(n, path, "must not be negative, got %s", s)
	case v < least:
		d.fail(n, path, "must be at least %v, got %s", least, s)
	case v > most:
		d.fail(n, path, "must be at most %v%s, got %s", most, mostSays, s)
	default:
		return v, true
	}
	return 0, false
}

// oneOf reads one of values.
func (d *decoder) oneOf(n *yaml.Node, path string, values []string) (string, bool) {
	s, ok := d.str(n, path)
	if !ok {
		return "", false
	}
	for _, v := range values {
		if s == v {
			return s, true
		}
	}
	d.fail(n, path, "must be %s, got %q", orList(values), s)
	return "", false
}

// list calls each on every item of the list n, at path[i]; items that are null are errors.
func (d *decoder) list(n *yaml.Node, path string, each func(item *yaml.Node, path string)) bool {
	if !d.present(n, path) {
		return false
	}
	if n.Kind != yaml.SequenceNode {
		d.fail(n, path, "must be a list, got %s", describe(n))
		return false
	}
	for i, item := range n.Content {
		at := fmt.Sprintf("%s[%d]", path, i)
		if item = d.value(item); item != nil && d.present(item, at) {
			each(item, at)
		}
	}
	return true
}

// strs reads a list of strings.
func (d *decoder) strs(n *yaml.Node, path string) ([]string, bool) {
	out := []string{}
	ok := d.list(n, path, func(item *yaml.Node, at string) {
		if s, ok := d.str(item, at); ok {
			out = append(out, s)
		}
	})
	return out, ok
}

// pair is one key of a mapping and its value.
type pair struct{ key, value *yaml.Node }

// fields calls each on every key of the mapping n, its merged keys (<<) included unless the
// mapping gives them itself, with the path of the key's value. A key given twice is an error.
func (d *decoder) fields(n *yaml.Node, path string, each func(key string, k, v *yaml.Node, path string)) bool {
	if !d.present(n, path) {
		return false
	}
	if n.Kind != yaml.MappingNode {
		d.fail(n, path, "must be a mapping, got %s", describe(n))
		return false
	}
	seen := map[string]*yaml.Node{}
	var own, merged []pair
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := d.value(n.Content[i]), n.Content[i+1]
		switch {
		case k == nil:
			return false
		case k.Kind == yaml.ScalarNode && k.ShortTag() == "!!merge":
			merged = d.merge(v, path, merged, map[*yaml.Node]bool{n: true})
		case k.Kind != yaml.ScalarNode || isNull(k):
			d.fail(k, path, "keys must be names, got %s", describe(k))
		case seen[k.Value] != nil:
			d.fail(k, join(path, k.Value), "is given twice (first on line %d)", seen[k.Value].Line)
		default:
			seen[k.Value] = k
			own = append(own, pair{k, v})
		}
	}
	for _, p := range merged {
		if seen[p.key.Value] == nil {
			seen[p.key.Value] = p.key
			own = append(own, p)
		}
	}
	for _, p := range own {
		at := join(path, p.key.Value)
		if v := d.value(p.value); v != nil {
			each(p.key.Value, p.key, v, at)
		}
	}
	return true
}

// merge appends to out the keys that the merge value v brings (a mapping or a list of them,
// the earlier ones first, as YAML gives them precedence); active holds the mappings being
// merged, so that one that merges itself is an error rather than a loop.
func (d *decoder) merge(v *yaml.Node, path string, out []pair, active map[*yaml.Node]bool) []pair {
	v = d.value(v)
	if v == nil {
		return out
	}
	switch v.Kind {
	case yaml.SequenceNode:
		for _, item := range v.Content {
			out = d.merge(item, path, out, active)
		}
		return out
	case yaml.MappingNode:
	default:
		d.fail(v, path, "<< must merge a mapping or a list of mappings, got %s", describe(v))
		return out
	}
	if active[v] {
		d.fail(v, path, "<< merges a mapping into itself")
		return out
	}
	active[v] = true
	defer delete(active, v)
	var inner []pair
	for i := 0; i+1 < len(v.Content); i += 2 {
		k := d.value(v.Content[i])
		switch {
		case k == nil:
			return out
		case k.Kind == yaml.ScalarNode && k.ShortTag() == "!!merge":
			inner = d.merge(v.Content[i+1], path, inner, active)
		case k.Kind == yaml.ScalarNode && !isNull(k):
			out = append(out, pair{k, v.Content[i+1]})
		}
	}
	// A mapping's own keys win over what it merges in turn.
	return append(out, inner...)
}

// unknown reports a key that the mapping at path does not have, suggesting the nearest of known.
func (d *decoder) unknown(k *yaml.Node, path string, known []string) {
	key := k.Value
	best, bestDist := "", 3
	for _, c := range known {
		if dist := editDistance(key, c); dist < bestDist {
			best, bestDist = c, dist
		}
	}
	if best != "" {
		d.fail(k, path, "unknown field (did you mean %s?)", best)
		return
	}
	d.fail(k, path, "unknown field")
}

// editDistance is the Levenshtein distance of a and b.
func editDistance(a, b string) int {
	if len(a) > 64 || len(b) > 64 {
		return 64
	}
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// orList writes values as "a, b or c".
func orList(values []string) string {
	switch len(values) {
	case 0:
		return ""
	case 1:
		return values[0]
	}
	return strings.Join(values[:len(values)-1], ", ") + " or " + values[len(values)-1]
}

// parseYAML parses a built-in YAML text of the tables into its node.
func parseYAML(text string) (*yaml.Node, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal([]byte(text), &doc); err != nil {
		return nil, err
	}
	if len(doc.Content) != 1 {
		return nil, fmt.Errorf("%q is not one YAML value", text)
	}
	return doc.Content[0], nil
}
