package store

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

func TestCreateLayoutAndModes(t *testing.T) {
	s := newStore(t)
	rec := mustCreate(t, s, "vm1")
	assert.Equal(t, creating, rec.GetState())
	assert.NotNil(t, rec.GetCreatedAt())

	p, err := s.Paths("vm1")
	require.NoError(t, err)
	assert.Equal(t, filepath.Join(s.StateDir(), "instances", "vm1"), p.Dir)
	for path, name := range map[string]string{
		p.Record: "record.json", p.Socket: "qemu.sock", p.Log: "qemu.log", p.PID: "qemu.pid", p.ManualStop: "manual-stop",
	} {
		assert.Equal(t, filepath.Join(p.Dir, name), path)
	}

	for _, d := range []string{filepath.Join(s.StateDir(), "instances"), p.Dir} {
		fi, err := os.Stat(d)
		require.NoError(t, err)
		assert.Equal(t, os.FileMode(0o700), fi.Mode().Perm(), d)
	}
	require.NoError(t, s.MarkManualStop(context.Background(), "vm1"))
	for _, f := range []string{p.Record, p.ManualStop} {
		fi, err := os.Stat(f)
		require.NoError(t, err)
		assert.Equal(t, os.FileMode(0o600), fi.Mode().Perm(), f)
	}

	// The file is snake_case JSON an operator can read. (protojson varies
	// its whitespace on purpose, so compare parsed JSON, not text.)
	b, err := os.ReadFile(p.Record)
	require.NoError(t, err)
	var doc map[string]any
	require.NoError(t, json.Unmarshal(b, &doc))
	assert.Equal(t, "on-failure", doc["restart_policy"])
	assert.Equal(t, "INSTANCE_STATE_CREATING", doc["state"])
	assert.Equal(t, map[string]any{
		"vcpus": 1.0, "memory_mib": 128.0, "machine": "none", "accel": "kvm", "uuid": testSpec().GetUuid(),
	}, doc["spec"])

	got, err := s.Get("vm1")
	require.NoError(t, err)
	assert.True(t, proto.Equal(rec, got))
}

func TestNewTightensExistingDirs(t *testing.T) {
	dir, err := os.MkdirTemp("", "vst")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	require.NoError(t, os.Mkdir(filepath.Join(dir, "instances"), 0o755))
	require.NoError(t, os.Chmod(filepath.Join(dir, "instances"), 0o755))
	_, err = New(dir)
	require.NoError(t, err)
	fi, err := os.Stat(filepath.Join(dir, "instances"))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o700), fi.Mode().Perm())

	_, err = New("")
	assert.Error(t, err)
}

func TestCreateIdempotent(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	first := mustCreate(t, s, "vm1")
	moveTo(t, s, "vm1", running)

	// A retried create with the same spec returns the existing record, in
	// whatever state it reached, and writes nothing.
	again, err := s.Create(ctx, wantRecord("vm1"))
	require.NoError(t, err)
	assert.Equal(t, running, again.GetState())
	assert.True(t, proto.Equal(first.GetCreatedAt(), again.GetCreatedAt()))

	// Fields other than the desired configuration are ignored in the input.
	w := wantRecord("vm1")
	w.State = exited
	w.LastError = "ignored"
	again, err = s.Create(ctx, w)
	require.NoError(t, err)
	assert.Equal(t, running, again.GetState())
	assert.Empty(t, again.GetLastError())
}

