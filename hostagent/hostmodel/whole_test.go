package hostmodel_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"pgregory.net/rapid"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// The whole-GPU (passthrough) part of the model. Every check's host has
// PCI GPUs beside its vGPUs, and the instances of wholeCounts ask for
// whole GPUs instead of vGPUs (the two do not mix in one VM). Claims,
// launches, releases, reconcile rounds, stray binds and reboots that
// renumber the IOMMU groups, remove a card or put another in its slot are
// among the random steps, with faults on one PCI function at a time (one
// bad card beside healthy ones), for one step or until a reboot swaps the
// card, so strikes and quarantines happen.

// pciGPUs and pciGroupWith make the model's whole-GPU host: GPUs 0 and 4
// share an IOMMU group (behind a switch without ACS: two GPUs in one
// lease), GPU 1 has an audio function, GPU 2 a bridge in its group, and
// GPU 3 a NIC (never offered): four GPUs in three groups for instances
// asking for one and two, so placement binds and a request for one never
// takes the two-GPU group.
const pciGPUs = 5

var pciGroupWith = map[int]int{4: 0}

// wholeCounts is how many whole GPUs the instances that ask for them
// want; the others ask for vGPUs (vgpuCounts).
var wholeCounts = map[string]int{"vm-d": 1, "vm-e": 2}

// card is the identity of the PCI function at an address: what a lease
// records of the card it bound (vendor:device, and the PCIe serial
// number, 0 for functions without one).
type card struct {
	id     string
	serial uint64
}

// serialString is serial as lspci prints it, which is how a lease
// records it; "" for none.
func serialString(serial uint64) string {
	if serial == 0 {
		return ""
	}
	parts := make([]string, 8)
	for i := range parts {
		parts[i] = fmt.Sprintf("%02x", byte(serial>>(8*(7-i))))
	}
	return strings.Join(parts, "-")
}

// installedCards is the PCI hardware at mount: every function of
// vgpusim.PCIGPUAt(0..pciGPUs-1).
func installedCards() map[string]card {
	m := map[string]card{}
	for i := range pciGPUs {
		g := vgpusim.PCIGPUAt(i)
		m[g.GPU] = card{id: g.ID, serial: g.Serial}
		if g.Audio != "" {
			m[g.Audio] = card{id: "10de:22ba"}
		}
		if g.Bridge != "" {
			m[g.Bridge] = card{id: "1000:c010"}
		}
		if g.NIC != "" {
			m[g.NIC] = card{id: "15b3:101d"}
		}
	}
	return m
}

// isGPU reports whether addr is a GPU's display function.
func isGPU(addr string) bool {
	for i := range pciGPUs {
		if vgpusim.PCIGPUAt(i).GPU == addr {
			return true
		}
	}
	return false
}

// cardThere reports whether the function a lease recorded still holds the
// card it bound: installed at its address with the same identity.
func (h *host) cardThere(f *vmflowv1.PassthroughFunction) bool {
	c, ok := h.cards[f.GetAddr()]
	return ok && c.id == f.GetId() && serialString(c.serial) == f.GetSerial()
}

// leaseCardsThere reports whether every function of l holds its card.
func (h *host) leaseCardsThere(l *vmflowv1.Lease) bool {
	for _, f := range l.GetGpuPassthrough().GetFunctions() {
		if !h.cardThere(f) {
			return false
		}
	}
	return true
}

// driverOf is the driver the simulator has addr bound to ("" none or gone).
func (h *host) driverOf(addr string) string {
	d, _ := h.srv.PCIDriver(addr)
	return d
}

// boundFunctions are the installed PCI functions on vfio-pci, as the
// simulator has them.
func (h *host) boundFunctions() map[string]bool {
	out := map[string]bool{}
	for a := range h.cards {
		if h.driverOf(a) == vgpusim.DrvVFIO {
			out[a] = true
		}
	}
	return out
}

