package hostmodel_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"pgregory.net/rapid"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/network/nettest"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/store"
	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/stacktest"
)

// checksEnv sets the number of rapid checks per driver kind (make fuzz);
// -rapid.checks and RAPID_CHECKS win over it.
const checksEnv = "VMFLOW_MODEL_CHECKS"

// defaultChecks keeps `make test` short: 25 to 45 s under -race on 2
// busy cores, both kinds together (rapid's first checks are short).
const defaultChecks = 15

// defaultSteps is the mean number of actions per check (rapid.steps).
const defaultSteps = 60

func TestMain(m *testing.M) {
	proctest.RunHelperIfRequested()
	flag.Parse()
	if err := setChecks(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	os.Exit(m.Run())
}

// setChecks applies VMFLOW_MODEL_CHECKS (or the short default) to rapid's
// check count unless the caller chose one with -rapid.checks or RAPID_CHECKS.
// It also keeps rapid from writing fail files into the source tree unless
// asked: a failure prints a -rapid.seed that replays it (the model is
// deterministic given the seed).
func setChecks() error {
	set := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if !set["rapid.nofailfile"] && !set["rapid.failfile"] && os.Getenv("RAPID_NOFAILFILE") == "" {
		if err := flag.Set("rapid.nofailfile", "true"); err != nil {
			return err
		}
	}
	if !set["rapid.steps"] && os.Getenv("RAPID_STEPS") == "" {
		// Holes need a few instances through several stages each: longer
		// sequences than rapid's default 30 steps reach them.
		if err := flag.Set("rapid.steps", strconv.Itoa(defaultSteps)); err != nil {
			return err
		}
	}
	if set["rapid.checks"] || os.Getenv("RAPID_CHECKS") != "" {
		return nil
	}
	n := defaultChecks
	if v := os.Getenv(checksEnv); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n <= 0 {
			return fmt.Errorf("%s=%q: want a positive number", checksEnv, v)
		}
	}
	return flag.Set("rapid.checks", strconv.Itoa(n))
}

// TestHostModel runs the state machine once per driver kind.
func TestHostModel(t *testing.T) {
	proctest.RequiresFUSE(t)
	for _, dc := range driverCases {
		t.Run(string(dc.kind), func(t *testing.T) {
			dc.netns = nettest.Namespace(t)
			var checks, steps int
			events := map[string]int{}
			spent := map[string]time.Duration{} // per action, skipped draws included
			start := time.Now()
			rapid.Check(t, func(rt *rapid.T) {
				checks++
				h := newHost(rt, dc)
				h.events = events
				actions := h.actions()
				for name, a := range actions {
					actions[name] = func(rt *rapid.T) {
						defer func(t0 time.Time) { spent[name] += time.Since(t0) }(time.Now())
						a(rt)
						if name != "" {
							steps++ // one that ran: a skipped draw does not return here
						}
					}
				}
				rt.Repeat(actions)
			})
			t.Logf("host model (%s): %d checks, %d steps (%.1f per check) in %s; slowest: %s; outcomes: %s", dc.kind, checks, steps,
				float64(steps)/float64(max(checks, 1)), time.Since(start).Round(time.Millisecond), slowest(spent, 5), formatEvents(events))
		})
	}
}

func (h *host) actions() map[string]func(*rapid.T) {
	return map[string]func(*rapid.T){
		"":            h.check,
		"create":      h.create,
		"claim":       h.claim,
		"launch":      h.launch,
		"exit":        h.exit,
		"beginDelete": h.beginDelete,
		"release":     h.release,
		"reconcile":   h.reconcile,
		"teardown":    h.teardown,
		"delete":      h.deleteRecord,
		"restart":     h.restart,
		"strayDevice": h.strayDevice,
		"corrupt":     h.corruptRecord,
		"repair":      h.repairRecord,
		"assignUID":   h.assignUID,
		"oldShape":    h.oldShape,
		"migrate":     h.migrate,
		"reboot":      h.reboot,
		"fillDisk":    h.fillDisk,
		"clearQuar":   h.clearQuarantine,
		"freeDisk":    h.freeDisk,
		"netAttach":   h.netAttach,
		"netRelease":  h.netRelease,
		"spawn":       h.spawn,
		"remove":      h.remove,
		"strayGroup":  h.strayGroup,
		"badCard":     h.badCard,
		"swapCard":    h.swapCard,
		"releaseAll":  h.releaseAll,
		"bridgeLoss":  h.bridgeLoss,
		"tapRound":    h.tapReconcile,
	}
}

// slowest names the n actions the run spent most time in ("" is the
// checks between them).
func slowest(spent map[string]time.Duration, n int) string {
	names := make([]string, 0, len(spent))
	for k := range spent {
		names = append(names, k)
	}
	sort.Slice(names, func(i, j int) bool { return spent[names[i]] > spent[names[j]] })
	var parts []string
	for _, k := range names[:min(n, len(names))] {
		label := k
		if k == "" {
			label = "(checks)"
		}
		parts = append(parts, fmt.Sprintf("%s %s", label, spent[k].Round(time.Millisecond)))
	}
	return strings.Join(parts, ", ")
}

// formatEvents lists outcome counts, so a run shows which paths it walked.
func formatEvents(ev map[string]int) string {
	keys := make([]string, 0, len(ev))
	for k := range ev {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s=%d", k, ev[k])
	}
	return strings.Join(parts, " ")
}

func drawID(t *rapid.T) string { return rapid.SampledFrom(instanceIDs).Draw(t, "id") }