func TestCreateRefused(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name    string
		state   vmflowv1.InstanceState
		mutate  func(*vmflowv1.InstanceRecord)
		wantErr error
		wantMsg string
	}{
		{"different vcpus", running, func(r *vmflowv1.InstanceRecord) { r.Spec.Vcpus = 2 }, ErrConflict, "spec.vcpus 1 -> 2"},
		{"different machine", creating, func(r *vmflowv1.InstanceRecord) { r.Spec.Machine = "q35" }, ErrConflict, `spec.machine "none" -> "q35"`},
		{"different uuid", exited, func(r *vmflowv1.InstanceRecord) { r.Spec.Uuid = "other" }, ErrConflict, "spec.uuid"},
		{"different restart policy", running, func(r *vmflowv1.InstanceRecord) { r.RestartPolicy = "always" }, ErrConflict, "restart_policy"},
		{"different max attempts", running, func(r *vmflowv1.InstanceRecord) { r.RestartMaxAttempts = 9 }, ErrConflict, "restart_max_attempts 3 -> 9"},
		{"different stable after", running, func(r *vmflowv1.InstanceRecord) { r.RestartStableAfterSeconds = 60 }, ErrConflict, "restart_stable_after_seconds"},
		{"same spec while deleting", deleting, func(*vmflowv1.InstanceRecord) {}, ErrDeleting, "state deleting"},
		{"same spec while release failed", releaseFailed, func(*vmflowv1.InstanceRecord) {}, ErrDeleting, "state release_failed"},
		{"different spec while deleting", deleting, func(r *vmflowv1.InstanceRecord) { r.Spec.Vcpus = 4 }, ErrDeleting, "deleting"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newStore(t)
			mustCreate(t, s, "vm1")
			moveTo(t, s, "vm1", tt.state)
			before, err := s.Get("vm1")
			require.NoError(t, err)

			w := wantRecord("vm1")
			tt.mutate(w)
			_, err = s.Create(ctx, w)
			require.ErrorIs(t, err, tt.wantErr)
			assert.Contains(t, err.Error(), tt.wantMsg)

			after, err := s.Get("vm1")
			require.NoError(t, err)
			assert.True(t, proto.Equal(before, after), "a refused create must not write")
		})
	}
}

func TestCreateInvalidInput(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	_, err := s.Create(ctx, &vmflowv1.InstanceRecord{Id: "vm1"})
	assert.ErrorIs(t, err, ErrInvalidRecord)
	_, err = s.Create(ctx, nil)
	assert.ErrorIs(t, err, ErrInvalidID)
	_, err = s.Get("vm1")
	assert.ErrorIs(t, err, ErrNotFound)
}

func TestBadIDsRefused(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	bad := []string{"", "..", ".", "/", "a/b", "../x", "vm1/../../etc", "VM1", "Vm", "-vm", "vm_1", "vm 1", "vm.1",
		strings.Repeat("a", 64), strings.Repeat("a", 200), "vm\x00", "vm\n", "é"}
	for _, id := range bad {
		t.Run(quoteID(id), func(t *testing.T) {
			require.ErrorIs(t, ValidateID(id), ErrInvalidID)
			_, err := s.Paths(id)
			assert.ErrorIs(t, err, ErrInvalidID)
			w := wantRecord(id)
			_, err = s.Create(ctx, w)
			assert.ErrorIs(t, err, ErrInvalidID)
			_, err = s.Get(id)
			assert.ErrorIs(t, err, ErrInvalidID)
			_, err = s.Update(ctx, id, func(*vmflowv1.InstanceRecord) error { return nil })
			assert.ErrorIs(t, err, ErrInvalidID)
			assert.ErrorIs(t, s.Delete(ctx, id), ErrInvalidID)
			assert.ErrorIs(t, s.MarkManualStop(ctx, id), ErrInvalidID)
			_, err = s.ManualStop(id)
			assert.ErrorIs(t, err, ErrInvalidID)
			_, err = s.Lock(ctx, id)
			assert.ErrorIs(t, err, ErrInvalidID)
		})
	}
	// Nothing was created anywhere for any of them.
	entries, err := os.ReadDir(filepath.Join(s.StateDir(), "instances"))
	require.NoError(t, err)
	assert.Empty(t, entries)
	entries, err = os.ReadDir(s.StateDir())
	require.NoError(t, err)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	assert.ElementsMatch(t, []string{"instances", "locks", "qemu-uids", "reserve"}, names)
}

func TestGoodIDs(t *testing.T) {
	for _, id := range []string{"a", "0", "vm1", "vm-1", "a-", "a--b", strings.Repeat("a", 63), "0123456789abcdefghijklmnopqrstuvwxyz"} {
		assert.NoError(t, ValidateID(id), id)
	}
}

