package cli_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/hostagent/cli"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// hostFixture is a state dir holding one instance of every kind ls and show
// must tell apart, written through the store as the agent writes them.
type hostFixture struct {
	dir  string
	st   *store.Store
	self proc.Identity // this test process: a live QEMU stand-in
}

const (
	idRunning  = "vm-running"  // running, alive process, active vendor claim
	idGone     = "vm-gone"     // running, recorded process no longer exists
	idOldBoot  = "vm-oldboot"  // exited state kept a process from another boot
	idBad      = "vm-bad"      // record.json is not a record
	idRelFail  = "vm-relfail"  // release failed, claim held, marker written
	idDeleting = "vm-deleting" // deleting, claim still held
	idLaunch   = "vm-launch"   // launch marker without a process
	idDupA     = "vm-dup-a"    // two held claims on one mdev
	idDupB     = "vm-dup-b"
	idNoRecord = "vm-norecord" // a directory without record.json
	idCreating = "vm-creating" // freshly created, nothing to report
)

func newHostFixture(t *testing.T) *hostFixture {
	t.Helper()
	dir := t.TempDir()
	st, err := store.New(dir)
	require.NoError(t, err)
	self, err := proc.ReadIdentity(os.Getpid())
	require.NoError(t, err)
	f := &hostFixture{dir: dir, st: st, self: self}
	ctx := context.Background()

	create := func(id string) {
		t.Helper()
		_, err := st.Create(ctx, &vmflowv1.InstanceRecord{
			Id:                  id,
			Spec:                &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 128, Machine: "none", Accel: "kvm"},
			CreatedByWorkflowId: "spawn/" + id, CreatedByRunId: "run-" + id,
		})
		require.NoError(t, err)
	}
	update := func(id string, fn func(*vmflowv1.InstanceRecord)) {
		t.Helper()
		_, err := st.Update(ctx, id, func(r *vmflowv1.InstanceRecord) error { fn(r); return nil })
		require.NoError(t, err)
	}
	claim := func(dev, uuid string) []*vmflowv1.Lease {
		l := store.VGPULease(&vmflowv1.VgpuLease{Profile: "GRID A100-4C", Parent: "0000:3b:00.0", TypeId: "nvidia-471",
			Uuid: uuid, DeviceId: dev})
		l.Phase, l.ClaimedAt = vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, timestamppb.Now()
		return []*vmflowv1.Lease{l}
	}

	create(idRunning)
	update(idRunning, func(r *vmflowv1.InstanceRecord) {
		r.State = vmflowv1.InstanceState_INSTANCE_STATE_RUNNING
		r.Process = store.ProcessRecord(self)
		r.Leases = claim("0000:3b:00.4", "6f9b6c1e-0000-4000-8000-000000000001")
		r.Leases[0].GetVgpu().Driver = "vendor"
		net := store.NetworkLease(&vmflowv1.NetworkLease{Tap: "vmtap0a580002", Mac: "02:11:22:33:44:55", Address: "10.88.0.2/24",
			Gateway: "10.88.0.1", Bridge: "vmflow0"})
		net.Phase = vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE
		r.Leases = append(r.Leases, net)
		r.CreatedAt = timestamppb.New(time.Now().Add(-2 * time.Hour))
	})

	create(idGone)
	gone := self
	gone.StartTime++ // the pid now names another process: the recorded one is gone
	update(idGone, func(r *vmflowv1.InstanceRecord) {
		r.State = vmflowv1.InstanceState_INSTANCE_STATE_RUNNING
		r.Process = store.ProcessRecord(gone)
	})

	create(idOldBoot)
	old := self
	old.BootID = "00000000-0000-4000-8000-000000000000"
	update(idOldBoot, func(r *vmflowv1.InstanceRecord) {
		r.State = vmflowv1.InstanceState_INSTANCE_STATE_RUNNING
		r.Process = store.ProcessRecord(old)
	})

	create(idRelFail)
	require.NoError(t, st.MarkManualStop(ctx, idRelFail))
	update(idRelFail, func(r *vmflowv1.InstanceRecord) {
		r.Leases = claim("", "6f9b6c1e-0000-4000-8000-000000000002")
		r.State = vmflowv1.InstanceState_INSTANCE_STATE_DELETING
	})
	_, err = st.Apply(ctx, idRelFail, store.LeaseReleaseFailed("vgpu:6f9b6c1e-0000-4000-8000-000000000002", "write remove: device or resource busy"))
	require.NoError(t, err)

	create(idDeleting)
	require.NoError(t, st.MarkManualStop(ctx, idDeleting))
	update(idDeleting, func(r *vmflowv1.InstanceRecord) {
		r.Leases = claim("", "6f9b6c1e-0000-4000-8000-000000000003")
		r.Leases[0].Phase = vmflowv1.ClaimPhase_CLAIM_PHASE_RELEASING
		r.State = vmflowv1.InstanceState_INSTANCE_STATE_DELETING
	})

	create(idLaunch)
	update(idLaunch, func(r *vmflowv1.InstanceRecord) {
		r.LaunchStartedAt = timestamppb.New(time.Now().Add(-time.Minute))
	})

	for _, id := range []string{idDupA, idDupB} {
		create(id)
		update(id, func(r *vmflowv1.InstanceRecord) {
			r.Leases = claim("", "6f9b6c1e-0000-4000-8000-0000000000dd")
		})
	}

	create(idCreating)

	create(idBad)
	p, err := st.Paths(idBad)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p.Record, []byte(`{"id":"vm-bad","spec":{},"stat":"oops"}`), 0o600))

	np, err := st.Paths(idNoRecord)
	require.NoError(t, err)
	require.NoError(t, os.Mkdir(np.Dir, 0o700))
	return f
}