// markedFunctions are the installed PCI functions with vmflow's mark
// (driver_override=vfio-pci), read from sysfs.
func (h *host) markedFunctions(t *rapid.T) map[string]bool {
	out := map[string]bool{}
	for a := range h.cards {
		b, err := os.ReadFile(filepath.Join(h.sys, "bus", "pci", "devices", a, "driver_override"))
		if err != nil {
			t.Fatalf("read driver_override of %s: %v", a, err)
		}
		if strings.TrimSpace(string(b)) == vgpusim.DrvVFIO {
			out[a] = true
		}
	}
	return out
}

// functions lists the installed GPUs and their audio functions, sorted:
// where the model puts a fault.
func (h *host) functions() []string {
	var out []string
	for a := range h.cards {
		if isGPU(a) || strings.HasSuffix(a, ".1") {
			out = append(out, a)
		}
	}
	sort.Strings(out)
	return out
}

// drawFunction draws a PCI function to fault: most often one that leases
// name (those whose steps run), else any GPU or audio function.
func (h *host) drawFunction(t *rapid.T, leases []*vmflowv1.Lease) string {
	var named []string
	for _, l := range leases {
		for _, a := range store.PassthroughDevices(l) {
			if _, ok := h.cards[a]; ok {
				named = append(named, a)
			}
		}
	}
	if len(named) > 0 && !rarely(t, "elsewhere") {
		return rapid.SampledFrom(named).Draw(t, "function")
	}
	return rapid.SampledFrom(h.functions()).Draw(t, "function")
}

// pciFault is one fault of the simulator's per-function control files.
type pciFault struct{ name, addr string }

// inject sets a fault on one PCI function for this step and notes which
// GPUs its failure may be struck against.
func (h *host) inject(t *rapid.T, name, addr, errno string) pciFault {
	h.setFault(t, vgpusim.At(name, addr), errno)
	if name == vgpusim.CtlBlockUnbind {
		return pciFault{name, addr} // a wait is no failure: nothing may be struck for it
	}
	for _, g := range h.strikable(t, addr) {
		h.faulted[g] = true
		h.double[g] = h.double[g] || failsUndo(name)
		h.atOnce[g] = h.atOnce[g] || name == vgpusim.CtlFailReset
	}
	return pciFault{name, addr}
}

// failsUndo reports whether a fault of name can fail a claim's undo of a
// bind that failed: a probe back to the previous driver, or the reset of
// a function of the group the bind did move to vfio-pci. Its group's GPUs
// are then struck twice in one step, for two failed steps.
func failsUndo(name string) bool {
	return name == vgpusim.CtlFailProbe || name == vgpusim.CtlFailReset
}

// strikable are the GPUs a failure of PCI function addr may be struck
// against: those of its IOMMU group, and those of any held lease naming
// it.
func (h *host) strikable(t *rapid.T, addr string) []string {
	var out []string
	group := h.srv.PCIGroup(addr)
	for a := range h.cards {
		if isGPU(a) && group != "" && h.srv.PCIGroup(a) == group {
			out = append(out, a)
		}
	}
	recs, _ := h.records(t)
	for _, r := range recs {
		for _, l := range store.HeldPassthrough(r) {
			if slices.Contains(store.PassthroughDevices(l), addr) {
				out = append(out, store.PassthroughGPUs(l)...)
			}
		}
	}
	return out
}

// badCard makes one card fail its unbind, reset or probe from now on, as
// a wedged GPU does, until a reboot puts another card in its slot: its
// claims move on and strike it, its releases fail until then.
func (h *host) badCard(t *rapid.T) {
	addr := rapid.SampledFrom(h.functions()).Draw(t, "function")
	if h.bad[addr] != "" {
		t.Skip("already bad")
	}
	name := rapid.SampledFrom([]string{vgpusim.CtlFailUnbind, vgpusim.CtlFailReset, vgpusim.CtlFailProbe}).Draw(t, "fault")
	h.setFault(t, vgpusim.At(name, addr), "EIO")
	h.bad[addr] = name
	h.events["bad card"]++
	t.Logf("bad card: %s at %s", name, addr)
}

// failingCards are the installed GPUs with strikes: what an operator
// swaps.
func (h *host) failingCards() map[string]bool {
	out := map[string]bool{}
	for d := range h.quarantine.Strikes() {
		if _, ok := h.cards[d]; ok && isGPU(d) {
			out[d] = true
		}
	}
	return out
}