// A 63-byte id under a state dir far longer than the 23 bytes a Unix socket
// address leaves it is created: the socket path's length is the VMM's
// business (it binds and dials through the directory), not a refusal.
func TestLongStateDirCreates(t *testing.T) {
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), strings.Repeat("d", 90))
	s, err := New(dir)
	require.NoError(t, err)
	id := strings.Repeat("a", 63)
	p, err := s.Paths(id)
	require.NoError(t, err)
	require.Greater(t, len(p.Socket), 107, "longer than sun_path holds")
	_, err = s.Create(ctx, wantRecord(id))
	require.NoError(t, err)
	_, err = s.Get(id)
	assert.NoError(t, err)
}

func TestUpdate(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	created := mustCreate(t, s, "vm1")

	rec, err := s.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.Process = &vmflowv1.ProcessIdentity{Pid: 42, StartTime: 1234567, BootId: "b00t"}
		r.StopStep = vmflowv1.StopStep_STOP_STEP_POWERDOWN_SENT
		return nil
	})
	require.NoError(t, err)
	assert.Equal(t, int32(42), rec.GetProcess().GetPid())
	assert.False(t, rec.GetUpdatedAt().AsTime().Before(created.GetUpdatedAt().AsTime()))
	got, err := s.Get("vm1")
	require.NoError(t, err)
	assert.True(t, proto.Equal(rec, got))

	// fn's error: nothing written, error wrapped.
	errBoom := errors.New("boom")
	_, err = s.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.LastError = "half done"
		return errBoom
	})
	require.ErrorIs(t, err, errBoom)
	got, err = s.Get("vm1")
	require.NoError(t, err)
	assert.Empty(t, got.GetLastError())

	// The id cannot change.
	_, err = s.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.Id = "vm2"
		return nil
	})
	require.ErrorIs(t, err, ErrInvalidRecord)

	// An unknown enum value is refused before it reaches the disk.
	_, err = s.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.StopStep = 77
		return nil
	})
	require.ErrorIs(t, err, ErrInvalidRecord)

	// No change, no write.
	before, err := os.Stat(filepath.Join(s.StateDir(), "instances", "vm1", "record.json"))
	require.NoError(t, err)
	_, err = s.Update(ctx, "vm1", func(*vmflowv1.InstanceRecord) error { return nil })
	require.NoError(t, err)
	after, err := os.Stat(filepath.Join(s.StateDir(), "instances", "vm1", "record.json"))
	require.NoError(t, err)
	assert.True(t, os.SameFile(before, after), "an unchanged record is not rewritten")

	_, err = s.Update(ctx, "nope", func(*vmflowv1.InstanceRecord) error { return nil })
	require.ErrorIs(t, err, ErrNotFound)
}

var allStates = []vmflowv1.InstanceState{
	vmflowv1.InstanceState_INSTANCE_STATE_UNSPECIFIED, creating, running, exited, deleting, releaseFailed,
}

// legal is the state machine as the issue states it, written out again on
// purpose: the table below checks the store's copy against it.
var legal = map[[2]vmflowv1.InstanceState]bool{
	{creating, running}:       true,
	{running, exited}:         true,
	{exited, running}:         true,
	{creating, deleting}:      true,
	{running, deleting}:       true,
	{exited, deleting}:        true,
	{deleting, releaseFailed}: true,
	{releaseFailed, deleting}: true,
}

func TestCheckTransitionAllPairs(t *testing.T) {
	for _, from := range allStates {
		for _, to := range append(allStates, vmflowv1.InstanceState(99)) {
			t.Run(StateName(from)+"->"+StateName(to), func(t *testing.T) {
				err := CheckTransition(from, to)
				if legal[[2]vmflowv1.InstanceState{from, to}] {
					assert.NoError(t, err)
					return
				}
				require.ErrorIs(t, err, ErrIllegalTransition)
				var te *TransitionError
				require.ErrorAs(t, err, &te)
				assert.Equal(t, from, te.From)
				assert.Equal(t, to, te.To)
			})
		}
	}
}

