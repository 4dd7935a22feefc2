package activities

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
	"golang.org/x/sys/unix"

	"vmflow/hostagent/admission"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// watchOpens reports, when called, whether any process opened path since
// watchOpens returned (inotify IN_OPEN: every open(2) of the file, also
// QEMU's, also a read-only one).
func watchOpens(t *testing.T, path string) func() bool {
	t.Helper()
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	require.NoError(t, err)
	t.Cleanup(func() { unix.Close(fd) })
	_, err = unix.InotifyAddWatch(fd, path, unix.IN_OPEN)
	require.NoError(t, err)
	return func() bool {
		buf := make([]byte, 4096)
		n, err := unix.Read(fd, buf)
		if errors.Is(err, unix.EAGAIN) {
			return false
		}
		require.NoError(t, err)
		return n > 0
	}
}

// TestAdmissionWithoutValidateSpawn: a caller's own workflow skips
// SpawnInstance and schedules CreateRecord, then LaunchVM, with a disk
// outside every image root. CreateRecord refuses it (InvalidInput, as
// ValidateSpawn does) and writes nothing; a record that holds such a spec
// anyway (written by an agent before this check) is refused by LaunchVM
// (AdmissionRefused, non-retryable) before the fork; and the file is never
// opened. Fails without admission in CreateRecord and PrepareLaunch: both
// activities succeed and QEMU opens the file.
func TestAdmissionWithoutValidateSpawn(t *testing.T) {
	images, err := filepath.EvalSymlinks(t.TempDir())
	require.NoError(t, err)
	secret := filepath.Join(t.TempDir(), "secret.raw")
	require.NoError(t, os.WriteFile(secret, make([]byte, 1<<20), 0o600))
	roots, err := admission.OpenImageRoots([]string{images})
	require.NoError(t, err)
	t.Cleanup(func() { roots.Close() })
	h := newHostPolicy(t, func(host *admission.Host) { host.Images = roots })
	opened := watchOpens(t, secret)

	// q35 under TCG: a machine that takes a disk, as in the report (QEMU
	// opened the file read-write as root).
	req := spawnReq("vm1")
	req.VgpuProfile, req.Machine, req.Accel = "", "q35", "tcg"
	req.Disk = secret
	t.Cleanup(func() { killRecorded(t, h.st, "vm1") })
	err = h.run(t, h.acts.CreateRecord, req, nil)
	ae := appError(t, err)
	assert.Equal(t, workflows.ErrTypeInvalidInput, ae.Type(), "the type ValidateSpawn's refusal has")
	assert.True(t, ae.NonRetryable())
	assert.Contains(t, err.Error(), "disk:")
	assert.Contains(t, err.Error(), "outside the image roots")
	_, err = h.st.Get("vm1")
	assert.ErrorIs(t, err, store.ErrNotFound, "nothing written for a refused create")

	// The same spec in a record written without admission.
	_, err = h.st.Create(context.Background(), &vmflowv1.InstanceRecord{Id: "vm1", Spec: admission.RecordSpec(req)})
	require.NoError(t, err)
	err = h.run(t, h.acts.LaunchVM, &vmflowv1.LaunchVMRequest{InstanceId: "vm1"}, nil)
	ae = appError(t, err)
	assert.Equal(t, workflows.ErrTypeAdmissionRefused, ae.Type())
	assert.True(t, ae.NonRetryable())
	assert.Contains(t, err.Error(), "refused by this host's admission policy")
	assert.Contains(t, err.Error(), "disk:")
	rec, err := h.st.Get("vm1")
	require.NoError(t, err)
	assert.Nil(t, rec.GetProcess(), "no QEMU started")
	assert.Nil(t, rec.GetLaunchStartedAt(), "refused before the launch marker: nothing forked")
	assert.Equal(t, vmflowv1.InstanceState_INSTANCE_STATE_CREATING, rec.GetState())
	assert.Contains(t, rec.GetLastError(), "outside the image roots")

	assert.False(t, opened(), "%s was opened", secret)
}

// killRecorded kills the QEMU the record of id names, if any (identity
// verified): without admission the attack starts one.
func killRecorded(t *testing.T, st *store.Store, id string) {
	rec, err := st.Get(id)
	if err != nil || rec.GetProcess() == nil {
		return
	}
	pid := store.IdentityOf(rec.GetProcess())
	if err := proc.Signal(pid, unix.SIGKILL); err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if h, err := proc.Open(pid); err == nil {
		defer h.Close()
		_ = h.Wait(ctx)
	}
}

