package lease

import (
	"context"
	"sync/atomic"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/proc"
)

// CountFDScans makes c count its walks of every process's descriptors.
func CountFDScans(c *Claims) *atomic.Int32 {
	var n atomic.Int32
	c.scanFDs = func(ctx context.Context) (*proc.FDScan, error) {
		n.Add(1)
		return proc.ScanFDs(ctx)
	}
	return &n
}

// RecordLateRelease is what c does, in a goroutine of its own, when a
// release write returns after every caller stopped waiting.
func RecordLateRelease(c *Claims, dev gpu.Device) { c.recordLateRelease(dev) }
