package lease_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

const vendorProfile = "NVIDIA L40-4Q"

// vfType is what vendor VF vf runs now, as sysfs says.
func (e *claimsEnv) vfType(t *testing.T, vf string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(e.sim.Root, "bus/pci/devices", vf, "nvidia/current_vgpu_type"))
	require.NoError(t, err)
	return strings.TrimSpace(string(b))
}

// removeBehindBack removes a claim's device without the agent, as a host
// reboot (or a crash after the release write) would.
func (e *claimsEnv) removeBehindBack(t *testing.T, c *vmflowv1.Lease) {
	t.Helper()
	var path, val string
	if c.GetVgpu().GetDriver() == string(gpu.KindVendor) {
		path, val = filepath.Join(e.sim.Root, "bus/pci/devices", c.GetVgpu().GetDeviceId(), "nvidia/current_vgpu_type"), "0"
	} else {
		path, val = filepath.Join(e.sim.Root, "bus/mdev/devices", c.GetVgpu().GetDeviceId(), "remove"), "1"
	}
	require.NoError(t, os.WriteFile(path, []byte(val), 0o200))
}

func (e *claimsEnv) fault(t *testing.T, name, errno string) { t.Helper(); e.sim.Set(t, name, errno) }

func (e *claimsEnv) clearFault(t *testing.T, name string) { t.Helper(); e.sim.Clear(t, name) }

// truncate makes id's record.json unreadable; the returned func restores it.
func (e *claimsEnv) truncate(t *testing.T, id string) (restore func()) {
	t.Helper()
	p, err := e.st.Paths(id)
	require.NoError(t, err)
	good, err := os.ReadFile(p.Record)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p.Record, good[:len(good)/2], 0o600))
	_, err = e.st.Get(id)
	require.Error(t, err, "the record must be unreadable now")
	return func() { require.NoError(t, os.WriteFile(p.Record, good, 0o600)) }
}

func (e *claimsEnv) ensure(t *testing.T, id string) (*vmflowv1.Lease, error) {
	t.Helper()
	l, err := e.st.Lock(context.Background(), id)
	require.NoError(t, err)
	defer l.Unlock()
	ls, err := e.claims.EnsureDevicesLocked(context.Background(), l)
	if err != nil || len(ls) == 0 {
		return nil, err
	}
	return ls[0], nil
}

// TestReleaseRetryAfterCrashSparesNextClaim: A's release writes 0, the agent
// dies before released_at is recorded; B must not be placed on the VF A's
// held claim still names, so that A's retried release cannot destroy B's
// vGPU.
func TestReleaseRetryAfterCrashSparesNextClaim(t *testing.T) {
	e := newClaims(t, vgpusim.Options{VendorVFs: 1})
	ctx := context.Background()
	e.record(t, "vm-a")
	a, err := claimOne(ctx, e.claims, "vm-a", vendorProfile)
	require.NoError(t, err)
	e.beginDelete(t, "vm-a")
	_, err = e.st.Update(ctx, "vm-a", func(r *vmflowv1.InstanceRecord) error {
		store.VGPU(r).Phase = vmflowv1.ClaimPhase_CLAIM_PHASE_RELEASING
		return nil
	})
	require.NoError(t, err)
	e.removeBehindBack(t, a) // the release write landed; the agent died
	require.Empty(t, e.devices(t))

	e.record(t, "vm-b")
	// Checked with assert, not require: before invariant 10 vm-b got the
	// VF here, and the rest of the test shows what that cost.
	_, err = claimOne(ctx, e.claims, "vm-b", vendorProfile)
	assert.ErrorIs(t, err, gpu.ErrNoCapacity, "the only VF is named by vm-a's held claim")

	released, _, err := e.claims.Release(ctx, "vm-a") // the retried release
	require.NoError(t, err)
	assert.True(t, released)

	b, err := claimOne(ctx, e.claims, "vm-b", vendorProfile)
	require.NoError(t, err, "the VF is free once vm-a's release is recorded")
	assert.Equal(t, a.GetVgpu().GetDeviceId(), b.GetVgpu().GetDeviceId())
	assert.Equal(t, "592", e.vfType(t, b.GetVgpu().GetDeviceId()), "vm-b's record says active, so its vGPU must exist")
	// A late duplicate of vm-a's release finds no held claim and touches
	// nothing.
	released, _, err = e.claims.Release(ctx, "vm-a")
	require.NoError(t, err)
	assert.False(t, released)
	assert.Equal(t, "592", e.vfType(t, b.GetVgpu().GetDeviceId()), "vm-b's vGPU survives")
}