// TestCreateRecordRefusesHugeCmdline: a 1.1 MB cmdline once passed, was
// written, and made the record unreadable ("larger than 1048576") and the
// instance undeletable. Now CreateRecord refuses it with nothing written,
// and the delete finds nothing to delete. Fails before admission in
// CreateRecord (and before the cmdline bound).
func TestCreateRecordRefusesHugeCmdline(t *testing.T) {
	h := newHost(t)
	req := spawnReq("vm1")
	req.VgpuProfile = ""
	req.Kernel = "" // the bound is checked first, whatever else is wrong
	req.Cmdline = strings.Repeat("x", 1100*1000)
	err := h.run(t, h.acts.CreateRecord, req, nil)
	ae := appError(t, err)
	assert.Equal(t, workflows.ErrTypeInvalidInput, ae.Type())
	assert.True(t, ae.NonRetryable())
	assert.Contains(t, err.Error(), "cmdline: 1100000 bytes, longer than 2047")
	assert.Less(t, len(err.Error()), 4096, "the refusal does not quote the value")

	var begun vmflowv1.BeginDeleteResult
	require.NoError(t, h.run(t, h.acts.BeginDelete, &vmflowv1.BeginDeleteRequest{InstanceId: "vm1"}, &begun))
	assert.True(t, begun.GetAlreadyAbsent())
}

// TestHostActivityInputsAreBounded: the string fields of the host
// activities' requests that the spawn request does not carry are bounded
// too; an oversized one is refused with nothing touched.
func TestHostActivityInputsAreBounded(t *testing.T) {
	h := newHost(t)
	require.NoError(t, h.run(t, h.acts.CreateRecord, spawnReq("vm1"), nil))

	err := h.run(t, h.acts.ClaimVGPU, &vmflowv1.ClaimVGPURequest{InstanceId: "vm1", VgpuProfile: strings.Repeat("p", admission.MaxProfileBytes+1)}, nil)
	assert.Equal(t, workflows.ErrTypeInvalidInput, appError(t, err).Type())
	rec, err := h.st.Get("vm1")
	require.NoError(t, err)
	assert.Nil(t, store.VGPU(rec))

	err = h.run(t, h.acts.BeginDelete, &vmflowv1.BeginDeleteRequest{InstanceId: "vm1",
		OnlyIfCreatedByWorkflowId: strings.Repeat("w", admission.MaxWorkflowIDBytes+1), OnlyIfCreatedByRunId: "r"}, nil)
	assert.Equal(t, workflows.ErrTypeInvalidInput, appError(t, err).Type())
	marked, err := h.st.ManualStop("vm1")
	require.NoError(t, err)
	assert.False(t, marked, "nothing written for a refused delete")

	err = h.run(t, h.acts.ReconcileHost, &vmflowv1.ReconcileVGPURequest{HostId: strings.Repeat("h", 1<<16)}, nil)
	assert.Equal(t, workflows.ErrTypeInvalidInput, appError(t, err).Type())
}

// On a host without KVM a spawn that leaves accel empty (KVM) is refused by
// ValidateSpawn and by CreateRecord alike, as invalid input (no retry),
// saying the host has no KVM and that accel "tcg" exists; nothing is
// written. Without the check both pass and LaunchVM fails after the record
// was created.
func TestNoKVMSpawnRefused(t *testing.T) {
	h := newHostPolicy(t, func(host *admission.Host) {
		host.KVM = vmm.CheckKVM(filepath.Join(t.TempDir(), "kvm"))
	})
	req := spawnReq("vm1")
	req.Accel, req.VgpuProfile = "", ""
	for name, fn := range map[string]any{"ValidateSpawn": h.acts.ValidateSpawn, "CreateRecord": h.acts.CreateRecord} {
		err := h.run(t, fn, req, nil)
		ae := appError(t, err)
		assert.Equal(t, workflows.ErrTypeInvalidInput, ae.Type(), name)
		assert.True(t, ae.NonRetryable(), name)
		assert.Contains(t, err.Error(), "this host has no KVM", name)
		assert.Contains(t, err.Error(), `accel "tcg"`, name)
	}
	_, err := h.st.Get("vm1")
	assert.ErrorIs(t, err, store.ErrNotFound, "nothing written for a refused spawn")
}

// TestClaimServesOnlyWhatTheRecordNames: the claim is what the admitted
// record names: a request for more vGPUs, another profile or whole GPUs
// for a vGPU record is refused as invalid input with nothing held (before,
// the claim took the request's fields).
func TestClaimServesOnlyWhatTheRecordNames(t *testing.T) {
	h := newHost(t)
	a := h.acts
	req := spawnReq("vm1")
	require.NoError(t, h.run(t, a.CreateRecord, req, nil))
	for _, bad := range []*vmflowv1.ClaimVGPURequest{
		{InstanceId: "vm1", VgpuProfile: req.GetVgpuProfile(), VgpuCount: 2},
		{InstanceId: "vm1", VgpuProfile: "GRID A100-8C"},
		{InstanceId: "vm1", GpuPassthroughCount: 1},
	} {
		err := h.run(t, a.ClaimDevices, bad, nil)
		require.Error(t, err, "%v", bad)
		assert.Equal(t, workflows.ErrTypeInvalidInput, appError(t, err).Type(), "%v", bad)
		rec, err := h.st.Get("vm1")
		require.NoError(t, err)
		assert.Empty(t, store.HeldLeases(rec), "nothing held after %v", bad)
	}
	var claim vmflowv1.ClaimVGPUResult
	require.NoError(t, h.run(t, a.ClaimDevices, &vmflowv1.ClaimVGPURequest{InstanceId: "vm1", VgpuProfile: req.GetVgpuProfile()}, &claim))
	assert.Len(t, claim.GetDeviceIds(), 1)
}
