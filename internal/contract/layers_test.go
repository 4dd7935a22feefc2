package contract

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// layers are the module's packages from top to bottom. A package's own
// (non-test) files import only packages of its layer or of layers below:
// tests sit above everything, so a _test file may import anything, and
// nothing a binary links reaches back up to what drives it. The binaries
// (every package main) form their own layer, matched by name.
var layers = []struct {
	name     string
	prefixes []string
}{
	{"test drivers", []string{"vmflow/e2e", "vmflow/bench", "vmflow/deploy"}},
	{"test support", []string{"vmflow/testsupport"}},
	{"binaries", nil},
	{"daemons", []string{"vmflow/daemon"}},
	{"activities", []string{"vmflow/activities"}},
	{"workflows and the platform client", []string{"vmflow/workflows", "vmflow/platform"}},
	{"host", []string{"vmflow/hostagent", "vmflow/guest"}},
	{"shared", []string{"vmflow/internal", "vmflow/proto"}},
}

// layerOf is p's index in layers, or -1 for a package outside the module.
func layerOf(p listed) int {
	if !strings.HasPrefix(p.ImportPath, "vmflow/") {
		return -1
	}
	if p.Name == "main" {
		return 2
	}
	for i, l := range layers {
		for _, pre := range l.prefixes {
			if p.ImportPath == pre || strings.HasPrefix(p.ImportPath, pre+"/") {
				return i
			}
		}
	}
	return -2
}

// listed is what go list -json says of a package.
type listed struct {
	ImportPath     string
	Name           string
	Dir            string
	GoFiles        []string
	CgoFiles       []string
	TestGoFiles    []string
	IgnoredGoFiles []string
	Imports        []string
}

// TestLayers: no package imports one of a layer above its own.
func TestLayers(t *testing.T) {
	pkgs := goListPackages(t, "vmflow/...")
	byPath := map[string]listed{}
	for _, p := range pkgs {
		byPath[p.ImportPath] = p
	}
	for _, p := range pkgs {
		own := layerOf(p)
		if !assert.GreaterOrEqual(t, own, 0, "%s lies in no layer: add it to layers", p.ImportPath) {
			continue
		}
		for _, imp := range p.Imports {
			q, ok := byPath[imp]
			if !ok {
				continue // outside the module
			}
			assert.GreaterOrEqual(t, layerOf(q), own, "%s (%s) imports %s (%s), a layer above it",
				p.ImportPath, layers[own].name, imp, layers[max(layerOf(q), 0)].name)
		}
	}
}

// isTestSupport: the test-support tree, and the fixtures beside the
// package they fake (proctest, vmmtest, tclienttest: go-qemu's qmptest).
func isTestSupport(path string) bool {
	return path == "vmflow/testsupport" || strings.HasPrefix(path, "vmflow/testsupport/") ||
		strings.HasSuffix(filepath.Base(path), "test")
}

// TestTestSupportOnlyInTests: test support is imported by tests, by other
// test support and by the test drivers (e2e, bench, deploy) only; no
// binary or library links it.
func TestTestSupportOnlyInTests(t *testing.T) {
	pkgs := goListPackages(t, "vmflow/...")
	var checked int
	for _, p := range pkgs {
		if isTestSupport(p.ImportPath) || layerOf(p) == 0 {
			continue
		}
		checked++
		for _, imp := range p.Imports {
			assert.False(t, isTestSupport(imp), "%s imports the test support %s outside its tests", p.ImportPath, imp)
		}
	}
	require.Greater(t, checked, 20, "the module's packages were listed")
}

// TestMainIsWiring: a package main holds main.go and nothing else, tests
// included: what a command does lives in a package that can be imported and
// tested.
func TestMainIsWiring(t *testing.T) {
	var mains int
	for _, p := range goListPackages(t, "vmflow/...") {
		if p.Name != "main" {
			continue
		}
		mains++
		for _, files := range [][]string{p.GoFiles, p.CgoFiles, p.TestGoFiles, p.IgnoredGoFiles} {
			for _, f := range files {
				assert.Equal(t, "main.go", f, "%s: package main holds %s: move it to a package", p.ImportPath, f)
			}
		}
	}
	require.GreaterOrEqual(t, mains, 5, "the module's commands were listed")
}

// goListPackages lists the packages matching pattern (without tests).
func goListPackages(t *testing.T, pattern string) []listed {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "go", "list", "-json", pattern).Output()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		t.Fatalf("go list -json %s: %v\n%s", pattern, err, ee.Stderr)
	}
	require.NoError(t, err)
	var pkgs []listed
	dec := json.NewDecoder(bytes.NewReader(out))
	for dec.More() {
		var p listed
		require.NoError(t, dec.Decode(&p))
		pkgs = append(pkgs, p)
	}
	return pkgs
}
