// Package vmmtest holds the skip helpers and small fixtures tests that run
// real QEMU share. CI installs QEMU and has /dev/kvm, so nothing is skipped
// there.
package vmmtest

import (
	"os"
	"os/exec"
	"testing"

	"vmflow/hostagent/vmm"
)

// RequiresQEMU skips tb when qemu-system-x86_64 is not installed and
// returns its path otherwise.
func RequiresQEMU(tb testing.TB) string {
	tb.Helper()
	p, err := exec.LookPath(vmm.DefaultBinary)
	if err != nil {
		tb.Skipf("needs %s (make qemu installs it): %v", vmm.DefaultBinary, err)
	}
	return p
}

// Accel is KVM where /dev/kvm opens (and its group can open it: QEMU runs
// as a uid of its own with that group), TCG otherwise: -machine none runs
// the same either way, only faster under KVM.
func Accel() vmm.Accel {
	if vmm.CheckKVM("").Err != nil {
		return vmm.AccelTCG
	}
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return vmm.AccelTCG
	}
	f.Close()
	return vmm.AccelKVM
}

// RequiresKVM skips tb when /dev/kvm cannot be opened.
func RequiresKVM(tb testing.TB) {
	tb.Helper()
	if Accel() != vmm.AccelKVM {
		tb.Skip("needs a usable /dev/kvm")
	}
}

// ShortDir is a fresh directory under /tmp, removed after the test: a unix
// socket path (the QMP socket inside it) holds at most 107 bytes, which
// t.TempDir's long names can exceed.
func ShortDir(tb testing.TB, prefix string) string {
	tb.Helper()
	d, err := os.MkdirTemp("/tmp", prefix)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(d) })
	return d
}
