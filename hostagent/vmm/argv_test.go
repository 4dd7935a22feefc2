package vmm

import (
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var testPaths = Paths{QMPSocket: "/run/vm/a/qemu.sock", PIDFile: "/run/vm/a/qemu.pid", Log: "/run/vm/a/qemu.log"}

// nullFile is an open file standing in for an image: Argv only numbers it.
func nullFile(tb testing.TB) *os.File {
	tb.Helper()
	f, err := os.Open(os.DevNull)
	require.NoError(tb, err)
	tb.Cleanup(func() { f.Close() })
	return f
}

func noneSpec() VMSpec {
	return VMSpec{Name: "a", VCPUs: 1, MemoryMiB: 128, Machine: MachineNone, Accel: AccelKVM}
}

// common is the prefix every argv starts with for spec s and testPaths.
func common(s VMSpec) []string {
	return []string{
		"-name", "guest=" + s.Name,
		"-machine", string(s.Machine),
		"-accel", string(s.Accel),
		"-nodefaults", "-no-user-config", "-display", "none",
		// QMP on the agent's listener (fd 3), never a path; no pidfile;
		// always the sandbox.
		"-chardev", "socket,id=qmp,fd=3,server=on,wait=off", "-mon", "chardev=qmp,mode=control",
		"-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
	}
}

func TestArgv(t *testing.T) {
	q35 := VMSpec{Name: "web-1", VCPUs: 4, MemoryMiB: 4096, Machine: MachineQ35, Accel: AccelKVM}
	tests := []struct {
		name  string
		spec  VMSpec
		paths Paths
		want  []string // after common(spec)
	}{
		{
			name: "machine none",
			spec: noneSpec(),
			want: []string{"-m", "128", "-smp", "1"},
		},
		{
			name: "uuid lower-cased",
			spec: func() VMSpec {
				s := noneSpec()
				s.UUID = "6F1C1B0E-1C1A-4D4E-9F55-0123456789AB"
				return s
			}(),
			want: []string{"-m", "128", "-smp", "1", "-uuid", "6f1c1b0e-1c1a-4d4e-9f55-0123456789ab"},
		},
		{
			name: "q35 direct kernel boot, serial, no-reboot",
			spec: func() VMSpec {
				s := q35
				s.Accel = AccelTCG
				s.Kernel, s.Initrd, s.Cmdline = nullFile(t), nullFile(t), "console=ttyS0 panic=-1"
				s.SerialToLog, s.NoReboot = true, true
				return s
			}(),
			want: []string{"-m", "4096", "-smp", "4",
				"-kernel", "/proc/self/fd/4", "-initrd", "/proc/self/fd/5", "-append", "console=ttyS0 panic=-1",
				"-chardev", "stdio,id=serial0,signal=off", "-serial", "chardev:serial0",
				"-no-reboot"},
		},
		{
			name: "q35 disk as a read-only base under an overlay, two vfio devices",
			spec: func() VMSpec {
				s := q35
				s.Disk = &Disk{Base: nullFile(t), Overlay: nullFile(t)}
				s.VFIO = []string{"/sys/bus/mdev/devices/5e1b5c4a-2c55-4b1e-9a34-7d0c3f2a9b10", "/sys/bus/pci/devices/0000:41:00.4"}
				return s
			}(),
			want: []string{"-m", "4096", "-smp", "4",
				"-add-fd", "fd=4,set=4", "-add-fd", "fd=5,set=5",
				"-blockdev", "driver=file,node-name=base-file,filename=/dev/fdset/4,read-only=on",
				"-blockdev", "driver=raw,node-name=base,file=base-file,read-only=on",
				"-blockdev", "driver=file,node-name=overlay-file,filename=/dev/fdset/5",
				"-blockdev", "driver=qcow2,node-name=disk0,file=overlay-file,backing=base",
				"-device", "virtio-blk-pci,drive=disk0,id=vda",
				"-device", "vfio-pci,sysfsdev=/sys/bus/mdev/devices/5e1b5c4a-2c55-4b1e-9a34-7d0c3f2a9b10,rombar=0",
				"-device", "vfio-pci,sysfsdev=/sys/bus/pci/devices/0000:41:00.4,rombar=0"},
		},
		{
			// A whole GPU on real hardware: each function of its IOMMU
			// group (the GPU and its audio function) is a vfio-pci device
			// of its own, named by its PCI directory.
			name: "q35 passthrough GPU with its audio function",
			spec: func() VMSpec {
				s := q35
				s.VFIO = []string{"/sys/bus/pci/devices/0000:82:00.0", "/sys/bus/pci/devices/0000:82:00.1"}
				return s
			}(),
			want: []string{"-m", "4096", "-smp", "4",
				"-device", "vfio-pci,sysfsdev=/sys/bus/pci/devices/0000:82:00.0,rombar=0",
				"-device", "vfio-pci,sysfsdev=/sys/bus/pci/devices/0000:82:00.1,rombar=0"},
		},
		{
			name: "microvm disk is virtio-mmio",
			spec: VMSpec{Name: "m", VCPUs: 2, MemoryMiB: 256, Machine: MachineMicroVM, Accel: AccelKVM,
				Kernel: nullFile(t), Disk: &Disk{Base: nullFile(t), Overlay: nullFile(t)}},
			want: []string{"-m", "256", "-smp", "2", "-kernel", "/proc/self/fd/4",
				"-add-fd", "fd=5,set=5", "-add-fd", "fd=6,set=6",
				"-blockdev", "driver=file,node-name=base-file,filename=/dev/fdset/5,read-only=on",
				"-blockdev", "driver=raw,node-name=base,file=base-file,read-only=on",
				"-blockdev", "driver=file,node-name=overlay-file,filename=/dev/fdset/6",
				"-blockdev", "driver=qcow2,node-name=disk0,file=overlay-file,backing=base",
				"-device", "virtio-blk-device,drive=disk0,id=vda"},
		},
		{
			name: "q35 nic on its tap descriptor, no option rom",
			spec: func() VMSpec {
				s := q35
				s.Disk = &Disk{Base: nullFile(t), Overlay: nullFile(t)}
				s.NIC = &NIC{TAP: nullFile(t), MAC: "02:aa:bb:cc:dd:ee"}
				return s
			}(),
			want: []string{"-m", "4096", "-smp", "4",
				"-add-fd", "fd=4,set=4", "-add-fd", "fd=5,set=5",
				"-blockdev", "driver=file,node-name=base-file,filename=/dev/fdset/4,read-only=on",
				"-blockdev", "driver=raw,node-name=base,file=base-file,read-only=on",
				"-blockdev", "driver=file,node-name=overlay-file,filename=/dev/fdset/5",
				"-blockdev", "driver=qcow2,node-name=disk0,file=overlay-file,backing=base",
				"-device", "virtio-blk-pci,drive=disk0,id=vda",
				"-netdev", "tap,fd=6,id=net0", "-device", "virtio-net-pci,netdev=net0,mac=02:aa:bb:cc:dd:ee,romfile="},
		},
		{
			name: "microvm nic is virtio-mmio",
			spec: VMSpec{Name: "m", VCPUs: 1, MemoryMiB: 256, Machine: MachineMicroVM, Accel: AccelTCG,
				Kernel: nullFile(t), NIC: &NIC{TAP: nullFile(t), MAC: "02:00:00:00:00:01"}},
			want: []string{"-m", "256", "-smp", "1", "-kernel", "/proc/self/fd/4",
				"-netdev", "tap,fd=5,id=net0", "-device", "virtio-net-device,netdev=net0,mac=02:00:00:00:00:01"},
		},
		{
			name: "pc",
			spec: VMSpec{Name: "p", VCPUs: 1, MemoryMiB: 64, Machine: MachinePC, Accel: AccelTCG},
			want: []string{"-m", "64", "-smp", "1"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Argv(tt.spec, testPaths)
			require.NoError(t, err)
			assert.Equal(t, append(common(tt.spec), tt.want...), got)
		})
	}
}

// TestBuildArgvFDTable: the files QEMU inherits are the spec's, in the order
// the argv numbers them (ExtraFiles[i] is fd 3+i), and no path of theirs is
// in the argv.
func TestBuildArgvFDTable(t *testing.T) {
	k, i, b, o := nullFile(t), nullFile(t), nullFile(t), nullFile(t)
	s := VMSpec{Name: "q", VCPUs: 1, MemoryMiB: 64, Machine: MachineQ35, Accel: AccelTCG,
		Kernel: k, Initrd: i, Disk: &Disk{Base: b, Overlay: o}}
	var fds FDTable
	argv, err := BuildArgv(s, testPaths, &fds)
	require.NoError(t, err)
	// fd 3 is reserved for the QMP listener Launch binds (Fill).
	assert.Equal(t, []*os.File{nil, k, i, b, o}, fds.Files())
	assert.Subset(t, argv, []string{"socket,id=qmp,fd=3,server=on,wait=off", "/proc/self/fd/4", "/proc/self/fd/5", "fd=6,set=6", "fd=7,set=7"})
	assert.Error(t, fds.Fill(4, nullFile(t)), "only a reserved number is filled")
	require.NoError(t, fds.Fill(QMPFD, nullFile(t)))
	assert.Error(t, fds.Fill(QMPFD, nullFile(t)), "and only once")
	assert.NotContains(t, strings.Join(argv, " "), os.DevNull, "QEMU is given numbers, never the images' paths")

	// A table shared with another user (the QMP listener) keeps counting.
	var shared FDTable
	assert.Equal(t, 3, shared.Add(nullFile(t)))
	argv, err = BuildArgv(s, testPaths, &shared)
	require.NoError(t, err)
	assert.Contains(t, argv, "socket,id=qmp,fd=4,server=on,wait=off")
	assert.Contains(t, argv, "/proc/self/fd/5")
	assert.Len(t, shared.Files(), 6)

	require.NoError(t, fds.Close())
	_, err = k.Stat()
	assert.ErrorIs(t, err, os.ErrClosed, "Close closes the agent's copies")
	assert.NoError(t, s.Close(), "closing again is not an error")
}

// No path of the instance directory reaches QEMU's argv: QEMU's uid
// cannot open them (the directory is root's, 0700) and must not (it could
// rewrite its record).
func TestArgvNamesNoInstancePath(t *testing.T) {
	got, err := Argv(noneSpec(), testPaths)
	require.NoError(t, err)
	for _, a := range got {
		assert.NotContains(t, a, "/run/vm/a")
	}
	for _, opt := range []string{"-qmp", "-pidfile", "-runas", "-run-with", "-daemonize"} {
		assert.NotContains(t, got, opt)
	}
}

func TestArgvRejects(t *testing.T) {
	mod := func(f func(*VMSpec)) VMSpec {
		s := noneSpec()
		f(&s)
		return s
	}
	q35 := func(f func(*VMSpec)) VMSpec {
		s := VMSpec{Name: "q", VCPUs: 2, MemoryMiB: 512, Machine: MachineQ35, Accel: AccelKVM}
		f(&s)
		return s
	}
	tests := []struct {
		name  string
		spec  VMSpec
		paths Paths
		want  string
	}{
		{"empty name", mod(func(s *VMSpec) { s.Name = "" }), testPaths, "name"},
		{"name with comma", mod(func(s *VMSpec) { s.Name = "a,debug-threads=on" }), testPaths, "name"},
		{"name with slash", mod(func(s *VMSpec) { s.Name = "../x" }), testPaths, "name"},
		{"name too long", mod(func(s *VMSpec) { s.Name = strings.Repeat("a", 64) }), testPaths, "name"},
		{"bad uuid", mod(func(s *VMSpec) { s.UUID = "nope" }), testPaths, "uuid"},
		{"urn uuid", mod(func(s *VMSpec) { s.UUID = "urn:uuid:6f1c1b0e-1c1a-4d4e-9f55-0123456789ab" }), testPaths, "uuid"},
		{"unknown machine", mod(func(s *VMSpec) { s.Machine = "virt" }), testPaths, "machine"},
		{"empty machine", mod(func(s *VMSpec) { s.Machine = "" }), testPaths, "machine"},
		{"unknown accel", mod(func(s *VMSpec) { s.Accel = "hvf" }), testPaths, "accel"},
		{"zero vcpus", mod(func(s *VMSpec) { s.VCPUs = 0 }), testPaths, "vcpus"},
		{"negative memory", mod(func(s *VMSpec) { s.MemoryMiB = -1 }), testPaths, "memory"},
		{"huge memory", mod(func(s *VMSpec) { s.MemoryMiB = MaxMemoryMiB + 1 }), testPaths, "memory"},
		{"none with 2 vcpus", mod(func(s *VMSpec) { s.VCPUs = 2 }), testPaths, "exactly 1 vcpu"},
		{"none with kernel", mod(func(s *VMSpec) { s.Kernel = nullFile(t) }), testPaths, "machine none"},
		{"none with serial", mod(func(s *VMSpec) { s.SerialToLog = true }), testPaths, "machine none"},
		{"none with nic", mod(func(s *VMSpec) { s.NIC = &NIC{TAP: nullFile(t), MAC: "02:00:00:00:00:01"} }), testPaths, "machine none"},
		{"nic without tap", q35(func(s *VMSpec) { s.NIC = &NIC{MAC: "02:00:00:00:00:01"} }), testPaths, "without a tap"},
		{"nic multicast mac", q35(func(s *VMSpec) { s.NIC = &NIC{TAP: nullFile(t), MAC: "03:00:00:00:00:01"} }), testPaths, "unicast"},
		{"nic mac with options", q35(func(s *VMSpec) { s.NIC = &NIC{TAP: nullFile(t), MAC: "02:00:00:00:00:01,romfile=/x"} }), testPaths, "unicast"},
		{"initrd without kernel", q35(func(s *VMSpec) { s.Initrd = nullFile(t) }), testPaths, "initrd without kernel"},
		{"cmdline without kernel", q35(func(s *VMSpec) { s.Cmdline = "quiet" }), testPaths, "cmdline without kernel"},
		{"cmdline newline", q35(func(s *VMSpec) { s.Kernel, s.Cmdline = nullFile(t), "a\nb" }), testPaths, "newline"},
		{"disk without base", q35(func(s *VMSpec) { s.Disk = &Disk{Overlay: nullFile(t)} }), testPaths, "without a base"},
		{"disk without overlay", q35(func(s *VMSpec) { s.Disk = &Disk{Base: nullFile(t)} }), testPaths, "without an overlay"},
		{"relative vfio", q35(func(s *VMSpec) { s.VFIO = []string{"sys/bus/pci/devices/x"} }), testPaths, "vfio[0]"},
		{"duplicate vfio", q35(func(s *VMSpec) { s.VFIO = []string{"/sys/a", "/sys/a"} }), testPaths, "twice"},
		{"microvm without kernel", VMSpec{Name: "m", VCPUs: 1, MemoryMiB: 64, Machine: MachineMicroVM, Accel: AccelKVM}, testPaths, "needs a kernel"},
		{"microvm vfio", VMSpec{Name: "m", VCPUs: 1, MemoryMiB: 64, Machine: MachineMicroVM, Accel: AccelKVM, Kernel: nullFile(t), VFIO: []string{"/sys/a"}}, testPaths, "no PCI bus"},
		{"empty socket", noneSpec(), Paths{PIDFile: "/p"}, "qmp socket"},
		{"relative pidfile", noneSpec(), Paths{QMPSocket: "/s", PIDFile: "p"}, "pid file"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Argv(tt.spec, tt.paths)
			require.Error(t, err)
			assert.Nil(t, got)
			assert.True(t, errors.Is(err, ErrInvalidSpec), "%v is not ErrInvalidSpec", err)
			assert.Contains(t, err.Error(), tt.want)
		})
	}
}

