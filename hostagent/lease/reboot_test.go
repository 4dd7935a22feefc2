package lease_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
)

// After a reboot every mdev is gone while the claims stay held on disk.
// While instance A waits for its restart, a new spawn must not take the
// slot A's held claim names (here the parent's only one), nor put another
// type on that parent (it runs one vGPU type at a time): A's restart gets
// its device back, where B taking the slot would fail A's re-create with
// "no capacity".
func TestHeldClaimKeepsItsSlotAcrossReboot(t *testing.T) {
	const whole = "GRID A100-40C" // one per GPU
	e := newClaims(t, vgpusim.Options{MdevParents: 1})
	ctx := context.Background()
	e.record(t, "vm-a")
	a, err := claimOne(ctx, e.claims, "vm-a", whole)
	require.NoError(t, err)
	e.removeBehindBack(t, a) // the reboot
	require.Empty(t, e.devices(t))

	e.record(t, "vm-b")
	_, err = claimOne(ctx, e.claims, "vm-b", whole)
	require.ErrorIs(t, err, gpu.ErrNoCapacity, "A's held claim keeps the parent's only slot")
	_, err = claimOne(ctx, e.claims, "vm-b", profile)
	require.ErrorIs(t, err, gpu.ErrNoCapacity, "the parent runs A's type: no other type fits beside it")
	assert.Empty(t, e.devices(t), "nothing was created for B")

	got, err := e.ensure(t, "vm-a")
	require.NoError(t, err, "A's restart gets its device back")
	assert.Equal(t, a.GetVgpu().GetDeviceId(), got.GetVgpu().GetDeviceId())
	require.Len(t, e.devices(t), 1)
}

// A held claim whose device is missing counts against its type's capacity
// on its parent, and only that: the other slots stay free.
func TestMissingDeviceCountsOneSlot(t *testing.T) {
	const half = "GRID A100-20C" // two per GPU
	e := newClaims(t, vgpusim.Options{MdevParents: 1})
	ctx := context.Background()
	e.record(t, "vm-a")
	a, err := claimOne(ctx, e.claims, "vm-a", half)
	require.NoError(t, err)
	e.removeBehindBack(t, a)
	e.record(t, "vm-b")
	_, err = claimOne(ctx, e.claims, "vm-b", half)
	require.NoError(t, err, "one of two slots is A's, the other is free")
	e.record(t, "vm-c")
	_, err = claimOne(ctx, e.claims, "vm-c", half)
	require.ErrorIs(t, err, gpu.ErrNoCapacity)
	_, err = e.ensure(t, "vm-a")
	require.NoError(t, err)
	require.Len(t, e.devices(t), 2)
}

// The same on NVIDIA SR-IOV: after a reboot every VF reads type 0, but a
// GPU runs one type on all its VFs, so a new spawn may not put another type
// on a free VF of the GPU whose held claim's device is missing: B's 8Q on
// a VF would leave A's 4Q unable to be re-created.
func TestHeldVendorClaimKeepsItsTypeAcrossReboot(t *testing.T) {
	e := newClaims(t, vgpusim.Options{VendorVFs: 2})
	ctx := context.Background()
	e.record(t, "vm-a")
	a, err := claimOne(ctx, e.claims, "vm-a", vendorProfile)
	require.NoError(t, err)
	e.removeBehindBack(t, a)
	require.Empty(t, e.devices(t))

	e.record(t, "vm-b")
	_, err = claimOne(ctx, e.claims, "vm-b", "NVIDIA L40-8Q")
	require.ErrorIs(t, err, gpu.ErrNoCapacity, "the GPU runs A's type")
	b, err := claimOne(ctx, e.claims, "vm-b", vendorProfile)
	require.NoError(t, err, "A's type on the other VF fits")
	assert.NotEqual(t, a.GetVgpu().GetDeviceId(), b.GetVgpu().GetDeviceId(), "not A's VF")

	got, err := e.ensure(t, "vm-a")
	require.NoError(t, err)
	assert.Equal(t, a.GetVgpu().GetDeviceId(), got.GetVgpu().GetDeviceId())
	require.Len(t, e.devices(t), 2)
}

// After a reboot an unreadable record's held claims are missing devices no
// placement can see: a new mdev spawn placed meanwhile would take their
// slots, and the instance, once its record is repaired, could not get its
// devices back. So mdev placement waits for the record, as vendor
// placement does.
func TestUnreadableRecordKeepsItsSlotsAcrossReboot(t *testing.T) {
	const half = "GRID A100-20C" // two per GPU
	e := newClaims(t, vgpusim.Options{MdevParents: 1})
	ctx := context.Background()
	e.record(t, "vm-b")
	b, err := e.claims.Claim(ctx, "vm-b", half, 2)
	require.NoError(t, err)
	for _, l := range b {
		e.removeBehindBack(t, l) // the reboot
	}
	restore := e.truncate(t, "vm-b")

	e.record(t, "vm-a")
	_, err = claimOne(ctx, e.claims, "vm-a", half)
	assert.ErrorIs(t, err, gpu.ErrRecordsUnreadable, "vm-b's record may hold every slot")
	assert.Empty(t, e.devices(t), "nothing was created for vm-a")

	restore()
	l, err := e.st.Lock(ctx, "vm-b")
	require.NoError(t, err)
	got, err := e.claims.EnsureDevicesLocked(ctx, l)
	_ = l.Unlock()
	require.NoError(t, err, "vm-b's restart gets both its devices back")
	assert.Equal(t, deviceIDs(b), deviceIDs(got))
	require.Len(t, e.devices(t), 2)
}