// TestRetriedIntentDoesNotAdoptAnothersVF: A's create fails
// after its intent was written; B must be placed elsewhere, and A's retried
// claim finishes on its own VF, never on B's.
func TestRetriedIntentDoesNotAdoptAnothersVF(t *testing.T) {
	e := newClaims(t, vgpusim.Options{VendorVFs: 2})
	ctx := context.Background()
	e.record(t, "vm-a")
	e.fault(t, vgpusim.CtlFailCreate, "EIO")
	_, err := claimOne(ctx, e.claims, "vm-a", vendorProfile)
	require.ErrorIs(t, err, syscall.EIO)
	e.clearFault(t, vgpusim.CtlFailCreate)
	rec, err := e.st.Get("vm-a")
	require.NoError(t, err)
	intentVF := store.VGPU(rec).GetVgpu().GetDeviceId()
	require.NotEmpty(t, intentVF)

	e.record(t, "vm-b")
	b, err := claimOne(ctx, e.claims, "vm-b", vendorProfile)
	require.NoError(t, err)
	assert.NotEqual(t, intentVF, b.GetVgpu().GetDeviceId(), "vm-a's intent names that VF")

	a, err := claimOne(ctx, e.claims, "vm-a", vendorProfile)
	require.NoError(t, err)
	assert.Equal(t, intentVF, a.GetVgpu().GetDeviceId())
	assert.NotEqual(t, a.GetVgpu().GetDeviceId(), b.GetVgpu().GetDeviceId())
	assert.Len(t, e.devices(t), 2)
}

// TestLedgerRefusesDeviceOfAnotherClaim: two records naming one device
// (hand-edited, or written by an agent before invariant 10) stop release,
// adoption and ensure, naming both instances; the device stays.
func TestLedgerRefusesDeviceOfAnotherClaim(t *testing.T) {
	for _, tc := range []struct {
		name    string
		opts    vgpusim.Options
		profile string
	}{
		{"mdev", vgpusim.Options{MdevParents: 1}, profile},
		{"vendor", vgpusim.Options{VendorVFs: 2}, vendorProfile},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newClaims(t, tc.opts)
			ctx := context.Background()
			e.record(t, "vm-a")
			a, err := claimOne(ctx, e.claims, "vm-a", tc.profile)
			require.NoError(t, err)
			e.record(t, "vm-b")
			_, err = e.st.Update(ctx, "vm-b", func(r *vmflowv1.InstanceRecord) error {
				l := store.VGPULease(proto.CloneOf(a.GetVgpu()))
				l.Phase = vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE
				r.Leases = []*vmflowv1.Lease{l}
				return nil
			})
			require.NoError(t, err)

			_, err = e.ensure(t, "vm-a")
			require.ErrorIs(t, err, gpu.ErrClaimedByOther)
			_, err = claimOne(ctx, e.claims, "vm-a", tc.profile)
			require.ErrorIs(t, err, gpu.ErrClaimedByOther, "an active claim goes through the same check")

			e.beginDelete(t, "vm-a")
			released, _, err := e.claims.Release(ctx, "vm-a")
			require.ErrorIs(t, err, gpu.ErrClaimedByOther)
			assert.False(t, released)
			assert.Contains(t, err.Error(), "vm-a")
			assert.Contains(t, err.Error(), "vm-b")
			require.Len(t, e.devices(t), 1, "the device stays")
			rec, err := e.st.Get("vm-a")
			require.NoError(t, err)
			assert.True(t, store.ClaimHeld(rec))
			assert.Contains(t, store.VGPU(rec).GetLastReleaseError(), "vm-b", "the record says why")
		})
	}
}

