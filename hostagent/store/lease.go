package store

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"vmflow/internal/crashpoint"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// A lease (vmflowv1.Lease) is one host resource an instance holds: written
// ahead in the record before the resource exists (phase INTENT), ACTIVE once
// it does, RELEASING while a release runs, and held until released_at is
// set. The store removes no record while any of its leases is held
// (invariant 1), and the delete's release stage releases every lease, only
// once the VM's thread group is gone (invariant 2).
//
// Adding a kind (a whole GPU, a TAP, an address) takes, all local to it:
//   - a message for what it names and a field in Lease's resource oneof
//     (record.proto, then make proto);
//   - a case in LeaseKind (its name in messages) and in LeaseName (the one
//     name under which at most one held lease on the host may hold the
//     resource: invariants 10 and 13);
//   - a releaser for it in the delete's release stage (activities).
//
// The phases, the held rule, the release bookkeeping (LeaseReleasing,
// LeaseReleaseFailed, LeaseReleased), the store's removal guard and the
// record migration are shared by every kind and need nothing new.

// Lease kinds, as LeaseKind names them.
const (
	KindVGPU        = "vgpu"
	KindPassthrough = "passthrough"
	KindNetwork     = "network"
	KindCapacity    = "capacity"
)

// LeaseKinds are every kind LeaseKind names.
var LeaseKinds = []string{KindVGPU, KindPassthrough, KindNetwork, KindCapacity}

// LeaseKind names l's kind ("vgpu"); "unknown" for a lease with no
// resource, which ValidateRecord refuses.
func LeaseKind(l *vmflowv1.Lease) string {
	switch l.GetResource().(type) {
	case *vmflowv1.Lease_Vgpu:
		return KindVGPU
	case *vmflowv1.Lease_GpuPassthrough:
		return KindPassthrough
	case *vmflowv1.Lease_Network:
		return KindNetwork
	case *vmflowv1.Lease_Capacity:
		return KindCapacity
	}
	return "unknown"
}

// LeaseName is l's host-wide name, "<kind>:<resource>": two held leases with
// one name are one resource booked twice.
func LeaseName(l *vmflowv1.Lease) string {
	switch r := l.GetResource().(type) {
	case *vmflowv1.Lease_Vgpu:
		return KindVGPU + ":" + ClaimDevice(r.Vgpu)
	case *vmflowv1.Lease_GpuPassthrough:
		// Its first function's address: a card's address is its name
		// (its group number may change across a reboot) and placement
		// never splits a group, so no two leases share a function. A
		// lease recorded before identities (functions without an id)
		// keeps the name it had, its group.
		fns := r.GpuPassthrough.GetFunctions()
		if len(fns) == 0 || fns[0].GetId() == "" {
			return KindPassthrough + ":" + r.GpuPassthrough.GetIommuGroup()
		}
		return KindPassthrough + ":" + fns[0].GetAddr()
	case *vmflowv1.Lease_Network:
		// The address, without its prefix: the one thing two VMs on a
		// host must never share (the TAP's name is derived from it).
		addr, _, _ := strings.Cut(r.Network.GetAddress(), "/")
		return KindNetwork + ":" + addr
	case *vmflowv1.Lease_Capacity:
		// A share of the host, not a thing only one lease may name: the
		// name is the record's one capacity lease (the ledger, not the
		// name, keeps the host from being promised twice).
		return KindCapacity + ":"
	}
	return "unknown:"
}

// VGPULease is a lease on the vGPU v names, for LeaseIntent.
func VGPULease(v *vmflowv1.VgpuLease) *vmflowv1.Lease {
	return &vmflowv1.Lease{Resource: &vmflowv1.Lease_Vgpu{Vgpu: v}}
}

// PassthroughLeaseOf is a lease on the IOMMU group p names, for LeaseIntent.
func PassthroughLeaseOf(p *vmflowv1.PassthroughLease) *vmflowv1.Lease {
	return &vmflowv1.Lease{Resource: &vmflowv1.Lease_GpuPassthrough{GpuPassthrough: p}}
}

