package lease

import (
	"context"
	"fmt"
	"slices"
	"sort"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Device states in an inventory (and vmflow_gpu_devices{state}).
const (
	DeviceFree        = "free"
	DeviceClaimed     = "claimed"
	DeviceQuarantined = "quarantined"
	DeviceNotOurs     = "not-vmflows"
)

// DeviceStates lists them, in the order the CLI and the metric use.
var DeviceStates = []string{DeviceFree, DeviceClaimed, DeviceQuarantined, DeviceNotOurs}

// DeviceRow is one GPU device of the host as vmflow sees it.
type DeviceRow struct {
	// ID is the PCI address (a whole GPU, a vGPU parent, a VF) or mdev UUID.
	ID string `json:"id"`
	// Kind: "whole" (a GPU for passthrough), "vgpu-parent", "vgpu".
	Kind  string `json:"kind"`
	State string `json:"state"`
	// Instance holds it (claimed), or whose release failed (quarantined).
	Instance string `json:"instance_id,omitempty"`
	// Why: the quarantine's reason, or why the device is not vmflow's.
	Why string `json:"why,omitempty"`
}

// Inventory lists every GPU device of the host: whole GPUs (every
// display-class PCI function, from whole), vGPU parents and the vGPUs that
// exist (from drv), and quarantined ids no listing shows. whole and drv may
// be nil; recs are the instance records, q the quarantine.
func Inventory(ctx context.Context, recs []*vmflowv1.InstanceRecord, q map[string]Quarantined, whole *gpu.Passthrough, drv gpu.Driver) ([]DeviceRow, error) {
	owner := heldGroups(recs, "", "")
	for k, v := range heldDevices(recs, "", "", kindOf(drv)) {
		owner[k] = v
	}
	seen := map[string]bool{}
	var rows []DeviceRow
	add := func(r DeviceRow) {
		if seen[r.ID] {
			return
		}
		seen[r.ID] = true
		if inst, ok := owner[r.ID]; ok {
			r.State, r.Instance, r.Why = DeviceClaimed, inst, ""
		}
		if e, ok := q[r.ID]; ok {
			r.State, r.Instance, r.Why = DeviceQuarantined, e.Instance, e.Reason
		}
		rows = append(rows, r)
	}
	if whole != nil {
		gpus, err := whole.GPUs(ctx)
		if err != nil {
			return nil, fmt.Errorf("inventory: whole GPUs: %w", err)
		}
		for _, g := range gpus {
			r := DeviceRow{ID: g.Addr, Kind: "whole", State: DeviceFree}
			switch {
			case g.VGPUParent:
				continue // listed as a vGPU parent below
			case g.Driver == gpu.DriverVFIO && !g.Marked:
				r.State, r.Why = DeviceNotOurs, "bound to vfio-pci by someone else"
			case !g.Offered && !g.Viable:
				r.State, r.Why = DeviceNotOurs, g.NotViable
			case !g.Offered:
				r.State, r.Why = DeviceNotOurs, "not offered: not named by --gpu-passthrough, or its group holds a device someone else moved"
			case !g.Viable && !g.Marked:
				r.State, r.Why = DeviceNotOurs, g.NotViable
			}
			add(r)
		}
	}
	if drv != nil {
		profs, err := drv.Profiles(ctx)
		if err != nil {
			return nil, fmt.Errorf("inventory: vGPU parents: %w", err)
		}
		var parents []string
		for _, p := range profs {
			if !slices.Contains(parents, p.Parent) {
				parents = append(parents, p.Parent)
			}
		}
		sort.Strings(parents)
		for _, p := range parents {
			add(DeviceRow{ID: p, Kind: "vgpu-parent", State: DeviceFree})
		}
		devs, err := drv.Devices(ctx)
		if err != nil {
			return nil, fmt.Errorf("inventory: vGPUs: %w", err)
		}
		for _, d := range devs {
			add(DeviceRow{ID: d.ID, Kind: "vgpu", State: DeviceFree, Why: "no held claim names it (reconcile removes it after the grace)"})
		}
	}
	for _, id := range IDs(q) {
		add(DeviceRow{ID: id, Kind: "?"})
	}
	return rows, nil
}

// CountByState counts rows per DeviceStates entry (each present, 0 or not).
func CountByState(rows []DeviceRow) map[string]int {
	m := map[string]int{}
	for _, s := range DeviceStates {
		m[s] = 0
	}
	for _, r := range rows {
		m[r.State]++
	}
	return m
}

func kindOf(drv gpu.Driver) gpu.Kind {
	if drv == nil {
		return ""
	}
	return drv.Kind()
}

// inventoryRecords is the records for an inventory: a record that cannot
// be read names nothing here (ls names it), and the listing goes on.
func inventoryRecords(st *store.Store) []*vmflowv1.InstanceRecord {
	recs, _ := st.List()
	return recs
}

// HostInventory is Inventory of the host under st, as the agent and the
// CLI both read it.
func HostInventory(ctx context.Context, st *store.Store, q *Quarantine, whole *gpu.Passthrough, drv gpu.Driver) ([]DeviceRow, error) {
	qm, err := q.List()
	if err != nil {
		return nil, err
	}
	return Inventory(ctx, inventoryRecords(st), qm, whole, drv)
}
