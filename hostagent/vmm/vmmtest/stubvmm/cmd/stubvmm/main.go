// Command stubvmm is the stub VMM (package stubvmm): a one-thread stand-in
// for QEMU, for tests and benchmarks of the control plane. Linked with
// stubvmm.EntryLdflags (stacktest.BuildStubVMM), the process starts at
// stubvmm.Entry and main never runs; linked without, main refuses.
package main

import (
	"os"

	"vmflow/hostagent/vmm/vmmtest/stubvmm"
)

func main() { os.Exit(stubvmm.Unlinked()) }
