// Package vmmtest holds the skip helpers and small fixtures tests that run
// real QEMU share. CI installs QEMU, so nothing is skipped there but the
// few checks of KVM itself on a machine without it (or with
// VMFLOW_TEST_ACCEL=tcg).
package vmmtest

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/vmm"
)

// RequiresQEMU skips tb when qemu-system-x86_64 is not installed and
// returns its path otherwise.
func RequiresQEMU(tb testing.TB) string {
	tb.Helper()
	return proctest.RequiresBinary(tb, vmm.DefaultBinary, "make qemu installs it")
}

// Accel is the accelerator of every test running QEMU (proctest.Accel): KVM
// where a confined QEMU can open /dev/kvm, else TCG, or VMFLOW_TEST_ACCEL's.
func Accel() vmm.Accel { return vmm.Accel(proctest.Accel(vmm.CheckKVM("").Err)) }

// QEMUDeadline scales d, a deadline for a wait on QEMU, to Accel: longer
// under TCG.
func QEMUDeadline(d time.Duration) time.Duration {
	return proctest.ScaleDeadline(string(Accel()), d)
}

// RequiresKVM skips tb unless the tests run under KVM: for the checks of
// KVM itself (its kernel threads, the /dev/kvm group rule).
func RequiresKVM(tb testing.TB) {
	tb.Helper()
	proctest.RequiresKVM(tb, vmm.CheckKVM("").Err)
}

var confineUIDs atomic.Uint32

// Confine is a test launch's Confinement: a uid outside every agent's default
// range and other test processes' (3.1e9 + 1000 per pid) and /dev/kvm; a
// stand-in script must be readable by that uid (WorldReadable).
func Confine() vmm.Confinement {
	uid := 3_100_000_000 + uint32(os.Getpid()%100_000)*1_000 + confineUIDs.Add(1)%1_000
	return vmm.Confinement{UID: uid, KVM: vmm.CheckKVM("")}
}

// WorldReadable makes dir searchable by every uid (0755): a QEMU exec'd as
// a uid of its own must reach the stand-in scripts and firmware in it.
func WorldReadable(tb testing.TB, dir string) {
	tb.Helper()
	if err := os.Chmod(dir, 0o755); err != nil {
		tb.Fatal(err)
	}
}

// RequiresQEMUImg skips tb when qemu-img (Debian's qemu-utils, which
// `make qemu` installs) is missing, and returns its path otherwise.
func RequiresQEMUImg(tb testing.TB) string {
	tb.Helper()
	return proctest.RequiresBinary(tb, vmm.DefaultQEMUImg, "make qemu installs qemu-utils")
}

// OpenFile is one file descriptor a process holds.
type OpenFile struct {
	FD     int
	Target string // the /proc/<pid>/fd/<fd> link: a path, or "pipe:[...]" and the like
	Flags  int    // the open flags from /proc/<pid>/fdinfo/<fd> (O_ACCMODE etc.)
}

// OpenFiles lists the file descriptors of process pid.
func OpenFiles(tb testing.TB, pid int) []OpenFile {
	tb.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	entries, err := os.ReadDir(dir)
	if err != nil {
		tb.Fatalf("list %s: %v", dir, err)
	}
	var out []OpenFile
	for _, e := range entries {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		target, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil {
			continue // closed meanwhile
		}
		info, err := os.ReadFile(fmt.Sprintf("/proc/%d/fdinfo/%d", pid, fd))
		if err != nil {
			continue
		}
		of := OpenFile{FD: fd, Target: target, Flags: -1}
		for _, line := range strings.Split(string(info), "\n") {
			if v, ok := strings.CutPrefix(line, "flags:"); ok {
				// fdinfo prints the flags in octal.
				if n, err := strconv.ParseInt(strings.TrimSpace(v), 8, 64); err == nil {
					of.Flags = int(n)
				}
			}
		}
		out = append(out, of)
	}
	return out
}

// Cmdline is process pid's argv as one string, arguments separated by
// spaces.
func Cmdline(tb testing.TB, pid int) string {
	tb.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		tb.Fatalf("read cmdline of %d: %v", pid, err)
	}
	return strings.ReplaceAll(strings.TrimRight(string(b), "\x00"), "\x00", " ")
}

// floodCode is real-mode x86 at the reset vector: write 'A' to COM1's
// transmit register (port 0x3f8) for ever. No firmware, no kernel, no disk:
// under TCG it writes the serial port as fast as QEMU lets it (~1 MB/s here),
// the guest that fills a host's disk through an unbounded log.
//
//	mov dx, 0x3f8 ; mov al, 'A' ; l: out dx, al ; jmp l
var floodCode = []byte{0xBA, 0xF8, 0x03, 0xB0, 0x41, 0xEE, 0xEB, 0xFD}

// SerialFlood returns a QEMU wrapper and spec whose guest firmware writes its
// serial port without end, world-readable for a QEMU of another uid.
func SerialFlood(tb testing.TB, name string) (binary string, spec vmm.VMSpec) {
	tb.Helper()
	qemu := RequiresQEMU(tb)
	d := proctest.ShortDir(tb, "fl")
	if err := os.Chmod(d, 0o755); err != nil {
		tb.Fatal(err)
	}
	bios := make([]byte, 64<<10) // mapped below 1 MiB and 4 GiB; the CPU starts 16 bytes below the top
	for i := range bios {
		bios[i] = 0xF4 // hlt
	}
	copy(bios[len(bios)-16:], floodCode)
	biosPath := filepath.Join(d, "flood.bin")
	binary = filepath.Join(d, "qemu-flood")
	if err := os.WriteFile(biosPath, bios, 0o644); err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(binary, []byte("#!/bin/sh\nexec "+qemu+" -bios "+biosPath+" \"$@\"\n"), 0o755); err != nil {
		tb.Fatal(err)
	}
	return binary, vmm.VMSpec{Name: name, VCPUs: 1, MemoryMiB: 64, Machine: vmm.MachineQ35, Accel: vmm.AccelTCG, SerialToLog: true}
}

// FloodStall bounds a wait on a flooding guest's output by its progress, not
// its total: under TCG the guest's rate follows the machine's load (6 MiB
// took 49 s on an idle 2-core machine without KVM, 78 s with other tests
// running), so a wait fails only when no new output came for Stall, or
// after Cap.
type FloodStall struct {
	Stall, Cap time.Duration

	begin, since time.Time
	last         int64
}

// DefaultFloodStall is the bound the guest-log tests use.
func DefaultFloodStall() *FloodStall {
	return &FloodStall{Stall: 30 * time.Second, Cap: 10 * time.Minute}
}

// Check takes the output seen so far and returns an error once it has not
// grown for Stall, or the wait has lasted Cap.
func (s *FloodStall) Check(progress int64) error {
	now := time.Now()
	if s.begin.IsZero() {
		s.begin = now
	}
	if s.since.IsZero() || progress > s.last {
		s.since, s.last = now, progress
	}
	switch {
	case now.Sub(s.since) > s.Stall:
		return fmt.Errorf("no new guest output for %s (%d bytes in %s)", s.Stall, progress, now.Sub(s.begin).Round(time.Second))
	case now.Sub(s.begin) > s.Cap:
		return fmt.Errorf("%d bytes of guest output in %s", progress, s.Cap)
	}
	return nil
}