// TestUpdateTransitionsAllPairs drives a real record into every state and
// tries every target through Update: illegal ones are refused with nothing
// written, legal ones land.
func TestUpdateTransitionsAllPairs(t *testing.T) {
	ctx := context.Background()
	for _, from := range allStates[1:] {
		for _, to := range allStates {
			if from == to {
				continue // not a transition; Update accepts "no change"
			}
			t.Run(StateName(from)+"->"+StateName(to), func(t *testing.T) {
				s := newStore(t)
				mustCreate(t, s, "vm1")
				moveTo(t, s, "vm1", from)
				// The marker is written for every case so only the state
				// machine decides here (the marker rule has its own test).
				require.NoError(t, s.MarkManualStop(ctx, "vm1"))
				before, err := s.Get("vm1")
				require.NoError(t, err)

				rec, err := s.Transition(ctx, "vm1", to)
				if legal[[2]vmflowv1.InstanceState{from, to}] {
					require.NoError(t, err)
					assert.Equal(t, to, rec.GetState())
					return
				}
				require.ErrorIs(t, err, ErrIllegalTransition)
				after, err := s.Get("vm1")
				require.NoError(t, err)
				assert.True(t, proto.Equal(before, after), "a refused transition must not write")
			})
		}
	}
}

func TestDeletingRequiresMarker(t *testing.T) {
	ctx := context.Background()
	for _, from := range []vmflowv1.InstanceState{creating, running, exited} {
		t.Run(StateName(from), func(t *testing.T) {
			s := newStore(t)
			mustCreate(t, s, "vm1")
			moveTo(t, s, "vm1", from)
			_, err := s.Transition(ctx, "vm1", deleting)
			require.ErrorIs(t, err, ErrManualStopMissing)
			rec, err := s.Get("vm1")
			require.NoError(t, err)
			assert.Equal(t, from, rec.GetState())

			require.NoError(t, s.MarkManualStop(ctx, "vm1"))
			_, err = s.Transition(ctx, "vm1", deleting)
			require.NoError(t, err)
		})
	}
}

func TestDeleteRefusedWithClaim(t *testing.T) {
	ctx := context.Background()
	phases := []vmflowv1.ClaimPhase{
		vmflowv1.ClaimPhase_CLAIM_PHASE_INTENT, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, vmflowv1.ClaimPhase_CLAIM_PHASE_RELEASING,
	}
	for _, phase := range phases {
		t.Run(phase.String(), func(t *testing.T) {
			s := newStore(t)
			mustCreate(t, s, "vm1")
			_, err := s.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
				r.Leases = []*vmflowv1.Lease{vgpuLease(&vmflowv1.VgpuLease{Profile: "nvidia-35", Uuid: "6c2b0cd4-6f5e-4c3e-9b5e-1c0e6c2b0cd4"}, phase)}
				return nil
			})
			require.NoError(t, err)
			moveTo(t, s, "vm1", deleting)

			err = s.Delete(ctx, "vm1")
			require.ErrorIs(t, err, ErrClaimHeld)
			assert.Contains(t, err.Error(), "6c2b0cd4-6f5e-4c3e-9b5e-1c0e6c2b0cd4")
			rec, err := s.Get("vm1")
			require.NoError(t, err, "the record survives a refused delete")
			assert.NotNil(t, VGPU(rec))
			marked, err := s.ManualStop("vm1")
			require.NoError(t, err)
			assert.True(t, marked, "the marker survives a refused delete")

			// A failed release goes to ReleaseFailed and back; the record,
			// claim and marker stay throughout.
			_, err = s.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
				r.State = releaseFailed
				l := VGPU(r)
				l.Phase = vmflowv1.ClaimPhase_CLAIM_PHASE_RELEASING
				l.ReleaseAttempts++
				l.LastReleaseError = "write remove: device busy"
				return nil
			})
			require.NoError(t, err)
			_, err = s.Transition(ctx, "vm1", deleting)
			require.NoError(t, err)
			require.ErrorIs(t, s.Delete(ctx, "vm1"), ErrClaimHeld)

			// Once the release is confirmed the delete goes through.
			_, err = s.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
				VGPU(r).ReleasedAt = timestamppb.Now()
				return nil
			})
			require.NoError(t, err)
			require.NoError(t, s.Delete(ctx, "vm1"))
			_, err = s.Get("vm1")
			assert.ErrorIs(t, err, ErrNotFound)
		})
	}
}

