package admission

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// TestCmdlineBound: the kernel's boot header holds 2047 bytes of command
// line. Fails before the bound (any length passed).
func TestCmdlineBound(t *testing.T) {
	h, root := testHost(t)
	r := good(root)
	r.Cmdline = strings.Repeat("x", MaxCmdlineBytes)
	assert.NoError(t, h.Validate(context.Background(), r))
	r.Cmdline += "x"
	err := h.Validate(context.Background(), r)
	require.ErrorIs(t, err, ErrInvalid)
	assert.Contains(t, err.Error(), "cmdline: 2048 bytes, longer than 2047")
}

// oversized sets every string field of m to a 1 MiB value and returns the
// field names; each must then be refused by name, with a short message
// (an oversized value is never quoted back).
func oversizedFields(t *testing.T, m proto.Message, check func(field string) error) {
	t.Helper()
	fields := m.ProtoReflect().Descriptor().Fields()
	for i := 0; i < fields.Len(); i++ {
		f := fields.Get(i)
		if f.Kind() != protoreflect.StringKind || f.IsList() {
			continue
		}
		name := string(f.Name())
		err := check(name)
		if !assert.Error(t, err, "%s: a 1 MiB value was accepted", name) {
			continue
		}
		assert.ErrorIs(t, err, ErrInvalid, name)
		assert.Contains(t, err.Error(), name+":", "the refusal names the field")
		assert.Less(t, len(err.Error()), 4096, "%s: the refusal quotes the value back", name)
	}
}

func setString(m proto.Message, field, v string) {
	r := m.ProtoReflect()
	r.Set(r.Descriptor().Fields().ByName(protoreflect.Name(field)), protoreflect.ValueOfString(v))
}

// TestEveryStringFieldIsBounded walks the descriptors, so a string field
// added later is covered without a change here: each of SpawnRequest's and
// VMSpec's string fields, 1 MiB long, is refused by name with a short
// message. Fails before the bounds (paths were resolved and quoted whole).
func TestEveryStringFieldIsBounded(t *testing.T) {
	h, root := testHost(t)
	huge := strings.Repeat("a", 1<<20)
	oversizedFields(t, &vmflowv1.SpawnRequest{}, func(field string) error {
		r := good(root)
		setString(r, field, huge)
		return h.Validate(context.Background(), r)
	})
	oversizedFields(t, &vmflowv1.VMSpec{}, func(field string) error {
		rec := &vmflowv1.InstanceRecord{Id: "vm1", RestartPolicy: "on-failure", Spec: RecordSpec(good(root))}
		setString(rec.Spec, field, huge)
		return h.AdmitRecord(context.Background(), rec)
	})
	// The other host activities' requests: every string field is an id
	// (contract.IDPattern) or has its bound in the one table.
	for _, m := range []proto.Message{&vmflowv1.ClaimVGPURequest{}, &vmflowv1.BeginDeleteRequest{}, &vmflowv1.LaunchVMRequest{},
		&vmflowv1.StopVMRequest{}, &vmflowv1.InstanceRef{}, &vmflowv1.ReconcileVGPURequest{}} {
		fields := m.ProtoReflect().Descriptor().Fields()
		for i := 0; i < fields.Len(); i++ {
			f := fields.Get(i)
			if f.Kind() != protoreflect.StringKind || f.Name() == "instance_id" || f.Name() == "host_id" {
				continue
			}
			assert.Contains(t, MaxBytes, string(f.Name()), "%s.%s has no bound", m.ProtoReflect().Descriptor().Name(), f.Name())
		}
	}
	assert.Error(t, CheckBound("no_such_field", ""), "a field without a bound is refused")
}

