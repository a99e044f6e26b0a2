package yamllimit

import (
	"fmt"

	"go.yaml.in/yaml/v3"
)

// Check measures a decoded document: it refuses collections nested more than MaxDepth deep, a
// mapping of more than MaxKeys keys or with a key given twice (which the YAML decoder refuses
// too, with an error per pair of keys), an alias to a value that holds it, and a document whose
// values, each alias counted as the value it repeats, number more than budget. It returns that
// number. Its recursion stops at MaxDepth
// and it visits each node once, whatever the aliases repeat.
func Check(doc *yaml.Node, budget int) (int, error) {
	w := walker{budget: budget, anchored: map[*yaml.Node]*measure{}}
	m, err := w.walk(doc, 0)
	if err != nil {
		return 0, err
	}
	return m.values, nil
}

// measure is what a node holds: its values with its aliases expanded, and how many collections
// deep it nests.
type measure struct {
	values, height int
	done           bool // false while the node's own children are walked
}

type walker struct {
	budget   int
	total    int // values counted so far, aliases expanded
	anchored map[*yaml.Node]*measure
}

func (w *walker) walk(n *yaml.Node, depth int) (measure, error) {
	if n == nil {
		return measure{}, nil
	}
	if n.Kind == yaml.AliasNode {
		target := w.anchored[n.Alias]
		if target == nil || !target.done {
			return measure{}, &Error{Line: n.Line, Problem: fmt.Sprintf("alias *%s refers to a value that holds it", n.Value)}
		}
		if depth+target.height > MaxDepth {
			return measure{}, w.tooDeep(n)
		}
		return w.count(n, *target)
	}
	collection := n.Kind == yaml.MappingNode || n.Kind == yaml.SequenceNode
	if collection {
		depth++
		if depth > MaxDepth {
			return measure{}, w.tooDeep(n)
		}
	}
	if n.Kind == yaml.MappingNode {
		if err := keys(n); err != nil {
			return measure{}, err
		}
	}
	var self *measure
	if n.Anchor != "" {
		self = &measure{}
		w.anchored[n] = self
	}
	m := measure{values: 1}
	if _, err := w.count(n, measure{values: 1}); err != nil {
		return measure{}, err
	}
	for _, c := range n.Content {
		cm, err := w.walk(c, depth)
		if err != nil {
			return measure{}, err
		}
		m.values = min(m.values+cm.values, w.budget+1)
		m.height = max(m.height, cm.height)
	}
	if collection {
		m.height++
	}
	m.done = true
	if self != nil {
		*self = m
	}
	return m, nil
}

// count adds the values an alias repeats, or a node's own one, to the total.
func (w *walker) count(n *yaml.Node, m measure) (measure, error) {
	w.total = min(w.total+m.values, w.budget+1)
	if w.total > w.budget {
		return measure{}, &Error{Line: n.Line, Problem: fmt.Sprintf("more than %d YAML values, its aliases expanded: the most this input may hold", w.budget)}
	}
	return m, nil
}

func (w *walker) tooDeep(n *yaml.Node) error {
	return &Error{Line: n.Line, Problem: fmt.Sprintf("mappings and sequences nested more than %d deep, the most that is read", MaxDepth)}
}

// keys refuses a mapping of more than MaxKeys keys, or with a scalar key given twice.
func keys(n *yaml.Node) error {
	if len(n.Content)/2 > MaxKeys {
		return &Error{Line: n.Line, Problem: fmt.Sprintf("a mapping of more than %d keys, the most that is read", MaxKeys)}
	}
	seen := make(map[string]int, len(n.Content)/2)
	for i := 0; i+1 < len(n.Content); i += 2 {
		k := n.Content[i]
		if k.Kind != yaml.ScalarNode {
			continue
		}
		if first, ok := seen[k.Value]; ok {
			return &Error{Line: k.Line, Problem: fmt.Sprintf("mapping key %q given again (first at line %d)", k.Value, first)}
		}
		seen[k.Value] = k.Line
	}
	return nil
}
