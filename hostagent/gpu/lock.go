package gpu

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"vmflow/internal/fsx"
)

// hostLock serialises placement host-wide so that two spawns cannot take
// the last slot twice: a channel for goroutines of this process (waiting on
// it honours ctx without polling) and fsx's flock(2) on a file in the state
// dir for other processes.
type hostLock struct {
	path string
	sem  chan struct{}
}

func newHostLock(stateDir string) *hostLock {
	return &hostLock{path: filepath.Join(stateDir, "vgpu.lock"), sem: make(chan struct{}, 1)}
}

// lock returns an unlock function once both locks are held.
func (l *hostLock) lock(ctx context.Context) (func(), error) {
	select {
	case l.sem <- struct{}{}:
	case <-ctx.Done():
		return nil, fmt.Errorf("vgpu: host lock: %w", ctx.Err())
	}
	release := func() { <-l.sem }
	if err := os.MkdirAll(filepath.Dir(l.path), 0o700); err != nil {
		release()
		return nil, fmt.Errorf("vgpu: host lock: %w", err)
	}
	fl, err := fsx.LockFile(ctx, l.path)
	if err != nil {
		release()
		return nil, fmt.Errorf("vgpu: host lock: %w", err)
	}
	return func() {
		_ = fl.Release(false) // closing drops the flock; nothing to report
		release()
	}, nil
}
