package claims

import (
	"context"
	"sync/atomic"

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
