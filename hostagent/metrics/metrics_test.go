package metrics

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

func TestStoreGaugesFollowRecords(t *testing.T) {
	dir, err := os.MkdirTemp("/tmp", "mt")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	st, err := store.New(dir)
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	a, err := New(reg, st)
	require.NoError(t, err)

	ctx := context.Background()
	for _, id := range []string{"a", "b"} {
		_, err := st.Create(ctx, &vmflowv1.InstanceRecord{Id: id, Spec: &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none"}})
		require.NoError(t, err)
	}
	_, err = st.Apply(ctx, "b", store.LeaseIntent(store.VGPULease(&vmflowv1.VgpuLease{Profile: "GRID A100-4C", Uuid: "u"}), time.Now()))
	require.NoError(t, err)
	net := store.NetworkLease(&vmflowv1.NetworkLease{Address: "10.88.0.2/24", Gateway: "10.88.0.1", Tap: "vmtap10.88.0.2", Mac: "52:54:00:00:00:02"})
	_, err = st.Apply(ctx, "a", store.LeaseIntent(net, time.Now()))
	require.NoError(t, err)
	_, err = st.Apply(ctx, "a", store.NetworkActive())
	require.NoError(t, err)
	a.ReleaseFailures.WithLabelValues("EBUSY").Inc()
	a.RefreshStore() // what RunStoreRefresh does every DefaultStoreRefresh

	want := `
# HELP vmflow_instances Instance records on this host, by state.
# TYPE vmflow_instances gauge
vmflow_instances{state="creating"} 2
vmflow_instances{state="deleting"} 0
vmflow_instances{state="exited"} 0
vmflow_instances{state="release_failed"} 0
vmflow_instances{state="running"} 0
# HELP vmflow_leases Leases held by instance records on this host, by kind (vgpu, passthrough, network, capacity) and phase (intent, active, releasing).
# TYPE vmflow_leases gauge
vmflow_leases{kind="capacity",phase="active"} 0
vmflow_leases{kind="capacity",phase="intent"} 0
vmflow_leases{kind="capacity",phase="releasing"} 0
vmflow_leases{kind="network",phase="active"} 1
vmflow_leases{kind="network",phase="intent"} 0
vmflow_leases{kind="network",phase="releasing"} 0
vmflow_leases{kind="passthrough",phase="active"} 0
vmflow_leases{kind="passthrough",phase="intent"} 0
vmflow_leases{kind="passthrough",phase="releasing"} 0
vmflow_leases{kind="vgpu",phase="active"} 0
vmflow_leases{kind="vgpu",phase="intent"} 1
vmflow_leases{kind="vgpu",phase="releasing"} 0
# HELP vmflow_lease_release_failures_total Release stages (every lease of one instance) that failed, by errno (or reason when no errno applies).
# TYPE vmflow_lease_release_failures_total counter
vmflow_lease_release_failures_total{errno="EAGAIN"} 0
vmflow_lease_release_failures_total{errno="EBUSY"} 1
vmflow_lease_release_failures_total{errno="EIO"} 0
vmflow_lease_release_failures_total{errno="ENODEV"} 0
`
	assert.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(want),
		"vmflow_instances", "vmflow_leases", "vmflow_lease_release_failures_total"))

	names := map[string]bool{}
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		names[mf.GetName()] = true
	}
	for _, n := range []string{"vmflow_stop_duration_seconds", "vmflow_exit_detect_seconds", "vmflow_reattach_total", "vmflow_launch_duration_seconds"} {
		assert.True(t, names[n], "%s is exported before its first observation", n)
	}
	// The state file system's room, as the store reads it, with its
	// reserve in place.
	var seen []store.Space
	a.OnStateSpace(func(sp store.Space) { seen = append(seen, sp) })
	a.RefreshStore()
	require.Len(t, seen, 1)
	assert.Equal(t, float64(seen[0].Free), testutil.ToFloat64(gauge(t, reg, "vmflow_state_fs_free_bytes", "")))
	assert.Positive(t, testutil.ToFloat64(gauge(t, reg, "vmflow_state_fs_free_bytes", "")))
	assert.Equal(t, 1.0, testutil.ToFloat64(gauge(t, reg, "vmflow_state_fs_reserve_held", "")))
	assert.Equal(t, float64(store.DefaultReserve), testutil.ToFloat64(gauge(t, reg, "vmflow_state_fs_reserve_bytes", "")))
}