// badGroup reports whether a function of addr's IOMMU group is a bad
// card's: its group's steps may fail at any time.
func (h *host) badGroup(addr string) bool {
	g := h.srv.PCIGroup(addr)
	for b := range h.bad {
		if h.srv.PCIGroup(b) == g {
			return true
		}
	}
	return false
}

// badLease reports whether a function of l's, or of its group, is a bad
// card's.
func (h *host) badLease(l *vmflowv1.Lease) bool {
	return slices.ContainsFunc(store.PassthroughDevices(l), h.badGroup)
}

// lift removes the fault; after a block, it waits until the blocked
// unbind went through (the function has left the driver it was on while
// blocked), so that no write runs on between steps.
func (h *host) lift(t *rapid.T, f pciFault) {
	if f.name == "" {
		return
	}
	blocked, from := h.srv.Blocked() > 0, h.driverOf(f.addr)
	if h.bad[f.addr] == f.name {
		return // the bad card's own fault: it stays
	}
	h.clearFault(t, vgpusim.At(f.name, f.addr))
	if f.name != vgpusim.CtlBlockUnbind || !blocked {
		return
	}
	if !waitFor(func() bool { return h.srv.Blocked() == 0 && h.driverOf(f.addr) != from }) {
		t.Fatalf("the blocked unbind of %s never finished", f.addr)
	}
}

// claimWhole claims id's whole GPUs, maybe with one function failing its
// unbind or probe (the claim strikes its GPU and moves on) or blocking
// its unbind (the claim gives up waiting; the retry resumes). A claim no
// retry can finish must leave no lease held and nothing bound.
func (h *host) claimWhole(t *rapid.T, id string) {
	faultName := rapid.SampledFrom([]string{"", "", vgpusim.CtlFailUnbind, vgpusim.CtlFailProbe, vgpusim.CtlBlockUnbind}).Draw(t, "fault")
	model := rapid.SampledFrom([]string{"", "", vgpusim.PCIGPUAt(0).ID}).Draw(t, "model")
	before := h.boundFunctions()
	var f pciFault
	wait := opTimeout
	if faultName != "" {
		f = h.inject(t, faultName, h.drawFunction(t, nil), "EIO")
		if faultName == vgpusim.CtlBlockUnbind {
			wait = 200 * time.Millisecond
		}
	}
	c, cancel := ctx()
	defer cancel()
	c, cancel2 := context.WithTimeout(c, wait)
	defer cancel2()
	n := wholeCounts[id]
	ls, err := h.whole.Claim(c, id, model, n)
	h.lift(t, f)
	var devs []string
	gpus := 0
	for _, l := range ls {
		devs = append(devs, store.PassthroughDevices(l)...)
		gpus += len(store.PassthroughGPUs(l))
	}
	t.Logf("claim whole %s x%d %q (fault %s at %s): %v %v", id, n, model, f.name, f.addr, devs, err)
	h.event("claim whole", ls != nil, err)
	if err == nil && gpus != n {
		t.Fatalf("VIOLATION claim of %d whole GPUs for %s returned %d (%v)", n, id, gpus, devs)
	}
	for _, l := range ls {
		if !h.leaseCardsThere(l) {
			t.Fatalf("VIOLATION %s's lease of %v does not record the cards there now (%v)", id, store.PassthroughDevices(l), l.GetGpuPassthrough().GetFunctions())
		}
	}
	rec, gerr := h.st.Get(id)
	if err == nil || !errors.Is(err, errdefs.NoCapacity) || gerr != nil || !store.NeverLaunched(rec) {
		return
	}
	if strings.Contains(err.Error(), "roll back the claim") {
		h.events["claim whole rollback failed"]++
		return
	}
	h.events["claim whole rolled back"]++
	if held := store.HeldPassthrough(rec); len(held) > 0 {
		t.Fatalf("VIOLATION a whole-GPU claim that failed for capacity kept %d lease(s) of %s", len(held), id)
	}
	for a := range h.boundFunctions() {
		if !before[a] {
			t.Fatalf("VIOLATION a whole-GPU claim that failed for capacity left %s on vfio-pci", a)
		}
	}
}