func (f *hostFixture) recordPath(t *testing.T, id string) string {
	t.Helper()
	p, err := f.st.Paths(id)
	require.NoError(t, err)
	return p.Record
}

type lsRow struct {
	ID         string `json:"id"`
	State      string `json:"state"`
	RecordPath string `json:"record_path"`
	Error      string `json:"error"`
	Process    *struct {
		PID   int    `json:"pid"`
		State string `json:"state"`
		Alive bool   `json:"alive"`
	} `json:"process"`
	ClaimPhase     string   `json:"claim_phase"`
	ClaimDevice    string   `json:"claim_device"`
	ClaimHeld      *bool    `json:"claim_held"`
	ManualStop     bool     `json:"manual_stop"`
	AgeSeconds     int64    `json:"age_seconds"`
	NeedsAttention []string `json:"needs_attention"`
}

func runLs(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := cli.Ls(args, cli.IO{Stdout: &stdout, Stderr: &stderr})
	return code, stdout.String(), stderr.String()
}

func lsJSON(t *testing.T, dir string) map[string]lsRow {
	t.Helper()
	code, out, stderr := runLs(t, "--state-dir", dir, "-o", "json")
	require.Equal(t, cli.ExitOK, code, stderr)
	var rows []lsRow
	require.NoError(t, json.Unmarshal([]byte(out), &rows), out)
	m := map[string]lsRow{}
	var ids []string
	for _, r := range rows {
		m[r.ID] = r
		ids = append(ids, r.ID)
	}
	assert.IsNonDecreasing(t, ids, "sorted by id")
	return m
}