// FuzzArgv: no input panics, and whatever Argv accepts is a well-formed argv.
func FuzzArgv(f *testing.F) {
	f.Add("a", "", 1, 128, "none", "kvm", false, "", false, "/s", false)
	f.Add("web-1", "6f1c1b0e-1c1a-4d4e-9f55-0123456789ab", 4, 4096, "q35", "tcg", true, "quiet", true, "/sys/a", true)
	image := nullFile(f)
	f.Fuzz(func(t *testing.T, name, id string, vcpus, mem int, machine, accel string, kernel bool, cmdline string, disk bool, vfio string, serial bool) {
		s := VMSpec{Name: name, UUID: id, VCPUs: vcpus, MemoryMiB: mem, Machine: Machine(machine), Accel: Accel(accel),
			Cmdline: cmdline, SerialToLog: serial}
		if kernel {
			s.Kernel = image
		}
		if disk {
			s.Disk = &Disk{Base: image, Overlay: image}
		}
		if vfio != "" {
			s.VFIO = []string{vfio}
		}
		argv, err := Argv(s, testPaths)
		if err != nil {
			if !errors.Is(err, ErrInvalidSpec) {
				t.Fatalf("error %v is not ErrInvalidSpec", err)
			}
			return
		}
		for _, a := range argv {
			if a == "" || strings.ContainsAny(a, "\x00\n") {
				t.Fatalf("bad argv element %q in %q", a, argv)
			}
		}
	})
}

func BenchmarkArgv(b *testing.B) {
	s := VMSpec{Name: "web-1", UUID: "6f1c1b0e-1c1a-4d4e-9f55-0123456789ab", VCPUs: 4, MemoryMiB: 4096,
		Machine: MachineQ35, Accel: AccelKVM, Kernel: nullFile(b), Cmdline: "console=ttyS0",
		Disk: &Disk{Base: nullFile(b), Overlay: nullFile(b)},
		VFIO: []string{"/sys/bus/mdev/devices/5e1b5c4a-2c55-4b1e-9a34-7d0c3f2a9b10"}, SerialToLog: true}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Argv(s, testPaths); err != nil {
			b.Fatal(err)
		}
	}
}
