// Package codeshape_test holds the product's code to the shape a reader can hold in one pass:
// functions a screen long, internal/check exporting what its callers use, and the stream carrying
// few values. Each limit is counted here the way a reviewer counts it, from the source.
package codeshape_test

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// root is the repository, from this directory.
const root = "../.."

// parseDir parses the non-test Go files of one directory.
func parseDir(t *testing.T, fset *token.FileSet, dir string) []*ast.File {
	t.Helper()
	paths, err := filepath.Glob(filepath.Join(root, dir, "*.go"))
	require.NoError(t, err)
	var files []*ast.File
	for _, p := range paths {
		if strings.HasSuffix(p, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, p, nil, 0)
		require.NoError(t, err)
		files = append(files, f)
	}
	require.NotEmpty(t, files, "no Go files in %s", dir)
	return files
}

// The product's code: every package under these directories, tests excluded.
var productDirs = []string{"extproc", "cache", "cmd", "internal/check"}

// Functions are at most a screen long: at most three over 60 lines, none over 100. A long table
// is a package-level value, not a function.
func TestFunctionsAreAScreenLong(t *testing.T) {
	type fn struct {
		name  string
		lines int
	}
	var long []fn
	fset := token.NewFileSet()
	for _, top := range productDirs {
		err := filepath.WalkDir(filepath.Join(root, top), func(p string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
				return err
			}
			f, err := parser.ParseFile(fset, p, nil, 0)
			if err != nil {
				return err
			}
			for _, d := range f.Decls {
				fd, ok := d.(*ast.FuncDecl)
				if !ok {
					continue
				}
				n := fset.Position(fd.End()).Line - fset.Position(fd.Pos()).Line + 1
				if n > 60 {
					rel, _ := filepath.Rel(root, p)
					long = append(long, fn{rel + ": " + fd.Name.Name, n})
				}
			}
			return nil
		})
		require.NoError(t, err)
	}
	sort.Slice(long, func(i, j int) bool { return long[i].lines > long[j].lines })
	var list []string
	for _, f := range long {
		list = append(list, fmt.Sprintf("%s (%d lines)", f.name, f.lines))
	}
	require.LessOrEqual(t, len(long), 3, "functions over 60 lines: %s", strings.Join(list, ", "))
	if len(long) > 0 {
		require.LessOrEqual(t, long[0].lines, 100, "a function over 100 lines: %s", list[0])
	}
}

// internal/check exports at most 25 top-level names: what its callers use.
func TestCheckExportsWhatItsCallersUse(t *testing.T) {
	var exported []string
	for _, f := range parseDir(t, token.NewFileSet(), "internal/check") {
		for _, d := range f.Decls {
			switch d := d.(type) {
			case *ast.FuncDecl:
				if d.Recv == nil && d.Name.IsExported() {
					exported = append(exported, d.Name.Name)
				}
			case *ast.GenDecl:
				for _, s := range d.Specs {
					switch s := s.(type) {
					case *ast.TypeSpec:
						if s.Name.IsExported() {
							exported = append(exported, s.Name.Name)
						}
					case *ast.ValueSpec:
						for _, n := range s.Names {
							if n.IsExported() {
								exported = append(exported, n.Name)
							}
						}
					}
				}
			}
		}
	}
	sort.Strings(exported)
	require.LessOrEqual(t, len(exported), 25, "internal/check exports %d names: %s", len(exported), strings.Join(exported, ", "))
}
