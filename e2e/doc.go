// Package e2e holds vmflow's end-to-end tests: a real Temporal dev server
// (testsupport/devserver), the real vmflow-worker and vmflow-hostagent binaries
// as subprocesses, real QEMU (the small Debian guest under TCG, or
// -machine none under KVM), the FUSE vGPU simulator and, for the Web UI,
// Debian's Chromium driven by chromedp. Each test asserts on the host (QEMU
// processes, instance records, vGPU claims and devices) as well as on the
// workflow.
//
// The package has no non-test code; this file exists for the package
// comment. Prerequisites come from the Makefile: `make tools` (Temporal CLI,
// QEMU, Chromium) and `make guest` (the guest kernel and initrd). A test skips
// only when one of them is missing and says which target builds it.
package e2e
