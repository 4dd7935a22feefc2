package store_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The record's lifecycle has one home, this package (lifecycle.go): no
// production code outside it writes a field of an instance record or of a
// lease. A request's desired configuration (id, spec, restart settings,
// creator) is what a caller may put in the record it asks Create for.
const recordPkg = "vmflow/proto/vmflow/v1"

var desiredFields = map[string]bool{
	"Id": true, "Spec": true, "RestartPolicy": true, "RestartMaxAttempts": true, "RestartStableAfterSeconds": true,
	"CreatedByWorkflowId": true, "CreatedByRunId": true,
}

// ownedTypes are the messages whose fields only this package writes.
var ownedTypes = map[string]bool{"InstanceRecord": true, "Lease": true}

// TestNoRecordFieldSetOutsideStore walks every non-test package of the
// module but this one and the generated proto code, type-checked, for an
// assignment to a field of an InstanceRecord or a Lease (x.State = ...,
// x.Leases = append(...), x.RestartCount++), for a composite literal of
// one that sets more than the desired configuration, and for a read of the
// record's old shape (gpu_claim), which only the migration reads. Tests
// and the test-support tree are exempt: they forge records on purpose.
func TestNoRecordFieldSetOutsideStore(t *testing.T) {
	if testing.Short() {
		t.Skip("type-checks the module")
	}
	pkgs := listModule(t)
	checked := 0
	var found []string
	for _, p := range pkgs {
		if p.Module == nil || p.Module.Path != "vmflow" || p.ImportPath == "vmflow/hostagent/store" ||
			strings.HasPrefix(p.ImportPath, "vmflow/proto/") || strings.HasPrefix(p.ImportPath, "vmflow/testsupport/") || len(p.GoFiles) == 0 {
			continue
		}
		var files []string
		for _, f := range p.GoFiles {
			files = append(files, filepath.Join(p.Dir, f))
		}
		got, err := ownedWrites(p.ImportPath, files, pkgs)
		require.NoError(t, err, p.ImportPath)
		found = append(found, got...)
		checked++
	}
	require.Greater(t, checked, 20, "the module's packages were checked")
	assert.Empty(t, found, "record fields the lifecycle owns, set outside hostagent/store: apply a named step (store.Locked.Apply) instead")
}

// TestOwnedWritesFindsAssignments proves the walk: a file that sets record
// and lease fields by hand is reported, line by line.
func TestOwnedWritesFindsAssignments(t *testing.T) {
	if testing.Short() {
		t.Skip("type-checks the module")
	}
	pkgs := listModule(t)
	found, err := ownedWrites("example/bad", []string{filepath.Join("testdata", "ownedfields", "bad.go.txt")}, pkgs)
	require.NoError(t, err)
	joined := strings.Join(found, "\n")
	for _, want := range []string{"InstanceRecord.State", "InstanceRecord.RestartCount", "Lease.Phase", "InstanceRecord.Leases",
		"literal InstanceRecord.LastError", "old shape read InstanceRecord.GetGpuClaim"} {
		assert.Contains(t, joined, want)
	}
	assert.NotContains(t, joined, "Spec", "the desired configuration is the caller's")
	assert.Len(t, found, 6, joined)
}

type listedPkg struct {
	ImportPath string
	Dir        string
	GoFiles    []string
	Export     string
	Module     *struct{ Path string }
}

// listModule lists the module's packages and their dependencies with
// their export data (go list -export builds what the cache lacks).
func listModule(t *testing.T) map[string]listedPkg {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "list", "-export", "-deps", "-json=ImportPath,Dir,GoFiles,Export,Module", "vmflow/...")
	out, err := cmd.Output()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		t.Fatalf("go list: %v\n%s", err, ee.Stderr)
	}
	require.NoError(t, err)
	pkgs := map[string]listedPkg{}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for dec.More() {
		var p listedPkg
		require.NoError(t, dec.Decode(&p))
		pkgs[p.ImportPath] = p
	}
	return pkgs
}

// ownedWrites type-checks files as package path (imports from export
// data) and returns every write of an owned field they hold.
func ownedWrites(path string, files []string, pkgs map[string]listedPkg) ([]string, error) {
	fset := token.NewFileSet()
	var parsed []*ast.File
	for _, f := range files {
		af, err := parser.ParseFile(fset, f, nil, 0)
		if err != nil {
			return nil, err
		}
		parsed = append(parsed, af)
	}
	imp := importer.ForCompiler(fset, "gc", func(p string) (io.ReadCloser, error) {
		lp, ok := pkgs[p]
		if !ok || lp.Export == "" {
			return nil, fmt.Errorf("no export data for %s", p)
		}
		return os.Open(lp.Export)
	})
	info := &types.Info{Selections: map[*ast.SelectorExpr]*types.Selection{}, Types: map[ast.Expr]types.TypeAndValue{}}
	conf := types.Config{Importer: imp}
	if _, err := conf.Check(path, fset, parsed, info); err != nil {
		return nil, err
	}
	var found []string
	report := func(n ast.Node, what string) {
		found = append(found, fmt.Sprintf("%s: %s", fset.Position(n.Pos()), what))
	}
	owned := func(e ast.Expr) (string, bool) {
		sel, ok := ast.Unparen(e).(*ast.SelectorExpr)
		if !ok {
			return "", false
		}
		s, ok := info.Selections[sel]
		if !ok || s.Kind() != types.FieldVal {
			return "", false
		}
		name, ok := ownedType(s.Recv())
		return name + "." + sel.Sel.Name, ok
	}
	for _, af := range parsed {
		ast.Inspect(af, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.SelectorExpr:
				// The old shape is the migration's to read (lease.go).
				if s, ok := info.Selections[n]; ok && (n.Sel.Name == "GpuClaim" || n.Sel.Name == "GetGpuClaim") {
					if name, ok := ownedType(s.Recv()); ok {
						report(n, "old shape read "+name+"."+n.Sel.Name)
					}
				}
			case *ast.AssignStmt:
				for _, lhs := range n.Lhs {
					if f, ok := owned(lhs); ok {
						report(lhs, f)
					}
				}
			case *ast.IncDecStmt:
				if f, ok := owned(n.X); ok {
					report(n.X, f)
				}
			case *ast.CompositeLit:
				name, ok := ownedType(info.Types[n].Type)
				if !ok {
					return true
				}
				for _, el := range n.Elts {
					kv, ok := el.(*ast.KeyValueExpr)
					if !ok {
						continue
					}
					key, _ := kv.Key.(*ast.Ident)
					if key != nil && (name != "InstanceRecord" || !desiredFields[key.Name]) {
						report(kv, "literal "+name+"."+key.Name)
					}
				}
			}
			return true
		})
	}
	return found, nil
}

// ownedType is the name of t's message when it is (a pointer to) one of
// ownedTypes.
func ownedType(t types.Type) (string, bool) {
	if t == nil {
		return "", false
	}
	if p, ok := t.(*types.Pointer); ok {
		t = p.Elem()
	}
	n, ok := t.(*types.Named)
	if !ok || n.Obj().Pkg() == nil || n.Obj().Pkg().Path() != recordPkg {
		return "", false
	}
	return n.Obj().Name(), ownedTypes[n.Obj().Name()]
}