// TestAdmitRecord: a record is admitted with the checks a spawn request
// gets, against the host's policy as it is now.
func TestAdmitRecord(t *testing.T) {
	h, root := testHost(t)
	ctx := context.Background()
	rec := func() *vmflowv1.InstanceRecord {
		return &vmflowv1.InstanceRecord{Id: "vm1", RestartPolicy: "on-failure", Spec: RecordSpec(good(root))}
	}
	require.NoError(t, h.AdmitRecord(ctx, rec()))

	refused := func(h Host, r *vmflowv1.InstanceRecord, field string) {
		t.Helper()
		err := h.AdmitRecord(ctx, r)
		require.ErrorIs(t, err, ErrAdmissionRefused)
		assert.ErrorIs(t, err, ErrInvalid)
		assert.Contains(t, err.Error(), field+":")
	}
	lowered := h
	lowered.MaxVCPUs = 1
	refused(lowered, rec(), "vcpus")
	lowered = h
	lowered.MaxMemoryMiB = 128
	refused(lowered, rec(), "memory_mib")
	// The image root removed from the configuration.
	other := h
	elsewhere, err := OpenImageRoots([]string{t.TempDir()})
	require.NoError(t, err)
	t.Cleanup(func() { elsewhere.Close() })
	other.Images = elsewhere
	refused(other, rec(), "kernel")
	// The image itself gone, or replaced by a symlink leaving the root.
	r := rec()
	r.Spec.Disk = filepath.Join(root, "escape")
	refused(h, r, "disk")
	require.NoError(t, os.Remove(filepath.Join(root, "initrd.img")))
	refused(h, rec(), "initrd")

	r = rec()
	r.Spec = nil
	assert.ErrorIs(t, h.AdmitRecord(ctx, r), ErrAdmissionRefused)
	assert.ErrorIs(t, h.AdmitRecord(ctx, nil), ErrAdmissionRefused)
}

// TestValidateAndAdmitRecordAgree: one list of checks. Every request
// Validate refuses for a field the record keeps is refused by AdmitRecord
// once recorded, and what one admits the other admits.
func TestValidateAndAdmitRecordAgree(t *testing.T) {
	h, root := testHost(t)
	ctx := context.Background()
	for _, mutate := range []func(r *vmflowv1.SpawnRequest){
		func(*vmflowv1.SpawnRequest) {},
		func(r *vmflowv1.SpawnRequest) { r.Vcpus = 9 },
		func(r *vmflowv1.SpawnRequest) { r.MemoryMib = 0 },
		func(r *vmflowv1.SpawnRequest) { r.Machine = "virt" },
		func(r *vmflowv1.SpawnRequest) { r.Accel = "hvf" },
		func(r *vmflowv1.SpawnRequest) { r.RestartPolicy = "sometimes" },
		func(r *vmflowv1.SpawnRequest) { r.Kernel = "/etc/passwd" },
		func(r *vmflowv1.SpawnRequest) { r.Disk = filepath.Join(root, "escape") },
		func(r *vmflowv1.SpawnRequest) { r.Cmdline = "a\nb" },
		func(r *vmflowv1.SpawnRequest) { r.Cmdline = strings.Repeat("c", 4000) },
		func(r *vmflowv1.SpawnRequest) { r.InstanceId = "VM1" },
		func(r *vmflowv1.SpawnRequest) { r.Kernel, r.Initrd, r.Cmdline = "", "", "" },
	} {
		req := good(root)
		mutate(req)
		rec := &vmflowv1.InstanceRecord{Id: req.GetInstanceId(), RestartPolicy: req.GetRestartPolicy(), Spec: RecordSpec(req)}
		verr, aerr := h.Validate(ctx, req), h.AdmitRecord(ctx, rec)
		assert.Equal(t, verr == nil, aerr == nil, "Validate: %v\nAdmitRecord: %v", verr, aerr)
	}
}

// fakeDevices counts how often a launch got as far as the vGPU devices,
// and hands back the locked record's held vGPU leases.
type fakeDevices struct{ ensured int }

func (f *fakeDevices) EnsureDevicesLocked(_ context.Context, l *store.Locked) ([]*vmflowv1.Lease, error) {
	f.ensured++
	rec, err := l.Get()
	if errors.Is(err, store.ErrNotFound) {
		return []*vmflowv1.Lease{store.VGPULease(&vmflowv1.VgpuLease{Uuid: "x"})}, nil
	}
	return store.HeldVGPUs(rec), err
}
func (f *fakeDevices) DevicePath(l *vmflowv1.Lease) string {
	return "/sys/bus/mdev/devices/" + l.GetVgpu().GetUuid()
}