// TestIntentAdoptionRefusesAnothersDevice: an intent whose VF another
// record's claim names (and whose device exists) is not adopted.
func TestIntentAdoptionRefusesAnothersDevice(t *testing.T) {
	e := newClaims(t, vgpusim.Options{VendorVFs: 2})
	ctx := context.Background()
	e.record(t, "vm-a")
	e.fault(t, vgpusim.CtlFailCreate, "EIO")
	_, err := claimOne(ctx, e.claims, "vm-a", vendorProfile)
	require.ErrorIs(t, err, syscall.EIO)
	e.clearFault(t, vgpusim.CtlFailCreate)
	rec, err := e.st.Get("vm-a")
	require.NoError(t, err)
	intent := store.VGPU(rec)

	// vm-b's device on the same VF, with a record naming it: the state an
	// agent before invariant 10 could leave.
	dev, err := e.claims.Driver().Create(ctx, gpu.CreateRequest{Profile: vendorProfile, UUID: "2b6c4e3a-0d4f-4a8e-9a43-6f5d2e1c0b7a"})
	require.NoError(t, err)
	require.Equal(t, intent.GetVgpu().GetDeviceId(), dev.ID)
	e.record(t, "vm-b")
	_, err = e.st.Update(ctx, "vm-b", func(r *vmflowv1.InstanceRecord) error {
		l := store.VGPULease(&vmflowv1.VgpuLease{Profile: vendorProfile, Parent: dev.Parent, TypeId: dev.TypeID, Uuid: dev.UUID,
			DeviceId: dev.ID, Driver: string(gpu.KindVendor)})
		l.Phase = vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE
		r.Leases = []*vmflowv1.Lease{l}
		return nil
	})
	require.NoError(t, err)

	_, err = claimOne(ctx, e.claims, "vm-a", vendorProfile)
	require.ErrorIs(t, err, gpu.ErrClaimedByOther)
	assert.Contains(t, err.Error(), "vm-b")
	rec, err = e.st.Get("vm-a")
	require.NoError(t, err)
	assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_INTENT, store.VGPU(rec).GetPhase(), "not adopted")
}

// TestPlacementRefusedWhileRecordUnreadable: an unreadable record may name
// any VF, so vendor placement waits for it; an mdev placement too (a fresh
// UUID cannot be named, but the record may keep slots of missing devices:
// TestUnreadableRecordKeepsItsSlotsAcrossReboot).
func TestPlacementRefusedWhileRecordUnreadable(t *testing.T) {
	ctx := context.Background()
	e := newClaims(t, vgpusim.Options{VendorVFs: 2})
	e.record(t, "vm-bad")
	restore := e.truncate(t, "vm-bad")
	e.record(t, "vm1")
	_, err := claimOne(ctx, e.claims, "vm1", vendorProfile)
	require.ErrorIs(t, err, gpu.ErrRecordsUnreadable)
	assert.Contains(t, err.Error(), "vm-bad")
	assert.NotErrorIs(t, err, store.ErrInvalidRecord, "vm-bad's trouble is not vm1's record's")
	assert.Empty(t, e.devices(t))
	rec, err := e.st.Get("vm1")
	require.NoError(t, err)
	assert.Nil(t, store.VGPU(rec), "no intent is written for a refused placement")
	restore()
	_, err = claimOne(ctx, e.claims, "vm1", vendorProfile)
	require.NoError(t, err)

	m := newClaims(t, vgpusim.Options{MdevParents: 1})
	m.record(t, "vm-bad")
	restore = m.truncate(t, "vm-bad")
	m.record(t, "vm1")
	_, err = claimOne(ctx, m.claims, "vm1", profile)
	require.ErrorIs(t, err, gpu.ErrRecordsUnreadable)
	assert.Empty(t, m.devices(t))
	restore()
	_, err = claimOne(ctx, m.claims, "vm1", profile)
	require.NoError(t, err)
}

// TestReleaseRefusedWhileLaunchUnrecorded: a launch marker without a
// recorded process means a QEMU may run unnamed (the agent died between
// fork and recording its pid): no release until the marker is resolved.
func TestReleaseRefusedWhileLaunchUnrecorded(t *testing.T) {
	e := newClaims(t, vgpusim.Options{MdevParents: 1})
	ctx := context.Background()
	e.record(t, "vm1")
	_, err := claimOne(ctx, e.claims, "vm1", profile)
	require.NoError(t, err)
	_, err = e.st.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.LaunchStartedAt = timestamppb.New(time.Now())
		return nil
	})
	require.NoError(t, err)
	e.beginDelete(t, "vm1")

	released, _, err := e.claims.Release(ctx, "vm1")
	require.ErrorIs(t, err, lease.ErrVMAlive)
	assert.Contains(t, err.Error(), "not recorded")
	assert.False(t, released)
	assert.Len(t, e.devices(t), 1)

	// The supervisor resolved the marker (the QEMU was not there).
	_, err = e.st.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.LaunchStartedAt = nil
		return nil
	})
	require.NoError(t, err)
	released, _, err = e.claims.Release(ctx, "vm1")
	require.NoError(t, err)
	assert.True(t, released)
	assert.Empty(t, e.devices(t))
}

