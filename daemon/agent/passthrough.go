package agent

import (
	"go.uber.org/zap"

	"vmflow/hostagent/store"
	"vmflow/hostagent/vgpu"
	"vmflow/hostagent/vgpu/claims"
	"vmflow/internal/crashpoint"
)

// newWhole sets up the whole-GPU driver and claims when --gpu-passthrough
// names any GPU; nil otherwise (a spec asking for one is then refused).
func newWhole(cfg Config, st *store.Store, log *zap.Logger) (*claims.Whole, error) {
	if !cfg.GPUPassthrough.Enabled() {
		return nil, nil
	}
	drv := vgpu.NewPassthrough(vgpu.PassthroughConfig{
		SysfsRoot: cfg.SysfsRoot, StateDir: cfg.StateDir, DevRoot: cfg.DevRoot, Filter: cfg.GPUPassthrough,
		AfterWrite: func(string, string) { crashpoint.Hit(crashpoint.PassthroughSysfsWritten) },
	})
	log.Info("whole GPUs by passthrough", zap.String("gpu_passthrough", cfg.GPUPassthrough.String()))
	return claims.NewWhole(claims.WholeConfig{Driver: drv, Store: st, OrphanGrace: cfg.OrphanGrace, Logger: log,
		IgnoreUninspectable: cfg.IgnoreUninspectable})
}
