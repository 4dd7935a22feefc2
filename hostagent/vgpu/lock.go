package vgpu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// hostLock serialises placement host-wide so that two spawns cannot take
// the last slot twice: a channel for goroutines of this process (waiting on
// it honours ctx) and flock(2) on a file in the state dir for other
// processes (flock cannot be cancelled, so it is polled non-blocking).
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
	f, err := os.OpenFile(l.path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		release()
		return nil, fmt.Errorf("vgpu: host lock: %w", err)
	}
	delay := time.Millisecond
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) && !errors.Is(err, syscall.EINTR) {
			f.Close()
			release()
			return nil, fmt.Errorf("vgpu: host lock %s: %w", l.path, err)
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			f.Close()
			release()
			return nil, fmt.Errorf("vgpu: host lock %s: %w", l.path, ctx.Err())
		case <-t.C:
		}
		if delay < 50*time.Millisecond {
			delay *= 2
		}
	}
	return func() {
		f.Close() // drops the flock
		release()
	}, nil
}