func TestDeleteOnlyFromDeleting(t *testing.T) {
	ctx := context.Background()
	for _, st := range []vmflowv1.InstanceState{creating, running, exited} {
		t.Run(StateName(st), func(t *testing.T) {
			s := newStore(t)
			mustCreate(t, s, "vm1")
			moveTo(t, s, "vm1", st)
			require.ErrorIs(t, s.Delete(ctx, "vm1"), ErrIllegalTransition)
			_, err := s.Get("vm1")
			require.NoError(t, err)
		})
	}
}

func TestDeleteRemovesEverything(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	mustCreate(t, s, "vm1")
	p, err := s.Paths("vm1")
	require.NoError(t, err)
	for _, f := range []string{p.Socket, p.Log, p.PID} {
		require.NoError(t, os.WriteFile(f, []byte("x"), 0o600))
	}
	moveTo(t, s, "vm1", deleting)
	require.NoError(t, s.Delete(ctx, "vm1"))

	_, err = os.Lstat(p.Dir)
	assert.ErrorIs(t, err, os.ErrNotExist)
	entries, err := os.ReadDir(filepath.Join(s.StateDir(), "instances"))
	require.NoError(t, err)
	assert.Empty(t, entries, "no trash left behind")
	entries, err = os.ReadDir(filepath.Join(s.StateDir(), "locks"))
	require.NoError(t, err)
	assert.Empty(t, entries, "the lock file goes with the instance")

	// Deleting again says not found: the delete path's "already absent".
	assert.ErrorIs(t, s.Delete(ctx, "vm1"), ErrNotFound)
	// And the id can be used again from scratch.
	rec := mustCreate(t, s, "vm1")
	assert.Equal(t, creating, rec.GetState())
	marked, err := s.ManualStop("vm1")
	require.NoError(t, err)
	assert.False(t, marked)
}

func TestNewFinishesCrashedDelete(t *testing.T) {
	s := newStore(t)
	trash := filepath.Join(s.StateDir(), "instances", trashPrefix+"vm1-123")
	require.NoError(t, os.MkdirAll(trash, 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(trash, "qemu.log"), []byte("x"), 0o600))
	_, err := New(s.StateDir())
	require.NoError(t, err)
	_, err = os.Lstat(trash)
	assert.ErrorIs(t, err, os.ErrNotExist)
}

func TestManualStopMarker(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()

	require.ErrorIs(t, s.MarkManualStop(ctx, "vm1"), ErrNotFound, "no marker without a record")
	p, err := s.Paths("vm1")
	require.NoError(t, err)
	_, err = os.Lstat(p.Dir)
	require.ErrorIs(t, err, os.ErrNotExist, "and no directory made for it")

	mustCreate(t, s, "vm1")
	marked, err := s.ManualStop("vm1")
	require.NoError(t, err)
	assert.False(t, marked)

	require.NoError(t, s.MarkManualStop(ctx, "vm1"))
	first, err := os.ReadFile(p.ManualStop)
	require.NoError(t, err)
	require.NoError(t, s.MarkManualStop(ctx, "vm1"), "idempotent")
	second, err := os.ReadFile(p.ManualStop)
	require.NoError(t, err)
	assert.Equal(t, first, second, "an existing marker is kept as is")

	// The marker survives everything but a successful delete: record
	// rewrites, state changes, failed deletes, a reopened store.
	_, err = s.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.State = deleting
		r.Leases = []*vmflowv1.Lease{vgpuLease(&vmflowv1.VgpuLease{Profile: "p", Uuid: "u"}, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE)}
		return nil
	})
	require.NoError(t, err)
	require.ErrorIs(t, s.Delete(ctx, "vm1"), ErrClaimHeld)
	_, err = s.Transition(ctx, "vm1", releaseFailed)
	require.NoError(t, err)
	require.ErrorIs(t, s.Delete(ctx, "vm1"), ErrClaimHeld, "refused for the claim in ReleaseFailed too")
	s2, err := New(s.StateDir())
	require.NoError(t, err)
	marked, err = s2.ManualStop("vm1")
	require.NoError(t, err)
	assert.True(t, marked)

	// A mangled record does not stop a delete from blocking restarts.
	mustCreate(t, s, "vm2")
	require.NoError(t, os.WriteFile(filepath.Join(s.StateDir(), "instances", "vm2", "record.json"), []byte("garbage"), 0o600))
	require.NoError(t, s.MarkManualStop(ctx, "vm2"))
	marked, err = s.ManualStop("vm2")
	require.NoError(t, err)
	assert.True(t, marked)

	l, err := s2.Lock(ctx, "vm1")
	require.NoError(t, err)
	marked, err = l.ManualStop()
	require.NoError(t, err)
	assert.True(t, marked)
	require.NoError(t, l.Unlock())
}

