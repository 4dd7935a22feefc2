package lease_test

import (
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/store"
)

// TestScanFindsReconcileWork: the agent's local scan says "work" exactly
// where a reconcile round would act (a deleting instance's claim whose VM
// is gone, a released claim whose delete may wait, an orphan past its grace
// and held by nobody) and "no work" on a host a reconcile would leave as it
// is, and it changes nothing on the host.
func TestScanFindsReconcileWork(t *testing.T) {
	e := newClaims(t, vgpusim.Options{MdevParents: 1})
	ctx := context.Background()
	scan := func() lease.Work {
		t.Helper()
		w, err := e.claims.Scan(ctx)
		require.NoError(t, err)
		return w
	}
	assert.False(t, scan().Any(), "an empty host")

	e.record(t, "vm1")
	_, err := claimOne(ctx, e.claims, "vm1", profile)
	require.NoError(t, err)
	assert.False(t, scan().Any(), "a claim a spawn owns is no reconcile work")

	// A deleting instance whose VM's thread group is still alive: the
	// release would be refused (invariant 2), so nothing to do yet.
	z := proctest.StartZombie(t)
	id, err := proc.ReadIdentity(z.PID)
	require.NoError(t, err)
	e.setProcess(t, "vm1", id)
	e.beginDelete(t, "vm1")
	assert.False(t, scan().Any(), "the VM of a deleting instance still runs")
	z.Release(t)
	require.Eventually(t, func() bool { return !proc.Inspect(id).Alive }, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, []string{"release:vm1"}, scan().Items, "the VM is gone: its claim can be released")
	rec, err := e.st.Get("vm1")
	require.NoError(t, err)
	assert.True(t, store.ClaimHeld(rec), "the scan released nothing")
	assert.Len(t, e.devices(t), 1, "the scan removed nothing")

	res, err := e.claims.Reconcile(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, res.GetClaimsReleased())
	assert.Equal(t, []string{"wake:vm1"}, scan().Items, "released, record kept: its delete may need waking")
	require.NoError(t, e.st.Delete(ctx, "vm1"))
	assert.False(t, scan().Any(), "the delete finished")

	orphan, err := e.claims.Driver().Create(ctx, gpu.CreateRequest{Profile: profile, UUID: "2b6c4e3a-0d4f-4a8e-9a43-6f5d2e1c0b7a"})
	require.NoError(t, err)
	assert.False(t, scan().Any(), "an unclaimed device inside its grace")
	node := e.vfioNode(t, orphan.ID)
	f, err := os.Open(node)
	require.NoError(t, err)
	e.now.Advance(2 * time.Minute)
	assert.False(t, scan().Any(), "an orphan past its grace but held open")
	require.NoError(t, f.Close())
	assert.Equal(t, []string{"orphan:" + orphan.ID}, scan().Items, "an orphan past its grace, held by nobody")
	assert.Len(t, e.devices(t), 1, "the scan removed nothing")
	// The round the scan triggers counts the scan's sighting: it does not
	// start the grace again (and the scan trigger again) for want of a
	// ledger entry.
	res, err = e.claims.Reconcile(ctx)
	require.NoError(t, err)
	assert.EqualValues(t, 1, res.GetOrphansRemoved())
	assert.Empty(t, e.devices(t))
	// The same device made again before any scan (a claim in flight to a
	// round that listed the records before its intent): its grace starts
	// again, whatever the scan saw before the removal.
	_, err = e.claims.Driver().Create(ctx, gpu.CreateRequest{Profile: profile, UUID: orphan.UUID})
	require.NoError(t, err)
	res, err = e.claims.Reconcile(ctx)
	require.NoError(t, err)
	assert.Zero(t, res.GetOrphansRemoved())
	assert.Len(t, e.devices(t), 1)
}

