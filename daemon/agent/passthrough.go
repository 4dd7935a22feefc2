package agent

import (
	"context"
	"time"

	"go.uber.org/zap"

	"vmflow/hostagent/metrics"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/store"
	"vmflow/internal/crashpoint"
)

// newWhole sets up the whole-GPU driver and claims when --gpu-passthrough
// names any GPU; nil otherwise (a spec asking for one is then refused).
func newWhole(cfg Config, st *store.Store, log *zap.Logger) (*lease.Whole, error) {
	if !cfg.GPUPassthrough.Enabled() {
		return nil, nil
	}
	drv := gpu.NewPassthrough(gpu.PassthroughConfig{
		SysfsRoot: cfg.SysfsRoot, StateDir: cfg.StateDir, DevRoot: cfg.DevRoot, Filter: cfg.GPUPassthrough,
		AfterWrite: func(string, string) { crashpoint.Hit(crashpoint.PassthroughSysfsWritten) },
	})
	log.Info("whole GPUs by passthrough", zap.String("gpu_passthrough", cfg.GPUPassthrough.String()), zap.String("gpu_scrub", cfg.GPUScrub))
	if why := drv.Unsafe(); why != "" {
		// Not fatal: vGPUs and CPU-only VMs are still served. Every GPU is
		// listed as not offered with this reason (devices), and each claim
		// checks again, so a host set right is served without a restart.
		log.Error("whole GPUs are not offered: the host's IOMMU does not isolate them", zap.String("reason", why))
	}
	return lease.NewWhole(lease.WholeConfig{Driver: drv, Store: st, OrphanGrace: cfg.OrphanGrace, Logger: log,
		IgnoreUninspectable: cfg.IgnoreUninspectable, Quarantine: quarantineOf(cfg), Scrub: cfg.GPUScrub})
}

// runGPUInventory sets vmflow_gpu_devices from the host's GPU inventory
// (lease.HostInventory) every `every`, until ctx ends. A listing that
// fails keeps the last numbers and is logged.
func runGPUInventory(ctx context.Context, am *metrics.Agent, st *store.Store, cfg Config, whole *lease.Whole, vgpus *lease.Claims, every time.Duration, log *zap.Logger) {
	var drv gpu.Driver
	if vgpus != nil {
		drv = vgpus.Driver()
	}
	var pt *gpu.Passthrough
	if whole != nil {
		pt = whole.Driver()
	}
	q := quarantineOf(cfg)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		rctx, cancel := context.WithTimeout(ctx, every)
		rows, err := lease.HostInventory(rctx, st, q, pt, drv)
		cancel()
		if err != nil {
			log.Warn("GPU inventory for vmflow_gpu_devices", zap.Error(err))
		} else {
			am.SetGPUDevices(lease.CountByState(rows))
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// quarantineOf is the host's GPU quarantine, in the state dir.
func quarantineOf(cfg Config) *lease.Quarantine {
	return lease.NewQuarantine(cfg.StateDir, cfg.QuarantineAfter, nil)
}