// existingID draws among the instances that have a record (readable or
// not), so that most steps act on something; no record skips the step.
func (h *host) existingID(t *rapid.T) string {
	recs, _ := h.records(t)
	var ids []string
	for _, r := range recs {
		ids = append(ids, r.GetId())
	}
	for id := range h.corrupt {
		ids = append(ids, id)
	}
	if len(ids) == 0 {
		t.Skip("no records")
	}
	sort.Strings(ids)
	return rapid.SampledFrom(ids).Draw(t, "id")
}

// drawKey draws one of m's keys in a stable order; none skips the step.
func drawKey[V any](t *rapid.T, m map[string]V) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	if len(keys) == 0 {
		t.Skip("nothing to act on")
	}
	sort.Strings(keys)
	return rapid.SampledFrom(keys).Draw(t, "id")
}

// rarely is true one time in four: faults often enough to matter, rarely
// enough that the happy path gets somewhere.
func rarely(t *rapid.T, label string) bool { return rapid.IntRange(0, 3).Draw(t, label) == 0 }

// vgpuCounts is how many vGPUs each model instance asks for: with two
// instances of one and one of two, capacity binds part-way through a claim.
var vgpuCounts = map[string]uint32{"vm-a": 1, "vm-b": 2, "vm-c": 1}

func (h *host) create(t *rapid.T) { h.createOf(t, drawID(t)) } // any id: creating an existing one is a retried create

// modelCPUs is the host's CPUs (and vCPUs: no overcommit); vcpusOf the
// model instances' vCPUs, which add up to more.
const modelCPUs = 3

var vcpusOf = map[string]uint32{"vm-b": 2}

func (h *host) createOf(t *rapid.T, id string) {
	c, cancel := ctx()
	defer cancel()
	vcpus := max(vcpusOf[id], 1)
	spec := &vmflowv1.VMSpec{Vcpus: vcpus, MemoryMib: 64, Machine: "none", VgpuProfile: h.dc.profile, VgpuCount: vgpuCounts[id]}
	if n := wholeCounts[id]; n > 0 {
		spec = &vmflowv1.VMSpec{Vcpus: vcpus, MemoryMib: 64, Machine: "none", GpuPassthroughCount: uint32(n)}
	}
	_, existed := h.st.Get(id)
	_, err := h.st.Create(c, &vmflowv1.InstanceRecord{Id: id, Spec: spec}, store.Reserving(h.capacity.Reserve(id, spec)))
	t.Logf("create %s: %v", id, err)
	h.event("create", err == nil, err)
	if errors.Is(err, lease.ErrNoHostCapacity) && errors.Is(existed, store.ErrNotFound) {
		if _, gerr := h.st.Get(id); !errors.Is(gerr, store.ErrNotFound) {
			t.Fatalf("VIOLATION a create refused for capacity left a record of %s: %v", id, gerr)
		}
	}
}

// checkCapacity: the ledger never holds more than the host's capacity
// (invariant 17), and no VM runs without an active share.
func (h *host) checkCapacity(t *rapid.T) {
	u, err := h.capacity.Usage("")
	if err != nil {
		t.Fatalf("capacity: %v", err)
	}
	if lim := h.capacity.Limits(); u.VCPUs > lim.VCPUs || u.MemoryMiB > lim.MemoryMiB {
		t.Fatalf("VIOLATION the ledger holds %d vCPUs and %d MiB, over the host's %d and %d", u.VCPUs, u.MemoryMiB, lim.VCPUs, lim.MemoryMiB)
	}
	// The ledger summed over the store's index (and the ledger's memo of
	// it) is the ledger summed over the records read from disk now.
	recs, err := h.st.List()
	bad, _ := store.Unreadable(err)
	if disk := h.capacity.UsageOf(recs, len(bad)); !reflect.DeepEqual(u, disk) {
		t.Fatalf("VIOLATION the ledger over the index %+v is not the ledger over the disk %+v", u, disk)
	}
	for id, hp := range h.helpers {
		if !hp.alive() || h.corrupt[id] != nil {
			continue
		}
		rec, err := h.st.Get(id)
		if err != nil {
			continue
		}
		if l := store.Capacity(rec); !store.LeaseHeld(l) || l.GetPhase() != vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE {
			t.Fatalf("VIOLATION %s runs (pid %d) without an active share of the host: %v", id, hp.child.Identity().PID, l)
		}
	}
}

// spawn drives one instance along the spawn workflow (create, claim,
// network, launch) for one to four stages, as far as they go: the
// single-stage actions alone rarely get a VM running, and most holes
// need one. The other actions still come in between.
func (h *host) spawn(t *rapid.T) {
	id := drawID(t)
	h.drive(t, "spawn", func() string {
		rec, err := h.st.Get(id)
		switch {
		case errors.Is(err, store.ErrNotFound):
			return "create"
		case err != nil || store.IsDeleting(rec):
		case !h.claimed(id, rec):
			return "claim"
		case !store.LeaseHeld(store.Network(rec)):
			return "network"
		case h.helpers[id] == nil || !h.helpers[id].alive():
			return "launch"
		}
		return ""
	}, func(stage string) {
		switch stage {
		case "create":
			h.createOf(t, id)
		case "claim":
			h.claimOf(t, id)
		case "network":
			h.netAttachOf(t, id)
		case "launch":
			h.launchOf(t, id)
		}
	})
}

