package errdefs

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// hostRoot is the tree whose sentinels must all be classified.
const hostRoot = "../../hostagent"

// TestEverySentinelClassified walks every package under hostagent/ and
// fails for an exported Err* variable that is not declared as a class's
// New or as a Context: a sentinel nobody classified would reach the
// activity edge as a retryable HostError, whatever it means.
func TestEverySentinelClassified(t *testing.T) {
	var checked int
	err := filepath.WalkDir(hostRoot, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && d.Name() == "testdata" {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		for _, s := range sentinels(t, path) {
			checked++
			assert.True(t, s.classified, "%s: %s is not declared as errdefs.<Class>.New(...) or errdefs.Context(...)", s.pos, s.name)
		}
		return nil
	})
	require.NoError(t, err)
	require.Greater(t, checked, 40, "the walk found the host's sentinels")
}

type sentinelDecl struct {
	name       string
	pos        token.Position
	classified bool
}

// sentinels lists the exported Err* package variables of the file at path.
func sentinels(t *testing.T, path string) []sentinelDecl {
	t.Helper()
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
	require.NoError(t, err)
	local := ""
	for _, imp := range f.Imports {
		if p, _ := strconv.Unquote(imp.Path.Value); p == "vmflow/internal/errdefs" {
			local = "errdefs"
			if imp.Name != nil {
				local = imp.Name.Name
			}
		}
	}
	var out []sentinelDecl
	for _, decl := range f.Decls {
		gd, ok := decl.(*ast.GenDecl)
		if !ok || gd.Tok != token.VAR {
			continue
		}
		for _, spec := range gd.Specs {
			vs := spec.(*ast.ValueSpec)
			for i, name := range vs.Names {
				if !isSentinelName(name.Name) {
					continue
				}
				var value ast.Expr
				if i < len(vs.Values) {
					value = vs.Values[i]
				}
				out = append(out, sentinelDecl{name: name.Name, pos: fset.Position(name.Pos()), classified: isAlias(value) || (local != "" && isClassified(value, local))})
			}
		}
	}
	return out
}

func isSentinelName(name string) bool {
	rest, ok := strings.CutPrefix(name, "Err")
	return ok && rest != "" && strings.ToUpper(rest[:1]) == rest[:1]
}

// isAlias reports whether e names another package's sentinel
// (network.ErrVMAlive = lease.ErrVMAlive): one value, classified where it
// is declared, which this walk checks too when it is under hostagent/.
func isAlias(e ast.Expr) bool {
	sel, ok := e.(*ast.SelectorExpr)
	if !ok {
		return false
	}
	_, pkg := sel.X.(*ast.Ident)
	return pkg && isSentinelName(sel.Sel.Name)
}

// isClassified reports whether e is errdefs.<Class>.New(...) or
// errdefs.Context(...), errdefs imported as local.
func isClassified(e ast.Expr, local string) bool {
	call, ok := e.(*ast.CallExpr)
	if !ok {
		return false
	}
	sel, ok := call.Fun.(*ast.SelectorExpr)
	if !ok {
		return false
	}
	if pkg, ok := sel.X.(*ast.Ident); ok {
		return pkg.Name == local && sel.Sel.Name == "Context"
	}
	class, ok := sel.X.(*ast.SelectorExpr)
	if !ok || sel.Sel.Name != "New" {
		return false
	}
	pkg, ok := class.X.(*ast.Ident)
	return ok && pkg.Name == local
}
