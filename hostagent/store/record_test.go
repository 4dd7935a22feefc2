package store

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/internal/contract"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// fullRecord has every field set, for round trips and benchmarks.
func fullRecord() *vmflowv1.InstanceRecord {
	ts := timestamppb.New(time.Date(2025, 3, 1, 12, 0, 0, 123, time.UTC))
	return &vmflowv1.InstanceRecord{
		Id: "vm-full-1",
		Spec: &vmflowv1.VMSpec{
			Vcpus: 4, MemoryMib: 16384, Machine: "q35", Accel: "kvm",
			Kernel: "/srv/images/vmlinuz", Initrd: "/srv/images/initrd.img", Cmdline: "console=ttyS0 quiet",
			Disk: "/srv/images/root.qcow2", VgpuProfile: "GRID A100-4C", Uuid: "0b9e3a62-8c1e-4b59-9f0e-3c9a2f1d7e44",
		},
		RestartPolicy: "on-failure", RestartMaxAttempts: 5, RestartStableAfterSeconds: 300,
		State: running, StopStep: vmflowv1.StopStep_STOP_STEP_POWERDOWN_SENT, StopStepAt: ts,
		Process: &vmflowv1.ProcessIdentity{Pid: 123456, StartTime: 987654321012, BootId: "5f0a6e1c-1b2d-4c3e-8f9a-0b1c2d3e4f5a"},
		Leases: []*vmflowv1.Lease{{
			Phase: vmflowv1.ClaimPhase_CLAIM_PHASE_RELEASING, ReleaseAttempts: 3, ClaimedAt: ts,
			LastReleaseError: "write /sys/bus/mdev/devices/6c2b0cd4/remove: device or resource busy",
			Resource: &vmflowv1.Lease_Vgpu{Vgpu: &vmflowv1.VgpuLease{
				Profile: "GRID A100-4C", Parent: "0000:3b:00.4", TypeId: "nvidia-500", Uuid: "6c2b0cd4-6f5e-4c3e-9b5e-1c0e6c2b0cd4",
				DeviceId: "0000:3b:00.4", Driver: "mdev",
			}},
		}},
		RestartCount: 2, LastStart: ts, LastExit: ts, LastExitStatus: "signal: killed", LastExitCode: -1,
		LastError: "qemu exited: signal: killed", CreatedAt: ts, UpdatedAt: ts,
	}
}

func TestRecordRoundTrip(t *testing.T) {
	rec := fullRecord()
	b, err := EncodeRecord(rec)
	require.NoError(t, err)
	for _, key := range []string{`"stop_step"`, `"leases"`, `"vgpu"`, `"last_release_error"`, `"restart_stable_after_seconds"`, `"boot_id"`} {
		assert.Contains(t, string(b), key, "snake_case proto field names")
	}
	assert.NotContains(t, string(b), `"stopStep"`)
	got, err := DecodeRecord(b)
	require.NoError(t, err)
	assert.True(t, proto.Equal(rec, got))
}

func TestDecodeRecordStrict(t *testing.T) {
	valid := `{"id":"vm1","spec":{"vcpus":1},"state":"INSTANCE_STATE_RUNNING"}`
	_, err := DecodeRecord([]byte(valid))
	require.NoError(t, err)

	tests := []struct{ name, in, want string }{
		{"empty", ``, "invalid instance record"},
		{"not json", `hello`, "invalid"},
		{"unknown key", `{"id":"vm1","spec":{},"state":"INSTANCE_STATE_RUNNING","colour":"red"}`, "colour"},
		{"unknown nested key", `{"id":"vm1","spec":{"cpus":1},"state":"INSTANCE_STATE_RUNNING"}`, "cpus"},
		{"no id", `{"spec":{},"state":"INSTANCE_STATE_RUNNING"}`, "invalid instance id"},
		{"bad id", `{"id":"../etc","spec":{},"state":"INSTANCE_STATE_RUNNING"}`, "invalid instance id"},
		{"no spec", `{"id":"vm1","state":"INSTANCE_STATE_RUNNING"}`, "no spec"},
		{"no state", `{"id":"vm1","spec":{}}`, "unknown state"},
		{"unknown state number", `{"id":"vm1","spec":{},"state":42}`, "unknown state 42"},
		{"unknown state name", `{"id":"vm1","spec":{},"state":"STOPPING"}`, "invalid"},
		{"unknown stop step", `{"id":"vm1","spec":{},"state":2,"stop_step":9}`, "unknown stop_step"},
		{"unknown claim phase", `{"id":"vm1","spec":{},"state":2,"gpu_claim":{"phase":7}}`, "unknown lease phase"},
		{"negative vcpus", `{"id":"vm1","spec":{"vcpus":-1},"state":2}`, "invalid"},
		{"bad timestamp", `{"id":"vm1","spec":{},"state":2,"created_at":"yesterday"}`, "invalid"},
		{"too big", `{"id":"vm1","last_error":"` + strings.Repeat("x", maxRecordSize) + `"}`, "larger than"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := DecodeRecord([]byte(tt.in))
			require.ErrorIs(t, err, ErrInvalidRecord)
			assert.Contains(t, err.Error(), tt.want)
		})
	}
}

func TestClaimHeld(t *testing.T) {
	assert.False(t, ClaimHeld(nil))
	assert.False(t, ClaimHeld(&vmflowv1.InstanceRecord{}))
	assert.True(t, ClaimHeld(&vmflowv1.InstanceRecord{Leases: []*vmflowv1.Lease{vgpuLease(&vmflowv1.VgpuLease{}, 0)}}), "even an empty INTENT counts")
	released := vgpuLease(&vmflowv1.VgpuLease{}, 0)
	released.ReleasedAt = timestamppb.Now()
	assert.False(t, ClaimHeld(&vmflowv1.InstanceRecord{Leases: []*vmflowv1.Lease{released}}))
}