func TestScanAllMergesScans(t *testing.T) {
	scan := func(w lease.Work, err error) func(context.Context) (lease.Work, error) {
		return func(context.Context) (lease.Work, error) { return w, err }
	}
	all := lease.ScanAll(
		scan(lease.Work{Items: []string{"orphan:d1", "release:vm1"}, UnreadableRecords: 1}, nil),
		scan(lease.Work{Items: []string{"orphan-group:7", "release:vm1"}, UnreadableRecords: 1}, nil))
	w, err := all(context.Background())
	require.NoError(t, err)
	assert.Equal(t, []string{"orphan-group:7", "orphan:d1", "release:vm1"}, w.Items, "sorted, once each")
	assert.Equal(t, 1, w.UnreadableRecords, "each scan reads the same records")

	boom := errors.New("sysfs unreadable")
	_, err = lease.ScanAll(scan(lease.Work{}, nil), scan(lease.Work{}, boom))(context.Background())
	assert.ErrorIs(t, err, boom)
}

func TestDueNeedsTwoScans(t *testing.T) {
	prev := lease.Work{Items: []string{"orphan:d1", "release:vm1"}}
	cur := lease.Work{Items: []string{"release:vm1", "release:vm2"}}
	assert.Equal(t, []string{"release:vm1"}, lease.Due(prev, cur))
	assert.Empty(t, lease.Due(lease.Work{}, cur), "work seen once may be a delete in progress")
}

// TestNewOrphansCountsEachOnce: an orphan counts at the first scan that
// finds it, by kind, and not again while later scans still see it; a
// release is no orphan.
func TestNewOrphansCountsEachOnce(t *testing.T) {
	first := lease.Work{Items: []string{"orphan-group:7", "orphan:d1", "release:vm1"}}
	assert.Equal(t, map[string]int{store.KindVGPU: 1, store.KindPassthrough: 1}, lease.NewOrphans(lease.Work{}, first))
	second := lease.Work{Items: []string{"orphan-group:7", "orphan:d1", "orphan:d2", "release:vm1"}}
	assert.Equal(t, map[string]int{store.KindVGPU: 1}, lease.NewOrphans(first, second), "only d2 is new")
	assert.Empty(t, lease.NewOrphans(second, second))
}

func TestGateSpacesOutTriggersForTheSameWork(t *testing.T) {
	g := &lease.Gate{Min: time.Minute, Max: 4 * time.Minute}
	t0 := time.Unix(0, 0)
	due := []string{"release:vm1"}
	assert.False(t, g.Should(t0, nil), "no work")
	assert.True(t, g.Should(t0, due), "new work triggers at once")
	assert.False(t, g.Should(t0.Add(30*time.Second), due))
	assert.True(t, g.Should(t0.Add(time.Minute), due), "the same work again after Min")
	assert.False(t, g.Should(t0.Add(2*time.Minute), due), "then twice as long")
	assert.True(t, g.Should(t0.Add(3*time.Minute), due))
	assert.True(t, g.Should(t0.Add(3*time.Minute), []string{"release:vm1", "release:vm2"}), "other work triggers at once")
	assert.False(t, g.Should(t0.Add(4*time.Minute), nil))
	assert.True(t, g.Should(t0.Add(4*time.Minute), due), "work that went and came back is new")
}

// One scan walks /proc's descriptors once for all its items, however many
// devices it asks about; a scan with nothing to ask walks none.
func TestScanWalksDescriptorsOnce(t *testing.T) {
	e := newClaims(t, vgpusim.Options{MdevParents: 3})
	ctx := context.Background()
	walks := lease.CountFDScans(e.claims)
	w, err := e.claims.Scan(ctx)
	require.NoError(t, err)
	assert.False(t, w.Any())
	assert.Zero(t, walks.Load(), "nothing to ask about")

	var want []string
	for _, u := range []string{"2b6c4e3a-0d4f-4a8e-9a43-6f5d2e1c0b01", "2b6c4e3a-0d4f-4a8e-9a43-6f5d2e1c0b02", "2b6c4e3a-0d4f-4a8e-9a43-6f5d2e1c0b03"} {
		d, err := e.claims.Driver().Create(ctx, gpu.CreateRequest{Profile: profile, UUID: u})
		require.NoError(t, err)
		want = append(want, "orphan:"+d.ID)
	}
	_, err = e.claims.Scan(ctx)
	require.NoError(t, err)
	e.now.Advance(2 * time.Minute)
	walks.Store(0)
	w, err = e.claims.Scan(ctx)
	require.NoError(t, err)
	assert.ElementsMatch(t, want, w.Items)
	assert.EqualValues(t, 1, walks.Load(), "three devices asked about, one walk")
}
