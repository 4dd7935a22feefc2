package stacktest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/store"
	"vmflow/internal/crashpoint"
)

// ModuleRoot walks up from the working directory (go test runs in the
// package's folder) to the go.mod of module vmflow.
func ModuleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("module root: %w", err)
	}
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && strings.HasPrefix(string(b), "module vmflow\n") {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("module root: no go.mod of module vmflow above the working directory")
		}
		dir = parent
	}
}

// BuildBinaries builds vmflow-worker and vmflow-hostagent from this checkout
// into dir (never stale bin/ files), with the crash points compiled in
// (crashpoint.BuildTag, never in production), and returns their paths.
func BuildBinaries(ctx context.Context, dir string) (worker, agent string, err error) {
	if err := GoBuild(ctx, "-tags", crashpoint.BuildTag, "-o", dir+"/", "./worker", "./hostagent"); err != nil {
		return "", "", err
	}
	return filepath.Join(dir, "worker"), filepath.Join(dir, "hostagent"), nil
}

// Stamp is the version and revision a build says it is.
type Stamp struct{ Version, Revision string }

// Build builds package pkg of this checkout into out; with a stamp, with `make
// build`'s -ldflags from `make print-ldflags`, so they live in the Makefile alone.
func Build(ctx context.Context, out, pkg string, stamp *Stamp) error {
	args := []string{"-o", out}
	if stamp != nil {
		root, err := ModuleRoot()
		if err != nil {
			return err
		}
		b, err := exec.CommandContext(ctx, "make", "-s", "-C", root, "print-ldflags",
			"VERSION="+stamp.Version, "REVISION="+stamp.Revision).CombinedOutput()
		if err != nil {
			return fmt.Errorf("make print-ldflags: %w\n%s", err, b)
		}
		args = append(args, "-ldflags", strings.TrimSpace(string(b)))
	}
	return GoBuild(ctx, append(args, pkg)...)
}

// BuildCommand builds package pkg with ldflags into a short folder every uid
// may enter (a launch runs it as its own uid) and returns the binary's path.
func BuildCommand(tb testing.TB, pkg, ldflags string) string {
	tb.Helper()
	bin := filepath.Join(proctest.ShortDir(tb, "cmd"), filepath.Base(pkg))
	if err := os.Chmod(filepath.Dir(bin), 0o755); err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := GoBuild(ctx, "-o", bin, "-ldflags", ldflags, pkg); err != nil {
		tb.Fatal(err)
	}
	return bin
}

// GoBuild runs go build with args in the module root.
func GoBuild(ctx context.Context, args ...string) error {
	root, err := ModuleRoot()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, "go", append([]string{"build"}, args...)...)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	return nil
}

// HoldersIgnoreInit passes --holders-ignore-pid 1 only where PID 1's open
// files cannot be read even by root (proctest.UninspectableInit).
func HoldersIgnoreInit() []string {
	var args []string
	for _, pid := range proctest.UninspectableInit() {
		args = append(args, "--holders-ignore-pid", strconv.Itoa(pid))
	}
	return args
}

// agentUIDs counts the agents this test process started.
var agentUIDs atomic.Uint32

// QEMUUIDRange is one agent's own --qemu-uid-range, disjoint from every other
// agent of any test process (keyed by pid) and the vmm and supervise tests':
// a process in it is that agent's QEMU or wrapper. 1,000 uids: bench-fleet's 200 VMs.
func QEMUUIDRange() store.UIDRange {
	first := 1_000_000_000 + uint32(os.Getpid()%1_000)*100_000 + (agentUIDs.Add(1)%100)*1_000
	return store.UIDRange{First: first, Last: first + 999}
}