// TestUnreadRoomIsNotServed: when the state file system cannot be
// statted (here, the state dir is gone), its free bytes and reserve are
// left out of a scrape rather than served as 0, which an alert would read
// as a full disk; the reserve's size is still served.
func TestUnreadRoomIsNotServed(t *testing.T) {
	dir, err := os.MkdirTemp("/tmp", "mt")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	st, err := store.New(dir)
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	a, err := New(reg, st)
	require.NoError(t, err)
	served := func() map[string]bool {
		mfs, err := reg.Gather()
		require.NoError(t, err)
		names := map[string]bool{}
		for _, mf := range mfs {
			names[mf.GetName()] = true
		}
		return names
	}
	names := served()
	assert.True(t, names["vmflow_state_fs_free_bytes"])
	assert.True(t, names["vmflow_state_fs_reserve_held"])
	require.NoError(t, os.RemoveAll(dir))
	a.RefreshStore()
	names = served()
	assert.False(t, names["vmflow_state_fs_free_bytes"], "not served as 0")
	assert.False(t, names["vmflow_state_fs_reserve_held"], "not served as given up")
	assert.True(t, names["vmflow_state_fs_reserve_bytes"])
}

// TestLabelledSeriesExistAtZero: the stop histogram has a series per
// ladder step, the release histogram and the orphan counter one per lease
// kind, before anything is observed (an alert's increase() then sees the
// first one), and an observation lands in its own label's series.
func TestLabelledSeriesExistAtZero(t *testing.T) {
	reg := prometheus.NewRegistry()
	a, err := New(reg, nil)
	require.NoError(t, err)
	assert.Equal(t, len(StopSteps), testutil.CollectAndCount(a.StopDuration))
	assert.Equal(t, len(store.LeaseKinds), testutil.CollectAndCount(a.ReleaseDuration))
	assert.Equal(t, len(store.LeaseKinds)-1, testutil.CollectAndCount(a.OrphansFound), "every kind but capacity")
	a.StopDuration.WithLabelValues("quit").Observe(7)
	a.ObserveRelease(store.KindPassthrough, 2*time.Second)
	a.OrphansFound.WithLabelValues(store.KindNetwork).Add(2)
	want := `
# HELP vmflow_reconcile_orphans_found_total Resources the agent's local scans found that no record's held lease names, past their grace, by kind: vgpu and passthrough (a vfio-pci group) once each when the reconcile scan first sees them, network when the TAP reconcile removes a TAP.
# TYPE vmflow_reconcile_orphans_found_total counter
vmflow_reconcile_orphans_found_total{kind="network"} 2
vmflow_reconcile_orphans_found_total{kind="passthrough"} 0
vmflow_reconcile_orphans_found_total{kind="vgpu"} 0
`
	assert.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(want), "vmflow_reconcile_orphans_found_total"))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	counts := map[string]uint64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			if h := m.GetHistogram(); h != nil && len(m.GetLabel()) == 1 {
				counts[mf.GetName()+"/"+m.GetLabel()[0].GetValue()] = h.GetSampleCount()
			}
		}
	}
	assert.Equal(t, uint64(1), counts["vmflow_stop_duration_seconds/quit"])
	assert.Equal(t, uint64(0), counts["vmflow_stop_duration_seconds/powerdown"])
	assert.Equal(t, uint64(1), counts["vmflow_lease_release_duration_seconds/passthrough"])
	assert.Equal(t, uint64(0), counts["vmflow_lease_release_duration_seconds/vgpu"])
}

