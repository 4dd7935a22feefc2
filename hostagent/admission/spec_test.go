package admission

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

func testHost(t *testing.T) (Host, string) {
	t.Helper()
	root := t.TempDir()
	outside := t.TempDir()
	// Kernel and initrd world-readable (QEMU re-opens them by their mode),
	// the disk not (QEMU gets its fd).
	for f, mode := range map[string]os.FileMode{"vmlinuz": 0o644, "initrd.img": 0o644, "disk.raw": 0o600} {
		require.NoError(t, os.WriteFile(filepath.Join(root, f), []byte("x"), mode))
		require.NoError(t, os.Chmod(filepath.Join(root, f), mode))
	}
	require.NoError(t, os.WriteFile(filepath.Join(outside, "shadow"), []byte("x"), 0o644))
	require.NoError(t, os.Symlink(filepath.Join(outside, "shadow"), filepath.Join(root, "escape")))
	require.NoError(t, os.Symlink("vmlinuz", filepath.Join(root, "link-inside")))
	require.NoError(t, os.Mkdir(filepath.Join(root, "dir"), 0o700))
	h, err := SystemHost([]string{root}, "", func(context.Context) ([]string, error) {
		return []string{"GRID A100-4C", "NVIDIA L40-4Q"}, nil
	})
	require.NoError(t, err)
	// A host with KVM, whether or not this machine has one (the host
	// without is TestNoKVMRefused's).
	h.MaxVCPUs, h.MaxMemoryMiB, h.KVM = 8, 16384, vmm.KVMAccess{}
	return h, root
}

func good(root string) *vmflowv1.SpawnRequest {
	return &vmflowv1.SpawnRequest{
		InstanceId: "vm1", HostId: "h1", Vcpus: 2, MemoryMib: 256, Machine: "q35", Accel: "tcg",
		Kernel: filepath.Join(root, "vmlinuz"), Initrd: filepath.Join(root, "initrd.img"), Cmdline: "console=ttyS0",
		Disk: filepath.Join(root, "disk.raw"), VgpuProfile: "GRID A100-4C", RestartPolicy: "on-failure",
	}
}

func TestValidateAccepts(t *testing.T) {
	h, root := testHost(t)
	assert.NoError(t, h.Validate(context.Background(), good(root)))
	r := good(root)
	r.Kernel = filepath.Join(root, "link-inside") // a relative symlink that stays inside is fine
	assert.NoError(t, h.Validate(context.Background(), r))
	minimal := &vmflowv1.SpawnRequest{InstanceId: "vm1", HostId: "h1", Vcpus: 1, MemoryMib: 128, Machine: "none"}
	assert.NoError(t, h.Validate(context.Background(), minimal))
	placed := good(root)
	placed.Numa, placed.Hugepages, placed.DedicatedCpus = "strict", "2M", true
	h.DedicatedCPUs = 2
	assert.NoError(t, h.Validate(context.Background(), placed))
	assert.Equal(t, "strict", RecordSpec(placed).GetNuma(), "the record keeps where the request asked to run")
	assert.True(t, RecordSpec(placed).GetDedicatedCpus())
}