// drive runs one to four stages of a workflow: next says the stage the
// instance is at ("" for none), do runs it. It stops at no stage, or at a
// stage that did not go through (the workflow would retry it later), and
// checks every invariant between two stages, as between steps.
func (h *host) drive(t *rapid.T, what string, next func() string, do func(stage string)) {
	stages := rapid.IntRange(1, 4).Draw(t, "stages")
	last := ""
	for i := 0; i < stages; i++ {
		stage := next()
		if stage == "" || stage == last {
			if i == 0 {
				t.Skip("nothing to " + what)
			}
			return
		}
		if i > 0 {
			h.check(t)
		}
		last = stage
		do(stage)
	}
}

// claimed reports whether rec holds every GPU its spec asks for, active.
func (h *host) claimed(id string, rec *vmflowv1.InstanceRecord) bool {
	held, want := store.HeldVGPUs(rec), store.VGPUCount(h.dc.profile, vgpuCounts[id])
	got := len(held)
	if n := wholeCounts[id]; n > 0 {
		held, want, got = store.HeldPassthrough(rec), n, store.HeldPassthroughGPUs(rec)
	}
	return got == want && !slices.ContainsFunc(held, func(l *vmflowv1.Lease) bool { return l.GetPhase() != vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE })
}

// remove drives one instance along the delete workflow (begin, stop,
// release every lease through the host's engine, tear down and remove
// the record) for one to four stages, as spawn does the spawn's.
func (h *host) remove(t *rapid.T) {
	id := h.existingID(t)
	h.drive(t, "remove", func() string {
		rec, err := h.st.Get(id)
		switch {
		case err != nil:
		case !store.IsDeleting(rec):
			return "begin"
		case h.helpers[id] != nil && h.helpers[id].alive():
			return "stop"
		case store.AnyLeaseHeld(rec):
			return "release"
		default:
			return "remove"
		}
		return ""
	}, func(stage string) {
		switch stage {
		case "begin":
			h.beginDeleteOf(t, id)
		case "stop":
			h.exitOf(t, id)
		case "release":
			h.releaseAllOf(t, id)
		case "remove":
			h.teardownOf(t, id)
			h.deleteRecordOf(t, id)
		}
	})
}

// claim claims the instance's vGPUs; failCreate injects a create fault after
// an intent is written. A claim no retry can finish (no capacity part-way)
// must leave its record holding no vGPU and no device it made behind.
func (h *host) claim(t *rapid.T) { h.claimOf(t, h.existingID(t)) }

func (h *host) claimOf(t *rapid.T, id string) {
	if wholeCounts[id] > 0 {
		h.claimWhole(t, id)
		return
	}
	failCreate := rarely(t, "failCreate")
	if failCreate {
		h.setFault(t, vgpusim.CtlFailCreate, "EIO")
		defer h.clearFault(t, vgpusim.CtlFailCreate)
	}
	before := h.devices(t)
	c, cancel := ctx()
	defer cancel()
	n := store.VGPUCount(h.dc.profile, vgpuCounts[id])
	ls, err := h.claims.Claim(c, id, h.dc.profile, n)
	var keys []string
	for _, l := range ls {
		keys = append(keys, claimKey(l))
	}
	t.Logf("claim %s x%d (fail-create=%t): %v %v", id, n, failCreate, keys, err)
	h.event("claim", ls != nil, err)
	if err == nil && len(ls) != n {
		t.Fatalf("VIOLATION claim of %d vGPUs for %s returned %d", n, id, len(ls))
	}
	rec, gerr := h.st.Get(id)
	if err == nil || !errors.Is(err, errdefs.NoCapacity) || gerr != nil || !store.NeverLaunched(rec) {
		return
	}
	if strings.Contains(err.Error(), "roll back the claim") {
		// The undo itself failed (a full disk): the leases stay for the
		// retried claim or the spawn's delete, which the other checks
		// follow.
		h.events["claim rollback failed"]++
		return
	}
	h.events["claim rolled back"]++
	if held := store.HeldVGPUs(rec); len(held) > 0 {
		t.Fatalf("VIOLATION a claim that failed for capacity kept %d vGPU lease(s) of %s", len(held), id)
	}
	for d := range h.devices(t) {
		if !before[d] {
			t.Fatalf("VIOLATION a claim that failed for capacity left its device %s behind", d)
		}
	}
}

// launch starts a QEMU stand-in for id, holding its claim's device open,
// and records its identity with state Running. A claim whose device is
// missing fails the launch, as QEMU would.
func (h *host) launch(t *rapid.T) { h.launchOf(t, h.existingID(t)) }

func (h *host) launchOf(t *rapid.T, id string) {
	if hp := h.helpers[id]; hp != nil && hp.alive() {
		t.Skip("already running")
	}
	rec, err := h.st.Get(id)
	if err != nil {
		t.Logf("launch %s: %v", id, err)
		return
	}
	node, ok := "", false
	if wholeCounts[id] > 0 {
		node, ok = h.wholeNode(t, id, rec)
	} else {
		node, ok = h.vgpuNode(t, id, rec)
	}
	if !ok {
		return
	}
	if !h.placeCapacity(t, id) {
		return
	}
	hp, err := startHelper(node)
	if err != nil {
		t.Fatalf("launch %s: %v", id, err)
	}
	c, cancel := ctx()
	defer cancel()
	ident := hp.child.Identity()
	_, err = h.st.Update(c, id, func(r *vmflowv1.InstanceRecord) error {
		r.Process = store.ProcessRecord(ident)
		r.State = vmflowv1.InstanceState_INSTANCE_STATE_RUNNING
		return nil
	})
	if err != nil {
		// A failed launch leaves nothing (invariant 5).
		if eerr := hp.end(); eerr != nil {
			t.Fatalf("launch %s: %v", id, eerr)
		}
		t.Logf("launch %s: %v", id, err)
		return
	}
	h.helpers[id] = hp
	t.Logf("launch %s: pid %d holding %q", id, ident.PID, node)
	h.events["launched"]++
}

