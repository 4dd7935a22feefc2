package hostmodel_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	"pgregory.net/rapid"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/network"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// grace is the orphan grace the model's Claims run with; the clock only
// moves when a reconcile step advances it past the grace.
const grace = time.Minute

// opTimeout bounds every call into the system under test: a hang is a
// failure the model reports, never a stuck test.
const opTimeout = 20 * time.Second

// driverCase is one vGPU ABI the model runs over. The simulated host is
// small on purpose (few VFs, one mdev parent) so that placements collide.
type driverCase struct {
	kind    gpu.Kind
	opts    vgpusim.Options
	profile string
	netns   string // the network namespace TestHostModel made for the case
}

var driverCases = []driverCase{
	// Two per GPU for four vGPUs (vgpuCounts) and strays: capacity binds part-way through a claim, and a reboot's
	// missing devices meet new claims competing for their slots.
	{kind: gpu.KindMdev, opts: vgpusim.Options{MdevParents: 1}, profile: "GRID A100-20C"},
	{kind: gpu.KindVendor, opts: vgpusim.Options{VendorVFs: 3}, profile: "NVIDIA L40-4Q"},
}

// stateFSSize is the model's state file system: room for the records and
// the store's reserve (store.DefaultReserve), until fillDisk fills it.
const stateFSSize = 16 << 20

// instanceIDs is the model's whole id space: few ids, so actions meet.
// vm-a to vm-c ask for vGPUs (vgpuCounts), vm-d and vm-e for whole GPUs
// (wholeCounts).
var instanceIDs = []string{"vm-a", "vm-b", "vm-c", "vm-d", "vm-e"}

// helper is one QEMU stand-in: a zombie leader with a live thread that
// holds its instance's VFIO node open, as QEMU's workers do.
type helper struct {
	child *proc.Child
	stdin io.WriteCloser
}

func (h *helper) alive() bool {
	select {
	case <-h.child.Done():
		return false
	default:
		return true
	}
}

// end closes the helper's stdin (its last thread then exits the group) and
// waits until the reaper saw the whole group go.
func (h *helper) end() error {
	_ = h.stdin.Close()
	select {
	case <-h.child.Done():
		return nil
	case <-time.After(opTimeout):
		return fmt.Errorf("helper %v did not exit", h.child.Identity())
	}
}

// snapshot is what the system looked like after a step: the only state the
// model carries from one step to the next.
type snapshot struct {
	devices map[string]bool              // sysfs: device ids that exist
	holders map[string][]string          // device key -> instances whose held claims name it
	procs   map[string]proc.Identity     // instance -> recorded process
	held    map[string][]*vmflowv1.Lease // instance -> its held vGPU leases
	whole   map[string][]*vmflowv1.Lease // instance -> its held whole-GPU leases
	bound   map[string]bool              // PCI functions on vfio-pci (the simulator's bindings)
	strikes map[string]lease.Strike      // the quarantine's runs of failures
	quar    map[string]bool              // the quarantined devices
}

// heldOn is the lease of leases naming device key, nil for none.
func heldOn(leases []*vmflowv1.Lease, key string) *vmflowv1.Lease {
	for _, l := range leases {
		if claimKey(l) == key {
			return l
		}
	}
	return nil
}

