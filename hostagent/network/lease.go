package network

import (
	"context"
	"fmt"
	"net/netip"
	"os"

	"go.uber.org/zap"

	"vmflow/guest"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/store"
	"vmflow/internal/crashpoint"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Attachment is what a launch gives QEMU (the TAP's descriptor and the
// NIC's MAC) and the guest (its address and gateway).
type Attachment struct {
	// TAP is an open queue of the lease's TAP; the caller closes it once
	// QEMU has its copy.
	TAP     *os.File
	MAC     string
	Address netip.Prefix
	Gateway netip.Addr
}

// Lease is a network lease's resource, parsed: what its record says.
type Lease struct {
	TAP     string
	MAC     string
	Address netip.Prefix
	Gateway netip.Addr
}

// ParseLease reads a recorded network lease.
func ParseLease(l *vmflowv1.NetworkLease) (Lease, error) {
	addr, err := netip.ParsePrefix(l.GetAddress())
	if err != nil || !addr.Addr().Is4() {
		return Lease{}, fmt.Errorf("%w: lease address %q", ErrInvalid, l.GetAddress())
	}
	gw, err := netip.ParseAddr(l.GetGateway())
	if err != nil || !gw.Is4() {
		return Lease{}, fmt.Errorf("%w: lease gateway %q", ErrInvalid, l.GetGateway())
	}
	if err := checkIfName("tap", l.GetTap()); err != nil {
		return Lease{}, err
	}
	return Lease{TAP: l.GetTap(), MAC: l.GetMac(), Address: addr, Gateway: gw}, nil
}

// AttachLocked gives the locked instance its place on the bridge for a
// launch: its network lease (placed, and written ahead as an intent, when
// it has none), its TAP (made when missing: the first launch, a failed
// launch's clean-up, a reboot), owned by uid, and an open queue of it. The
// instance's QEMU uid must be assigned (uid). Idempotent: a retry finds its
// own lease and finishes it; the name, MAC and address never change while
// the lease is held.
func (n *Net) AttachLocked(ctx context.Context, l *store.Locked, uid uint32) (Attachment, error) {
	rec, err := l.Get()
	if err != nil {
		return Attachment{}, fmt.Errorf("attach network of %s: %w", l.ID(), err)
	}
	lease := store.Network(rec)
	if !store.LeaseHeld(lease) {
		if lease, err = n.place(ctx, l); err != nil {
			return Attachment{}, fmt.Errorf("attach network of %s: %w", l.ID(), err)
		}
	}
	if lease.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_RELEASING {
		return Attachment{}, fmt.Errorf("attach network of %s: %w", l.ID(), ErrLeaseNotActive)
	}
	nl, err := ParseLease(lease.GetNetwork())
	if err != nil {
		return Attachment{}, fmt.Errorf("attach network of %s: %w", l.ID(), err)
	}
	if !n.cfg.Subnet.Contains(nl.Address.Addr()) || nl.Address.Bits() != n.cfg.Subnet.Bits() {
		return Attachment{}, fmt.Errorf("attach network of %s: %w: its address %s is not in this host's subnet %s",
			l.ID(), ErrMisconfigured, nl.Address, n.cfg.Subnet)
	}
	p, err := nl.port()
	if err != nil {
		return Attachment{}, fmt.Errorf("attach network of %s: %w", l.ID(), err)
	}
	// The filter's element before the TAP: a guest's port forwards
	// nothing until its element exists.
	if err := n.guardPort(l.ID(), p); err != nil {
		return Attachment{}, fmt.Errorf("attach network of %s: %w", l.ID(), err)
	}
	if err := n.EnsureBridge(ctx); err != nil {
		return Attachment{}, fmt.Errorf("attach network of %s: %w", l.ID(), err)
	}
	if err := n.ensureTAP(nl, uid); err != nil {
		return Attachment{}, fmt.Errorf("attach network of %s: %w", l.ID(), err)
	}
	crashpoint.Hit(crashpoint.NetTAPCreated)
	if lease.GetPhase() != vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE {
		if _, err := l.Apply(store.NetworkActive()); err != nil {
			return Attachment{}, fmt.Errorf("attach network of %s: %w", l.ID(), err)
		}
		crashpoint.Hit(crashpoint.NetActivated)
		n.cfg.Logger.Info("network leased", zap.String("instance_id", l.ID()), zap.String("address", nl.Address.String()),
			zap.String("tap", nl.TAP), zap.String("mac", nl.MAC))
	}
	f, err := n.openTAP(nl.TAP)
	if err != nil {
		return Attachment{}, fmt.Errorf("attach network of %s: %w", l.ID(), err)
	}
	return Attachment{TAP: f, MAC: nl.MAC, Address: nl.Address, Gateway: nl.Gateway}, nil
}

// place picks the locked instance's address under the host-wide lock, from
// the records: the lowest of the subnet that no other record's held lease
// names (whatever its phase or the record's state), never the network's,
// the gateway's or the broadcast address; and writes the lease's intent.
// No address is placed while a record cannot be read: it may name one.
func (n *Net) place(ctx context.Context, l *store.Locked) (*vmflowv1.Lease, error) {
	// Before the placement lock: making the key takes it.
	key, err := n.MACKey(ctx)
	if err != nil {
		return nil, err
	}
	hl, err := n.hostLock(ctx)
	if err != nil {
		return nil, err
	}
	defer hl.Release(false)
	taken, macs, err := n.held(l.ID())
	if err != nil {
		return nil, err
	}
	addr, ok := n.free(taken)
	if !ok {
		return nil, fmt.Errorf("%w: %s (%d held)", ErrNoAddress, n.cfg.Subnet, len(taken))
	}
	mac := ""
	for i := 0; mac == ""; i++ {
		if m := MAC(key, l.ID(), i); !macs[m] && m != bridgeMAC(key, n.cfg.Bridge).String() {
			mac = m
		}
	}
	rec, err := l.Apply(store.LeaseIntent(store.NetworkLease(&vmflowv1.NetworkLease{
		Tap: TAPName(addr), Mac: mac, Address: netip.PrefixFrom(addr, n.cfg.Subnet.Bits()).String(),
		Gateway: n.gateway.String(), Bridge: n.cfg.Bridge,
	}), n.cfg.Now()))
	if err != nil {
		return nil, err
	}
	crashpoint.Hit(crashpoint.NetIntentWritten)
	return store.Network(rec), nil
}

// held reads the records' held network leases, except self's: the
// addresses they name (to the instance naming each) and their MACs.
func (n *Net) held(self string) (map[netip.Addr]string, map[string]bool, error) {
	recs, err := n.cfg.Store.Records() // read only
	bad, listed := store.Unreadable(err)
	if !listed {
		return nil, nil, fmt.Errorf("network: read leases: %w", err)
	}
	if len(bad) > 0 {
		// Quoted, not wrapped: other instances' troubles.
		return nil, nil, fmt.Errorf("%w: %d record(s), e.g. instance %s", ErrRecordsUnreadable, len(bad), bad[0].ID)
	}
	taken, macs := map[netip.Addr]string{}, map[string]bool{}
	for _, r := range recs {
		lease := store.Network(r)
		if r.GetId() == self || !store.LeaseHeld(lease) {
			continue
		}
		nl := lease.GetNetwork()
		if p, err := netip.ParsePrefix(nl.GetAddress()); err == nil {
			taken[p.Addr()] = r.GetId()
		} else {
			return nil, nil, fmt.Errorf("%w: instance %s: lease address %q", ErrRecordsUnreadable, r.GetId(), nl.GetAddress())
		}
		macs[nl.GetMac()] = true
	}
	return taken, macs, nil
}

// free is the lowest guest address of the subnet not in taken.
func (n *Net) free(taken map[netip.Addr]string) (netip.Addr, bool) {
	last := guest.Broadcast(n.cfg.Subnet)
	for a := n.gateway.Next(); a.IsValid() && a.Less(last); a = a.Next() {
		if _, ok := taken[a]; !ok {
			return a, true
		}
	}
	return netip.Addr{}, false
}

// DetachLocked removes the locked instance's TAP after a launch that
// failed once the TAP was made: a failed launch leaves no TAP. The lease
// (the address) stays the instance's while its record lives; the next
// launch makes the TAP again. Only when no QEMU of the record may live.
func (n *Net) DetachLocked(l *store.Locked) error {
	rec, err := l.Get()
	if err != nil {
		return fmt.Errorf("detach network of %s: %w", l.ID(), err)
	}
	lease := store.Network(rec)
	if !store.LeaseHeld(lease) {
		return nil
	}
	if err := store.MayQEMULive(rec, false, nil); err != nil {
		return fmt.Errorf("detach network of %s: %w: %w", l.ID(), ErrVMAlive, err)
	}
	if err := n.removeTAP(lease.GetNetwork().GetTap()); err != nil {
		return fmt.Errorf("detach network of %s: %w", l.ID(), err)
	}
	return nil
}

// Release releases instance id's network lease through the engine
// (lease.Engine, with LeaseDriver): its TAP removed, then the lease marked
// released, which returns the address to the pool, then its filter
// element removed. Refused while the VM may live (lease.ErrVMAlive), by the
// one rule every kind follows. A failed release keeps the lease, counts
// the attempt, records the error and moves the record to ReleaseFailed; a
// later Release retries from the record. released is false when the
// instance holds no network lease; name is its address.
func (n *Net) Release(ctx context.Context, id string) (released bool, name string, err error) {
	eng := lease.NewEngine(lease.EngineConfig{Store: n.cfg.Store, Logger: n.cfg.Logger, Now: n.cfg.Now})
	eng.Register(n.LeaseDriver())
	out, err := eng.Release(ctx, id, store.KindNetwork)
	for _, l := range out.Released {
		name = l.GetNetwork().GetAddress()
	}
	return out.All, name, err
}

// leaseDriver is the engine's driver of network leases: a TAP on the
// bridge and an address of the host's subnet.
type leaseDriver struct{ n *Net }

var _ lease.Driver = leaseDriver{}

// LeaseDriver is the engine's driver of the network leases n makes.
// Register it lease.AfterOthers: the address goes back last.
func (n *Net) LeaseDriver() lease.Driver { return leaseDriver{n} }

func (d leaseDriver) Kind() string { return store.KindNetwork }

// Owned refuses when another record's held lease names the address: the
// TAP (named from the address) is then that instance's. A record that
// cannot be read does not refuse (one broken instance never holds up
// another's delete): no address is placed while one is unreadable, so it
// cannot name one placed since.
func (d leaseDriver) Owned(_ context.Context, id string, l *vmflowv1.Lease) error {
	addr, err := netip.ParsePrefix(l.GetNetwork().GetAddress())
	if err != nil {
		return fmt.Errorf("%w: lease address %q", ErrInvalid, l.GetNetwork().GetAddress())
	}
	recs, err := d.n.cfg.Store.Records() // read only
	if _, listed := store.Unreadable(err); !listed {
		return fmt.Errorf("network: read leases: %w", err)
	}
	for _, r := range recs {
		other := store.Network(r)
		if r.GetId() == id || !store.LeaseHeld(other) {
			continue
		}
		if p, err := netip.ParsePrefix(other.GetNetwork().GetAddress()); err == nil && p.Addr() == addr.Addr() {
			return fmt.Errorf("%w: address %s is held by instance %s", ErrNotOurs, addr.Addr(), r.GetId())
		}
	}
	return nil
}

// Nodes: QEMU gets its TAP as a descriptor; no device node to wait for.
func (d leaseDriver) Nodes(context.Context, *vmflowv1.Lease) ([]string, error) { return nil, nil }

// Release removes the TAP; one already gone is released.
func (d leaseDriver) Release(_ context.Context, _ string, l *vmflowv1.Lease) error {
	return d.n.removeTAP(l.GetNetwork().GetTap())
}

// Devices: an address is never quarantined.
func (d leaseDriver) Devices(*vmflowv1.Lease) []string { return nil }

func (d leaseDriver) Points() lease.ReleasePoints {
	return lease.ReleasePoints{Releasing: crashpoint.NetReleasing, Done: crashpoint.NetTAPRemoved, Recorded: crashpoint.NetReleased}
}

// Released removes the lease's own element from the anti-spoofing filter
// and its TAP's ingress chain.
func (d leaseDriver) Released(_ context.Context, id string, l *vmflowv1.Lease) {
	nl := l.GetNetwork()
	if err := d.n.unguardPort(id, nl); err != nil {
		// Its TAP is gone, so the element passes nothing; the next
		// rebuild removes what no held lease names, and the next lease of
		// the address replaces it.
		d.n.cfg.Logger.Warn("network filter element or ingress chain not removed", zap.String("instance_id", id), zap.String("tap", nl.GetTap()), zap.Error(err))
	}
	d.n.cfg.Logger.Info("network released", zap.String("instance_id", id), zap.String("address", nl.GetAddress()), zap.String("tap", nl.GetTap()))
}

// KernelParam is the guest's network as its init reads it from the kernel
// command line (guest.NetParam): "vmflow.net=10.88.0.2/24,10.88.0.1".
func (a Attachment) KernelParam() string {
	return guest.NetConfig{Addr: a.Address, Gateway: a.Gateway}.Param()
}