// placeCapacity makes id's share active, as a launch's capacity stage
// does, and reports whether the launch may go on.
func (h *host) placeCapacity(t *rapid.T, id string) bool {
	c, cancel := ctx()
	defer cancel()
	l, err := h.st.Lock(c, id)
	if err != nil {
		t.Logf("launch %s: %v", id, err)
		return false
	}
	defer l.Unlock()
	_, err = h.capacity.Place(c, l)
	h.event("place capacity", err == nil, err)
	if err != nil {
		t.Logf("launch %s: %v", id, err)
		return false
	}
	return true
}

// vgpuNode makes id's vGPUs launchable and returns the VFIO node of the
// first for the QEMU stand-in to hold. Every vGPU instance asks for vGPUs,
// so QEMU starts only with all of them active and existing, and holds its
// first one's VFIO node open (the release guard for the others is the
// VM's liveness).
func (h *host) vgpuNode(t *rapid.T, id string, rec *vmflowv1.InstanceRecord) (string, bool) {
	held := store.HeldVGPUs(rec)
	if len(held) != store.VGPUCount(h.dc.profile, vgpuCounts[id]) ||
		slices.ContainsFunc(held, func(l *vmflowv1.Lease) bool { return l.GetPhase() != vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE }) {
		t.Logf("launch %s: not every claim active", id)
		return "", false
	}
	cl := held[0]
	devs := h.devices(t)
	if slices.ContainsFunc(held, func(l *vmflowv1.Lease) bool { return !devs[claimKey(l)] }) && !h.ensureDevice(t, id, cl) {
		return "", false
	}
	return h.vfioNode(t, claimKey(cl)), true
}

// exit ends id's process group and records Exited, as the supervisor's exit
// watcher does.
func (h *host) exit(t *rapid.T) {
	running := map[string]*helper{}
	for id, hp := range h.helpers {
		if hp.alive() {
			running[id] = hp
		}
	}
	h.exitOf(t, drawKey(t, running))
}

func (h *host) exitOf(t *rapid.T, id string) {
	hp := h.helpers[id]
	if err := hp.end(); err != nil {
		t.Fatalf("exit %s: %v", id, err)
	}
	c, cancel := ctx()
	defer cancel()
	_, err := h.st.Update(c, id, func(r *vmflowv1.InstanceRecord) error {
		if r.GetState() == vmflowv1.InstanceState_INSTANCE_STATE_RUNNING {
			r.State = vmflowv1.InstanceState_INSTANCE_STATE_EXITED
		}
		return nil
	})
	t.Logf("exit %s: %v", id, err)
}

// beginDelete is the delete path's first step: the manual-stop marker, then
// Deleting.
func (h *host) beginDelete(t *rapid.T) { h.beginDeleteOf(t, h.existingID(t)) }

func (h *host) beginDeleteOf(t *rapid.T, id string) {
	c, cancel := ctx()
	defer cancel()
	reserved := h.st.Space().Held
	err := h.st.MarkManualStop(c, id)
	if err == nil {
		_, err = h.st.Transition(c, id, vmflowv1.InstanceState_INSTANCE_STATE_DELETING)
	}
	t.Logf("begin-delete %s: %v", id, err)
	h.checkRoomForDelete(t, "begin-delete", id, reserved, err)
}

// checkRoomForDelete: a delete's step never fails for want of space while
// the reserve was there to give up (invariant 14).
func (h *host) checkRoomForDelete(t *rapid.T, step, id string, reserved bool, err error) {
	if reserved && errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("VIOLATION %s of %s failed on a full disk with the reserve in place: %v", step, id, err)
	}
}

// fillDisk fills the state file system to the last byte, as a runaway
// guest log or overlay would.
func (h *host) fillDisk(t *rapid.T) {
	if !rarely(t, "fill") {
		t.Skip("not this time")
	}
	f, err := os.OpenFile(filepath.Join(h.state, "filler"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatalf("fill: %v", err)
	}
	defer f.Close()
	buf := make([]byte, 64<<10)
	for {
		if _, err := f.Write(buf); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatalf("fill: %v", err)
			}
			break
		}
	}
	h.events["disk filled"]++
	t.Logf("disk filled (reserve held: %t)", h.st.Space().Held)
}

// freeDisk removes what fillDisk wrote: the operator cleaned up.
func (h *host) freeDisk(t *rapid.T) {
	if err := os.Remove(filepath.Join(h.state, "filler")); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			t.Skip("not full")
		}
		t.Fatalf("free: %v", err)
	}
	t.Logf("disk freed")
}

// Release modes.
const (
	releaseOK      = "ok"
	releaseFail    = "fail"
	releaseBlocked = "blocked"
	// releaseCrash: the sysfs write is blocked, the record becomes
	// unreadable meanwhile, the write completes: the agent "died" between
	// the device's removal and the record update.
	releaseCrash = "crash-after-write"
)