// Every invalid id is refused as ErrInvalidID (contract.FuzzCheckID holds
// the rule itself).
func FuzzValidateID(f *testing.F) {
	for _, seed := range []string{"", "a", "vm-1", "-a", "..", "a/b", "VM", strings.Repeat("z", 200)} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, id string) {
		err := ValidateID(id)
		if (err == nil) != contract.ValidID(id) {
			t.Fatalf("ValidateID(%q) = %v, contract.ValidID = %v", id, err, contract.ValidID(id))
		}
		if err != nil && !errors.Is(err, ErrInvalidID) {
			t.Fatalf("error %q is not ErrInvalidID", err)
		}
	})
}

func FuzzDecodeRecord(f *testing.F) {
	full, err := EncodeRecord(fullRecord())
	require.NoError(f, err)
	for _, seed := range []string{
		string(full),
		`{"id":"vm1","spec":{"vcpus":1},"state":"INSTANCE_STATE_RUNNING"}`,
		`{"id":"vm1","spec":{},"state":2,"gpu_claim":{"phase":"CLAIM_PHASE_INTENT"}}`,
		`{"id":"vm1","spec":{},"state":2,"leases":[{"phase":"CLAIM_PHASE_ACTIVE","vgpu":{"uuid":"u"}}]}`,
		`{"id":"vm1","spec":{},"state":2,"leases":[{"vgpu":{"uuid":"u"}},{"vgpu":{"uuid":"v"}}]}`,
		`{"id":"vm1","spec":{},"state":2,"leases":[{}]}`,
		`{"id":"vm1","spec":{},"state":2,"leases":[{"vgpu":{}}],"gpu_claim":{}}`,
		`{"id":"vm1","spec":{},"state":42}`,
		`{"id":"vm1","spec":{},"state":2,"colour":1}`,
		`{"id":"../x","spec":{},"state":2}`,
		`{"id":"vm1","spec":{},"state":2,"created_at":"2025-01-01T00:00:00Z","process":{"start_time":"18446744073709551615"}}`,
		`{"id":"vm1","spec":{},"state":2,"created_at":"10000-01-01T00:00:00Z"}`,
		``, `null`, `[]`, `{`, `{"id":`, "\xff\xfe",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		rec, err := DecodeRecord(b)
		if err != nil {
			return
		}
		// Whatever decodes must be valid, and survive a round trip unchanged.
		if err := ValidateRecord(rec); err != nil {
			t.Fatalf("decoded an invalid record: %v", err)
		}
		out, err := EncodeRecord(rec)
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		again, err := DecodeRecord(out)
		if err != nil {
			t.Fatalf("decode of re-encoded record: %v\n%s", err, out)
		}
		if !proto.Equal(rec, again) {
			t.Fatalf("round trip changed the record:\n%v\n%v", rec, again)
		}
	})
}

func BenchmarkEncodeRecord(b *testing.B) {
	rec := fullRecord()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := EncodeRecord(rec); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkDecodeRecord(b *testing.B) {
	data, err := EncodeRecord(fullRecord())
	require.NoError(b, err)
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := DecodeRecord(data); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkUpdate is one durable read-modify-write under the lock: what a
// state change costs on this disk (two fsyncs dominate).
func BenchmarkUpdate(b *testing.B) {
	dir := b.TempDir()
	s, err := New(dir)
	require.NoError(b, err)
	_, err = s.Create(b.Context(), wantRecord("vm1"))
	require.NoError(b, err)
	b.ReportAllocs()
	for b.Loop() {
		_, err := s.Update(b.Context(), "vm1", func(r *vmflowv1.InstanceRecord) error {
			r.RestartCount++
			return nil
		})
		if err != nil {
			b.Fatal(err)
		}
	}
}

// TestNamedDeleteMoves: the delete's moves written once in the store. A
// failed release keeps the lease and shows ReleaseFailed; a confirmed one
// frees the lease and returns to Deleting; nothing moves a record out of
// ReleaseFailed while a lease is held.
func TestNamedDeleteMoves(t *testing.T) {
	r := &vmflowv1.InstanceRecord{Id: "vm1", State: deleting,
		Leases: []*vmflowv1.Lease{vgpuLease(&vmflowv1.VgpuLease{Uuid: "u1"}, vmflowv1.ClaimPhase_CLAIM_PHASE_RELEASING)}}
	name := LeaseName(r.GetLeases()[0])
	assert.Equal(t, "vgpu:u1", name)
	applyTo(t, r, LeaseReleaseFailed(name, "EBUSY"))
	assert.Equal(t, releaseFailed, r.GetState())
	assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, VGPU(r).GetPhase())
	assert.EqualValues(t, 1, VGPU(r).GetReleaseAttempts())
	assert.Equal(t, "release vGPU: EBUSY", r.GetLastError())
	require.ErrorIs(t, MayRemove(r), ErrClaimHeld, "still holds its lease")
	assert.True(t, ClaimHeld(r))

	applyTo(t, r, LeaseReleased(name, time.Now()))
	assert.False(t, ClaimHeld(r))
	assert.Empty(t, VGPU(r).GetLastReleaseError())
	assert.Equal(t, deleting, r.GetState())
	assert.NoError(t, MayRemove(r))
}