// wholeNode makes id's whole GPUs launchable, as every launch does
// (EnsureDevicesLocked binds them again after a reboot), and returns the
// VFIO node of its first group for the QEMU stand-in to hold. A lease
// whose cards are all still there must bind: nothing else may have taken
// them, and no fault is injected at a launch.
func (h *host) wholeNode(t *rapid.T, id string, rec *vmflowv1.InstanceRecord) (string, bool) {
	held := store.HeldPassthrough(rec)
	if store.HeldPassthroughGPUs(rec) != wholeCounts[id] ||
		slices.ContainsFunc(held, func(l *vmflowv1.Lease) bool { return l.GetPhase() != vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE }) {
		t.Logf("launch %s: not every whole GPU active", id)
		return "", false
	}
	c, cancel := ctx()
	defer cancel()
	l, err := h.st.Lock(c, id)
	if err != nil {
		t.Fatalf("launch %s: %v", id, err)
	}
	_, err = h.whole.EnsureDevicesLocked(c, l)
	_ = l.Unlock()
	t.Logf("launch %s: ensure whole GPUs: %v", id, err)
	h.event("ensure whole", err == nil, err)
	there := !slices.ContainsFunc(held, func(l *vmflowv1.Lease) bool { return !h.leaseCardsThere(l) })
	if err == nil && !there {
		t.Fatalf("VIOLATION %s launched with a lease whose card is no longer at its address", id)
	}
	if err != nil {
		if there && slices.ContainsFunc(held, h.badLease) {
			return "", false // a bad card fails its bind
		}
		if there {
			t.Fatalf("VIOLATION a held lease's cards are all there and cannot be bound again: %s: %v", id, err)
		}
		if !errors.Is(err, lease.ErrClaimDeviceMissing) || !errors.Is(err, gpu.ErrCardGone) {
			t.Fatalf("VIOLATION a launch whose card is gone fails otherwise than ErrClaimDeviceMissing/ErrCardGone: %s: %v", id, err)
		}
		return "", false
	}
	first := store.PassthroughDevices(held[0])[0]
	return filepath.Join(h.devDir, "vfio", h.srv.PCIGroup(first)), true
}

// releaseWhole is release for an instance of whole GPUs, in the same
// modes, the faults on one PCI function: an unbind, reset or probe that
// fails (struck), an unbind that blocks (a wait: never struck), or one
// that blocks while the record is cut (the agent dies between the sysfs
// writes and the record update). A lease whose card is gone counts as
// released: with the VM gone, its release must finish.
func (h *host) releaseWhole(t *rapid.T, id, mode string) {
	before, berr := h.st.Get(id)
	recorded := store.IdentityOf(before.GetProcess())
	leases := store.HeldPassthrough(before)
	gone := berr == nil && len(leases) > 0 && !slices.ContainsFunc(leases, h.leaseCardsThere)
	call := func(wait time.Duration) (bool, []string, error) {
		c, cancel := ctx()
		defer cancel()
		c, cancel2 := context.WithTimeout(c, wait)
		defer cancel2()
		return h.whole.Release(c, id)
	}
	var released bool
	var dev []string
	var err error
	switch mode {
	case releaseOK:
		released, dev, err = call(opTimeout)
	case releaseFail:
		name := rapid.SampledFrom([]string{vgpusim.CtlFailUnbind, vgpusim.CtlFailReset, vgpusim.CtlFailProbe}).Draw(t, "fault")
		errno := rapid.SampledFrom([]string{"EIO", "EBUSY", "ENODEV", "EINVAL"}).Draw(t, "errno")
		f := h.inject(t, name, h.drawFunction(t, leases), errno)
		released, dev, err = call(opTimeout)
		t.Logf("release whole %s (%s %s at %s)", id, name, errno, f.addr)
		h.lift(t, f)
	case releaseBlocked:
		f := h.inject(t, vgpusim.CtlBlockUnbind, h.drawFunction(t, leases), "")
		released, dev, err = call(200 * time.Millisecond)
		t.Logf("release whole %s (blocked at %s, gave up): released=%t %s %v", id, f.addr, released, dev, err)
		h.lift(t, f)
		released, dev, err = call(opTimeout)
	case releaseCrash:
		f := h.inject(t, vgpusim.CtlBlockUnbind, h.drawFunction(t, leases), "")
		released, dev, err = h.crashDuring(t, id, func() { h.lift(t, f) }, func() (bool, []string, error) { return call(opTimeout) })
	}
	t.Logf("release whole %s (%s): released=%t %s %v", id, mode, released, dev, err)
	h.event("release whole "+mode, released, err)
	if released && recorded.PID != 0 {
		if st := proc.Inspect(recorded); st.Alive {
			t.Fatalf("VIOLATION whole GPUs released while the VM lives: %s released %s while its process %v is %s", id, dev, recorded, st.State)
		}
	}
	_, unreadable := h.corrupt[id]
	if mode == releaseOK && gone && !unreadable && !h.diskFull() && !proc.Inspect(recorded).Alive && (err != nil || !released) {
		t.Fatalf("VIOLATION a lease whose card is gone did not count as released: %s: released=%t %v", id, released, err)
	}
}

