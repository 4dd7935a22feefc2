package fleet

import (
	"fmt"
	"sort"
	"strings"

	"google.golang.org/protobuf/proto"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Ask is what a spawn asks of a host, in the terms of the hosts' views.
type Ask struct {
	VCPUs     uint32
	MemoryMiB uint32 // guest RAM; a host adds its own overhead (HostView.vm_overhead_mib)
	TCG       bool   // accel "tcg": the host's TCG overhead too; else the host needs KVM
	// GPUKind and GPUName: an offer (GpuOffer.kind and name; a
	// passthrough name "" is any model), GPUs how many; 0: none.
	GPUKind, GPUName string
	GPUs             uint32
	Network          bool
	// Dedicated: its vCPUs on CPUs of its own (dedicated_cpus);
	// Hugepages: its guest RAM from the hugepage pools.
	Dedicated, Hugepages bool
}

// AskOf is req's ask.
func AskOf(req *vmflowv1.SpawnRequest) Ask {
	a := Ask{VCPUs: req.GetVcpus(), MemoryMiB: req.GetMemoryMib(), TCG: req.GetAccel() == "tcg", Network: req.GetNetwork() != "",
		Dedicated: req.GetDedicatedCpus(), Hugepages: req.GetHugepages() != ""}
	switch {
	case req.GetVgpuProfile() != "":
		a.GPUKind, a.GPUName, a.GPUs = KindVGPU, req.GetVgpuProfile(), max(req.GetVgpuCount(), 1)
	case req.GetGpuPassthroughCount() > 0:
		a.GPUKind, a.GPUName, a.GPUs = KindPassthrough, req.GetGpuPassthroughModel(), req.GetGpuPassthroughCount()
	}
	return a
}

// Offer kinds, as the agents publish them (lease.OfferVGPU,
// lease.OfferPassthrough: the agent's side of the same strings).
const (
	KindVGPU        = "vgpu"
	KindPassthrough = "passthrough"
)

// String says what was asked, for NoFleetCapacity: "2 × passthrough
// \"10de:2335\" with 64 vCPUs and 8192 MiB".
func (a Ask) String() string {
	var b strings.Builder
	if a.GPUs > 0 {
		name := a.GPUName
		if name == "" {
			name = "any model"
		}
		fmt.Fprintf(&b, "%d × %s %q with ", a.GPUs, a.GPUKind, name)
	}
	fmt.Fprintf(&b, "%d vCPUs and %d MiB", a.VCPUs, a.MemoryMiB)
	if a.Network {
		b.WriteString(", a network")
	}
	if a.TCG {
		b.WriteString(" (tcg)")
	}
	return b.String()
}

// memory is what a VM of a holds of v's host's memory (with hugepages:
// QEMU's own, its guest RAM is the pools').
func (a Ask) memory(v *vmflowv1.HostView) uint32 {
	m := v.GetVmOverheadMib()
	if !a.Hugepages {
		m += a.MemoryMiB
	}
	if a.TCG {
		m += v.GetTcgOverheadMib()
	}
	return m
}

// gpusFree is how many GPUs of a's offer v has free; for passthrough of
// any model, all its passthrough GPUs.
func (a Ask) gpusFree(v *vmflowv1.HostView) uint32 {
	var n uint32
	for _, g := range v.GetGpus() {
		if a.serves(g) {
			n += g.GetFree()
		}
	}
	return n
}

// serves reports whether offer g is of what a asks (a passthrough of any
// model: every passthrough offer).
func (a Ask) serves(g *vmflowv1.GpuOffer) bool {
	return g.GetKind() == a.GPUKind && (g.GetName() == a.GPUName || a.GPUKind == KindPassthrough && a.GPUName == "")
}

func anyGPUFree(v *vmflowv1.HostView) bool {
	for _, g := range v.GetGpus() {
		if g.GetFree() > 0 {
			return true
		}
	}
	return false
}

// Fits reports whether v's host can serve a now, by its view, and if not
// why not (one reason: the first that fails).
func Fits(v *vmflowv1.HostView, a Ask) (bool, string) {
	mem := a.memory(v)
	free := v.GetMemoryFreeMib()
	if a.GPUs > 0 {
		free = min(free, v.GetPinnedMemoryFreeMib())
	}
	switch {
	case v.GetDraining():
		return false, "draining: " + v.GetDrainReason()
	case v.GetUnreadableRecords() > 0:
		return false, fmt.Sprintf("%d record(s) unreadable: it promises nothing until they are repaired", v.GetUnreadableRecords())
	case !a.TCG && !v.GetKvm():
		return false, "no KVM"
	case a.Network && !v.GetNetwork():
		return false, "no network"
	case v.GetMaxVcpus() > 0 && a.VCPUs > v.GetMaxVcpus(), v.GetMaxMemoryMib() > 0 && a.MemoryMiB > v.GetMaxMemoryMib():
		return false, fmt.Sprintf("admits at most %d vCPUs and %d MiB", v.GetMaxVcpus(), v.GetMaxMemoryMib())
	case a.Dedicated && a.VCPUs > v.GetDedicatedCpusFree():
		return false, fmt.Sprintf("%d dedicated CPUs free", v.GetDedicatedCpusFree())
	case !a.Dedicated && a.VCPUs > v.GetVcpusFree():
		return false, fmt.Sprintf("%d of %d vCPUs free", v.GetVcpusFree(), v.GetVcpusTotal())
	case a.Hugepages && a.MemoryMiB > v.GetHugepagesFreeMib():
		return false, fmt.Sprintf("%d MiB of hugepages free", v.GetHugepagesFreeMib())
	case mem > free:
		return false, fmt.Sprintf("%d MiB free (this VM holds %d)", free, mem)
	case a.GPUs > 0 && a.gpusFree(v) < a.GPUs:
		return false, fmt.Sprintf("%d of %s %q free", a.gpusFree(v), a.GPUKind, a.GPUName)
	}
	return true, ""
}

// Score ranks a host that fits a; higher is better. The rule, with room
// the smaller of the host's vCPU and memory fractions left free after
// this VM (0 to 1):
//
//   - a VM with GPUs packs: 1000 − 10 × the GPUs of its offer the host
//     would have left − 10 × room, so GPU VMs fill the host with the
//     fewest such GPUs free first (the fewest hosts hold them, and whole
//     hosts stay free for large requests), then the fullest;
//   - a VM without spreads: 100 × room, less 100 on a host with a GPU
//     free, so CPU-only VMs go where the most is left, and to a host
//     with free GPUs only when no other fits: the GPU hosts' CPUs and
//     memory stay for GPU VMs;
//   - both lose 1 per reservation in flight there (granted spawns not
//     launched yet, as published, plus this placer's own recent choices):
//     a burst spreads over equal hosts instead of queuing on one.
//
// Ties go to the lower host id, so a replay or a dry run ranks alike.
func Score(v *vmflowv1.HostView, a Ask, inFlight uint32) (float64, string) {
	room := 1.0
	if t := v.GetVcpusTotal(); t > 0 && !a.Dedicated {
		room = min(room, float64(sat(v.GetVcpusFree(), a.VCPUs))/float64(t))
	}
	if t := v.GetMemoryTotalMib(); t > 0 {
		room = min(room, float64(sat(v.GetMemoryFreeMib(), a.memory(v)))/float64(t))
	}
	var s float64
	var why string
	if a.GPUs > 0 {
		left := sat(a.gpusFree(v), a.GPUs)
		s = 1000 - 10*float64(left) - 10*room
		why = fmt.Sprintf("packs GPUs: %d left after, %.0f%% room", left, 100*room)
	} else {
		s = 100 * room
		why = fmt.Sprintf("spreads: %.0f%% room after", 100*room)
		if anyGPUFree(v) {
			s -= 100
			why += ", keeps off a GPU host"
		}
	}
	if inFlight > 0 {
		s -= float64(inFlight)
		why += fmt.Sprintf(", %d in flight", inFlight)
	}
	return s, why
}

func sat(a, b uint32) uint32 {
	if b > a {
		return 0
	}
	return a - b
}

// Ranked is every host of views scored for a, fitting ones first, best
// first, ties by host id. inFlight adds a placer's own pending choices per
// host (already taken off the views' free figures by the caller).
func Ranked(views []*vmflowv1.HostView, a Ask, inFlight map[string]uint32) []*vmflowv1.HostCandidate {
	var out []*vmflowv1.HostCandidate
	for _, v := range views {
		c := &vmflowv1.HostCandidate{HostId: v.GetHostId(), View: v}
		if ok, why := Fits(v, a); !ok {
			c.Why = why
		} else {
			c.Fits = true
			c.Score, c.Why = Score(v, a, v.GetInFlight()+inFlight[v.GetHostId()])
		}
		out = append(out, c)
	}
	sort.SliceStable(out, func(i, j int) bool {
		x, y := out[i], out[j]
		if x.GetFits() != y.GetFits() {
			return x.GetFits()
		}
		if x.GetScore() != y.GetScore() {
			return x.GetScore() > y.GetScore()
		}
		return x.GetHostId() < y.GetHostId()
	})
	return out
}

// Best is the fleet's best offer for a that no host fits, in words: the
// host closest to fitting (the most of the scarcest thing asked) and what
// it has. "" for no hosts.
func Best(views []*vmflowv1.HostView, a Ask) string {
	var best *vmflowv1.HostView
	bestR := -1.0
	for _, v := range views {
		if v.GetDraining() {
			continue
		}
		r := closeness(v, a)
		if r > bestR || r == bestR && best != nil && v.GetHostId() < best.GetHostId() {
			best, bestR = v, r
		}
	}
	if best == nil {
		if len(views) == 0 {
			return "no host has published a view"
		}
		return "every host is draining"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s has ", best.GetHostId())
	if a.GPUs > 0 {
		fmt.Fprintf(&b, "%d %s %q free, ", a.gpusFree(best), a.GPUKind, a.GPUName)
	}
	fmt.Fprintf(&b, "%d vCPUs and %d MiB free", best.GetVcpusFree(), best.GetMemoryFreeMib())
	return b.String()
}

// closeness is the smallest fraction of a's needs v's host has free.
func closeness(v *vmflowv1.HostView, a Ask) float64 {
	r := 1.0
	frac := func(have, need uint32) {
		if need > 0 {
			r = min(r, float64(have)/float64(need))
		}
	}
	frac(v.GetVcpusFree(), a.VCPUs)
	frac(v.GetMemoryFreeMib(), a.memory(v))
	if a.GPUs > 0 {
		frac(a.gpusFree(v), a.GPUs)
	}
	return r
}

// Take returns v less a (a placer's own pending choice on its host), for
// scoring the next request before the host republishes.
func Take(v *vmflowv1.HostView, a Ask) *vmflowv1.HostView {
	out := proto.CloneOf(v)
	if a.Dedicated {
		out.DedicatedCpusFree = sat(v.GetDedicatedCpusFree(), a.VCPUs)
	} else {
		out.VcpusFree = sat(v.GetVcpusFree(), a.VCPUs)
	}
	if a.Hugepages {
		out.HugepagesFreeMib = sat(v.GetHugepagesFreeMib(), a.MemoryMiB)
	}
	out.MemoryFreeMib = sat(v.GetMemoryFreeMib(), a.memory(v))
	out.PinnedMemoryFreeMib = sat(v.GetPinnedMemoryFreeMib(), a.memory(v))
	need := a.GPUs
	for _, g := range out.GetGpus() {
		if need > 0 && a.serves(g) {
			took := min(need, g.GetFree())
			g.Free -= took
			need -= took
		}
	}
	return out
}