// TestPrepareLaunchAdmitsFirst: admission comes before anything is made
// or opened for the launch, the vGPU device included.
func TestPrepareLaunchAdmitsFirst(t *testing.T) {
	h, root := testHost(t)
	h.MemlockLimit = 0 // an agent whose limit covers the device (LimitMEMLOCK=infinity); this process's may not
	rec := &vmflowv1.InstanceRecord{Id: "vm1", Spec: RecordSpec(good(root)),
		Leases: []*vmflowv1.Lease{{Phase: vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE,
			Resource: &vmflowv1.Lease_Vgpu{Vgpu: &vmflowv1.VgpuLease{Profile: "GRID A100-4C"}}}}}
	rec.Spec.Disk = "" // no overlay to make: this test has no instance directory
	devs := &fakeDevices{}
	st, err := store.New(t.TempDir())
	require.NoError(t, err)
	l, err := st.Lock(context.Background(), "vm1")
	require.NoError(t, err)
	defer l.Unlock()
	v, err := PrepareLaunch(h, devs, true)(context.Background(), l, rec)
	require.NoError(t, err)
	t.Cleanup(func() { v.Close() })
	assert.Equal(t, []string{"/sys/bus/mdev/devices/x"}, v.VFIO)
	assert.Equal(t, 1, devs.ensured)

	lowered := h
	lowered.MaxVCPUs = 1
	_, err = PrepareLaunch(lowered, devs, true)(context.Background(), l, rec)
	require.ErrorIs(t, err, ErrAdmissionRefused)
	assert.Equal(t, 1, devs.ensured, "refused before the vGPU device was touched")

	// An agent whose own hard memlock limit is below the device's pinned
	// RAM refuses the launch while preparing it, naming the unit setting.
	small := h
	small.MemlockLimit = 8 << 20
	_, err = PrepareLaunch(small, devs, true)(context.Background(), l, rec)
	require.ErrorIs(t, err, vmm.ErrMemlockLimit)
	_, err = PrepareLaunch(small, devs, false)(context.Background(), l, rec)
	require.NoError(t, err, "without attaching the device nothing is pinned")
}

// TestPrepareLaunchGivesEveryVGPU: a VM asking for two vGPUs gets both, in
// claim order, and never starts holding fewer.
func TestPrepareLaunchGivesEveryVGPU(t *testing.T) {
	h, root := testHost(t)
	h.MemlockLimit = 0
	spec := RecordSpec(good(root))
	spec.Disk, spec.VgpuProfile, spec.VgpuCount = "", "GRID A100-4C", 2
	st, err := store.New(t.TempDir())
	require.NoError(t, err)
	ctx := context.Background()
	_, err = st.Create(ctx, &vmflowv1.InstanceRecord{Id: "vm1", Spec: spec})
	require.NoError(t, err)
	intent := func(u string) store.Step {
		return store.LeaseIntent(store.VGPULease(&vmflowv1.VgpuLease{Profile: "GRID A100-4C", Uuid: u}), time.Now())
	}
	rec, err := st.Apply(ctx, "vm1", intent("u1"))
	require.NoError(t, err)
	l, err := st.Lock(ctx, "vm1")
	require.NoError(t, err)
	_, err = PrepareLaunch(h, &fakeDevices{}, true)(ctx, l, rec)
	require.ErrorIs(t, err, ErrInvalid, "one of two vGPUs is no launch")
	assert.Contains(t, err.Error(), "holds 1")
	require.NoError(t, l.Unlock())

	rec, err = st.Apply(ctx, "vm1", intent("u2"))
	require.NoError(t, err)
	l, err = st.Lock(ctx, "vm1")
	require.NoError(t, err)
	defer l.Unlock()
	v, err := PrepareLaunch(h, &fakeDevices{}, true)(ctx, l, rec)
	require.NoError(t, err)
	t.Cleanup(func() { v.Close() })
	assert.Equal(t, []string{"/sys/bus/mdev/devices/u1", "/sys/bus/mdev/devices/u2"}, v.VFIO)
}

// fakeWhole hands back the locked record's held whole-GPU leases.
type fakeWhole struct{}

func (fakeWhole) EnsureDevicesLocked(_ context.Context, l *store.Locked) ([]*vmflowv1.Lease, error) {
	rec, err := l.Get()
	return store.HeldPassthrough(rec), err
}
func (fakeWhole) DevicePaths(l *vmflowv1.Lease) []string {
	var out []string
	for _, a := range store.PassthroughDevices(l) {
		out = append(out, "/sys/bus/pci/devices/"+a)
	}
	return out
}