// HeldPassthrough are rec's held whole-GPU leases, in claim order.
func HeldPassthrough(rec *vmflowv1.InstanceRecord) []*vmflowv1.Lease {
	var out []*vmflowv1.Lease
	for _, l := range rec.GetLeases() {
		if l.GetGpuPassthrough() != nil && LeaseHeld(l) {
			out = append(out, l)
		}
	}
	return out
}

// PassthroughDevices names the PCI functions a whole-GPU lease holds, in
// address order: the ids SpawnResult.gpu_device_ids and the CLI show.
func PassthroughDevices(l *vmflowv1.Lease) []string {
	var out []string
	for _, f := range l.GetGpuPassthrough().GetFunctions() {
		out = append(out, f.GetAddr())
	}
	return out
}

// HeldPassthroughGPUs is how many whole GPUs rec's held leases give it:
// display functions, not leases (GPUs that share an IOMMU group are one
// lease). The one count of whole GPUs a record holds: the claim, the
// launch's check against the spec and what a user is shown agree on it.
func HeldPassthroughGPUs(rec *vmflowv1.InstanceRecord) int {
	n := 0
	for _, l := range HeldPassthrough(rec) {
		n += len(PassthroughGPUs(l))
	}
	return n
}

// PassthroughGPUs are the GPUs (display functions) a whole-GPU lease
// holds, in address order; its other functions are their companions
// (audio).
func PassthroughGPUs(l *vmflowv1.Lease) []string {
	var out []string
	for _, f := range l.GetGpuPassthrough().GetFunctions() {
		if f.GetDisplay() {
			out = append(out, f.GetAddr())
		}
	}
	return out
}

// PassthroughCount is how many whole GPUs spec asks for.
func PassthroughCount(spec *vmflowv1.VMSpec) int { return int(spec.GetGpuPassthroughCount()) }

// MaxPassthrough bounds the whole GPUs one instance may hold: an 8-GPU
// node's.
const MaxPassthrough = 8

// NetworkLease is a lease on the TAP and address n names, for LeaseIntent.
func NetworkLease(n *vmflowv1.NetworkLease) *vmflowv1.Lease {
	return &vmflowv1.Lease{Resource: &vmflowv1.Lease_Network{Network: n}}
}

// CapacityLeaseOf is a lease on the share of the host c names.
func CapacityLeaseOf(c *vmflowv1.CapacityLease) *vmflowv1.Lease {
	return &vmflowv1.Lease{Resource: &vmflowv1.Lease_Capacity{Capacity: c}}
}

// Capacity is rec's capacity lease, held or released; nil when it has
// none (a record written before the ledger, or whose reservation was
// refused). An instance has at most one (its name is the kind's).
func Capacity(rec *vmflowv1.InstanceRecord) *vmflowv1.Lease {
	for _, l := range rec.GetLeases() {
		if l.GetCapacity() != nil {
			return l
		}
	}
	return nil
}

// Network is rec's network lease, held or released; nil when it has none.
// An instance has at most one (ValidateRecord).
func Network(rec *vmflowv1.InstanceRecord) *vmflowv1.Lease {
	for _, l := range rec.GetLeases() {
		if l.GetNetwork() != nil {
			return l
		}
	}
	return nil
}

// LeaseHeld reports whether l is held: from the moment it is recorded
// (INTENT, before the resource exists) until its release is confirmed.
func LeaseHeld(l *vmflowv1.Lease) bool {
	return l != nil && l.GetReleasedAt() == nil
}

// HeldLeases are rec's held leases, in record order.
func HeldLeases(rec *vmflowv1.InstanceRecord) []*vmflowv1.Lease {
	var out []*vmflowv1.Lease
	for _, l := range rec.GetLeases() {
		if LeaseHeld(l) {
			out = append(out, l)
		}
	}
	return out
}

// AnyLeaseHeld reports whether rec holds any lease: while it does, the
// record must not be removed (invariant 1).
func AnyLeaseHeld(rec *vmflowv1.InstanceRecord) bool {
	return len(HeldLeases(rec)) > 0
}