// diskFull reports whether fillDisk's file is there.
func (h *host) diskFull() bool {
	_, err := os.Stat(filepath.Join(h.state, "filler"))
	return err == nil
}

// strayGroup binds a group to vfio-pci with vmflow's mark and no lease,
// as a lease whose record was removed by hand leaves it: reconcile
// returns it after the grace. The bind respects the held leases, as the
// agent's does.
func (h *host) strayGroup(t *rapid.T) {
	groups := map[string]bool{}
	for a := range h.cards {
		if isGPU(a) {
			groups[h.srv.PCIGroup(a)] = true
		}
	}
	g := drawKey(t, groups)
	taken := func(context.Context) (map[string]string, error) {
		recs, err := h.st.List()
		m := map[string]string{}
		for _, r := range recs {
			for _, l := range store.HeldPassthrough(r) {
				for _, a := range store.PassthroughDevices(l) {
					m[a] = r.GetId()
				}
			}
		}
		if err != nil {
			return m, fmt.Errorf("%w: %w", gpu.ErrRecordsUnreadable, err)
		}
		return m, nil
	}
	c, cancel := ctx()
	defer cancel()
	b, err := h.whole.Driver().Bind(c, gpu.BindRequest{Group: g, Taken: taken})
	for _, a := range b.Addrs() {
		h.strays[a] = true // bound part-way too, when a bad card failed the rest
	}
	t.Logf("stray group %s: %v %v", g, b.Addrs(), err)
	h.event("stray group", err == nil, err)
}