func TestList(t *testing.T) {
	s := newStore(t)
	for _, id := range []string{"vm3", "vm1", "vm2"} {
		mustCreate(t, s, id)
	}
	inst := filepath.Join(s.StateDir(), "instances")
	// Things List must skip: a directory without a record, trash, a temp
	// file, a stranger's file.
	require.NoError(t, os.Mkdir(filepath.Join(inst, "half"), 0o700))
	require.NoError(t, os.Mkdir(filepath.Join(inst, trashPrefix+"x-1"), 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(inst, "README"), nil, 0o600))

	recs, err := s.List()
	require.NoError(t, err)
	var ids []string
	for _, r := range recs {
		ids = append(ids, r.GetId())
	}
	assert.Equal(t, []string{"vm1", "vm2", "vm3"}, ids)

	// A corrupt record is reported but does not hide the others.
	require.NoError(t, os.WriteFile(filepath.Join(inst, "vm2", "record.json"), []byte(`{"id":"vm2","bogus":1}`), 0o600))
	recs, err = s.List()
	require.ErrorIs(t, err, ErrInvalidRecord)
	assert.Contains(t, err.Error(), "vm2")
	assert.Len(t, recs, 2)

	// A record whose id does not match its directory is refused.
	b, err := EncodeRecord(&vmflowv1.InstanceRecord{Id: "vm9", Spec: testSpec(), State: running})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(inst, "vm2", "record.json"), b, 0o600))
	_, err = s.Get("vm2")
	require.ErrorIs(t, err, ErrInvalidRecord)
	assert.Contains(t, err.Error(), "vm9")
}

func TestLockedHandle(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	l, err := s.Lock(ctx, "vm1")
	require.NoError(t, err)
	assert.Equal(t, "vm1", l.ID())

	// The whole create-launch-record sequence under one lock.
	rec, err := l.Create(wantRecord("vm1"))
	require.NoError(t, err)
	assert.Equal(t, creating, rec.GetState())
	_, err = l.Update(func(r *vmflowv1.InstanceRecord) error {
		r.Process = &vmflowv1.ProcessIdentity{Pid: 7, StartTime: 1, BootId: "b"}
		return nil
	})
	require.NoError(t, err)
	rec, err = l.Transition(running)
	require.NoError(t, err)
	assert.Equal(t, running, rec.GetState())
	got, err := l.Get()
	require.NoError(t, err)
	assert.True(t, proto.Equal(rec, got))

	_, err = l.Create(wantRecord("vm2"))
	require.ErrorIs(t, err, ErrInvalidRecord, "a handle only creates its own id")

	require.NoError(t, l.Unlock())
	require.NoError(t, l.Unlock(), "second Unlock is a no-op")
	_, err = l.Get()
	require.ErrorIs(t, err, ErrUnlocked)
	_, err = l.Update(func(*vmflowv1.InstanceRecord) error { return nil })
	require.ErrorIs(t, err, ErrUnlocked)
	require.ErrorIs(t, l.Delete(), ErrUnlocked)
	require.ErrorIs(t, l.MarkManualStop(), ErrUnlocked)

	// Locking an id that never gets a record leaves no lock file behind.
	l, err = s.Lock(ctx, "ghost")
	require.NoError(t, err)
	require.NoError(t, l.Unlock())
	_, err = os.Lstat(filepath.Join(s.StateDir(), "locks", "ghost.lock"))
	assert.ErrorIs(t, err, os.ErrNotExist)
}

