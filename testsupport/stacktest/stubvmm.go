package stacktest

import (
	"path/filepath"
	"testing"

	"vmflow/hostagent/vmm/vmmtest/stubvmm"
)

// StubVMMCommand is the stub VMM's command (package stubvmm): a one-thread
// stand-in for QEMU that answers --version and QMP and holds no guest, for
// tests and benchmarks of the control plane at scale.
const StubVMMCommand = "./hostagent/vmm/vmmtest/stubvmm/cmd/stubvmm"

// StubVMMComm is the stub's process name: BuildCommand names the binary
// after its package.
var StubVMMComm = filepath.Base(StubVMMCommand)

// BuildStubVMM builds the stub VMM, linked to start at its own entry point
// (stubvmm.EntryLdflags: no Go runtime, one thread), into a folder every
// uid may enter (a launch runs it as the VM's uid) and returns the
// binary's path, for an agent's --qemu.
func BuildStubVMM(tb testing.TB) string {
	tb.Helper()
	return BuildCommand(tb, StubVMMCommand, stubvmm.EntryLdflags)
}
