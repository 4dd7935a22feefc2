package lease

import (
	"context"
	"fmt"
	"sort"
	"time"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// What the host offers the fleet of its GPUs: free devices by kind and
// name, less what granted spawns have yet to claim. The fleet view
// publishes it, and a grant (CreateRecord) checks a spawn's GPUs against
// it under the admission lock, so a burst placed on a host's last GPU
// gets one grant and refusals, not grants whose claims then fail.
//
// It is a count, the claim's placement the truth: the claim still places
// under the host's lock (invariant 10), and a device a count got wrong
// (an mdev type sharing its parent with another, a group of two GPUs,
// a device a reboot took away) makes a claim fail, never a double booking.

// Offer kinds (GpuOffer.kind).
const (
	OfferVGPU        = "vgpu"
	OfferPassthrough = "passthrough"
)

// Offers reads what the host offers: its capacity ledger's room and its
// GPU claims' free devices (any of the three may be nil).
type Offers struct {
	Store    *store.Store
	Capacity *Capacity
	VGPU     *Claims
	Whole    *Whole
	// Now is the clock a reservation's expiry is read on (time.Now).
	Now func() time.Time
}

type offerKey struct{ kind, name string }

// View is the host's view for the fleet as the records, the ledger and
// the devices give it now: its capacity (reservations in flight counted
// as taken, and counted), its free GPUs, whether it drains. The caller
// adds who the host is and what it can run (host id, network, KVM,
// bounds) and when.
func (o *Offers) View(ctx context.Context) (*vmflowv1.HostView, error) {
	v := &vmflowv1.HostView{}
	d, on, err := o.Store.Draining()
	if err != nil {
		d.Reason = err.Error()
	}
	v.Draining, v.DrainReason = on, d.Reason
	recs, err := o.Store.List()
	bad, listed := store.Unreadable(err)
	if !listed {
		return nil, fmt.Errorf("host view: %w", err)
	}
	v.UnreadableRecords = uint32(len(bad))
	if o.Capacity != nil {
		// The ledger's own sum, over the records listed above: what it
		// refuses by is what the view offers.
		lim, u := o.Capacity.Limits(), o.Capacity.UsageOf(recs, len(bad))
		v.VcpusTotal, v.VcpusFree = clamp32(lim.VCPUs), clamp32(sub(lim.VCPUs, u.VCPUs))
		v.MemoryTotalMib, v.MemoryFreeMib = clamp32(lim.MemoryMiB), clamp32(sub(lim.MemoryMiB, u.MemoryMiB))
		v.PinnedMemoryFreeMib = clamp32(sub(min(lim.MemoryMiB, lim.PhysicalMiB), u.MemoryMiB))
		v.DedicatedCpusFree = clamp32(sub(lim.DedicatedCPUs, u.DedicatedCPUs))
		v.HugepagesFreeMib = clamp32(sub(lim.HugepageMiB, sumValues(u.HugepageMiB)))
	}
	now := o.now()
	for _, r := range recs {
		if c := store.Capacity(r); store.LeaseHeld(c) && c.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_INTENT && !expired(c, now) {
			v.InFlight++
		}
	}
	if (o.VGPU != nil || o.Whole != nil) && len(bad) == 0 {
		// With a record unreadable, or the devices unreadable, GPUs are
		// offered as none: the view must not promise what a grant would
		// refuse.
		v.Gpus, _ = o.gpus(ctx, recs)
	}
	return v, nil
}

func clamp32(v uint64) uint32 { return uint32(min(v, 1<<32-1)) }

// GPUs lists the free GPUs by kind and name, sorted, less what granted
// records have yet to claim (never below 0).
func (o *Offers) GPUs(ctx context.Context) ([]*vmflowv1.GpuOffer, error) {
	recs, err := o.records()
	if err != nil {
		return nil, err
	}
	return o.gpus(ctx, recs)
}

// gpus is GPUs over recs, read before the devices.
func (o *Offers) gpus(ctx context.Context, recs []*vmflowv1.InstanceRecord) ([]*vmflowv1.GpuOffer, error) {
	free, driver, err := o.free(ctx)
	if err != nil {
		return nil, err
	}
	pending := pendingGPUs(recs, o.now(), "")
	var out []*vmflowv1.GpuOffer
	for k, n := range free {
		n -= pending[k]
		if k.kind == OfferPassthrough {
			n -= pending[offerKey{OfferPassthrough, ""}]
		}
		out = append(out, &vmflowv1.GpuOffer{Kind: k.kind, Name: k.name, Free: uint32(max(n, 0)), Driver: driver[k]})
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].GetKind() != out[j].GetKind() {
			return out[i].GetKind() < out[j].GetKind()
		}
		return out[i].GetName() < out[j].GetName()
	})
	return out, nil
}

