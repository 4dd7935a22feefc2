package agent

import (
	"os"
	"path/filepath"
	"runtime/debug"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestHeapProfileOnSignal: each signal writes a whole pprof heap profile
// (gzipped protobuf) to the file and logs the moment's goroutines and heap.
func TestHeapProfileOnSignal(t *testing.T) {
	path := filepath.Join(t.TempDir(), "heap.pb.gz")
	core, logs := observer.New(zapcore.InfoLevel)
	sig := make(chan os.Signal)
	stop := heapProfileOnSignal(path, sig, zap.New(core))
	defer stop()
	for i := range 2 {
		sig <- os.Interrupt // any value: the channel stands for SIGUSR1
		require.Eventually(t, func() bool { return logs.FilterMessage("heap profile written").Len() == i+1 },
			10*time.Second, 5*time.Millisecond)
		b, err := os.ReadFile(path)
		require.NoError(t, err)
		require.Greater(t, len(b), 2)
		assert.Equal(t, []byte{0x1f, 0x8b}, b[:2], "gzip, as pprof writes its protobuf")
	}
	entry := logs.FilterMessage("heap profile written").All()[0]
	assert.Positive(t, entry.ContextMap()["goroutines"])
	assert.Positive(t, entry.ContextMap()["heap_inuse_bytes"])
	names, err := os.ReadDir(filepath.Dir(path))
	require.NoError(t, err)
	assert.Len(t, names, 1, "no temporary file left")
}

// TestGCPercentUnlessGOGC: the agent collects at 50% growth unless GOGC says
// otherwise.
func TestGCPercentUnlessGOGC(t *testing.T) {
	prev := debug.SetGCPercent(100)
	defer debug.SetGCPercent(prev)

	setGCPercent(func(string) string { return "" })
	assert.Equal(t, agentGCPercent, debug.SetGCPercent(100))

	setGCPercent(func(k string) string {
		if k == "GOGC" {
			return "200"
		}
		return ""
	})
	assert.Equal(t, 100, debug.SetGCPercent(100), "GOGC set: the runtime's own reading stands")
}
