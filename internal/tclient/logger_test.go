package tclient

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/log"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

func observed(t *testing.T) (*ZapLogger, *observer.ObservedLogs) {
	t.Helper()
	core, logs := observer.New(zapcore.DebugLevel)
	return NewZapLogger(zap.New(core, zap.AddCaller())), logs
}

func TestZapLoggerKeysAndLevels(t *testing.T) {
	l, logs := observed(t)
	boom := errors.New("boom")

	// The keys the SDK itself uses (internal_logging_tags.go).
	l.Debug("d", "Namespace", "default", "TaskQueue", "vmflow")
	l.Info("i", "WorkflowID", "delete/vm1", "RunID", "r1", "ActivityType", "ReleaseVGPU")
	l.Warn("w", "Error", boom, "Attempt", 3, "TaskFirstEventID", 7)
	l.Error("e", "instance_id", "vm1", "hostID", "h1", "err", boom)

	entries := logs.AllUntimed()
	require.Len(t, entries, 4)
	assert.Equal(t, []zapcore.Level{zapcore.DebugLevel, zapcore.InfoLevel, zapcore.WarnLevel, zapcore.ErrorLevel},
		[]zapcore.Level{entries[0].Level, entries[1].Level, entries[2].Level, entries[3].Level})

	assert.Equal(t, map[string]any{"namespace": "default", "task_queue": "vmflow"}, entries[0].ContextMap())
	assert.Equal(t, map[string]any{"workflow_id": "delete/vm1", "run_id": "r1", "activity": "ReleaseVGPU"}, entries[1].ContextMap())
	assert.Equal(t, map[string]any{"error": "boom", "attempt": int64(3), "task_first_event_id": int64(7)}, entries[2].ContextMap())
	assert.Equal(t, map[string]any{"instance_id": "vm1", "host_id": "h1", "error": "boom"}, entries[3].ContextMap())

	// The caller is the line above, not the adapter.
	assert.Equal(t, "logger_test.go", filepath.Base(entries[0].Caller.File))
}

func TestZapLoggerWith(t *testing.T) {
	l, logs := observed(t)
	var base log.Logger = l
	wl, ok := base.(log.WithLogger)
	require.True(t, ok)
	child := wl.With("WorkflowID", "spawn/vm1")
	child.Info("started", "instance_id", "vm1")
	l.Info("parent untouched")

	entries := logs.AllUntimed()
	require.Len(t, entries, 2)
	assert.Equal(t, map[string]any{"workflow_id": "spawn/vm1", "instance_id": "vm1"}, entries[0].ContextMap())
	assert.Empty(t, entries[1].ContextMap())

	sl, ok := base.(log.WithSkipCallers)
	require.True(t, ok)
	helper := func() { sl.WithCallerSkip(1).Info("from helper") }
	helper() // the caller recorded is this line's file, one frame above helper
	last := logs.AllUntimed()[2]
	assert.Equal(t, "logger_test.go", filepath.Base(last.Caller.File))
}

func TestZapLoggerMalformedKeyvals(t *testing.T) {
	l, logs := observed(t)
	l.Info("odd", "instance_id", "vm1", "dangling")
	l.Info("non-string key", 42, "x")
	l.Info("nil logger is fine")
	NewZapLogger(nil).Info("dropped", "a")

	entries := logs.AllUntimed()
	require.Len(t, entries, 3)
	assert.Equal(t, map[string]any{"instance_id": "vm1", "missing_value": "dangling"}, entries[0].ContextMap())
	assert.Equal(t, map[string]any{"42": "x"}, entries[1].ContextMap())
}

func TestSnakeCase(t *testing.T) {
	for in, want := range map[string]string{
		"WorkflowID":       "workflow_id",
		"TaskFirstEventID": "task_first_event_id",
		"HTTPServer":       "http_server",
		"instance_id":      "instance_id",
		"Attempt":          "attempt",
		"PanicError":       "panic_error",
		"v2Thing":          "v2_thing",
		"":                 "",
		"ID":               "id",
		"already_Mixed":    "already_mixed",
	} {
		assert.Equal(t, want, snakeCase(in), in)
	}
	assert.Equal(t, KeyActivity, LogKey("ActivityType"))
}

func TestNewLogger(t *testing.T) {
	l, err := NewLogger("warn")
	require.NoError(t, err)
	assert.False(t, l.Core().Enabled(zap.InfoLevel))
	assert.True(t, l.Core().Enabled(zap.WarnLevel))
	_, err = NewLogger("loud")
	assert.Error(t, err)
}

// A workflow id, QEMU's stderr or a guest's bytes logged by the agent reach
// whoever tails the log on a terminal: no control character survives.
func TestNewLoggerEscapesControls(t *testing.T) {
	path := filepath.Join(t.TempDir(), "log")
	l, err := newLogger("info", path)
	require.NoError(t, err)
	l.Info("spawn", zap.String("workflow_id", "spawn/x\x1b]0;owned\a\u009b2J\u202e"))
	require.NoError(t, l.Sync())
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	for _, c := range []string{"\x1b", "\a", "\u009b", "\u202e"} {
		assert.NotContains(t, string(b), c)
	}
	assert.Contains(t, string(b), `spawn/x\u001b]0;owned\u0007\u009b2J\u202e`)
}