func (h *host) release(t *rapid.T) {
	id := h.existingID(t)
	mode := rapid.SampledFrom([]string{releaseOK, releaseFail, releaseBlocked, releaseCrash}).Draw(t, "mode")
	if wholeCounts[id] > 0 {
		h.releaseWhole(t, id, mode)
		return
	}
	before, _ := h.st.Get(id)
	recorded := store.IdentityOf(before.GetProcess())

	var released bool
	var dev []string
	var err error
	switch mode {
	case releaseOK:
		released, dev, err = h.callRelease(id, opTimeout)
	case releaseFail:
		errno := rapid.SampledFrom([]string{"EIO", "EBUSY", "EAGAIN", "ENODEV"}).Draw(t, "errno")
		h.setFault(t, vgpusim.CtlFailRelease, errno)
		released, dev, err = h.callRelease(id, opTimeout)
		h.clearFault(t, vgpusim.CtlFailRelease)
	case releaseBlocked:
		// The caller stops waiting while the write is blocked; the write
		// finishes later and the next Release receives its outcome.
		h.setFault(t, vgpusim.CtlBlockRelease, "")
		released, dev, err = h.callRelease(id, 200*time.Millisecond)
		t.Logf("release %s (blocked, gave up): released=%t %s %v", id, released, dev, err)
		h.clearFault(t, vgpusim.CtlBlockRelease)
		if !waitFor(func() bool { return h.srv.Blocked() == 0 }) {
			t.Fatalf("release %s: the blocked write never finished", id)
		}
		released, dev, err = h.callRelease(id, opTimeout)
	case releaseCrash:
		released, dev, err = h.releaseCrash(t, id)
	}
	t.Logf("release %s (%s): released=%t %s %v", id, mode, released, dev, err)
	h.event("release "+mode, released, err)
	if released && recorded.PID != 0 {
		if st := proc.Inspect(recorded); st.Alive {
			t.Fatalf("VIOLATION release while the VM lives: %s released %s while its process %v is %s with %d tasks",
				id, dev, recorded, st.State, st.Tasks)
		}
	}
}

func (h *host) callRelease(id string, wait time.Duration) (bool, []string, error) {
	c, cancel := ctx()
	defer cancel()
	c, cancel2 := context.WithTimeout(c, wait)
	defer cancel2()
	return h.claims.Release(c, id)
}

func (h *host) releaseCrash(t *rapid.T, id string) (bool, []string, error) {
	h.setFault(t, vgpusim.CtlBlockRelease, "")
	return h.crashDuring(t, id, func() { h.clearFault(t, vgpusim.CtlBlockRelease) },
		func() (bool, []string, error) { return h.callRelease(id, opTimeout) })
}

// crashDuring runs call, a release whose sysfs write the caller blocked:
// while it is blocked, id's record is cut (the agent "died" between the
// write and the record update), then unblock lifts the block and the
// write completes.
func (h *host) crashDuring(t *rapid.T, id string, unblock func(), call func() (bool, []string, error)) (bool, []string, error) {
	type result struct {
		released bool
		dev      []string
		err      error
	}
	done := make(chan result, 1)
	go func() {
		r, d, e := call()
		done <- result{r, d, e}
	}()
	var res result
	returned := false
	if !waitFor(func() bool {
		select {
		case res = <-done:
			returned = true
			return true
		default:
			return h.srv.Blocked() > 0
		}
	}) {
		t.Fatalf("release %s: neither blocked nor returned", id)
	}
	if !returned {
		h.truncate(t, id)
	}
	unblock()
	if !returned {
		select {
		case res = <-done:
		case <-time.After(opTimeout):
			t.Fatalf("release %s: did not return after the block was lifted", id)
		}
	}
	return res.released, res.dev, res.err
}

// reconcile runs one round, maybe after moving the clock past the grace,
// maybe with every release write failing. Then: no device that no held
// claim named since at least the grace before this round, and that nothing
// holds open, may survive a round that could remove it.
func (h *host) reconcile(t *rapid.T) {
	advance := rapid.Bool().Draw(t, "advance")
	failRelease := rarely(t, "failRelease")
	if advance {
		h.now.Add(int64(grace + time.Second))
	}
	now := h.clock()
	recs, unreadable := h.records(t)
	var unclaimed []string
	prevSince := h.unclaimedSince
	if !unreadable {
		named := map[string]bool{}
		for _, r := range recs {
			// Only held claims own their device: a released claim that
			// still names a VF must not shield a stray device on it.
			for _, cl := range store.HeldVGPUs(r) {
				named[claimKey(cl)] = true
			}
		}
		next := map[string]time.Time{}
		for d := range h.devices(t) {
			if named[d] {
				continue
			}
			since, ok := h.unclaimedSince[d]
			if !ok {
				since = now
			}
			next[d] = since
			unclaimed = append(unclaimed, d)
		}
		h.unclaimedSince = next
	}
	if failRelease {
		h.setFault(t, vgpusim.CtlFailRelease, "EIO")
	}
	c, cancel := ctx()
	defer cancel()
	res, err := h.claims.Reconcile(c)
	t.Logf("reconcile (advance=%t fail-release=%t unreadable=%t): %v %v", advance, failRelease, unreadable, res, err)
	h.events["reconcile claims released"] += int(res.GetClaimsReleased())
	h.events["reconcile orphans removed"] += int(res.GetOrphansRemoved())
	if err != nil {
		// The round's ledger was not written (a full disk): its first
		// sightings are not remembered, so their grace starts again.
		h.unclaimedSince = prevSince
	}
	if failRelease {
		h.clearFault(t, vgpusim.CtlFailRelease)
	}
	h.reconcileWhole(t, recs, unreadable, now)
	if unreadable || failRelease || err != nil {
		return
	}
	after := h.devices(t)
	// Like the reconcile ledger, forget devices that are gone: a new one
	// with the same id (a VF reused) starts its grace afresh.
	for d := range h.unclaimedSince {
		if !after[d] {
			delete(h.unclaimedSince, d)
		}
	}
	for _, d := range unclaimed {
		if after[d] && now.Sub(h.unclaimedSince[d]) >= grace && !h.heldOpen(t, d) {
			t.Fatalf("VIOLATION orphan device: %s, named by no held claim since %s (%s ago), survived a reconcile",
				d, h.unclaimedSince[d].Format(time.TimeOnly), now.Sub(h.unclaimedSince[d]))
		}
	}
}

