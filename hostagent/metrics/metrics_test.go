package metrics

import (
	"context"
	"os"
	"strings"
	"testing"

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
	_, err = st.Update(ctx, "b", func(r *vmflowv1.InstanceRecord) error {
		r.GpuClaim = &vmflowv1.GpuClaim{Profile: "GRID A100-4C", Uuid: "u"}
		return nil
	})
	require.NoError(t, err)
	a.ReleaseFailures.WithLabelValues("EBUSY").Inc()

	want := `
# HELP vmflow_instances Instance records on this host, by state.
# TYPE vmflow_instances gauge
vmflow_instances{state="creating"} 2
vmflow_instances{state="deleting"} 0
vmflow_instances{state="exited"} 0
vmflow_instances{state="release_failed"} 0
vmflow_instances{state="running"} 0
# HELP vmflow_vgpu_claims vGPU claims held by instance records on this host.
# TYPE vmflow_vgpu_claims gauge
vmflow_vgpu_claims 1
# HELP vmflow_vgpu_release_failures_total vGPU releases that failed, by errno (or reason when no errno applies).
# TYPE vmflow_vgpu_release_failures_total counter
vmflow_vgpu_release_failures_total{errno="EAGAIN"} 0
vmflow_vgpu_release_failures_total{errno="EBUSY"} 1
vmflow_vgpu_release_failures_total{errno="EIO"} 0
vmflow_vgpu_release_failures_total{errno="ENODEV"} 0
`
	assert.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(want),
		"vmflow_instances", "vmflow_vgpu_claims", "vmflow_vgpu_release_failures_total"))

	names := map[string]bool{}
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		names[mf.GetName()] = true
	}
	for _, n := range []string{"vmflow_stop_duration_seconds", "vmflow_exit_detect_seconds", "vmflow_reattach_total", "vmflow_launch_duration_seconds"} {
		assert.True(t, names[n], "%s is exported before its first observation", n)
	}
}