// TestValidateRejects: every rejection names its field, and is ErrInvalid.
func TestValidateRejects(t *testing.T) {
	h, root := testHost(t)
	tests := []struct {
		field  string
		mutate func(r *vmflowv1.SpawnRequest)
	}{
		{"instance_id", func(r *vmflowv1.SpawnRequest) { r.InstanceId = "../x" }},
		{"instance_id", func(r *vmflowv1.SpawnRequest) { r.InstanceId = "" }},
		{"host_id", func(r *vmflowv1.SpawnRequest) { r.HostId = "Host_1" }},
		{"vcpus", func(r *vmflowv1.SpawnRequest) { r.Vcpus = 0 }},
		{"vcpus", func(r *vmflowv1.SpawnRequest) { r.Vcpus = 9 }},
		{"vcpus", func(r *vmflowv1.SpawnRequest) {
			r.Machine = "none"
			r.Kernel, r.Initrd, r.Cmdline, r.Disk = "", "", "", ""
		}},
		{"memory_mib", func(r *vmflowv1.SpawnRequest) { r.MemoryMib = 0 }},
		{"memory_mib", func(r *vmflowv1.SpawnRequest) { r.MemoryMib = 16385 }},
		{"machine", func(r *vmflowv1.SpawnRequest) { r.Machine = "virt" }},
		{"machine", func(r *vmflowv1.SpawnRequest) { r.Machine = "" }},
		{"accel", func(r *vmflowv1.SpawnRequest) { r.Accel = "hvf" }},
		{"numa", func(r *vmflowv1.SpawnRequest) { r.Numa = "interleave" }},
		{"hugepages", func(r *vmflowv1.SpawnRequest) { r.Hugepages = "4K" }},
		{"memory_mib", func(r *vmflowv1.SpawnRequest) { r.Hugepages, r.MemoryMib = "1G", 1536 }},
		{"dedicated_cpus", func(r *vmflowv1.SpawnRequest) { r.DedicatedCpus = true }}, // the test host keeps none
		{"restart_policy", func(r *vmflowv1.SpawnRequest) { r.RestartPolicy = "sometimes" }},
		{"kernel", func(r *vmflowv1.SpawnRequest) { r.Kernel = "vmlinuz" }},
		{"kernel", func(r *vmflowv1.SpawnRequest) { r.Kernel = root + "/../" + filepath.Base(root) + "/vmlinuz" }},
		{"kernel", func(r *vmflowv1.SpawnRequest) { r.Kernel = root + "//vmlinuz" }},
		{"kernel", func(r *vmflowv1.SpawnRequest) { r.Kernel = filepath.Join(root, "escape") }},
		{"kernel", func(r *vmflowv1.SpawnRequest) { r.Kernel = "/etc/passwd" }},
		{"kernel", func(r *vmflowv1.SpawnRequest) { r.Kernel = filepath.Join(root, "missing") }},
		{"kernel", func(r *vmflowv1.SpawnRequest) { r.Kernel = filepath.Join(root, "dir") }},
		{"initrd", func(r *vmflowv1.SpawnRequest) { r.Initrd = "/proc/self/environ" }},
		{"initrd", func(r *vmflowv1.SpawnRequest) { r.Kernel = "" }},
		{"disk", func(r *vmflowv1.SpawnRequest) { r.Disk = filepath.Join(root, "escape") }},
		{"cmdline", func(r *vmflowv1.SpawnRequest) { r.Cmdline = "a\nb" }},
		{"vgpu_profile", func(r *vmflowv1.SpawnRequest) { r.VgpuProfile = "GRID A100-40C" }},
		{"vgpu_profile", func(r *vmflowv1.SpawnRequest) { r.VgpuProfile = "grid a100-4c" }},
		// Each input that reaches a path, an
		// argv element or a sysfs write has its rejection tested.
		{"instance_id", func(r *vmflowv1.SpawnRequest) { r.InstanceId = "VM1" }},
		{"instance_id", func(r *vmflowv1.SpawnRequest) { r.InstanceId = strings.Repeat("a", 64) }},
		{"instance_id", func(r *vmflowv1.SpawnRequest) { r.InstanceId = "-x" }},
		{"instance_id", func(r *vmflowv1.SpawnRequest) { r.InstanceId = "vm1/../../etc" }},
		{"host_id", func(r *vmflowv1.SpawnRequest) { r.HostId = "h1/../h2" }},
		{"kernel", func(r *vmflowv1.SpawnRequest) { r.Kernel = root }},
		{"kernel", func(r *vmflowv1.SpawnRequest) { r.Kernel = root + "/vmlinuz/" }},
		{"kernel", func(r *vmflowv1.SpawnRequest) { r.Kernel = "/dev/null" }},
		{"initrd", func(r *vmflowv1.SpawnRequest) { r.Initrd = filepath.Join(root, "escape") }},
		{"disk", func(r *vmflowv1.SpawnRequest) { r.Disk = "disk.raw" }},
		{"disk", func(r *vmflowv1.SpawnRequest) { r.Disk = "/dev/sda" }},
		{"disk", func(r *vmflowv1.SpawnRequest) { r.Disk = filepath.Join(root, "dir") }},
		{"disk", func(r *vmflowv1.SpawnRequest) { r.Disk = root + "/disk.raw,format=qcow2" }},
		{"cmdline", func(r *vmflowv1.SpawnRequest) { r.Cmdline = "a\x00b" }},
		{"cmdline", func(r *vmflowv1.SpawnRequest) { r.Kernel, r.Initrd = "", "" }},
		{"vgpu_profile", func(r *vmflowv1.SpawnRequest) { r.VgpuProfile = "../../../../bus/pci/devices" }},
		{"vgpu_profile", func(r *vmflowv1.SpawnRequest) { r.VgpuProfile = "GRID A100-4C\n" }},
		{"vgpu_count", func(r *vmflowv1.SpawnRequest) { r.VgpuCount = 17 }},
		{"vgpu_count", func(r *vmflowv1.SpawnRequest) { r.VgpuProfile, r.VgpuCount = "", 2 }},
		{"gpu_passthrough_count", func(r *vmflowv1.SpawnRequest) { r.GpuPassthroughCount = 1 }}, // beside vgpu_profile
		{"gpu_passthrough_count", func(r *vmflowv1.SpawnRequest) { r.VgpuProfile, r.GpuPassthroughCount = "", 9 }},
		{"gpu_passthrough_count", func(r *vmflowv1.SpawnRequest) { r.VgpuProfile, r.GpuPassthroughCount = "", 1 }}, // no --gpu-passthrough
		{"gpu_passthrough_model", func(r *vmflowv1.SpawnRequest) {
			r.VgpuProfile, r.GpuPassthroughCount, r.GpuPassthroughModel = "", 1, "10DE:2335"
		}},
		{"gpu_passthrough_model", func(r *vmflowv1.SpawnRequest) { r.VgpuProfile, r.GpuPassthroughModel = "", "10de:2335" }},
	}
	for _, tt := range tests {
		r := good(root)
		tt.mutate(r)
		err := h.Validate(context.Background(), r)
		require.Error(t, err, "%s: %+v", tt.field, r)
		assert.ErrorIs(t, err, ErrInvalid)
		var fe *FieldError
		require.ErrorAs(t, err, &fe)
		assert.Contains(t, err.Error(), tt.field+":", "the message names the field")
	}
	assert.Error(t, h.Validate(context.Background(), nil))
}