// rebootPCI is the PCI half of a reboot: every function back on the
// driver that matches it, the IOMMU groups maybe renumbered, maybe a
// card taken out or another put in its slot (swap's, when given).
func (h *host) rebootPCI(t *rapid.T, swap string) {
	r := vgpusim.Reboot{GroupOffset: rapid.SampledFrom([]int{0, 1, 2, 5}).Draw(t, "groupOffset")}
	if swap == "" && rarely(t, "removeCard") {
		g := vgpusim.PCIGPUAt(rapid.IntRange(0, pciGPUs-1).Draw(t, "removed"))
		for _, a := range []string{g.GPU, g.Audio} {
			if _, ok := h.cards[a]; ok && a != "" {
				r.Remove = append(r.Remove, a)
			}
		}
	}
	if swap != "" {
		r.Replace = map[string]string{swap: h.cards[swap].id} // the same model, another serial number
	} else if rarely(t, "replaceCard") {
		addr := vgpusim.PCIGPUAt(rapid.IntRange(0, pciGPUs-1).Draw(t, "replaced")).GPU
		if _, ok := h.cards[addr]; ok && !slices.Contains(r.Remove, addr) {
			r.Replace = map[string]string{addr: h.cards[addr].id}
		}
	}
	if err := h.srv.Reboot(r); err != nil {
		t.Fatalf("reboot: %v", err)
	}
	for _, a := range r.Remove {
		delete(h.cards, a)
	}
	// The card taken out, or the one put in its place, is not the bad
	// one any more (nor its audio function); unless the slot was the
	// fault (a riser, its power), and the new card fails as the old did.
	slot := len(r.Replace) > 0 && rapid.Bool().Draw(t, "badSlot")
	for _, a := range append(slices.Collect(maps.Keys(r.Replace)), r.Remove...) {
		for b := range h.bad {
			if slot && r.Replace[a] != "" {
				break
			}
			if b == a || strings.TrimSuffix(b, ".1") == strings.TrimSuffix(a, ".0") {
				h.clearFault(t, vgpusim.At(h.bad[b], b))
				delete(h.bad, b)
			}
		}
	}
	for a := range r.Replace {
		c := h.cards[a]
		c.serial += 1 << 32 // as the simulator gives the new card its serial number
		h.cards[a] = c
		h.own[a], h.swapped[a] = 0, true
	}
	// No mark survives a reboot: a function marked after it is a new
	// sighting (the agent's ledger, by group number, may remember an
	// older one, which only shortens a grace).
	h.strays, h.unmarkedSince = map[string]bool{}, map[string]time.Time{}
	h.events["card removed"] += len(r.Remove)
	h.events["card replaced"] += len(r.Replace)
	t.Logf("reboot PCI: groups +%d, removed %v, replaced %v", r.GroupOffset, r.Remove, r.Replace)
}

// wholeUnmarked is the whole-GPU half of a reconcile's bookkeeping before
// the round: the marked functions whose group no held lease names,
// first seen when (the ledger's grace).
func (h *host) wholeUnmarked(t *rapid.T, recs []*vmflowv1.InstanceRecord, now time.Time) []string {
	named := map[string]bool{}
	for _, r := range recs {
		for _, l := range store.HeldPassthrough(r) {
			for _, a := range store.PassthroughDevices(l) {
				named[h.srv.PCIGroup(a)] = true
			}
		}
	}
	next := map[string]time.Time{}
	var out []string
	for a := range h.markedFunctions(t) {
		if named[h.srv.PCIGroup(a)] {
			continue
		}
		since, ok := h.unmarkedSince[a]
		if !ok {
			since = now
		}
		next[a] = since
		out = append(out, a)
	}
	h.unmarkedSince = next
	return out
}

// reconcileWhole runs the whole-GPU round after the vGPU round, as the
// agent's reconcile does, maybe with one function failing its unbind.
// Then no group vmflow marked, that no held lease named since the grace
// before this round and that nothing holds open, may survive it.
func (h *host) reconcileWhole(t *rapid.T, recs []*vmflowv1.InstanceRecord, unreadable bool, now time.Time) {
	var unmarked []string
	prevSince := h.unmarkedSince
	if !unreadable {
		unmarked = h.wholeUnmarked(t, recs, now)
	}
	var f pciFault
	if rarely(t, "failUnbind") {
		f = h.inject(t, vgpusim.CtlFailUnbind, rapid.SampledFrom(h.functions()).Draw(t, "function"), "EIO")
	}
	c, cancel := ctx()
	defer cancel()
	res, err := h.whole.Reconcile(c)
	h.lift(t, f)
	t.Logf("reconcile whole (fail-unbind at %q): %v %v", f.addr, res, err)
	h.events["reconcile whole released"] += int(res.GetClaimsReleased())
	h.events["reconcile whole orphans returned"] += int(res.GetOrphansRemoved())
	marked := h.markedFunctions(t)
	switch {
	case err != nil:
		// The round's ledger was not written: its first sightings are
		// not remembered.
		h.unmarkedSince = prevSince
	case !unreadable:
		// Like the ledger, forget what the round returned: bound again,
		// it starts its grace afresh.
		for a := range h.unmarkedSince {
			if !marked[a] {
				delete(h.unmarkedSince, a)
			}
		}
	}
	if unreadable || f.name != "" || err != nil {
		return
	}
	for _, a := range unmarked {
		since, ok := h.unmarkedSince[a]
		if ok && now.Sub(since) >= grace && !h.badGroup(a) && !h.nodeHeld(filepath.Join(h.devDir, "vfio", h.srv.PCIGroup(a))) {
			t.Fatalf("VIOLATION orphan group: %s (group %s), marked and named by no held lease since %s (%s ago), survived a reconcile",
				a, h.srv.PCIGroup(a), since.Format(time.TimeOnly), now.Sub(since))
		}
	}
}

