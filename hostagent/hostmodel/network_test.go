package hostmodel_test

import (
	"errors"
	"net"
	"net/netip"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"pgregory.net/rapid"

	"vmflow/hostagent/lease"
	"vmflow/hostagent/network"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// The network's part of the model: each check gets the driver case's
// namespace emptied, a bridge in it and a subnet of one or five guest
// addresses for three instances, so placement binds and addresses come
// back through releases; leases and releases are among the random steps,
// and so are the loss of the bridge (deleted by a hand or a tool, its
// ports detached) and the TAP reconcile round that puts them back.

// startNetwork sets up the check's network in h.dc.netns.
func (h *host) startNetwork(t *rapid.T) {
	ns, err := netns.GetFromName(h.dc.netns)
	if err != nil {
		t.Fatalf("setup: netns %s: %v", h.dc.netns, err)
	}
	defer ns.Close()
	nh, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatalf("setup: netns %s: %v", h.dc.netns, err)
	}
	t.Cleanup(nh.Close)
	h.nh = nh
	h.wipeLinks(t) // what an earlier check left
	subnet := rapid.SampledFrom([]string{"10.66.0.0/30", "10.66.0.0/29"}).Draw(t, "subnet")
	h.net, err = network.New(network.Config{Subnet: netip.MustParsePrefix(subnet), NetNS: h.dc.netns, Store: h.st})
	if err != nil {
		t.Fatalf("setup: %v", err)
	}
	t.Cleanup(h.net.Close)
}

// wipeLinks removes every link of the namespace but lo: a reboot.
func (h *host) wipeLinks(t *rapid.T) {
	links, err := h.nh.LinkList()
	if err != nil {
		t.Fatalf("list links: %v", err)
	}
	for _, l := range links {
		if l.Attrs().Name == "lo" {
			continue
		}
		if err := h.nh.LinkDel(l); err != nil {
			t.Fatalf("remove %s: %v", l.Attrs().Name, err)
		}
	}
}

// netAttach attaches id as a launch does (lease, TAP, open descriptor).
func (h *host) netAttach(t *rapid.T) { h.netAttachOf(t, h.existingID(t)) }

func (h *host) netAttachOf(t *rapid.T, id string) {
	c, cancel := ctx()
	defer cancel()
	l, err := h.st.Lock(c, id)
	if err != nil {
		t.Logf("net-attach %s: %v", id, err)
		return
	}
	defer l.Unlock()
	uid := modelUIDs.First + uint32(slices.Index(instanceIDs, id))
	a, err := h.net.AttachLocked(c, l, uid)
	if err == nil {
		a.TAP.Close()
	}
	t.Logf("net-attach %s: %s %v", id, a.Address, err)
	h.event("net attach", err == nil, err)
}

// netRelease releases id's network lease, as the delete's release stage
// does once the VM is gone.
func (h *host) netRelease(t *rapid.T) {
	id := h.existingID(t)
	before, _ := h.st.Get(id)
	recorded := store.IdentityOf(before.GetProcess())
	c, cancel := ctx()
	defer cancel()
	released, addr, err := h.net.Release(c, id)
	t.Logf("net-release %s: released=%t %s %v", id, released, addr, err)
	h.event("net release", released, err)
	if released && recorded.PID != 0 {
		if st := proc.Inspect(recorded); st.Alive {
			t.Fatalf("VIOLATION network released while the VM lives: %s released %s while %v is %s", id, addr, recorded, st.State)
		}
	}
}

// checkNetwork: an address is named by at most one held lease, and every
// TAP in the namespace is a held lease's (none is unowned).
func (h *host) checkNetwork(t *rapid.T) {
	recs, err := h.st.List()
	if _, listed := store.Unreadable(err); !listed {
		t.Fatalf("list: %v", err)
	}
	owner := map[string]string{}
	taps := map[string]bool{}
	for _, r := range recs {
		l := store.Network(r)
		if !store.LeaseHeld(l) {
			continue
		}
		a := l.GetNetwork().GetAddress()
		if other, ok := owner[a]; ok {
			t.Fatalf("VIOLATION two held leases name one address: %s by %s and %s", a, other, r.GetId())
		}
		owner[a] = r.GetId()
		taps[l.GetNetwork().GetTap()] = true
	}
	h.checkPorts(t, recs)
	// A record the model made unreadable may hold a TAP's lease.
	if len(h.corrupt) > 0 {
		return
	}
	links, err := h.nh.LinkList()
	if err != nil {
		t.Fatalf("list links: %v", err)
	}
	for _, l := range links {
		if n := l.Attrs().Name; strings.HasPrefix(n, network.TAPPrefix) && !taps[n] {
			t.Fatalf("VIOLATION TAP %s is named by no held lease (leases: %v)", n, owner)
		}
	}
}

