package agent

import (
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"syscall"

	"go.uber.org/zap"
)

// envHeapProfile names the file a heap profile is written to on SIGUSR1
// (VMFLOW_HEAPPROFILE=FILE): a look at the agent's memory at any moment of
// a run, for `go tool pprof` (the scale bench's profiling aid; off unless
// set).
const envHeapProfile = "VMFLOW_HEAPPROFILE"

// heapProfileOnSignal writes a heap profile to path at each value on sig,
// replacing the last, and logs the goroutines and heap of that moment,
// until stop is called.
func heapProfileOnSignal(path string, sig <-chan os.Signal, log *zap.Logger) (stop func()) {
	done := make(chan struct{})
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		for {
			select {
			case <-sig:
				if err := writeHeapProfile(path, log); err != nil {
					log.Error("heap profile", zap.Error(err))
				}
			case <-done:
				return
			}
		}
	}()
	return func() { close(done); <-ended }
}

// writeHeapProfile writes the heap profile after a GC (so in-use is what is
// live) through a temporary file, so a reader never sees half of one.
func writeHeapProfile(path string, log *zap.Logger) error {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	tmp, err := os.CreateTemp(filepath.Dir(path), ".heapprofile-*")
	if err != nil {
		return fmt.Errorf("%s: %w", envHeapProfile, err)
	}
	defer os.Remove(tmp.Name())
	if err := pprof.Lookup("heap").WriteTo(tmp, 0); err != nil {
		tmp.Close()
		return fmt.Errorf("%s: %w", envHeapProfile, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("%s: %w", envHeapProfile, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("%s: %w", envHeapProfile, err)
	}
	log.Info("heap profile written", zap.String("path", path), zap.Int("goroutines", runtime.NumGoroutine()),
		zap.Uint64("heap_inuse_bytes", m.HeapInuse), zap.Uint64("stack_inuse_bytes", m.StackInuse),
		zap.Uint64("sys_bytes", m.Sys))
	return nil
}

// startHeapProfile arms VMFLOW_HEAPPROFILE when set; stop disarms it.
func startHeapProfile(log *zap.Logger) (stop func()) {
	path := os.Getenv(envHeapProfile)
	if path == "" {
		return func() {}
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGUSR1)
	end := heapProfileOnSignal(path, sig, log)
	return func() { signal.Stop(sig); end() }
}

// agentGCPercent is the agent's GOGC unless the environment sets one. What
// the agent holds grows with its VMs (~45 KiB each: goroutines parked on
// pidfds, pipes and sockets, QMP buffers), and Go's default lets the heap
// grow to twice what is live before a collection: at 200 VMs that headroom
// was a third of the agent's RSS. Half of it costs a collection more often
// for an agent that mostly waits. Unlike a fixed memory limit, it scales
// with the host's VMs.
const agentGCPercent = 50

// setGCPercent applies agentGCPercent unless GOGC is set (getenv).
func setGCPercent(getenv func(string) string) {
	if getenv("GOGC") == "" {
		debug.SetGCPercent(agentGCPercent)
	}
}
