package e2e_test

import (
	"fmt"
	"go/ast"
	"go/token"
	"go/types"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// sharedTypes are the structs a stream points to without owning them, and why: their fields are
// not the stream's.
var sharedTypes = map[string]string{
	"Server":  "one per process",
	"route":   "compiled from the policy at load, one per policy route",
	"problem": "the package's problem answers, made once",
}

// TestStreamFields holds docs/architecture.md's count of the fields one request's stream holds to
// the code: the fields of extproc's stream, and of every product struct it holds by value or
// through a pointer (besides sharedTypes), each struct once however often it is reached. A slice,
// map, interface or channel counts as one field, whatever it holds; so does a struct of another
// module.
func TestStreamFields(t *testing.T) {
	pkgs := loadTyped(t, "./extproc")
	require.Len(t, pkgs, 1)
	obj := pkgs[0].Types.Scope().Lookup("stream")
	require.NotNil(t, obj, "extproc declares stream")

	var order []string
	count := map[string]int{}
	var own func(n *types.Named)
	own = func(n *types.Named) {
		name := qualified(n)
		if _, done := count[name]; done {
			return
		}
		st := n.Underlying().(*types.Struct)
		count[name] = st.NumFields()
		order = append(order, fmt.Sprintf("`%s` %d", name, st.NumFields()))
		for f := range st.Fields() {
			typ := f.Type()
			if p, ok := typ.(*types.Pointer); ok {
				typ = p.Elem()
			}
			m, ok := types.Unalias(typ).(*types.Named)
			if !ok || m.Obj().Pkg() == nil || !strings.HasPrefix(m.Obj().Pkg().Path()+"/", module) {
				continue
			}
			if _, ok := m.Underlying().(*types.Struct); !ok {
				continue
			}
			if _, ok := sharedTypes[m.Obj().Name()]; ok && m.Obj().Pkg().Name() == "extproc" {
				continue
			}
			own(m)
		}
	}
	stream := obj.Type().(*types.Named)
	own(stream)
	total := 0
	for _, n := range count {
		total += n
	}
	t.Logf("the stream's fields: %d of its own, %d in all: %s", count["stream"], total, strings.Join(order, ", "))

	doc, err := os.ReadFile("../docs/architecture.md")
	require.NoError(t, err)
	m := regexp.MustCompile(`(?s)\x60stream\x60 has (\d+) fields of its own and (\d+) counting[^:]*:\s+(.*?)\.\s`).FindSubmatch(doc)
	require.NotNil(t, m, "docs/architecture.md counts the stream's fields: `stream` has N fields of its own and M counting ...: list.")
	require.Equal(t, strconv.Itoa(count["stream"]), string(m[1]), "the stream's own fields")
	require.Equal(t, strconv.Itoa(total), string(m[2]), "the fields counting the structs the stream owns")
	require.Equal(t, strings.Join(order, ", "), strings.Join(strings.Fields(string(m[3])), " "), "the structs and their fields, in the order the stream reaches them")
}

// qualified names a product type as the walk does: extproc's bare, others with their package.
func qualified(n *types.Named) string {
	return walkPrefix(n.Obj().Pkg().Name()) + n.Obj().Name()
}

// TestOutcomeSettledInOnePlace holds the stream to what docs/architecture.md says of its outcome:
// in the product's code, stream.outcome is assigned in stream.settleOutcome alone (no other
// assignment, composite literal or address taken), and settleOutcome is called from stream.move
// alone, once.
func TestOutcomeSettledInOnePlace(t *testing.T) {
	pkgs := loadTyped(t, "./extproc")
	require.Len(t, pkgs, 1)
	p := pkgs[0]
	st := p.Types.Scope().Lookup("stream").Type().(*types.Named)
	var outcome *types.Var
	for f := range st.Underlying().(*types.Struct).Fields() {
		if f.Name() == "outcome" {
			outcome = f
		}
	}
	require.NotNil(t, outcome, "stream has an outcome field")
	settleOutcome, _, _ := types.LookupFieldOrMethod(types.NewPointer(st), false, p.Types, "settleOutcome")
	require.NotNil(t, settleOutcome, "stream has settleOutcome")

	var writes, calls []string
	for _, f := range p.Syntax {
		for _, d := range f.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || fd.Body == nil {
				continue
			}
			in := funcName(p.Name, fd)
			isOutcome := func(e ast.Expr) bool {
				if s, ok := ast.Unparen(e).(*ast.SelectorExpr); ok {
					return p.TypesInfo.ObjectOf(s.Sel) == outcome
				}
				return false
			}
			ast.Inspect(fd.Body, func(n ast.Node) bool {
				switch n := n.(type) {
				case *ast.AssignStmt:
					for _, l := range n.Lhs {
						if isOutcome(l) {
							writes = append(writes, in)
						}
					}
				case *ast.IncDecStmt:
					if isOutcome(n.X) {
						writes = append(writes, in)
					}
				case *ast.UnaryExpr:
					if n.Op == token.AND && isOutcome(n.X) {
						writes = append(writes, in+" (its address)")
					}
				case *ast.KeyValueExpr:
					if id, ok := n.Key.(*ast.Ident); ok && p.TypesInfo.ObjectOf(id) == outcome {
						writes = append(writes, in+" (a literal)")
					}
				case *ast.SelectorExpr:
					if p.TypesInfo.ObjectOf(n.Sel) == settleOutcome {
						calls = append(calls, in)
					}
				}
				return true
			})
		}
	}
	require.Equal(t, []string{"stream.settleOutcome"}, writes, "the functions that assign stream.outcome")
	require.Equal(t, []string{"stream.move"}, calls, "the functions that call stream.settleOutcome")
}
