package network

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"

	"go.uber.org/zap"

	"vmflow/internal/fsx"
)

// The guests' MACs are derived with a key of the host's own, so that
// knowing an instance id (which tenants and logs see) tells no one the MAC
// of its NIC: an attacker who could compute a neighbour's MAC could aim
// layer-2 tricks at it (issue 32, finding 1). The key is random, made once
// per host in the state dir and kept there; a lease records its MAC when it
// is placed, so the key only matters for placements: leases placed before
// the key existed (or under another key) keep the MAC they recorded.
const (
	// MACKeyFile is the key's file in the state dir: 64 hex digits and a
	// newline, mode 0600.
	MACKeyFile = "network-mac.key"
	macKeyLen  = 32
)

// MAC is the guest NIC's MAC for instance id and attempt (0 first; the next
// when a held lease of another instance has it) under the host's key:
// HMAC-SHA256 of the id and attempt, made locally administered and
// unicast. Stable across restarts and reboots because the lease keeps it.
func MAC(key []byte, id string, attempt int) string {
	m := hmac.New(sha256.New, key)
	fmt.Fprintf(m, "vmflow-mac\x00%s\x00%d", id, attempt)
	sum := m.Sum(nil)
	return net.HardwareAddr{0x02, sum[0], sum[1], sum[2], sum[3], sum[4]}.String()
}

// bridgeMAC is the MAC the bridge named name is pinned to under key: one
// of the host's own (two agents' bridges on one machine differ), and the
// same after every reboot, so guests' ARP entries for the gateway stay
// right when the bridge is made again.
func bridgeMAC(key []byte, name string) net.HardwareAddr {
	m := hmac.New(sha256.New, key)
	fmt.Fprintf(m, "vmflow-bridge-mac\x00%s", name)
	sum := m.Sum(nil)
	return net.HardwareAddr{0x02, sum[0], sum[1], sum[2], sum[3], sum[4]}
}

// MACKey is the host's MAC key, read from the state dir, or made there
// when there is none (the first networked launch or bridge of the host).
// Making it takes the placement lock, so two agents' first placements
// agree on one key; the write is atomic (a crash leaves no key or the
// whole key). A key file that is not 64 hex digits, or that others than
// its owner may read, is refused (ErrMisconfigured) and never replaced:
// replacing a key that leaked or broke is the operator's call (RUNBOOK).
// Called without the placement lock held.
func (n *Net) MACKey(ctx context.Context) ([]byte, error) {
	n.kmu.Lock()
	defer n.kmu.Unlock()
	if n.key != nil {
		return n.key, nil
	}
	path := filepath.Join(n.cfg.Store.StateDir(), MACKeyFile)
	key, err := readMACKey(path)
	if errors.Is(err, fs.ErrNotExist) {
		key, err = n.makeMACKey(ctx, path)
	}
	if err != nil {
		return nil, err
	}
	n.key = key
	return key, nil
}

// makeMACKey makes the key at path under the placement lock, unless
// another agent made it meanwhile.
func (n *Net) makeMACKey(ctx context.Context, path string) ([]byte, error) {
	hl, err := n.hostLock(ctx)
	if err != nil {
		return nil, fmt.Errorf("network: MAC key: %w", err)
	}
	defer hl.Release(false)
	if key, err := readMACKey(path); !errors.Is(err, fs.ErrNotExist) {
		return key, err
	}
	// A crash between a temp file and its rename left it: under the lock
	// no one else writes one of these.
	stale, _ := filepath.Glob(filepath.Join(filepath.Dir(path), fsx.TempPrefix+MACKeyFile+"-*"))
	for _, s := range stale {
		_ = os.Remove(s) // best effort: a leftover temp is harmless
	}
	key := make([]byte, macKeyLen)
	if _, err := rand.Read(key); err != nil {
		return nil, fmt.Errorf("network: MAC key: %w", err)
	}
	// fsx.WriteFile's temp file is 0600 and renamed into place whole.
	if err := fsx.WriteFile(path, []byte(hex.EncodeToString(key)+"\n"), nil); err != nil {
		return nil, fmt.Errorf("network: MAC key: %w", err)
	}
	n.cfg.Logger.Info("network MAC key made: new guests' MACs are derived with it", zap.String("path", path))
	return key, nil
}

// readMACKey reads the key at path; fs.ErrNotExist when there is none.
func readMACKey(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
		return nil, fmt.Errorf("%w: MAC key: %w", ErrMisconfigured, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("%w: MAC key: %w", ErrMisconfigured, err)
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("%w: MAC key %s: mode %s, want a regular file only its owner can read (0600)", ErrMisconfigured, path, fi.Mode())
	}
	b, err := io.ReadAll(io.LimitReader(f, 4*macKeyLen))
	if err != nil {
		return nil, fmt.Errorf("%w: MAC key %s: %w", ErrMisconfigured, path, err)
	}
	key, err := hex.DecodeString(strings.TrimSuffix(string(b), "\n"))
	if err != nil || len(key) != macKeyLen {
		return nil, fmt.Errorf("%w: MAC key %s: want %d hex digits and a newline", ErrMisconfigured, path, 2*macKeyLen)
	}
	return key, nil
}