func TestValidateNoImageRootsOrVGPUs(t *testing.T) {
	_, root := testHost(t)
	h := Host{MaxVCPUs: 8, MaxMemoryMiB: 1024}
	err := h.Validate(context.Background(), good(root))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "no --image-root")
	assert.Contains(t, err.Error(), "no vGPUs")
}

func TestValidateProfileListingFailureIsNotInvalid(t *testing.T) {
	h, root := testHost(t)
	h.Profiles = func(context.Context) ([]string, error) { return nil, errors.New("sysfs: EIO") }
	err := h.Validate(context.Background(), good(root))
	require.Error(t, err)
	assert.NotErrorIs(t, err, ErrInvalid, "a host that cannot list its profiles may yet admit the request")
}

func TestInstanceUUIDIsStable(t *testing.T) {
	assert.Equal(t, InstanceUUID("vm1"), InstanceUUID("vm1"))
	assert.NotEqual(t, InstanceUUID("vm1"), InstanceUUID("vm2"))
	assert.Len(t, InstanceUUID("vm1"), 36)
}

func TestForRecord(t *testing.T) {
	_, root := testHost(t)
	rec := &vmflowv1.InstanceRecord{Id: "vm1", Spec: RecordSpec(good(root))}
	v := ForRecord(rec, []string{"/sys/bus/mdev/devices/u"})
	assert.Equal(t, "vm1", v.Name)
	assert.Equal(t, 2, v.VCPUs)
	assert.Equal(t, []string{"/sys/bus/mdev/devices/u"}, v.VFIO)
	assert.True(t, v.Kernel == nil && v.Initrd == nil && v.Disk == nil, "the images are opened by PrepareLaunch, not here")
	assert.True(t, v.NoReboot, "a guest reboot ends QEMU; the restart policy decides")
	assert.Equal(t, v.Machine != vmm.MachineNone, v.SerialToLog, "console to qemu.log where there is a serial port")
	assert.Empty(t, ForRecord(rec, nil).VFIO)
	assert.True(t, v.IO.IsZero(), "no disk I/O bound asked for")
	bounded := good(root)
	bounded.DiskIo = &vmflowv1.DiskIOLimits{ReadBps: 1 << 20, WriteIops: 50}
	rec = &vmflowv1.InstanceRecord{Id: "vm1", Spec: RecordSpec(bounded)}
	assert.Equal(t, vmm.IOLimits{ReadBPS: 1 << 20, WriteIOPS: 50}, ForRecord(rec, nil).IO, "the caller's disk I/O bound, from request to record to QEMU's cgroup")
	noAccel := good(root)
	noAccel.Accel = ""
	assert.Equal(t, "kvm", RecordSpec(noAccel).GetAccel(), "kvm is the default accelerator")
}

