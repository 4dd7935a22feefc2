package hostmodel_test

import (
	"net/netip"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"pgregory.net/rapid"

	"vmflow/hostagent/network"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
)

// The network's part of the model: each check gets the driver case's
// namespace emptied, a bridge in it and a subnet of one or five guest
// addresses for three instances, so placement binds and addresses come
// back through releases; leases and releases are among the random steps.

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
func (h *host) netAttach(t *rapid.T) {
	id := h.existingID(t)
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
