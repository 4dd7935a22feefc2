// Package stubvmm is the stub VMM, a stand-in for QEMU where only the
// control plane is measured (make bench-scale: thousands of VMs on one
// machine). The agent is given its command (cmd/stubvmm) as --qemu and launches it exactly as it launches QEMU: the
// same argv, its own uid, cgroup, rlimits, the jail's namespaces and root,
// vmflow's seccomp allowlist. It holds no guest memory and runs no guest:
//
//   - `stubvmm --version` prints a QEMU 7.2 version line (the agent logs
//     what vmm.DetectVersion parses of it);
//   - otherwise it finds the QMP listener the agent passed in
//     `-chardev socket,id=qmp,fd=N,...`, ignores the rest of its argv, and
//     serves one QMP client at a time, as QEMU does: the greeting,
//     qmp_capabilities, query-status (running), system_powerdown (it
//     powers off at once, as a guest that obeys the ACPI button) and quit
//     (it exits), an error for anything else. A client that goes away (an
//     agent killed -9) is followed by the next one (the agent restarted).
//
// One thread. This machine's pid_max is 32,768 and every thread takes a
// pid: a Go program on its runtime has at least three (measured with
// GOMAXPROCS=1: the main thread, sysmon, and the thread the main
// goroutine's lock during runtime init hands its P to), which would stop
// near 10,000 VMs with the agents, server and database beside them. So the
// binary (cmd/stubvmm) is linked with its entry point set to Entry
// (entry_amd64.s): Go's runtime is never started, and the protocol
// (qmp.go) is Go written not to need it: no allocation, no goroutine, raw
// system calls only, on buffers that are global variables.
// testsupport/stacktest.BuildStubVMM links it so (EntryLdflags); built
// without them, the command refuses to run (Unlinked).
//
// The system calls it makes (arch_prctl, rt_sigaction, fcntl, accept4,
// read, write, close, exit_group) are all in the agent's allowlist
// (hostagent/vmm/seccomp.go), and the binary is static: the jail binds it
// alone (plus QEMU's data folders, when installed). Tests and benchmarks
// only; never built into a product.
package stubvmm

import "os"

// EntryLdflags are the linker flags that make cmd/stubvmm the one-thread
// stub: the process starts at Entry, not in Go's runtime.
const EntryLdflags = "-E=vmflow/hostagent/vmm/vmmtest/stubvmm.Entry"

// Unlinked is cmd/stubvmm's main when the binary was linked without
// EntryLdflags: a Go runtime has started, so it is not the stub; it says
// so and returns the exit status.
func Unlinked() int {
	os.Stderr.WriteString("stubvmm: linked without its entry point: go build -ldflags=" + EntryLdflags + " (stacktest.BuildStubVMM)\n")
	return 2
}

// Entry is the process's entry point (entry_amd64.s): it points the FS
// register at tlsArea, so that Go code reached through its ABI wrappers
// reads fakeG as its goroutine (zero stack bounds: a stack check never
// fails) and calls bareMain with argc, argv and onSignal. Only the linker
// calls it (EntryLdflags).
func Entry()

// onSignal is the handler of SIGTERM, SIGINT and SIGHUP (entry_amd64.s):
// exit_group(0), as QEMU exits on them. Installed at all because the stub
// is PID 1 of its pid namespace in the jail, and the kernel delivers a
// signal to a namespace's init from an ancestor (the agent's SIGTERM when
// QMP cannot be reached) only when it has a handler for it.
func onSignal()

// fakeG stands in for the runtime's g for the code the entry runs: the ABI
// wrappers load it into R14 and every function's stack check compares the
// stack pointer with its stack guard, zero here.
var fakeG [32]uintptr

// tlsArea is the thread's TLS block: the FS register points one word past
// its start, and Go reads g at FS-8.
var tlsArea [4]uintptr

// The entry point and what its assembly calls are reached through the
// linker's -E and from assembly, which static analysis does not follow.
var _ = [...]any{onSignal, bareMain, &fakeG, &tlsArea}