// VGPUs are rec's vGPU leases, held or released, in claim order.
func VGPUs(rec *vmflowv1.InstanceRecord) []*vmflowv1.Lease {
	var out []*vmflowv1.Lease
	for _, l := range rec.GetLeases() {
		if l.GetVgpu() != nil {
			out = append(out, l)
		}
	}
	return out
}

// HeldVGPUs are rec's held vGPU leases, in claim order.
func HeldVGPUs(rec *vmflowv1.InstanceRecord) []*vmflowv1.Lease {
	var out []*vmflowv1.Lease
	for _, l := range VGPUs(rec) {
		if LeaseHeld(l) {
			out = append(out, l)
		}
	}
	return out
}

// VGPU is rec's first vGPU lease, held or released; nil when it has none.
func VGPU(rec *vmflowv1.InstanceRecord) *vmflowv1.Lease {
	if vs := VGPUs(rec); len(vs) > 0 {
		return vs[0]
	}
	return nil
}

// ClaimHeld reports whether rec holds any vGPU lease.
func ClaimHeld(rec *vmflowv1.InstanceRecord) bool {
	return len(HeldVGPUs(rec)) > 0
}

// VGPUCount is how many vGPUs spec asks for: vgpu_count, or one when only
// vgpu_profile is set (records and requests from before counts).
func VGPUCount(profile string, count uint32) int {
	switch {
	case profile == "":
		return 0
	case count == 0:
		return 1
	}
	return int(count)
}

// MaxVGPUs bounds the vGPUs one instance may hold (what a record
// admits and a spawn may ask for): an 8-GPU node's GPUs, each split in two.
const MaxVGPUs = 16

// ClaimDevice names a vGPU lease's device (the SR-IOV VF, else the mdev UUID):
// the one rule, so messages, the ledger and the CLI agree.
func ClaimDevice(c *vmflowv1.VgpuLease) string {
	if c.GetDeviceId() != "" {
		return c.GetDeviceId()
	}
	return c.GetUuid()
}

// DescribeLease is l for messages: "vgpu lease (profile "p", device d,
// phase ACTIVE)".
func DescribeLease(l *vmflowv1.Lease) string {
	switch r := l.GetResource().(type) {
	case *vmflowv1.Lease_Vgpu:
		return fmt.Sprintf("vgpu lease (profile %q, device %s, phase %s)", r.Vgpu.GetProfile(), ClaimDevice(r.Vgpu), l.GetPhase())
	case *vmflowv1.Lease_GpuPassthrough:
		return fmt.Sprintf("passthrough lease (IOMMU group %s, %s, phase %s)", r.GpuPassthrough.GetIommuGroup(),
			strings.Join(PassthroughDevices(l), " "), l.GetPhase())
	case *vmflowv1.Lease_Network:
		return fmt.Sprintf("network lease (address %s, tap %s, phase %s)", r.Network.GetAddress(), r.Network.GetTap(), l.GetPhase())
	case *vmflowv1.Lease_Capacity:
		return fmt.Sprintf("capacity lease (%d vCPUs, %d MiB, phase %s)", r.Capacity.GetVcpus(), r.Capacity.GetMemoryMib(), l.GetPhase())
	}
	return fmt.Sprintf("%s lease (phase %s)", LeaseKind(l), l.GetPhase())
}