// host is one simulated host under test, fresh for every rapid check.
type host struct {
	dc     driverCase
	srv    *vgpusim.Server
	sys    string // sysfs root (the simulator's mount)
	ctl    string // the simulator's fault-injection directory
	state  string
	devDir string
	ignore []int

	st     *store.Store
	claims *lease.Claims
	// capacity is the host's capacity ledger: room for 3 vCPUs, so the
	// model's instances (4 vCPUs in all) do not all fit at once.
	capacity *lease.Capacity
	now      atomic.Int64 // unix nanos; read by Claims from its goroutines

	helpers        map[string]*helper   // the latest helper of each instance
	corrupt        map[string][]byte    // records the model truncated, with their bytes
	unclaimedSince map[string]time.Time // mirrors the reconcile ledger for unclaimed devices
	prev           snapshot
	events         map[string]int // outcome counts over the whole run, for the log
	// rebooted: the last step was a reboot, whose vanished devices the
	// device checks must not take for releases.
	rebooted bool
	// quarantine is the host's GPU quarantine; quarantinedWith maps each
	// quarantined device to the leases naming it when the model first saw
	// it quarantined: any other lease naming it was placed there after.
	quarantine      *lease.Quarantine
	quarantinedWith map[string]map[string]bool
	// quarantineAfter is the check's --gpu-quarantine-after.
	quarantineAfter int
	net             *network.Net
	nh              *netlink.Handle // in dc.netns, for the checks
	// detached are the instances whose leased TAP may be off the bridge:
	// the model deleted the bridge and no TAP reconcile round has since
	// read their record (one that was unreadable waits for the round
	// after its repair).
	detached map[string]bool

	whole *lease.Whole
	// cards is the PCI hardware installed now (address -> the card's
	// identity), as the model's reboots changed it.
	cards map[string]card
	// strays are PCI functions the model bound to vfio-pci with no lease
	// (a record removed by hand): reconcile returns them after the grace.
	strays map[string]bool
	// unmarkedSince mirrors the whole-GPU reconcile ledger: functions
	// with vmflow's mark that no held lease names, first seen when.
	unmarkedSince map[string]time.Time
	// faulted are the devices a failure injected during this step may
	// be struck for (whole GPUs); vgpuFaulted: a vGPU release fault was
	// injected during this step. Any other strike is a violation.
	faulted     map[string]bool
	vgpuFaulted bool
	// own counts each whole GPU's failures in a row as the strikes file
	// showed them, from 0 when a reboot put another card at its address:
	// that card's failures are its own, not the one's it replaced.
	own map[string]int
	// swapped are the GPUs a reboot put another card at and that have
	// not failed since; double, those a fault this step may fail twice
	// (failsUndo: a claim's bind and then its undo).
	swapped, double map[string]bool
	// atOnce: GPUs a reset fault may fail this step, which quarantines
	// at its first failure (the card may hold its tenant's data).
	atOnce map[string]bool
	// bad are the PCI functions whose fault stays (badCard), with it.
	bad map[string]string
}

// quarantineKey is the device a vGPU lease's failed release quarantines:
// the VF (vendor), else the mdev's parent GPU.
func (h *host) quarantineKey(l *vmflowv1.Lease) string {
	if h.dc.kind == gpu.KindVendor {
		return l.GetVgpu().GetDeviceId()
	}
	return l.GetVgpu().GetParent()
}

// reason names an error by the sentinel callers branch on.
func reason(err error) string {
	for _, r := range []struct {
		err  error
		name string
	}{
		{lease.ErrVMAlive, "VM alive"}, {lease.ErrDeviceHeld, "device held"}, {gpu.ErrReleaseInProgress, "in progress"},
		{gpu.ErrNoCapacity, "no capacity"}, {gpu.ErrDeviceMismatch, "device mismatch"},
		{store.ErrDeleting, "deleting"}, {store.ErrClaimHeld, "claim held"}, {store.ErrIllegalTransition, "illegal transition"},
		{gpu.ErrRecordsUnreadable, "records unreadable"}, {store.ErrInvalidRecord, "unreadable record"}, {store.ErrNotFound, "no record"}, {syscall.EIO, "EIO"},
	} {
		if errors.Is(err, r.err) {
			return r.name
		}
	}
	if e, ok := gpu.Errno(err); ok {
		return e.Error()
	}
	return "other"
}

// event counts an action's outcome: done, refused (with the error's
// sentinel when it has one) or a no-op.
func (h *host) event(name string, done bool, err error) {
	switch {
	case err != nil:
		h.events[name+" refused ("+reason(err)+")"]++
	case done:
		h.events[name+" done"]++
	default:
		h.events[name+" no-op"]++
	}
}

