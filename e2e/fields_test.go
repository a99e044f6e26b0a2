package e2e_test

import (
	"fmt"
	"go/types"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/tools/go/packages"
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
	cfg := &packages.Config{BuildFlags: []string{"-tags=vtprotobuf"}, Mode: packages.NeedName | packages.NeedSyntax | packages.NeedTypes | packages.NeedTypesInfo, Dir: ".."}
	pkgs, err := packages.Load(cfg, "./extproc")
	require.NoError(t, err)
	require.Len(t, pkgs, 1)
	require.Empty(t, pkgs[0].Errors)
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
	if n.Obj().Pkg().Name() == "extproc" {
		return n.Obj().Name()
	}
	return n.Obj().Pkg().Name() + "." + n.Obj().Name()
}