// TestScrapeReadsNoRecord: a scrape serves the store gauges from the last
// snapshot. Every record file is made garbage after New: a scrape that read
// any of them would count it unreadable, so this fails if a scrape
// re-reads the records.
func TestScrapeReadsNoRecord(t *testing.T) {
	dir, err := os.MkdirTemp("/tmp", "mt")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	st, err := store.New(dir)
	require.NoError(t, err)
	const n = 200
	ctx := context.Background()
	var records []string
	for i := range n {
		id := fmt.Sprintf("vm-%03d", i)
		_, err := st.Create(ctx, &vmflowv1.InstanceRecord{Id: id, Spec: &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none"}})
		require.NoError(t, err)
		p, err := st.Paths(id)
		require.NoError(t, err)
		records = append(records, p.Record)
	}
	reg := prometheus.NewRegistry()
	a, err := New(reg, st)
	require.NoError(t, err)
	for _, p := range records {
		require.NoError(t, os.WriteFile(p, []byte("not a record"), 0o600))
	}

	for range 3 {
		assert.Equal(t, float64(n), testutil.ToFloat64(gauge(t, reg, "vmflow_instances", "creating")))
		assert.Zero(t, testutil.ToFloat64(gauge(t, reg, "vmflow_records_unreadable", "")), "a scrape read a record")
	}
	a.RefreshStore()
	assert.Equal(t, float64(n), testutil.ToFloat64(gauge(t, reg, "vmflow_records_unreadable", "")), "a refresh reads them all")
	assert.Zero(t, testutil.ToFloat64(gauge(t, reg, "vmflow_instances", "creating")))
}

// gauge gathers reg and returns the value of name (with state label when
// state is set) as a collector testutil can read.
func gauge(t *testing.T, reg *prometheus.Registry, name, state string) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if state != "" && (len(m.GetLabel()) != 1 || m.GetLabel()[0].GetValue() != state) {
				continue
			}
			return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: "copy"}, func() float64 { return m.GetGauge().GetValue() })
		}
	}
	t.Fatalf("no %s{state=%q} in a scrape", name, state)
	return nil
}

// TestGPUDevicesByState: vmflow_gpu_devices carries one series per state
// the agent's inventory counted.
func TestGPUDevicesByState(t *testing.T) {
	reg := prometheus.NewRegistry()
	a, err := New(reg, nil)
	require.NoError(t, err)
	a.SetGPUDevices(map[string]int{"free": 3, "claimed": 2, "quarantined": 1, "not-vmflows": 0})
	want := `
# HELP vmflow_gpu_devices GPU devices on this host by state: free, claimed, quarantined (a release or reset failed --gpu-quarantine-after times), not-vmflows.
# TYPE vmflow_gpu_devices gauge
vmflow_gpu_devices{state="claimed"} 2
vmflow_gpu_devices{state="free"} 3
vmflow_gpu_devices{state="not-vmflows"} 0
vmflow_gpu_devices{state="quarantined"} 1
`
	assert.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(want), "vmflow_gpu_devices"))
}

func TestNetworkFilterDroppedFollowsTheKernelCount(t *testing.T) {
	reg := prometheus.NewRegistry()
	a, err := New(reg, nil)
	require.NoError(t, err)
	a.SetNetworkFilterDropped(7)
	want := `
# HELP vmflow_network_filter_dropped_frames_total Frames from guest TAPs the anti-spoofing filter dropped (a spoofed source, IPv6, another ethertype), as of the last TAP reconcile round.
# TYPE vmflow_network_filter_dropped_frames_total counter
vmflow_network_filter_dropped_frames_total 7
`
	assert.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(want), "vmflow_network_filter_dropped_frames_total"))
	a.SetNetworkRateDropped(9)
	want = `
# HELP vmflow_network_port_rate_dropped_frames_total Frames from guest TAPs dropped for being over a port's frames-a-second limit (--net-port-pps), as of the last TAP reconcile round.
# TYPE vmflow_network_port_rate_dropped_frames_total counter
vmflow_network_port_rate_dropped_frames_total 9
`
	assert.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(want), "vmflow_network_port_rate_dropped_frames_total"))
}