// teardown is the host side of the delete path's TearDown: refused while
// the recorded VM may live, else the runtime files go.
func (h *host) teardown(t *rapid.T) { h.teardownOf(t, h.existingID(t)) }

func (h *host) teardownOf(t *rapid.T, id string) {
	rec, err := h.st.Get(id)
	if err != nil {
		t.Logf("teardown %s: %v", id, err)
		return
	}
	if p := rec.GetProcess(); p != nil {
		if st := proc.Inspect(store.IdentityOf(p)); st.Alive {
			t.Logf("teardown %s: VM still %s", id, st.State)
			return
		}
	}
	paths, err := h.st.Paths(id)
	if err != nil {
		t.Fatalf("teardown %s: %v", id, err)
	}
	for _, p := range []string{paths.Socket, paths.PID} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("teardown %s: %v", id, err)
		}
	}
	t.Logf("teardown %s: done", id)
}

// deleteRecord: the store must refuse while the record holds a claim, or
// while the model cannot tell (an unreadable record).
func (h *host) deleteRecord(t *rapid.T) { h.deleteRecordOf(t, h.existingID(t)) }

func (h *host) deleteRecordOf(t *rapid.T, id string) {
	before, getErr := h.st.Get(id)
	c, cancel := ctx()
	defer cancel()
	reserved := h.st.Space().Held
	err := h.st.Delete(c, id)
	t.Logf("delete %s: %v", id, err)
	h.event("delete", err == nil, err)
	h.checkRoomForDelete(t, "delete", id, reserved, err)
	if err != nil {
		return
	}
	switch {
	case getErr != nil && !errors.Is(getErr, store.ErrNotFound):
		t.Fatalf("VIOLATION record deleted while unreadable: %s (%v)", id, getErr)
	case getErr == nil && store.AnyLeaseHeld(before):
		t.Fatalf("VIOLATION record deleted while its claim is held: %s (%s %s)", id, claimKey(store.VGPU(before)), store.VGPU(before).GetPhase())
	case h.helpers[id] != nil && h.helpers[id].alive():
		t.Fatalf("VIOLATION record deleted while its process lives: %s (pid %d)", id, h.helpers[id].child.Identity().PID)
	}
}

// restart drops the Claims (its driver, release registry and all) and
// builds a new one, as a restarted agent does, and seeds the store's index
// again from disk.
func (h *host) restart(t *rapid.T) {
	if err := h.st.Close(); err != nil {
		t.Fatalf("agent restart: %v", err)
	}
	h.openIndex(t)
	h.startAgent(t)
	h.events["agent restarts"]++
	t.Logf("agent restart")
}

// strayDevice creates a device no record claims (an operator's, or one a
// record lost): reconcile must remove it after the grace.
func (h *host) strayDevice(t *rapid.T) {
	c, cancel := ctx()
	defer cancel()
	u := fmt.Sprintf("2b6c4e3a-0d4f-4a8e-9a43-%012d", rapid.IntRange(0, 999).Draw(t, "n"))
	d, err := h.claims.Driver().Create(c, gpu.CreateRequest{Profile: h.dc.profile, UUID: u})
	t.Logf("stray device: %s %v", d.ID, err)
}

func (h *host) corruptRecord(t *rapid.T) {
	// Rare: an unreadable record freezes its instance, and the model
	// should spend most steps elsewhere.
	if !rarely(t, "corrupt") {
		t.Skip("not this time")
	}
	id := h.existingID(t)
	if _, ok := h.corrupt[id]; ok {
		t.Skip("already corrupt")
	}
	if _, err := h.st.Get(id); err != nil {
		t.Skip("no record")
	}
	h.truncate(t, id)
	t.Logf("corrupt %s", id)
}

// oldShape rewrites a record holding a vGPU lease as an agent before
// leases wrote it (the claim in gpu_claim), as after an upgrade: every
// invariant must hold across the conversion on read and the migration.
func (h *host) oldShape(t *rapid.T) {
	recs, _ := h.records(t)
	var leased []*vmflowv1.InstanceRecord
	for _, r := range recs {
		if len(store.VGPUs(r)) == 1 && len(r.GetLeases()) == 1 { // the old shape held one vGPU and nothing else
			leased = append(leased, r)
		}
	}
	if len(leased) == 0 {
		t.Skip("no record with one vGPU lease")
	}
	id := rapid.SampledFrom(leased).Draw(t, "old shape").GetId()
	l, err := stacktest.WriteOldShape(h.st, id)
	if err != nil {
		t.Fatalf("%v", err)
	}
	again, err := h.st.Get(id)
	if err != nil || store.LeaseName(store.VGPU(again)) != store.LeaseName(l) || store.LeaseHeld(store.VGPU(again)) != store.LeaseHeld(l) {
		t.Fatalf("VIOLATION old-shape record of %s does not read back as its lease: %v %v", id, store.VGPU(again), err)
	}
	t.Logf("old shape %s (%s)", id, store.LeaseName(l))
	h.event("old shape", true, nil)
}

// migrate runs the agent start's record migration.
func (h *host) migrate(t *rapid.T) {
	c, cancel := ctx()
	defer cancel()
	done, err := h.st.Migrate(c)
	t.Logf("migrate: %v %v", done, err)
	h.event("migrate", err == nil, err)
}

