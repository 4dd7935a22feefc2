package vmm

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestGuestLogPumpMemoryPerVM: what an idle guest-output pump holds in the
// agent, per VM: heap, goroutine stacks, goroutines. A QEMU says a line or
// two at start and then nothing for its life; the agent runs hundreds.
func TestGuestLogPumpMemoryPerVM(t *testing.T) {
	const pumps = 200
	dir := t.TempDir()
	before := pumpMemNow()
	ws := make([]*os.File, pumps)
	gs := make([]*GuestLog, pumps)
	t.Cleanup(func() {
		for i := range pumps {
			if ws[i] != nil {
				ws[i].Close()
			}
			if gs[i] != nil {
				gs[i].Stop(0)
			}
		}
	})
	line := []byte("qemu-system-x86_64: warning: host doesn't support requested feature\n")
	for i := range pumps {
		w, g, err := guestOutput(filepath.Join(dir, fmt.Sprintf("%d.log", i)))
		require.NoError(t, err)
		ws[i], gs[i] = w, g
		_, err = w.Write(line)
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool {
		for _, g := range gs {
			if st := g.Stats(); st.Read != uint64(len(line)) {
				return false
			}
		}
		return true
	}, 10*time.Second, 5*time.Millisecond, "every pump read its line")
	// Written too: what the writer holds after its write is what stays.
	require.Eventually(t, func() bool {
		for i := range gs {
			if fi, err := os.Stat(filepath.Join(dir, fmt.Sprintf("%d.log", i))); err != nil || fi.Size() != int64(len(line)) {
				return false
			}
		}
		return true
	}, 10*time.Second, 5*time.Millisecond, "every pump wrote its line")
	after := pumpMemNow()
	heap := float64(after.heap-before.heap) / pumps / 1024
	stack := float64(after.stack-before.stack) / pumps / 1024
	goroutines := float64(after.goroutines-before.goroutines) / pumps
	t.Logf("per idle pump: heap %.1f KiB, stacks %.1f KiB, %.1f goroutines", heap, stack, goroutines)
	// About 8 KiB measured alone; up to 18 under the race detector on a
	// loaded CI machine (bigger stacks, other goroutines of the process
	// growing theirs meanwhile). The pump before this one held 71 KiB (its
	// 32 KiB buffer on the reader's stack, a parked writer): 32 tells the
	// two apart with room on both sides.
	assert.LessOrEqual(t, heap+stack, 32.0, "KiB per idle pump")
	assert.LessOrEqual(t, goroutines, 1.0, "goroutines per idle pump")
}

type pumpMem struct{ heap, stack, goroutines int64 }

func pumpMemNow() pumpMem {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return pumpMem{heap: int64(m.HeapInuse), stack: int64(m.StackInuse), goroutines: int64(runtime.NumGoroutine())}
}