// TestEnsureDeviceRecreatesAfterReboot: an active claim whose
// device vanished (a reboot) gets it back under the same UUID or on the
// same VF; when that fails, the error names the claim.
func TestEnsureDeviceRecreatesAfterReboot(t *testing.T) {
	for _, tc := range []struct {
		name    string
		opts    vgpusim.Options
		profile string
	}{
		{"mdev", vgpusim.Options{MdevParents: 2}, profile},
		{"vendor", vgpusim.Options{VendorVFs: 3}, vendorProfile},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newClaims(t, tc.opts)
			ctx := context.Background()
			e.record(t, "vm-none")
			got, err := e.ensure(t, "vm-none")
			require.NoError(t, err)
			assert.Nil(t, got, "no claim, nothing to ensure")

			e.record(t, "vm1")
			c, err := claimOne(ctx, e.claims, "vm1", tc.profile)
			require.NoError(t, err)
			got, err = e.ensure(t, "vm1")
			require.NoError(t, err)
			assert.Equal(t, c.GetVgpu().GetDeviceId(), got.GetVgpu().GetDeviceId())

			e.removeBehindBack(t, c)
			require.Empty(t, e.devices(t))
			got, err = e.ensure(t, "vm1")
			require.NoError(t, err)
			assert.Equal(t, c.GetVgpu().GetDeviceId(), got.GetVgpu().GetDeviceId())
			ds := e.devices(t)
			require.Len(t, ds, 1)
			assert.Equal(t, c.GetVgpu().GetDeviceId(), ds[0].ID, "same UUID / same VF")
			assert.Equal(t, c.GetVgpu().GetTypeId(), ds[0].TypeID)

			// Claim of an active claim goes through the same check.
			e.removeBehindBack(t, c)
			again, err := claimOne(ctx, e.claims, "vm1", tc.profile)
			require.NoError(t, err)
			assert.Equal(t, c.GetVgpu().GetDeviceId(), again.GetVgpu().GetDeviceId())
			require.Len(t, e.devices(t), 1)

			e.removeBehindBack(t, c)
			e.fault(t, vgpusim.CtlFailCreate, "EIO")
			_, err = e.ensure(t, "vm1")
			require.ErrorIs(t, err, lease.ErrClaimDeviceMissing)
			assert.ErrorIs(t, err, syscall.EIO)
			for _, s := range []string{"vm1", tc.profile, c.GetVgpu().GetDeviceId()} {
				assert.Contains(t, err.Error(), s)
			}
			_, err = claimOne(ctx, e.claims, "vm1", tc.profile)
			require.ErrorIs(t, err, lease.ErrClaimDeviceMissing)
			e.clearFault(t, vgpusim.CtlFailCreate)

			// An intent: the spawn has not finished claiming.
			e.record(t, "vm2")
			e.fault(t, vgpusim.CtlFailCreate, "EIO")
			_, err = claimOne(ctx, e.claims, "vm2", tc.profile)
			require.Error(t, err)
			e.clearFault(t, vgpusim.CtlFailCreate)
			_, err = e.ensure(t, "vm2")
			require.ErrorIs(t, err, lease.ErrClaimNotActive)
		})
	}
}

// TestEnsureRefusesVFRunningAnotherType: a VF that runs another type is not
// the claim's device; it is left alone and the claim's device is missing.
func TestEnsureRefusesVFRunningAnotherType(t *testing.T) {
	e := newClaims(t, vgpusim.Options{VendorVFs: 2})
	ctx := context.Background()
	e.record(t, "vm1")
	c, err := claimOne(ctx, e.claims, "vm1", vendorProfile)
	require.NoError(t, err)
	e.removeBehindBack(t, c)
	// Something else (no record) puts another type on the VF.
	require.NoError(t, os.WriteFile(filepath.Join(e.sim.Root, "bus/pci/devices", c.GetVgpu().GetDeviceId(), "nvidia/current_vgpu_type"), []byte("594"), 0o200))
	_, err = e.ensure(t, "vm1")
	require.ErrorIs(t, err, lease.ErrClaimDeviceMissing)
	assert.ErrorIs(t, err, gpu.ErrDeviceMismatch)
	assert.Equal(t, "594", e.vfType(t, c.GetVgpu().GetDeviceId()), "left alone")
}

