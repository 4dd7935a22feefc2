package supervise

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"

	"vmflow/hostagent/proc/proctest"
)

// TestSupervisedVMCost: what each launched VM holds in the agent once it
// runs. No OS thread: the reaper, the guest-log pump, the exit and QMP
// watchers all park in the runtime (bench-scale found one thread per VM
// blocked in waitid). And its heap and goroutine stacks, logged, bounded
// by the per-VM budget of issue 36 (100 KiB, of which RSS adds the GC's
// headroom on top).
func TestSupervisedVMCost(t *testing.T) {
	const n = 20
	e := newEnv(t)
	sup := e.newSupervisor(func(c *Config) { c.Logger = zap.NewNop() })
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("cost%d", i)
		e.create(ids[i], "never", 0)
	}
	before := costNow(t)
	launchAll(t, sup, ids, 4)
	after := costNow(t)
	heap := float64(after.heap-before.heap) / n / 1024
	stack := float64(after.stack-before.stack) / n / 1024
	goroutines := float64(after.goroutines-before.goroutines) / n
	threads := after.threads - before.threads
	t.Logf("per VM: heap %.1f KiB, stacks %.1f KiB, %.1f goroutines; threads %d → %d with %d VMs",
		heap, stack, goroutines, before.threads, after.threads, n)
	assert.Less(t, threads, n/2, "threads grew with the VMs")
	assert.LessOrEqual(t, goroutines, 6.0, "goroutines per VM")
	assert.LessOrEqual(t, heap+stack, 100.0, "KiB of heap and stacks per VM")
}

type cost struct{ heap, stack, goroutines, threads int }

func costNow(t *testing.T) cost {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	threads, err := strconv.Atoi(proctest.Status(t, os.Getpid())["Threads"])
	require.NoError(t, err)
	return cost{heap: int(m.HeapInuse), stack: int(m.StackInuse), goroutines: runtime.NumGoroutine(), threads: threads}
}