// validateLeases checks every lease has a known kind and phase, no two name
// one resource, and there are at most MaxVGPUs vGPUs and one network lease.
func validateLeases(rec *vmflowv1.InstanceRecord) error {
	names := map[string]bool{}
	nets := 0
	for i, l := range rec.GetLeases() {
		if l.GetResource() == nil {
			return fmt.Errorf("%w: instance %s: lease %d has no resource", ErrInvalidRecord, rec.GetId(), i)
		}
		if _, ok := vmflowv1.ClaimPhase_name[int32(l.GetPhase())]; !ok {
			return fmt.Errorf("%w: instance %s has unknown lease phase %d", ErrInvalidRecord, rec.GetId(), l.GetPhase())
		}
		if n := LeaseName(l); names[n] {
			return fmt.Errorf("%w: instance %s has two leases of %s", ErrInvalidRecord, rec.GetId(), n)
		} else {
			names[n] = true
		}
		if l.GetNetwork() != nil {
			nets++
		}
	}
	if n := len(rec.GetLeases()) - len(VGPUs(rec)); n > MaxPassthrough+16 {
		// Whole GPUs and whatever other kinds: bounded so a hand-made
		// record cannot make every reader walk a huge list.
		return fmt.Errorf("%w: instance %s has %d non-vgpu leases", ErrInvalidRecord, rec.GetId(), n)
	}
	if n := len(VGPUs(rec)); n > MaxVGPUs {
		return fmt.Errorf("%w: instance %s has %d vgpu leases, at most %d are allowed", ErrInvalidRecord, rec.GetId(), n, MaxVGPUs)
	}
	if nets > 1 {
		return fmt.Errorf("%w: instance %s has %d network leases, at most one is allowed", ErrInvalidRecord, rec.GetId(), nets)
	}
	return nil
}

// migrate converts rec's old shapes in place (gpu_claim becomes a vgpu lease)
// and reports whether it changed anything; the only code that reads an old
// shape, as every read passes through it.
func migrate(rec *vmflowv1.InstanceRecord) bool {
	c := rec.GetGpuClaim()
	if c == nil || VGPU(rec) != nil {
		// Both shapes at once is no record an agent wrote: ValidateRecord
		// refuses it, and nothing is guessed.
		return false
	}
	rec.Leases = append(rec.Leases, &vmflowv1.Lease{
		Phase: c.GetPhase(), ClaimedAt: c.GetClaimedAt(), ReleaseAttempts: c.GetReleaseAttempts(),
		LastReleaseError: c.GetLastReleaseError(), ReleasedAt: c.GetReleasedAt(),
		Resource: &vmflowv1.Lease_Vgpu{Vgpu: &vmflowv1.VgpuLease{
			Profile: c.GetProfile(), Parent: c.GetParent(), TypeId: c.GetTypeId(), Uuid: c.GetUuid(),
			DeviceId: c.GetDeviceId(), Driver: c.GetDriver(),
		}},
	})
	rec.GpuClaim = nil
	return true
}

// Migrate writes back, once at agent start, every record still in an old shape
// so the files say what the agent reads; an unreadable record is left for
// re-attach to quarantine, and the error names those that failed.
func (s *Store) Migrate(ctx context.Context) ([]string, error) {
	ids, err := s.IDs()
	if err != nil {
		return nil, fmt.Errorf("migrate records: %w", err)
	}
	var done []string
	var errs []error
	for _, id := range ids {
		err := s.withLock(ctx, id, func(l *Locked) error {
			if !oldShape(l.paths.Record) {
				return nil
			}
			rec, err := readRecord(l.paths, id)
			if err != nil {
				return nil // re-attach quarantines it
			}
			if err := l.write(rec); err != nil {
				return err
			}
			crashpoint.Hit(crashpoint.StoreMigrated)
			done = append(done, id)
			return nil
		})
		if err != nil {
			errs = append(errs, fmt.Errorf("migrate record of instance %s: %w", id, err))
		}
	}
	return done, errors.Join(errs...)
}

// oldShape reports whether the record file at path decodes to a shape
// migrate converts.
func oldShape(path string) bool {
	b, err := os.ReadFile(path)
	if err != nil || len(b) > maxRecordSize {
		return false
	}
	rec := &vmflowv1.InstanceRecord{}
	if unmarshalOpts.Unmarshal(b, rec) != nil {
		return false
	}
	return migrate(rec)
}

// PhaseName is the short, lower-case name of a lease phase ("intent",
// "active", "releasing"), as vmflow_leases labels it.
func PhaseName(p vmflowv1.ClaimPhase) string {
	name, ok := vmflowv1.ClaimPhase_name[int32(p)]
	if !ok {
		return "phase(" + p.String() + ")"
	}
	return strings.ToLower(strings.TrimPrefix(name, "CLAIM_PHASE_"))
}