// Check refuses (NoCapacity, nothing written) a new record id of spec
// whose GPUs are not free less what other granted records have yet to
// claim. Run it under the admission lock, before the record is written.
// The records are read before the devices: a claim finishing in between
// is then counted twice (a refusal), never not at all.
func (o *Offers) Check(ctx context.Context, id string, spec *vmflowv1.VMSpec) error {
	want := specGPUs(spec)
	if want.n == 0 {
		return nil
	}
	recs, err := o.records()
	if err != nil {
		return err
	}
	pending := pendingGPUs(recs, o.now(), id)
	free, _, err := o.free(ctx)
	if err != nil {
		return err
	}
	have := 0
	if want.key == (offerKey{OfferPassthrough, ""}) {
		for k, n := range free {
			if k.kind == OfferPassthrough {
				have += n - pending[k]
			}
		}
	} else {
		have = free[want.key] - pending[want.key]
	}
	if want.key.kind == OfferPassthrough {
		have -= pending[offerKey{OfferPassthrough, ""}]
	}
	if have >= want.n {
		return nil
	}
	what := gpu.ErrNoCapacity
	if want.key.kind == OfferPassthrough {
		what = ErrNoWholeGPU
	}
	return fmt.Errorf("%w: instance %s asks %d %s %q; free for new spawns: %d (granted spawns yet to claim theirs counted)",
		what, id, want.n, want.key.kind, want.key.name, max(have, 0))
}

func (o *Offers) now() time.Time {
	if o.Now == nil {
		return time.Now()
	}
	return o.Now()
}

// records lists the host's records; an unreadable one may hold any GPU,
// so the offer is refused rather than counted without it.
func (o *Offers) records() ([]*vmflowv1.InstanceRecord, error) {
	recs, err := o.Store.List()
	if bad, listed := store.Unreadable(err); !listed || len(bad) > 0 {
		return nil, fmt.Errorf("gpu offer: %w", err)
	}
	return recs, nil
}

// free counts the devices no held lease names and no quarantine holds, by
// offer, with the vGPU driver's name.
func (o *Offers) free(ctx context.Context) (map[offerKey]int, map[offerKey]string, error) {
	free, driver := map[offerKey]int{}, map[offerKey]string{}
	if o.VGPU != nil {
		q, err := o.VGPU.quar.List()
		if err != nil {
			return nil, nil, err
		}
		profs, err := o.VGPU.drv.Profiles(ctx)
		if err != nil {
			return nil, nil, fmt.Errorf("gpu offer: vGPU profiles: %w", err)
		}
		for _, p := range profs {
			k := offerKey{OfferVGPU, p.Name}
			driver[k] = string(o.VGPU.drv.Kind())
			if _, out := q[p.Parent]; !out {
				free[k] += p.Available
			} else {
				free[k] += 0 // listed, with nothing free
			}
		}
	}
	if o.Whole != nil {
		gpus, err := o.Whole.drv.GPUs(ctx)
		if err != nil {
			return nil, nil, fmt.Errorf("gpu offer: whole GPUs: %w", err)
		}
		taken, err := o.Whole.takenBy("", "")(ctx)
		if err != nil {
			return nil, nil, fmt.Errorf("gpu offer: %w", err)
		}
		q, err := o.Whole.quar.List()
		if err != nil {
			return nil, nil, err
		}
		// A group is free only when every GPU in it is: placement takes
		// groups whole.
		busy := map[string]bool{}
		for _, g := range gpus {
			_, qd := q[g.Addr]
			_, tk := taken[g.Addr]
			if !g.Offered || !g.Viable || g.Marked || qd || tk {
				busy[g.Group] = true
			}
		}
		for _, g := range gpus {
			if !g.Offered {
				continue
			}
			k := offerKey{OfferPassthrough, g.ID()}
			free[k] += 0 // listed, free or not
			if g.Group != "" && !busy[g.Group] {
				free[k]++
			}
		}
	}
	return free, driver, nil
}

// gpuWant is what a spec asks of GPUs.
type gpuWant struct {
	key offerKey
	n   int
}

func specGPUs(spec *vmflowv1.VMSpec) gpuWant {
	if n := store.VGPUCount(spec.GetVgpuProfile(), spec.GetVgpuCount()); n > 0 {
		return gpuWant{offerKey{OfferVGPU, spec.GetVgpuProfile()}, n}
	}
	if n := int(spec.GetGpuPassthroughCount()); n > 0 {
		return gpuWant{offerKey{OfferPassthrough, spec.GetGpuPassthroughModel()}, n}
	}
	return gpuWant{}
}

// pendingGPUs counts, by offer, the GPUs granted records have yet to
// claim: a record not launched yet (Creating) whose capacity reservation
// still counts, less its active GPU leases (an intent's device may exist
// already: counted again, the safe way). except is left out.
func pendingGPUs(recs []*vmflowv1.InstanceRecord, now time.Time, except string) map[offerKey]int {
	out := map[offerKey]int{}
	for _, r := range recs {
		if r.GetId() == except || r.GetState() != vmflowv1.InstanceState_INSTANCE_STATE_CREATING {
			continue
		}
		c := store.Capacity(r)
		if !store.LeaseHeld(c) || expired(c, now) {
			continue
		}
		want := specGPUs(r.GetSpec())
		if want.n == 0 {
			continue
		}
		for _, l := range append(store.HeldVGPUs(r), store.HeldPassthrough(r)...) {
			if l.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE {
				want.n -= max(len(store.PassthroughGPUs(l)), 1)
			}
		}
		out[want.key] += max(want.n, 0)
	}
	return out
}
