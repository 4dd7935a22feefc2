package contract

import (
	"context"
	"errors"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestImportRules guards the line this package exists for: nothing under
// hostagent/ imports go.temporal.io, directly or through another package,
// except the agent binary's main.go (package vmflow/hostagent), which wires
// daemon/agent; and workflows/ imports nothing under hostagent/. Host
// supervision must build, test and run without Temporal, and workflow code
// must never touch the OS.
//
// The hostagent packages are checked with their tests. The workflows
// package is checked without them: its dev-server tests reach hostagent's
// proc and store through testsupport/devserver, which is test tooling.
func TestImportRules(t *testing.T) {
	deps := goListDeps(t, true, "vmflow/hostagent/...")
	var checked int
	for pkg, ds := range deps {
		if isAgentWiring(pkg) {
			continue
		}
		checked++
		assert.Empty(t, matching(ds, "go.temporal.io/"), "%s: packages under hostagent/ must not reach go.temporal.io", pkg)
	}
	require.Greater(t, checked, 10, "the hostagent packages and their tests were listed")

	deps = goListDeps(t, false, "vmflow/workflows/...")
	require.Contains(t, deps, "vmflow/workflows")
	for pkg, ds := range deps {
		assert.Empty(t, matching(ds, "vmflow/hostagent"), "%s: workflows/ must not import hostagent/", pkg)
	}
}

// matching returns the packages of deps that are prefix or lie below it.
func matching(deps []string, prefix string) []string {
	var out []string
	for _, d := range deps {
		if d == strings.TrimSuffix(prefix, "/") || strings.HasPrefix(d, strings.TrimSuffix(prefix, "/")+"/") {
			out = append(out, d)
		}
	}
	return out
}

// isAgentWiring reports whether pkg, as go list -test names it, is the
// agent binary's package or one of its test variants ("vmflow/hostagent",
// "vmflow/hostagent [vmflow/hostagent.test]", "vmflow/hostagent.test").
func isAgentWiring(pkg string) bool {
	name, _, _ := strings.Cut(pkg, " ")
	return name == "vmflow/hostagent" || name == "vmflow/hostagent.test"
}

// goListDeps maps each package matching pattern (with its test variants
// when tests is set) to every package it depends on, transitively.
func goListDeps(t *testing.T, tests bool, pattern string) map[string][]string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	args := []string{"list"}
	if tests {
		args = append(args, "-test")
	}
	args = append(args, "-f", "{{.ImportPath}}\t{{join .Deps \" \"}}", pattern)
	cmd := exec.CommandContext(ctx, "go", args...)
	out, err := cmd.Output()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, ee.Stderr)
	}
	require.NoError(t, err)
	deps := map[string][]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		pkg, ds, ok := strings.Cut(line, "\t")
		require.True(t, ok, "go list line %q", line)
		deps[pkg] = strings.Fields(ds)
	}
	return deps
}