// nodeHeld reports whether anything has node open, as the lease layer
// decides it.
func (h *host) nodeHeld(node string) bool {
	if _, err := os.Stat(node); err != nil {
		return false
	}
	c, cancel := ctx()
	defer cancel()
	hs, err := proc.Holders(c, node)
	if err != nil {
		return true
	}
	return slices.ContainsFunc(hs, func(x proc.Holder) bool { return !(x.Uncertain && slices.Contains(h.ignore, x.PID)) })
}

// leaseNaming is the lease of ls naming PCI function addr, nil for none.
func leaseNaming(ls []*vmflowv1.Lease, addr string) *vmflowv1.Lease {
	for _, l := range ls {
		if slices.Contains(store.PassthroughDevices(l), addr) {
			return l
		}
	}
	return nil
}

// checkWhole: the whole-GPU invariants, against the simulator's bindings,
// the store and the quarantine's files.
func (h *host) checkWhole(t *rapid.T, now snapshot, rebooted bool) {
	for a := range h.strays {
		if !now.bound[a] {
			delete(h.strays, a)
		}
	}
	// One function, one lease (invariant 10).
	owner := map[string]string{}
	for id, ls := range now.whole {
		for _, l := range ls {
			for _, a := range store.PassthroughDevices(l) {
				if o, ok := owner[a]; ok {
					t.Fatalf("VIOLATION two held leases name PCI function %s: %s and %s", a, o, id)
				}
				owner[a] = id
			}
		}
	}
	// On vfio-pci only while a held lease names the card there (a claim's
	// rollback leaves nothing bound), or as the model's stray; never the
	// card now at an address bound for the lease of the one that was.
	for a := range now.bound {
		if h.strays[a] {
			continue
		}
		id, ok := owner[a]
		if !ok {
			t.Fatalf("VIOLATION %s is on vfio-pci and no held lease names it", a)
		}
		for _, f := range leaseNaming(now.whole[id], a).GetGpuPassthrough().GetFunctions() {
			if f.GetAddr() == a && !h.cardThere(f) {
				t.Fatalf("VIOLATION the card now at %s (%+v) is bound to vfio-pci for %s's lease of the card that was there (%s %s)",
					a, h.cards[a], id, f.GetId(), f.GetSerial())
			}
		}
	}
	// What is not a GPU's own is never touched: the NIC and the bridge
	// that share GPUs' groups keep their drivers.
	for i := range pciGPUs {
		g := vgpusim.PCIGPUAt(i)
		if d := h.driverOf(g.NIC); g.NIC != "" && d != vgpusim.DrvMLX5 {
			t.Fatalf("VIOLATION the NIC %s beside GPU %s is on %q", g.NIC, g.GPU, d)
		}
		if d := h.driverOf(g.Bridge); g.Bridge != "" && d != vgpusim.DrvPCIePort {
			t.Fatalf("VIOLATION the bridge %s beside GPU %s is on %q", g.Bridge, g.GPU, d)
		}
	}
	// No held lease without its record.
	for id, ls := range h.prev.whole {
		if _, ok := now.whole[id]; ok {
			continue
		}
		if _, err := h.st.Get(id); errors.Is(err, store.ErrNotFound) {
			t.Fatalf("VIOLATION held whole-GPU lease lost its record: %s held %s", id, store.LeaseName(ls[0]))
		}
	}
	// A function leaves vfio-pci only through its lease's release (or a
	// reboot), and never while a VM whose held lease names it lives
	// (invariant 2). A release that failed part-way (one function
	// returned, the next one's unbind failed) puts its lease back to
	// active with one more attempt counted, and is no loss.
	for a := range h.prev.bound {
		if rebooted || now.bound[a] {
			continue
		}
		for id, ls := range h.prev.whole {
			was := leaseNaming(ls, a)
			if was == nil {
				continue
			}
			is := leaseNaming(now.whole[id], a)
			if _, unreadable := h.corrupt[id]; !unreadable &&
				was.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE && is.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE &&
				is.GetReleaseAttempts() == was.GetReleaseAttempts() {
				t.Fatalf("VIOLATION %s of %s's active lease left vfio-pci and the lease still says active", a, id)
			}
			if p, ok := h.prev.procs[id]; ok {
				if st := proc.Inspect(p); st.Alive {
					t.Fatalf("VIOLATION %s left vfio-pci while the VM of %s lives (%v is %s)", a, id, p, st.State)
				}
			}
		}
	}
	h.checkStrikes(t, now)
}