// TestLsReportsEveryInstance: every instance directory is a row, the
// unreadable record included (with its path), each with the liveness of
// its recorded identity, its claim, and the reasons it needs attention.
func TestLsReportsEveryInstance(t *testing.T) {
	f := newHostFixture(t)
	rows := lsJSON(t, f.dir)
	require.Len(t, rows, 11)

	r := rows[idRunning]
	assert.Equal(t, "running", r.State)
	require.NotNil(t, r.Process)
	assert.Equal(t, os.Getpid(), r.Process.PID)
	assert.True(t, r.Process.Alive)
	assert.Equal(t, "active", r.ClaimPhase)
	assert.Equal(t, "0000:3b:00.4", r.ClaimDevice, "a vendor claim is its VF")
	assert.Equal(t, ptr(true), r.ClaimHeld)
	assert.InDelta(t, 2*3600, r.AgeSeconds, 60)
	assert.Empty(t, r.NeedsAttention)
	assert.NotNil(t, r.NeedsAttention, "[] in JSON, never null")

	r = rows[idGone]
	require.NotNil(t, r.Process)
	assert.False(t, r.Process.Alive, "a reused pid (other start time) is not the recorded process")
	assert.Equal(t, "exited", r.Process.State)
	assertAttention(t, r, "recorded QEMU pid", "is gone")

	assertAttention(t, rows[idOldBoot], "from an earlier boot")
	assert.False(t, rows[idOldBoot].Process.Alive)

	r = rows[idBad]
	assert.Equal(t, cli.StateUnreadable, r.State)
	assert.Equal(t, f.recordPath(t, idBad), r.RecordPath)
	assert.Contains(t, r.Error, "invalid instance record")
	assert.Nil(t, r.ClaimHeld, "unknown, not false")
	assertAttention(t, r, "record unreadable: "+f.recordPath(t, idBad))

	r = rows[idRelFail]
	assert.Equal(t, "release_failed", r.State)
	assert.True(t, r.ManualStop)
	assert.Equal(t, ptr(true), r.ClaimHeld)
	assertAttention(t, r, "release failed 1 time(s): write remove: device or resource busy")

	r = rows[idDeleting]
	assert.Equal(t, "deleting", r.State)
	assert.Equal(t, "releasing", r.ClaimPhase)
	assertAttention(t, r, "being deleted with its vGPU claim still held (phase releasing)")

	assertAttention(t, rows[idLaunch], "launch marker without a process")
	assertAttention(t, rows[idDupA], "claimed by 2 instances: vm-dup-a, vm-dup-b")
	assertAttention(t, rows[idDupB], "claimed by 2 instances: vm-dup-a, vm-dup-b")

	assert.Equal(t, cli.StateNoRecord, rows[idNoRecord].State)
	assert.NotEmpty(t, rows[idNoRecord].NeedsAttention)

	r = rows[idCreating]
	assert.Equal(t, "creating", r.State)
	assert.Nil(t, r.Process)
	assert.Equal(t, ptr(false), r.ClaimHeld)
	assert.Empty(t, r.NeedsAttention)
}

func ptr[T any](v T) *T { return &v }

func assertAttention(t *testing.T, r lsRow, parts ...string) {
	t.Helper()
	for _, reason := range r.NeedsAttention {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(reason, p)
		}
		if all {
			return
		}
	}
	t.Errorf("%s: no needs-attention reason with %q in %q", r.ID, parts, r.NeedsAttention)
}

func TestLsTable(t *testing.T) {
	f := newHostFixture(t)
	code, out, stderr := runLs(t, "--state-dir", f.dir)
	require.Equal(t, cli.ExitOK, code, stderr)
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	require.Len(t, lines, 12, out)
	assert.Regexp(t, `^ID +STATE +PID +ALIVE +VGPU +IP +AGE +NEEDS ATTENTION$`, lines[0])
	row := func(id string) string {
		for _, l := range lines[1:] {
			if strings.HasPrefix(l, id+" ") {
				return l
			}
		}
		t.Fatalf("no row for %s in\n%s", id, out)
		return ""
	}
	assert.Regexp(t, fmt.Sprintf(`^%s +running +%d +yes +active 0000:3b:00.4 +10.88.0.2/24 +2h\dm +-$`, idRunning, os.Getpid()), row(idRunning))
	assert.Regexp(t, `^vm-gone +running +\d+ +no +- `, row(idGone))
	assert.Contains(t, row(idBad), "unreadable")
	assert.Contains(t, row(idBad), f.recordPath(t, idBad))
}

// snapshot is everything about a state dir a write could change: each
// entry's path, mode, size, mtime and content hash.
func snapshot(t *testing.T, dir string) map[string]string {
	t.Helper()
	m := map[string]string{}
	require.NoError(t, filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		sum := ""
		if fi.Mode().IsRegular() {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			sum = fmt.Sprintf("%x", sha256.Sum256(b))
		}
		m[p] = fmt.Sprintf("%v %d %d %s", fi.Mode(), fi.Size(), fi.ModTime().UnixNano(), sum)
		return nil
	}))
	return m
}