// TestReconcileKeepsOrphansWhileRecordUnreadable: a truncated record may
// name the orphan, so it survives the round, and the round counts the
// record; once fixed, the orphan goes after the grace period.
func TestReconcileKeepsOrphansWhileRecordUnreadable(t *testing.T) {
	e := newClaims(t, vgpusim.Options{MdevParents: 1})
	ctx := context.Background()
	orphan, err := e.claims.Driver().Create(ctx, gpu.CreateRequest{Profile: profile, UUID: "2b6c4e3a-0d4f-4a8e-9a43-6f5d2e1c0b7a"})
	require.NoError(t, err)
	e.record(t, "vm-bad")
	restore := e.truncate(t, "vm-bad")

	for range 2 {
		res, err := e.claims.Reconcile(ctx)
		require.NoError(t, err)
		assert.EqualValues(t, 1, res.GetUnreadableRecords())
		assert.Zero(t, res.GetOrphansRemoved())
		e.now.Advance(2 * time.Minute)
	}
	require.Len(t, e.devices(t), 1, "the orphan survives while a record is unreadable")

	restore()
	res, err := e.claims.Reconcile(ctx)
	require.NoError(t, err)
	assert.Zero(t, res.GetUnreadableRecords())
	e.now.Advance(2 * time.Minute)
	res, err = e.claims.Reconcile(ctx)
	require.NoError(t, err)
	assert.EqualValues(t, 1, res.GetOrphansRemoved())
	for _, d := range e.devices(t) {
		assert.NotEqual(t, orphan.ID, d.ID)
	}
}

// TestConcurrentVendorClaimsNeverShareAVF: placement and the intent write
// run under one host lock, so concurrent claims never name one VF, and no
// more claims succeed than there are VFs.
func TestConcurrentVendorClaimsNeverShareAVF(t *testing.T) {
	e := newClaims(t, vgpusim.Options{VendorVFs: 3})
	ctx := context.Background()
	ids := []string{"vm1", "vm2", "vm3", "vm4", "vm5"}
	errs := make(chan error, len(ids))
	for _, id := range ids {
		e.record(t, id)
	}
	for _, id := range ids {
		go func() {
			_, err := claimOne(ctx, e.claims, id, vendorProfile)
			errs <- err
		}()
	}
	ok := 0
	for range ids {
		err := <-errs
		if err == nil {
			ok++
			continue
		}
		assert.ErrorIs(t, err, gpu.ErrNoCapacity)
	}
	assert.Equal(t, 3, ok)
	recs, err := e.st.List()
	require.NoError(t, err)
	seen := map[string]string{}
	for _, r := range recs {
		if !store.ClaimHeld(r) {
			continue
		}
		vf := store.VGPU(r).GetVgpu().GetDeviceId()
		assert.NotContains(t, seen, vf, "%s and %s name one VF", seen[vf], r.GetId())
		seen[vf] = r.GetId()
	}
	assert.Len(t, seen, 3)
}

// TestLateReleaseSparesNextClaimOnTheVF: a release write that returns after
// every caller stopped waiting is recorded late, by its device and UUID. By
// then A's release may be recorded and the VF B's: B's claim stays held.
func TestLateReleaseSparesNextClaimOnTheVF(t *testing.T) {
	e := newClaims(t, vgpusim.Options{VendorVFs: 1})
	ctx := context.Background()
	e.record(t, "vm-a")
	a, err := claimOne(ctx, e.claims, "vm-a", vendorProfile)
	require.NoError(t, err)
	e.beginDelete(t, "vm-a")
	released, _, err := e.claims.Release(ctx, "vm-a")
	require.NoError(t, err)
	require.True(t, released)
	e.record(t, "vm-b")
	b, err := claimOne(ctx, e.claims, "vm-b", vendorProfile)
	require.NoError(t, err)
	require.Equal(t, a.GetVgpu().GetDeviceId(), b.GetVgpu().GetDeviceId(), "the only VF")

	lease.RecordLateRelease(e.claims, gpu.Device{Kind: gpu.KindVendor, ID: a.GetVgpu().GetDeviceId(), UUID: a.GetVgpu().GetUuid()})
	rec, err := e.st.Get("vm-b")
	require.NoError(t, err)
	held := store.HeldVGPUs(rec)
	require.Len(t, held, 1, "vm-b's claim is not vm-a's late release")
	assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, held[0].GetPhase())
}