// truncate cuts id's record.json in half, keeping its bytes for repair.
func (h *host) truncate(t *rapid.T, id string) {
	paths, err := h.st.Paths(id)
	if err != nil {
		t.Fatalf("corrupt %s: %v", id, err)
	}
	b, err := os.ReadFile(paths.Record)
	if err != nil {
		t.Fatalf("corrupt %s: %v", id, err)
	}
	if err := os.WriteFile(paths.Record, b[:len(b)/2], 0o600); err != nil {
		t.Fatalf("corrupt %s: %v", id, err)
	}
	h.corrupt[id] = b
}

// repairRecord puts back what the operator would: the record as it was.
func (h *host) repairRecord(t *rapid.T) {
	id := drawKey(t, h.corrupt)
	b := h.corrupt[id]
	paths, err := h.st.Paths(id)
	if err != nil {
		t.Fatalf("repair %s: %v", id, err)
	}
	if err := os.WriteFile(paths.Record, b, 0o600); err != nil {
		t.Fatalf("repair %s: %v", id, err)
	}
	delete(h.corrupt, id)
	t.Logf("repair %s", id)
}

// ensureDevice re-creates the missing device of id's active claim, as every
// launch does (admission.PrepareLaunch), and reports whether it exists now. A
// held claim keeps its slot and its parent's type across a reboot: only a
// stray device (one no held claim names) can stand in its way.
func (h *host) ensureDevice(t *rapid.T, id string, cl *vmflowv1.Lease) bool {
	c, cancel := ctx()
	defer cancel()
	l, err := h.st.Lock(c, id)
	if err != nil {
		t.Fatalf("launch %s: %v", id, err)
	}
	_, err = h.claims.EnsureDevicesLocked(c, l)
	_ = l.Unlock()
	t.Logf("launch %s: re-create missing device %s: %v", id, claimKey(cl), err)
	h.event("re-create", err == nil, err)
	if err == nil {
		return true
	}
	if errors.Is(err, gpu.ErrNoCapacity) || errors.Is(err, gpu.ErrDeviceMismatch) {
		now := h.observe(t)
		for d := range now.devices {
			if len(now.holders[d]) == 0 {
				return false // a stray took it; reconcile removes it after the grace
			}
		}
		t.Fatalf("VIOLATION a held claim lost its slot to another claim: %s's %s cannot be re-created: %v", id, claimKey(cl), err)
	}
	return false
}

// reboot is a host reboot: every process ends and every device goes (mdevs
// vanish, VFs read type 0) while the records keep their claims; the agent
// starts again.
func (h *host) reboot(t *rapid.T) {
	if !rarely(t, "reboot") {
		t.Skip("not this time")
	}
	h.rebootHost(t, "")
}

// swapCard is a reboot in which an operator swaps a card that failed
// (one with strikes) for another of the same model: the new card's
// failures must count as its own.
func (h *host) swapCard(t *rapid.T) {
	h.rebootHost(t, drawKey(t, h.failingCards()))
}

// rebootHost reboots the host, swapping the card at swap ("" none).
func (h *host) rebootHost(t *rapid.T, swap string) {
	for id, hp := range h.helpers {
		if err := hp.end(); err != nil {
			t.Fatalf("reboot: %s: %v", id, err)
		}
	}
	for d := range h.devices(t) {
		path, val := filepath.Join(h.sys, "bus/mdev/devices", d, "remove"), "1"
		if h.dc.kind == gpu.KindVendor {
			path, val = filepath.Join(h.sys, "bus/pci/devices", d, "nvidia/current_vgpu_type"), "0"
		}
		if err := os.WriteFile(path, []byte(val), 0o200); err != nil {
			t.Fatalf("reboot: remove %s: %v", d, err)
		}
	}
	h.rebootPCI(t, swap)
	h.wipeLinks(t)
	h.startAgent(t)
	h.rebooted = true
	h.events["reboots"]++
	t.Logf("reboot")
}

// modelUIDs is the model's --qemu-uid-range: one uid per instance, so a
// quarantined record's uid is the one a careless assignment would reuse.
var modelUIDs = store.UIDRange{First: 3_900_000_000, Last: 3_900_000_000 + uint32(len(instanceIDs)) - 1}

// assignUID gives an instance its QEMU uid, as every launch does (the
// model's QEMU stand-ins run as root: no process holds a uid of the range).
func (h *host) assignUID(t *rapid.T) {
	id := h.existingID(t)
	c, cancel := ctx()
	defer cancel()
	l, err := h.st.Lock(c, id)
	if err != nil {
		t.Fatalf("assign uid %s: %v", id, err)
	}
	defer func() { _ = l.Unlock() }()
	rec, err := l.AssignQEMUUID(c, modelUIDs, noProcesses)
	t.Logf("assign uid %s: %d %v", id, rec.GetQemuUid(), err)
	h.event("assign uid", err == nil, err)
}

// noProcesses is the model's process scan for uids: its QEMU stand-ins run
// as root, so no process holds a uid of the range.
func noProcesses(context.Context) (map[uint32]bool, error) { return nil, nil }

// openIndex seeds the store's index from disk, as the agent does at start.
func (h *host) openIndex(t *rapid.T) {
	c, cancel := ctx()
	defer cancel()
	if err := h.st.OpenIndex(c, noProcesses); err != nil {
		t.Fatalf("open the store's index: %v", err)
	}
}

