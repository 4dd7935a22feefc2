package bench

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestLaunchTimelinesReadsTheAgentLog: the segments of each launch, by the
// instance's prefix, in the order the log line gives them; other lines and
// other instances are left out.
func TestLaunchTimelinesReadsTheAgentLog(t *testing.T) {
	log := filepath.Join(t.TempDir(), "agent.log")
	require.NoError(t, os.WriteFile(log, []byte(`{"msg":"VM running","instance_id":"t0-1","timeline_ms":{"lock and read":0.5,"uid":2,"exec to QMP":30.25}}
{"msg":"record created","instance_id":"t0-1"}
{"msg":"VM running","instance_id":"t1-1","timeline_ms":{"lock and read":1,"uid":3,"ensure leases":4}}
{"msg":"VM running","instance_id":"x-1","timeline_ms":{"other":9}}
not json "timeline_ms"
`), 0o644))
	tl, order, err := launchTimelines(log, "t0-", "t1-")
	require.NoError(t, err)
	assert.Equal(t, []string{"lock and read", "uid", "exec to QMP", "ensure leases"}, order)
	assert.Equal(t, []time.Duration{30250 * time.Microsecond}, tl["t0-"]["exec to QMP"])
	assert.Equal(t, []time.Duration{4 * time.Millisecond}, tl["t1-"]["ensure leases"])
	assert.NotContains(t, tl, "x-")
}
