package guest

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"strings"
)

// NetConfig is the guest's static IPv4 configuration, what NetParam
// carries.
type NetConfig struct {
	Addr    netip.Prefix // the guest's address and the subnet's length, e.g. 10.88.0.2/24
	Gateway netip.Addr   // the default route's next hop, inside Addr's subnet
}

// NetConfigFromCmdline finds NetParam among the kernel parameters (the text of
// /proc/cmdline) and parses it; ok is false when it is absent (a VM without
// a network). Given twice it is an error: the agent writes it once, and
// guessing which one wins would hide a mistake.
func NetConfigFromCmdline(cmdline string) (c NetConfig, ok bool, err error) {
	var values []string
	for _, f := range strings.Fields(cmdline) {
		if v, found := strings.CutPrefix(f, NetParam+"="); found {
			values = append(values, v)
		}
	}
	switch len(values) {
	case 0:
		return NetConfig{}, false, nil
	case 1:
		c, err = ParseNetConfig(values[0])
		return c, true, err
	default:
		return NetConfig{}, true, fmt.Errorf("%s given %d times", NetParam, len(values))
	}
}

// ParseNetConfig reads the parameter's value, "<ipv4>/<prefix>,<gateway>",
// and checks it is one the init can configure; the agent can check what it
// writes with it too.
func ParseNetConfig(v string) (NetConfig, error) {
	addr, gw, ok := strings.Cut(v, ",")
	if !ok {
		return NetConfig{}, fmt.Errorf("%s=%q: want <ipv4>/<prefix>,<gateway>", NetParam, v)
	}
	p, err := netip.ParsePrefix(addr)
	if err != nil {
		return NetConfig{}, fmt.Errorf("%s=%q: address: %w", NetParam, v, err)
	}
	g, err := netip.ParseAddr(gw)
	if err != nil {
		return NetConfig{}, fmt.Errorf("%s=%q: gateway: %w", NetParam, v, err)
	}
	switch {
	case !p.Addr().Is4() || !g.Is4():
		return NetConfig{}, fmt.Errorf("%s=%q: IPv4 only", NetParam, v)
	case p.Bits() < 1 || p.Bits() > 30:
		// A /31 or /32 would need an on-link gateway route; the agent's
		// subnets are ordinary ones with the gateway inside.
		return NetConfig{}, fmt.Errorf("%s=%q: prefix length %d: want 1 to 30", NetParam, v, p.Bits())
	case !p.Masked().Contains(g):
		return NetConfig{}, fmt.Errorf("%s=%q: gateway %s is outside %s", NetParam, v, g, p.Masked())
	case g == p.Addr():
		return NetConfig{}, fmt.Errorf("%s=%q: the gateway is the guest's own address", NetParam, v)
	case p.Addr() == p.Masked().Addr() || p.Addr() == Broadcast(p):
		return NetConfig{}, fmt.Errorf("%s=%q: %s is the subnet's network or broadcast address", NetParam, v, p.Addr())
	}
	return NetConfig{Addr: p, Gateway: g}, nil
}

// Broadcast is the broadcast address of p's subnet.
func Broadcast(p netip.Prefix) netip.Addr {
	a := p.Masked().Addr().As4()
	v := binary.BigEndian.Uint32(a[:]) | (1<<(32-p.Bits()) - 1)
	binary.BigEndian.PutUint32(a[:], v)
	return netip.AddrFrom4(a)
}

// Param is the kernel parameter carrying c, NetParam=<ipv4>/<prefix>,<gateway>.
func (c NetConfig) Param() string {
	return NetParam + "=" + c.Addr.String() + "," + c.Gateway.String()
}