// checkIndex: the store's index agrees with a fresh seed from disk (the
// same records, the same unreadable ones, every uid the disk holds held by
// the same instance). The records are listed first, as the agent's scans
// do: a record the model cut by hand is seen as unreadable there.
func (h *host) checkIndex(t *rapid.T) {
	if !h.st.Indexed() {
		t.Fatalf("VIOLATION the store runs without its index")
	}
	_, _ = h.st.List()
	c, cancel := ctx()
	defer cancel()
	diff, err := h.st.IndexDiff(c, noProcesses)
	if err != nil {
		t.Fatalf("index against disk: %v", err)
	}
	if len(diff) > 0 {
		t.Fatalf("VIOLATION the store's index disagrees with the disk:\n%s", strings.Join(diff, "\n"))
	}
}

// checkUIDs: no uid is named by two records, a quarantined one included
// (its bytes as they were before the model cut it).
func (h *host) checkUIDs(t *rapid.T) {
	recs, _ := h.records(t)
	for id, b := range h.corrupt {
		rec, err := store.DecodeRecord(b)
		if err != nil {
			t.Fatalf("decode the saved record of %s: %v", id, err)
		}
		recs = append(recs, rec)
	}
	owner := map[uint32]string{}
	for _, rec := range recs {
		u := rec.GetQemuUid()
		if u == 0 {
			continue
		}
		if other, ok := owner[u]; ok {
			t.Fatalf("VIOLATION qemu uid %d named by two records: %s and %s", u, other, rec.GetId())
		}
		owner[u] = rec.GetId()
	}
}

// clearQuarantine is the operator's devices clear of one quarantined
// device.
func (h *host) clearQuarantine(t *rapid.T) {
	q, err := h.quarantine.List()
	if err != nil {
		t.Fatalf("quarantine: %v", err)
	}
	id := drawKey(t, q)
	c, cancel := ctx()
	defer cancel()
	_, err = h.quarantine.Clear(c, id)
	t.Logf("clear quarantine of %s: %v", id, err)
	h.event("clear quarantine", err == nil, err)
	delete(h.quarantinedWith, id)
}

// checkQuarantine: no lease is placed on a quarantined device (a lease
// naming it that was not there when it was quarantined).
func (h *host) checkQuarantine(t *rapid.T, now snapshot) {
	q, err := h.quarantine.List()
	if err != nil {
		t.Fatalf("quarantine: %v", err)
	}
	naming := func(key string) map[string]bool {
		m := map[string]bool{}
		for id, ls := range now.held {
			for _, l := range ls {
				if h.quarantineKey(l) == key {
					m[id+" "+store.LeaseName(l)] = true
				}
			}
		}
		for id, ls := range now.whole {
			for _, l := range ls {
				if slices.Contains(store.PassthroughGPUs(l), key) {
					m[id+" "+store.LeaseName(l)] = true
				}
			}
		}
		return m
	}
	for key := range q {
		was, ok := h.quarantinedWith[key]
		if !ok {
			h.quarantinedWith[key] = naming(key)
			h.events["quarantined"]++
			continue
		}
		for l := range naming(key) {
			if !was[l] {
				t.Fatalf("VIOLATION a lease placed on a quarantined device: %s on %s (%s)", l, key, q[key].Reason)
			}
		}
	}
}

// check runs after every step, against the real system.
func (h *host) check(t *rapid.T) {
	now := h.observe(t)
	defer func() { h.prev = now }()
	t.Logf("  state: %s", h.describe(t, now))
	rebooted := h.rebooted
	h.rebooted = false
	h.checkIndex(t)
	h.checkUIDs(t)
	h.checkCapacity(t)
	h.checkQuarantine(t, now)
	h.checkNetwork(t)
	h.checkWhole(t, now, rebooted)

	// One device, one claim (invariant 10).
	uuids := map[string]string{}
	for key, ids := range now.holders {
		if len(ids) > 1 {
			t.Fatalf("VIOLATION two held claims name one device: %s is claimed by %v", key, ids)
		}
		for _, id := range ids {
			u := heldOn(now.held[id], key).GetVgpu().GetUuid()
			if other, ok := uuids[u]; ok && u != "" {
				t.Fatalf("VIOLATION two held claims name one vGPU UUID: %s is claimed by %s and %s", u, other, id)
			}
			uuids[u] = id
		}
	}
	// No held claim without its record (invariant 1, seen from the disk).
	for id, ls := range h.prev.held {
		if _, ok := now.held[id]; ok {
			continue
		}
		if _, err := h.st.Get(id); errors.Is(err, store.ErrNotFound) {
			t.Fatalf("VIOLATION held claim lost its record: %s held %s and its record is gone", id, claimKey(ls[0]))
		}
	}
	// A device goes only when every instance whose held claim named it has
	// no live process group (invariant 2); a reboot takes them all.
	for d := range h.prev.devices {
		if rebooted {
			break
		}
		if now.devices[d] {
			continue
		}
		// ... and only through its own claim's release: a claim that was
		// active before the step and is still active (readable, not being
		// released) has lost its device to someone else's write.
		for _, id := range h.prev.holders[d] {
			_, unreadable := h.corrupt[id]
			was, is := heldOn(h.prev.held[id], d), heldOn(now.held[id], d)
			if !unreadable &&
				was.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE && is.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE {
				t.Fatalf("VIOLATION device of an active claim destroyed: %s of %s is gone and its claim still says active", d, id)
			}
		}
		for _, id := range h.prev.holders[d] {
			if p, ok := h.prev.procs[id]; ok {
				if st := proc.Inspect(p); st.Alive {
					t.Fatalf("VIOLATION device released while its VM lives: %s of %s is gone while %v is %s with %d tasks",
						d, id, p, st.State, st.Tasks)
				}
			}
		}
	}
}
