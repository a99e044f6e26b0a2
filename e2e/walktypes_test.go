package e2e_test

import (
	"go/ast"
	"go/types"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/tools/go/packages"
)

// walkTypes names the product types the walk passes: those of the values the code of fns that
// ran (the blocks ran) computes, holds or converts to, and those of fns' receivers, parameters
// and results. A type is named as the walk names it (Type in package extproc, pkg.Type
// elsewhere); pointers, slices, arrays, maps and channels count as the types they hold, and a
// generic type's instances as the generic type.
func walkTypes(t *testing.T, fns []string, ran []block) []string {
	t.Helper()
	pkgs := loadTyped(t, "./cmd/...", "./extproc/...", "./internal/...")
	root, err := filepath.Abs("..")
	require.NoError(t, err)
	want := map[string]bool{}
	for _, f := range fns {
		want[f] = true
	}
	found, seen := map[string]bool{}, map[string]bool{}
	var add func(types.Type)
	add = func(typ types.Type) {
		switch u := typ.(type) {
		case *types.Pointer:
			add(u.Elem())
		case *types.Slice:
			add(u.Elem())
		case *types.Array:
			add(u.Elem())
		case *types.Map:
			add(u.Key())
			add(u.Elem())
		case *types.Chan:
			add(u.Elem())
		case *types.Alias:
			add(types.Unalias(u))
		case *types.Named:
			o := u.Origin().Obj()
			if o.Pkg() == nil || !strings.HasPrefix(o.Pkg().Path()+"/", module) {
				return
			}
			seen[walkPrefix(o.Pkg().Name())+o.Name()] = true
		}
	}
	for _, p := range pkgs {
		for _, f := range p.Syntax {
			file, err := filepath.Rel(root, p.Fset.Position(f.Pos()).Filename)
			require.NoError(t, err)
			var blocks []block
			for _, b := range ran {
				if b.file == filepath.ToSlash(file) {
					blocks = append(blocks, b)
				}
			}
			inRan := func(n ast.Node) bool {
				from, to := p.Fset.Position(n.Pos()), p.Fset.Position(n.End())
				return slices.ContainsFunc(blocks, func(b block) bool {
					return !b.from.after(lineCol{from.Line, from.Column}) && !(lineCol{to.Line, to.Column}).after(b.to)
				})
			}
			for _, d := range f.Decls {
				fd, ok := d.(*ast.FuncDecl)
				if !ok || !want[funcName(p.Name, fd)] {
					continue
				}
				found[funcName(p.Name, fd)] = true
				sig := p.TypesInfo.Defs[fd.Name].Type().(*types.Signature)
				if sig.Recv() != nil {
					add(sig.Recv().Type())
				}
				for _, vs := range []*types.Tuple{sig.Params(), sig.Results()} {
					for v := range vs.Variables() {
						add(v.Type())
					}
				}
				var inspect func(ast.Node) bool
				inspect = func(n ast.Node) bool {
					if l, ok := n.(*ast.FuncLit); ok {
						// A closure's parameters are values only if it runs, which its
						// body's own blocks tell.
						ast.Inspect(l.Body, inspect)
						return false
					}
					e, ok := n.(ast.Expr)
					if !ok || !inRan(e) {
						return true
					}
					if tv, ok := p.TypesInfo.Types[e]; ok && tv.Type != nil {
						add(tv.Type)
					}
					if id, ok := e.(*ast.Ident); ok {
						if o := p.TypesInfo.ObjectOf(id); o != nil && o.Type() != nil && !isPackage(o) {
							add(o.Type())
						}
					}
					return true
				}
				ast.Inspect(fd.Body, inspect)
			}
		}
	}
	for _, f := range fns {
		require.True(t, found[f], "the walk's %s is declared in the product's packages", f)
	}
	out := make([]string, 0, len(seen))
	for n := range seen {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

func isPackage(o types.Object) bool {
	_, ok := o.(*types.PkgName)
	return ok
}

// funcName names fd, declared in package pkg, as the walk does (as enclosingFunc does).
func funcName(pkg string, fd *ast.FuncDecl) string {
	prefix := walkPrefix(pkg)
	if fd.Recv == nil {
		return prefix + fd.Name.Name
	}
	recv := fd.Recv.List[0].Type
	if s, ok := recv.(*ast.StarExpr); ok {
		recv = s.X
	}
	if g, ok := recv.(*ast.IndexExpr); ok {
		recv = g.X
	}
	return prefix + recv.(*ast.Ident).Name + "." + fd.Name.Name
}

// walkPrefix is what the walk writes before a name declared in package pkg: nothing in extproc,
// the package's name and a dot elsewhere.
func walkPrefix(pkg string) string {
	if pkg == "extproc" {
		return ""
	}
	return pkg + "."
}

// loadTyped loads the module's packages that patterns name, with their syntax and types, built as
// the image builds them (-tags vtprotobuf), and fails t when one does not load.
func loadTyped(t *testing.T, patterns ...string) []*packages.Package {
	t.Helper()
	cfg := &packages.Config{BuildFlags: []string{"-tags=vtprotobuf"}, Mode: packages.NeedName | packages.NeedSyntax | packages.NeedTypes | packages.NeedTypesInfo, Dir: ".."}
	pkgs, err := packages.Load(cfg, patterns...)
	require.NoError(t, err)
	for _, p := range pkgs {
		require.Empty(t, p.Errors, "%s loads", p.PkgPath)
	}
	return pkgs
}