// A host without KVM refuses a spec that asks for KVM (accel "kvm", or
// empty: the default) at admission, naming the missing node and the way
// out (accel "tcg"), for a spawn request and a record alike; TCG is
// admitted. Without the check both are admitted, and the launch fails
// later, after the record was written.
func TestNoKVMRefused(t *testing.T) {
	h, _ := testHost(t)
	missing := filepath.Join(t.TempDir(), "kvm") // no such node
	h.KVM = vmm.CheckKVM(missing)
	ctx := context.Background()
	for _, accel := range []string{"", "kvm"} {
		req := &vmflowv1.SpawnRequest{InstanceId: "vm1", HostId: "h1", Vcpus: 1, MemoryMib: 128, Machine: "none", Accel: accel}
		err := h.Validate(ctx, req)
		require.Error(t, err, "accel %q", accel)
		assert.ErrorIs(t, err, ErrInvalid)
		var fe *FieldError
		require.ErrorAs(t, err, &fe)
		assert.Equal(t, "accel", fe.Field)
		assert.Contains(t, err.Error(), "this host has no KVM (no "+missing+")")
		assert.Contains(t, err.Error(), `ask for accel "tcg"`)

		err = h.AdmitRecord(ctx, &vmflowv1.InstanceRecord{Id: "vm1", Spec: RecordSpec(req)})
		assert.ErrorIs(t, err, ErrAdmissionRefused, "a restart on a host that lost its KVM")
		assert.Contains(t, err.Error(), "this host has no KVM")
	}
	tcg := &vmflowv1.SpawnRequest{InstanceId: "vm1", HostId: "h1", Vcpus: 1, MemoryMib: 128, Machine: "none", Accel: "tcg"}
	assert.NoError(t, h.Validate(ctx, tcg))
	assert.NoError(t, h.AdmitRecord(ctx, &vmflowv1.InstanceRecord{Id: "vm1", Spec: RecordSpec(tcg)}))

	// A node its group cannot open is unusable, not absent: said so.
	node := filepath.Join(t.TempDir(), "kvm")
	require.NoError(t, os.WriteFile(node, nil, 0o600))
	h.KVM = vmm.CheckKVM(node)
	err := h.Validate(ctx, &vmflowv1.SpawnRequest{InstanceId: "vm1", HostId: "h1", Vcpus: 1, MemoryMib: 128, Machine: "none"})
	assert.ErrorIs(t, err, ErrInvalid)
	assert.Contains(t, err.Error(), "this host's KVM is unusable")
	assert.Contains(t, err.Error(), "mode 0600")
}