// bridgeLoss deletes the bridge under the leased TAPs, as an operator's
// `ip link del` or a network tool would: its ports stay, detached.
func (h *host) bridgeLoss(t *rapid.T) {
	br, err := h.nh.LinkByName(h.net.Bridge())
	if err != nil {
		t.Skip("no bridge")
	}
	if err := h.nh.LinkDel(br); err != nil {
		t.Fatalf("delete bridge: %v", err)
	}
	for _, id := range instanceIDs {
		h.detached[id] = true
	}
	h.events["bridge lost"]++
	t.Logf("bridge %s deleted", h.net.Bridge())
}

// tapReconcile runs one TAP reconcile round (ReconcileTAPs): the bridge
// made again and every leased TAP put back on it.
func (h *host) tapReconcile(t *rapid.T) {
	c, cancel := ctx()
	defer cancel()
	round, err := h.net.ReconcileTAPs(c)
	t.Logf("tap round: reattached %v, removed %v: %v", round.Reattached, round.Removed, err)
	h.events["tap round reattached"] += len(round.Reattached)
	h.event("tap round", err == nil, err)
	if err != nil && len(h.corrupt) == 0 {
		t.Fatalf("tap round with every record readable: %v", err)
	}
	for id := range h.detached {
		if _, unreadable := h.corrupt[id]; !unreadable {
			delete(h.detached, id)
		}
	}
}

// checkPorts: every TAP a readable record's held lease names, where it
// exists, is a port of the bridge, isolated from the other ports and up:
// always, except between the bridge's loss and the next TAP round that
// could read the record.
func (h *host) checkPorts(t *rapid.T, recs []*vmflowv1.InstanceRecord) {
	var br netlink.Link
	for _, r := range recs {
		l := store.Network(r)
		if !store.LeaseHeld(l) || h.detached[r.GetId()] {
			continue
		}
		name := l.GetNetwork().GetTap()
		tap, err := h.nh.LinkByName(name)
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			continue // made again by the VM's next launch
		}
		if err != nil {
			t.Fatalf("look up %s: %v", name, err)
		}
		if br == nil {
			if br, err = h.nh.LinkByName(h.net.Bridge()); err != nil {
				t.Fatalf("VIOLATION leased TAP %s of %s and no bridge %s: %v", name, r.GetId(), h.net.Bridge(), err)
			}
		}
		if tap.Attrs().MasterIndex != br.Attrs().Index {
			t.Fatalf("VIOLATION leased TAP %s of %s is not a port of %s (master %d, bridge %d)", name, r.GetId(), h.net.Bridge(),
				tap.Attrs().MasterIndex, br.Attrs().Index)
		}
		if tap.Attrs().Flags&net.FlagUp == 0 {
			t.Fatalf("VIOLATION leased TAP %s of %s is down", name, r.GetId())
		}
		pi, err := h.nh.LinkGetProtinfo(tap)
		if err != nil {
			t.Fatalf("protinfo of %s: %v", name, err)
		}
		if !pi.Isolated {
			t.Fatalf("VIOLATION leased TAP %s of %s is not isolated from the other ports", name, r.GetId())
		}
	}
}

// releaseAll is the delete's release stage as the agent runs it: the
// host's one lease engine over every kind it serves (vGPUs, whole GPUs,
// then the network, AfterOthers). The address goes back last: never
// while a GPU lease of the record is still held.
func (h *host) releaseAll(t *rapid.T) { h.releaseAllOf(t, h.existingID(t)) }

func (h *host) releaseAllOf(t *rapid.T, id string) {
	before, _ := h.st.Get(id)
	recorded := store.IdentityOf(before.GetProcess())
	eng := lease.NewHostEngine(lease.EngineConfig{Store: h.st, Quarantine: h.quarantine, IgnoreUninspectable: h.ignore, Now: h.clock},
		[]lease.Driver{h.claims.LeaseDriver(), h.whole.LeaseDriver()}, h.net.LeaseDriver())
	c, cancel := ctx()
	defer cancel()
	out, err := eng.Release(c, id)
	var names []string
	for _, l := range out.Released {
		names = append(names, store.LeaseName(l))
	}
	t.Logf("release all %s: all=%t %v %v", id, out.All, names, err)
	h.event("release all", out.All, err)
	if len(out.Released) > 0 && recorded.PID != 0 {
		if st := proc.Inspect(recorded); st.Alive {
			t.Fatalf("VIOLATION leases released while the VM lives: %s released %v while %v is %s", id, names, recorded, st.State)
		}
	}
	after, gerr := h.st.Get(id)
	if len(out.Of(store.KindNetwork)) > 0 && gerr == nil && (len(store.HeldVGPUs(after)) > 0 || len(store.HeldPassthrough(after)) > 0) {
		t.Fatalf("VIOLATION %s's address went back while it still holds a GPU lease: %v", id, store.HeldLeases(after))
	}
}