func newHost(t *rapid.T, dc driverCase) *host {
	dir, err := os.MkdirTemp("/tmp", "hm")
	if err != nil {
		t.Fatalf("setup: %v", err)
	}
	h := &host{
		dc: dc, sys: filepath.Join(dir, "sys"), ctl: filepath.Join(dir, "ctl"),
		state: filepath.Join(dir, "state"), devDir: filepath.Join(dir, "dev"),
		events: map[string]int{}, helpers: map[string]*helper{}, corrupt: map[string][]byte{}, unclaimedSince: map[string]time.Time{},
		quarantinedWith: map[string]map[string]bool{}, strays: map[string]bool{}, unmarkedSince: map[string]time.Time{},
		faulted: map[string]bool{}, cards: installedCards(), detached: map[string]bool{}, own: map[string]int{}, bad: map[string]string{},
		swapped: map[string]bool{}, double: map[string]bool{}, atOnce: map[string]bool{},
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	for _, d := range []string{h.sys, h.ctl, h.state, filepath.Join(h.devDir, "vfio")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatalf("setup: %v", err)
		}
	}
	// The state dir is a small file system of its own, which the model
	// fills (fillDisk) and frees.
	if err := unix.Mount("tmpfs", h.state, "tmpfs", 0, "size="+strconv.Itoa(stateFSSize)); err != nil {
		t.Fatalf("setup: mount the state file system: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(h.state, unix.MNT_DETACH) })
	opts := dc.opts
	opts.Control = h.ctl
	// Every host also has whole GPUs, for the instances that ask for them
	// (wholeCounts); the simulator keeps their VFIO nodes in the model's /dev.
	opts.PCIGPUs, opts.PCIGroupWith, opts.DevRoot = pciGPUs, pciGroupWith, h.devDir
	h.srv, err = vgpusim.Mount(h.sys, opts)
	if err != nil {
		t.Fatalf("setup: %v", err)
	}
	// Registered after the directory's removal, so it runs first: helpers
	// end, then the simulator unmounts (lifting any block), then the files go.
	t.Cleanup(func() {
		if err := h.srv.Unmount(); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	t.Cleanup(func() {
		for id, hp := range h.helpers {
			if err := hp.end(); err != nil {
				t.Errorf("cleanup %s: %v", id, err)
			}
		}
	})
	// pid 1 of a sandbox can be more privileged than root here; it is
	// ignored only when it really cannot be inspected (as in lease' tests).
	h.ignore = proctest.UninspectableInit()
	h.now.Store(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	h.st, err = store.New(h.state)
	if err != nil {
		t.Fatalf("setup: %v", err)
	}
	// The agent's store keeps the index (checked against a fresh seed from
	// disk after every step: checkIndex).
	h.openIndex(t)
	t.Cleanup(func() { _ = h.st.Close() })
	// --gpu-quarantine-after: at 1 a single failure quarantines, at 3 a
	// success in between must start the count over.
	h.quarantineAfter = rapid.IntRange(1, 3).Draw(t, "quarantineAfter")
	h.quarantine = lease.NewQuarantine(h.state, h.quarantineAfter, h.clock)
	h.startAgent(t)
	h.startNetwork(t)
	h.prev = h.observe(t)
	return h
}

// startAgent builds the Claims the way the agent does at start, over the
// same store, sysfs and state directory (the orphan ledger persists).
func (h *host) startAgent(t *rapid.T) {
	c, err := lease.New(lease.Config{
		Driver: gpu.Config{SysfsRoot: h.sys, StateDir: h.state, Kind: h.dc.kind},
		Store:  h.st, DevRoot: h.devDir, OrphanGrace: grace, IgnoreUninspectable: h.ignore,
		Now:        func() time.Time { return time.Unix(0, h.now.Load()).UTC() },
		Quarantine: h.quarantine,
	})
	if err != nil || c == nil {
		t.Fatalf("start agent: %v", err)
	}
	h.claims = c
	h.capacity, err = lease.NewCapacity(lease.CapacityConfig{Store: h.st, CPUs: modelCPUs, MemoryMiB: 1 << 20, CPUOvercommit: 1, Now: h.clock})
	if err != nil {
		t.Fatalf("start agent: %v", err)
	}
	f, err := gpu.ParseGPUFilter("all")
	if err != nil {
		t.Fatalf("start agent: %v", err)
	}
	// A new Passthrough too: its registry of writes in flight and of
	// returns under way is the process's, lost with it.
	drv := gpu.NewPassthrough(gpu.PassthroughConfig{SysfsRoot: h.sys, StateDir: h.state, DevRoot: h.devDir, Filter: f})
	h.whole, err = lease.NewWhole(lease.WholeConfig{Driver: drv, Store: h.st, OrphanGrace: grace, IgnoreUninspectable: h.ignore,
		Now: h.clock, Quarantine: h.quarantine})
	if err != nil {
		t.Fatalf("start agent: %v", err)
	}
}

func (h *host) clock() time.Time { return time.Unix(0, h.now.Load()).UTC() }

func ctx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), opTimeout)
}

func (h *host) setFault(t *rapid.T, name, content string) {
	if name == vgpusim.CtlFailRelease {
		h.vgpuFaulted = true
	}
	if err := os.WriteFile(filepath.Join(h.ctl, name), []byte(content+"\n"), 0o644); err != nil {
		t.Fatalf("fault %s: %v", name, err)
	}
}

func (h *host) clearFault(t *rapid.T, name string) {
	if err := os.Remove(filepath.Join(h.ctl, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("fault %s: %v", name, err)
	}
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(cond func() bool) bool {
	deadline := time.Now().Add(opTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(2 * time.Millisecond)
	}
	return true
}

// claimKey names the device a claim is about the way the lease layer
// does: the device id (mdev UUID once active, the VF for vendor), else the
// UUID (an mdev intent).
func claimKey(cl *vmflowv1.Lease) string {
	return store.ClaimDevice(cl.GetVgpu())
}

func (h *host) devices(t *rapid.T) map[string]bool {
	c, cancel := ctx()
	defer cancel()
	ds, err := h.claims.Driver().Devices(c)
	if err != nil {
		t.Fatalf("list devices: %v", err)
	}
	out := map[string]bool{}
	for _, d := range ds {
		out[d.ID] = true
	}
	return out
}

// records lists the store. Only records the model corrupted may be
// unreadable; anything else is a failure of the store.
func (h *host) records(t *rapid.T) (recs []*vmflowv1.InstanceRecord, unreadable bool) {
	recs, err := h.st.List()
	if err != nil && len(h.corrupt) == 0 {
		t.Fatalf("store.List: %v, and no record was corrupted", err)
	}
	return recs, err != nil
}

// observe reads the real system. Instances whose records are unreadable
// keep what was last seen of them: the model cannot read them either.
func (h *host) observe(t *rapid.T) snapshot {
	s := snapshot{devices: h.devices(t), holders: map[string][]string{}, procs: map[string]proc.Identity{}, held: map[string][]*vmflowv1.Lease{},
		whole: map[string][]*vmflowv1.Lease{}, bound: h.boundFunctions(), strikes: h.quarantine.Strikes(), quar: map[string]bool{}}
	if q, err := h.quarantine.List(); err == nil {
		for d := range q {
			s.quar[d] = true
		}
	}
	recs, _ := h.records(t)
	for _, r := range recs {
		if p := r.GetProcess(); p != nil {
			s.procs[r.GetId()] = store.IdentityOf(p)
		}
		if store.ClaimHeld(r) {
			s.held[r.GetId()] = store.HeldVGPUs(r)
		}
		if ls := store.HeldPassthrough(r); len(ls) > 0 {
			s.whole[r.GetId()] = ls
		}
	}
	for id := range h.corrupt {
		if cl, ok := h.prev.held[id]; ok {
			s.held[id] = cl
		}
		if ls, ok := h.prev.whole[id]; ok {
			s.whole[id] = ls
		}
		if p, ok := h.prev.procs[id]; ok {
			s.procs[id] = p
		}
	}
	for id, ls := range s.held {
		for _, cl := range ls {
			s.holders[claimKey(cl)] = append(s.holders[claimKey(cl)], id)
		}
	}
	for _, ids := range s.holders {
		sort.Strings(ids)
	}
	return s
}

// vfioNode is the VFIO node of device id under the model's /dev, created
// so that a helper can hold it open; "" when the device has no IOMMU group.
func (h *host) vfioNode(t *rapid.T, id string) string {
	var link string
	if h.dc.kind == gpu.KindVendor {
		link = filepath.Join(h.sys, "bus", "pci", "devices", id, "iommu_group")
	} else {
		link = filepath.Join(h.sys, "bus", "mdev", "devices", id, "iommu_group")
	}
	target, err := os.Readlink(link)
	if err != nil {
		return ""
	}
	node := filepath.Join(h.devDir, "vfio", filepath.Base(target))
	if _, err := os.Stat(node); errors.Is(err, os.ErrNotExist) {
		if err := os.WriteFile(node, nil, 0o600); err != nil {
			t.Fatalf("vfio node %s: %v", node, err)
		}
	}
	return node
}

// held reports whether anything has the device's VFIO node open, as the
// lease layer decides it (an uninspectable process counts, except ignored
// ones).
func (h *host) heldOpen(t *rapid.T, id string) bool {
	node := h.vfioNode(t, id)
	if node == "" {
		return false
	}
	c, cancel := ctx()
	defer cancel()
	hs, err := proc.Holders(c, node)
	if err != nil {
		return true
	}
	for _, x := range hs {
		if !(x.Uncertain && slices.Contains(h.ignore, x.PID)) {
			return true
		}
	}
	return false
}

// startHelper starts a QEMU stand-in holding node open (none when "").
func startHelper(node string) (*helper, error) {
	var env []string
	if node != "" {
		env = append(env, proctest.HoldFileEnv+"="+node)
	}
	cmd := proctest.ZombieCommand(env...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	cmd.Stdout = nil
	child, err := proc.Start(cmd)
	if err != nil {
		return nil, err
	}
	hp := &helper{child: child, stdin: stdin}
	// A zombie leader means the helper opened its file and runs on in its
	// one live thread: the state a QEMU with VFIO workers is in.
	if !waitFor(func() bool {
		st, err := proc.ReadStat(child.Identity().PID)
		return (err == nil && st.State == 'Z') || !hp.alive()
	}) || !hp.alive() {
		_ = hp.end()
		return nil, fmt.Errorf("helper %v never became a zombie leader with a live thread", child.Identity())
	}
	return hp, nil
}

// describe is a one-line view of the store and of now's devices for the
// step log.
func (h *host) describe(t *rapid.T, now snapshot) string {
	recs, _ := h.records(t)
	var b strings.Builder
	for _, r := range recs {
		fmt.Fprintf(&b, "%s:%s", r.GetId(), store.StateName(r.GetState()))
		for _, cl := range store.VGPUs(r) {
			fmt.Fprintf(&b, "[%s %s held=%t]", claimKey(cl), strings.TrimPrefix(cl.GetPhase().String(), "CLAIM_PHASE_"), store.LeaseHeld(cl))
		}
		for _, l := range r.GetLeases() {
			if l.GetGpuPassthrough() != nil {
				fmt.Fprintf(&b, "[%s %s held=%t]", strings.Join(store.PassthroughDevices(l), "+"), strings.TrimPrefix(l.GetPhase().String(), "CLAIM_PHASE_"), store.LeaseHeld(l))
			}
		}
		if p := r.GetProcess(); p != nil {
			fmt.Fprintf(&b, "(pid %d alive=%t)", p.GetPid(), proc.Inspect(store.IdentityOf(p)).Alive)
		}
		b.WriteString(" ")
	}
	for id := range h.corrupt {
		fmt.Fprintf(&b, "%s:UNREADABLE ", id)
	}
	keys := make([]string, 0, len(now.devices))
	for d := range now.devices {
		keys = append(keys, d)
	}
	sort.Strings(keys)
	fmt.Fprintf(&b, "devices=%v", keys)
	var bound []string
	for a := range now.bound {
		bound = append(bound, a)
	}
	sort.Strings(bound)
	fmt.Fprintf(&b, " vfio-pci=%v", bound)
	return b.String()
}