// TestLsShowWriteNothing: ls and show leave the state dir exactly as it was
// (New would tighten modes, create locks/ and finish interrupted deletes;
// a command run beside the agent must do none of that), and a mistyped
// --state-dir is an error, not a new store.
func TestLsShowWriteNothing(t *testing.T) {
	f := newHostFixture(t)
	// What New changes: an interrupted delete's trash, a loose mode, no
	// locks/ folder.
	require.NoError(t, os.Mkdir(filepath.Join(f.dir, "instances", ".deleted-vm-x-123"), 0o700))
	require.NoError(t, os.Chmod(filepath.Join(f.dir, "instances"), 0o755))
	require.NoError(t, os.RemoveAll(filepath.Join(f.dir, "locks")))
	before := snapshot(t, f.dir)

	for _, args := range [][]string{{}, {"-o", "json"}} {
		code, _, stderr := runLs(t, append(args, "--state-dir", f.dir)...)
		require.Equal(t, cli.ExitOK, code, stderr)
	}
	for _, id := range []string{idRunning, idBad, idRelFail, idNoRecord} {
		for _, o := range []string{"table", "json"} {
			code, _, stderr := runShow(t, "--state-dir", f.dir, "-o", o, id)
			require.Equal(t, cli.ExitOK, code, stderr)
		}
	}
	assert.Equal(t, before, snapshot(t, f.dir))

	missing := filepath.Join(t.TempDir(), "typo")
	code, _, stderr := runLs(t, "--state-dir", missing)
	assert.Equal(t, cli.ExitError, code)
	assert.Contains(t, stderr, "--state-dir")
	code, _, _ = runShow(t, "--state-dir", missing, idRunning)
	assert.Equal(t, cli.ExitError, code)
	assert.NoDirExists(t, missing)
}

func TestLsBadArgs(t *testing.T) {
	dir := t.TempDir()
	_, err := store.New(dir)
	require.NoError(t, err)
	for _, args := range [][]string{{"extra"}, {"-o", "yaml"}, {"--bogus"}} {
		code, _, _ := runLs(t, append([]string{"--state-dir", dir}, args...)...)
		assert.Equal(t, cli.ExitUsage, code, "%q", args)
	}
	code, out, _ := runLs(t, "--state-dir", dir, "-o", "json")
	assert.Equal(t, cli.ExitOK, code)
	assert.JSONEq(t, "[]", out, "an empty host is an empty list, not null")
}

// TestNetworkReleaseFailureNamed: a delete parked on its network lease's
// release says so (not "vGPU release failed 0 time(s)").
func TestNetworkReleaseFailureNamed(t *testing.T) {
	dir := t.TempDir()
	st, err := store.New(dir)
	require.NoError(t, err)
	ctx := context.Background()
	_, err = st.Create(ctx, &vmflowv1.InstanceRecord{Id: "vm-net", Spec: &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "q35", Network: "default"}})
	require.NoError(t, err)
	_, err = st.Apply(ctx, "vm-net", store.LeaseIntent(store.NetworkLease(&vmflowv1.NetworkLease{Tap: "vmtap0a580002", Address: "10.88.0.2/24",
		Gateway: "10.88.0.1", Mac: "02:00:00:00:00:01"}), time.Now()), store.NetworkActive())
	require.NoError(t, err)
	require.NoError(t, st.MarkManualStop(ctx, "vm-net"))
	_, err = st.Transition(ctx, "vm-net", vmflowv1.InstanceState_INSTANCE_STATE_DELETING)
	require.NoError(t, err)
	_, err = st.Apply(ctx, "vm-net", store.LeaseReleaseFailed("network:10.88.0.2", "link is not this lease's TAP"))
	require.NoError(t, err)
	r := lsJSON(t, dir)["vm-net"]
	assert.Equal(t, "release_failed", r.State)
	assertAttention(t, r, "network release failed 1 time(s): link is not this lease's TAP")
}