func TestLockHonoursContext(t *testing.T) {
	s := newStore(t)
	l, err := s.Lock(context.Background(), "vm1")
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Unlock() })

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = s.Lock(ctx, "vm1")
	require.ErrorIs(t, err, ErrBusy)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Less(t, time.Since(start), 5*time.Second)

	cctx, ccancel := context.WithCancel(context.Background())
	ccancel()
	_, err = s.Update(cctx, "vm1", func(*vmflowv1.InstanceRecord) error { return nil })
	require.ErrorIs(t, err, context.Canceled)
}

// TestLockWaitEndsBeforeCallerDeadline: a caller that waits for an
// instance another holds hears ErrBusy while its own time still runs, so
// an activity overlapping a stop ladder fails with the typed, retryable
// Busy instead of a bare StartToClose timeout (the one in-process layer
// fails fast for the supervisor's own operations; this is the store's).
func TestLockWaitEndsBeforeCallerDeadline(t *testing.T) {
	s := newStore(t)
	l, err := s.Lock(context.Background(), "vm1")
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Unlock() })

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	_, err = s.Update(ctx, "vm1", func(*vmflowv1.InstanceRecord) error { return nil })
	require.ErrorIs(t, err, ErrBusy)
	assert.NoError(t, ctx.Err(), "Busy came back before the caller's deadline")
}

// TestConcurrentUpdatesGoroutines: read-modify-write from many goroutines on
// one instance loses nothing.
func TestConcurrentUpdatesGoroutines(t *testing.T) {
	s := newStore(t)
	mustCreate(t, s, "vm1")
	const workers, each = 8, 25
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for range workers {
		wg.Go(func() {
			// Each goroutine gets its own Store too: exclusion must come from
			// the lock file, not from sharing one Go value.
			st, err := New(s.StateDir())
			if err != nil {
				errs <- err
				return
			}
			errs <- increment(context.Background(), st, "vm1", each)
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	rec, err := s.Get("vm1")
	require.NoError(t, err)
	assert.Equal(t, uint32(workers*each), rec.GetRestartCount())
}

// TestCreateRaceOneWinner: concurrent creates of one id with different specs
// end with exactly one spec on disk and every other caller told why.
func TestCreateRaceOneWinner(t *testing.T) {
	s := newStore(t)
	const n = 8
	var wg sync.WaitGroup
	results := make([]error, n)
	for i := range n {
		wg.Go(func() {
			w := wantRecord("vm1")
			w.Spec.Vcpus = uint32(i + 1)
			_, results[i] = s.Create(context.Background(), w)
		})
	}
	wg.Wait()
	wins := 0
	for _, err := range results {
		if err == nil {
			wins++
			continue
		}
		assert.ErrorIs(t, err, ErrConflict)
	}
	assert.Equal(t, 1, wins)
}

// TestCreatorRecorded: the record names the spawn that created it, a second
// create by another spawn (same spec) gets the record back with its first
// creator, and only the creator's own workflow id and run id match
// (invariant 9).
func TestCreatorRecorded(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	w := wantRecord("vm1")
	w.CreatedByWorkflowId, w.CreatedByRunId = "spawn/vm1", "run-a"
	rec, err := s.Create(ctx, w)
	require.NoError(t, err)
	assert.True(t, CreatedBy(rec, "spawn/vm1", "run-a"))

	other := wantRecord("vm1")
	other.CreatedByWorkflowId, other.CreatedByRunId = "spawn/vm1", "run-b"
	again, err := s.Create(ctx, other)
	require.NoError(t, err)
	assert.Equal(t, "run-a", again.GetCreatedByRunId(), "a second spawn does not take the record over")
	assert.False(t, CreatedBy(again, "spawn/vm1", "run-b"))
	assert.True(t, CreatedBy(again, "spawn/vm1", "run-a"), "a retried create of the same spawn still counts as its own")
	assert.Equal(t, "spawn/vm1 (run run-a)", CreatorOf(again))

	// A record from before creators existed belongs to no spawn, and an
	// empty creator in the question matches nothing either.
	legacy := mustCreate(t, s, "vm2")
	assert.False(t, CreatedBy(legacy, "", ""))
	assert.False(t, CreatedBy(legacy, "spawn/vm2", "run-a"))
	assert.Contains(t, CreatorOf(legacy), "unknown spawn")
}