// TestPrepareLaunchGivesEveryWholeGPU: every function of every held group
// goes to QEMU, and a VM asking for whole GPUs never starts without them
// nor on an agent that hands out none.
func TestPrepareLaunchGivesEveryWholeGPU(t *testing.T) {
	h, root := testHost(t)
	h.MemlockLimit = 0
	spec := RecordSpec(good(root))
	spec.Disk, spec.VgpuProfile, spec.GpuPassthroughCount = "", "", 1
	st, err := store.New(t.TempDir())
	require.NoError(t, err)
	ctx := context.Background()
	rec, err := st.Create(ctx, &vmflowv1.InstanceRecord{Id: "vm1", Spec: spec})
	require.NoError(t, err)
	h.Whole = fakeWhole{}
	l, err := st.Lock(ctx, "vm1")
	require.NoError(t, err)
	_, err = PrepareLaunch(h, nil, true)(ctx, l, rec)
	require.ErrorIs(t, err, ErrInvalid, "no lease yet")
	rec, err = l.Apply(store.LeaseIntent(store.PassthroughLeaseOf(&vmflowv1.PassthroughLease{IommuGroup: "401", Functions: []*vmflowv1.PassthroughFunction{
		{Addr: "0000:82:00.0", PreviousDriver: "nvidia", Display: true}, {Addr: "0000:82:00.1", PreviousDriver: "snd_hda_intel"}}}), time.Now()))
	require.NoError(t, err)
	v, err := PrepareLaunch(h, nil, true)(ctx, l, rec)
	require.NoError(t, err)
	t.Cleanup(func() { v.Close() })
	assert.Equal(t, []string{"/sys/bus/pci/devices/0000:82:00.0", "/sys/bus/pci/devices/0000:82:00.1"}, v.VFIO)
	h.Whole = nil
	_, err = PrepareLaunch(h, nil, true)(ctx, l, rec)
	require.ErrorIs(t, err, ErrAdmissionRefused, "an agent without --gpu-passthrough refuses the record")
	require.NoError(t, l.Unlock())
}

// TestNetworkAdmission: "default" is admitted only on a host with a
// network, and never for machine "none" (no bus for a NIC); any other
// value is refused; the record keeps what was asked.
func TestNetworkAdmission(t *testing.T) {
	h, root := testHost(t)
	ctx := context.Background()
	req := good(root)
	req.Network = NetworkDefault
	err := h.Validate(ctx, req)
	require.ErrorIs(t, err, ErrInvalid)
	assert.Contains(t, err.Error(), "network:")
	assert.Contains(t, err.Error(), "--net-subnet")

	h.Network = true
	require.NoError(t, h.Validate(ctx, req))
	assert.Equal(t, NetworkDefault, RecordSpec(req).GetNetwork())
	require.NoError(t, h.AdmitRecord(ctx, &vmflowv1.InstanceRecord{Id: "vm1", Spec: RecordSpec(req)}))

	none := &vmflowv1.SpawnRequest{InstanceId: "vm1", HostId: "h", Vcpus: 1, MemoryMib: 64, Machine: "none", Accel: "tcg", Network: NetworkDefault}
	err = h.Validate(ctx, none)
	require.ErrorIs(t, err, ErrInvalid)
	assert.Contains(t, err.Error(), "no bus for a NIC")

	req.Network = "bridged"
	err = h.Validate(ctx, req)
	require.ErrorIs(t, err, ErrInvalid)
	assert.Contains(t, err.Error(), "network:")
}

// TestPrepareLaunchCountsGPUsNotGroups (issue 31 case 9): a VM asking for
// two whole GPUs that holds one IOMMU group of two GPUs launches with all
// four functions; it is refused only when it holds fewer GPUs than asked
// (before, the check counted leases and refused it).
func TestPrepareLaunchCountsGPUsNotGroups(t *testing.T) {
	h, root := testHost(t)
	h.MemlockLimit = 0
	h.Whole = fakeWhole{}
	spec := RecordSpec(good(root))
	spec.Disk, spec.VgpuProfile, spec.GpuPassthroughCount = "", "", 2
	st, err := store.New(t.TempDir())
	require.NoError(t, err)
	ctx := context.Background()
	_, err = st.Create(ctx, &vmflowv1.InstanceRecord{Id: "vm1", Spec: spec})
	require.NoError(t, err)
	l, err := st.Lock(ctx, "vm1")
	require.NoError(t, err)
	defer l.Unlock()
	rec, err := l.Apply(store.LeaseIntent(store.PassthroughLeaseOf(&vmflowv1.PassthroughLease{IommuGroup: "401", Functions: []*vmflowv1.PassthroughFunction{
		{Addr: "0000:82:00.0", PreviousDriver: "nvidia", Display: true}, {Addr: "0000:82:00.1", PreviousDriver: "snd_hda_intel"},
		{Addr: "0000:83:00.0", PreviousDriver: "nvidia", Display: true}, {Addr: "0000:83:00.1", PreviousDriver: "snd_hda_intel"}}}), time.Now()))
	require.NoError(t, err)
	assert.Equal(t, 2, store.HeldPassthroughGPUs(rec))
	v, err := PrepareLaunch(h, nil, true)(ctx, l, rec)
	require.NoError(t, err, "one group of two GPUs is the two GPUs asked for")
	t.Cleanup(func() { v.Close() })
	assert.Len(t, v.VFIO, 4)
}