// checkStrikes (invariant 16): a strike only for a failure the model
// injected in this step on that device (a refusal or a wait never
// strikes); a device whose strikes reached --gpu-quarantine-after is
// quarantined (when the disk had room to write it); and a whole GPU is
// quarantined only for that many failures of its own card in a row,
// never for those of the card a reboot took from its address.
func (h *host) checkStrikes(t *rapid.T, now snapshot) {
	defer func() {
		h.faulted, h.double, h.atOnce, h.vgpuFaulted = map[string]bool{}, map[string]bool{}, map[string]bool{}, false
	}()
	for b, name := range h.bad {
		for _, g := range h.strikable(t, b) {
			h.faulted[g] = true // a bad card fails in every step
			h.double[g] = h.double[g] || failsUndo(name)
			h.atOnce[g] = h.atOnce[g] || name == vgpusim.CtlFailReset
		}
	}
	for d := range h.own {
		if _, ok := now.strikes[d]; !ok {
			h.own[d] = 0 // a success, or a clear: the run starts over
			delete(h.swapped, d)
		}
	}
	var q map[string]lease.Quarantined
	for d, s := range now.strikes {
		was, ok := h.prev.strikes[d]
		if ok && was == s {
			continue
		}
		if isGPU(d) {
			switch {
			case h.swapped[d]:
				// The first failures of a card a reboot put at d: the
				// count is this step's alone, one (two where a fault
				// failed both a claim's bind and its undo).
				delete(h.swapped, d)
				h.events["struck after a card swap"]++
				if s.Count != 1 && !h.double[d] {
					t.Fatalf("VIOLATION the card a reboot put at %s failed once and its count says %d: the failures of the card it replaced were kept", d, s.Count)
				}
				h.own[d] = s.Count
			case s.Count > was.Count:
				// No step both succeeds and fails on one whole GPU: the
				// count grew by this step's failures...
				h.own[d] += s.Count - was.Count
			default:
				// ... or a success started it over before them.
				h.own[d] = s.Count
			}
			if now.quar[d] && !h.prev.quar[d] && h.own[d] < h.quarantineAfter && !h.atOnce[d] {
				t.Fatalf("VIOLATION %s quarantined after %d failure(s) of the card there now (--gpu-quarantine-after %d; the count says %d: the card a reboot took from the address failed before)",
					d, h.own[d], h.quarantineAfter, s.Count)
			}
		}
		if isGPU(d) && !h.faulted[d] || !isGPU(d) && !h.vgpuFaulted {
			t.Fatalf("VIOLATION %s struck with no failure of its own: %+v (faults this step: %v)", d, s, h.faulted)
		}
		h.events["struck"]++
		if s.Count < h.quarantineAfter || h.diskFull() {
			continue
		}
		if q == nil {
			var err error
			if q, err = h.quarantine.List(); err != nil {
				t.Fatalf("quarantine: %v", err)
			}
		}
		if _, ok := q[d]; !ok {
			t.Fatalf("VIOLATION %s failed %d times in a row (--gpu-quarantine-after %d) and is not quarantined", d, s.Count, h.quarantineAfter)
		}
	}
}
