package cli_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/cli"
	"vmflow/hostagent/store"
)

func runShow(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := cli.Show(args, cli.IO{Stdout: &stdout, Stderr: &stderr})
	return code, stdout.String(), stderr.String()
}

func TestShowInstance(t *testing.T) {
	f := newHostFixture(t)
	code, out, stderr := runShow(t, "--state-dir", f.dir, idRelFail)
	require.Equal(t, cli.ExitOK, code, stderr)
	for _, want := range []string{
		"instance         vm-relfail",
		"state            release_failed",
		"record           " + f.recordPath(t, idRelFail),
		"manual stop      yes",
		"by spawn/vm-relfail (run run-vm-relfail)",
		"process          none",
		`vGPU             active 6f9b6c1e-0000-4000-8000-000000000002: profile "GRID A100-4C"`,
		"1 failed release(s), last: write remove: device or resource busy",
		"last error       release vGPU: write remove: device or resource busy",
		"needs attention  yes",
		"release failed 1 time(s): write remove",
		"\nrecord.json:\n{\n",
	} {
		assert.Contains(t, out, want)
	}
	// protojson varies its spacing on purpose; the value is what counts.
	assert.Regexp(t, `"state":\s+"INSTANCE_STATE_RELEASE_FAILED"`, out)

	code, out, stderr = runShow(t, "--state-dir", f.dir, idRunning)
	require.Equal(t, cli.ExitOK, code, stderr)
	assert.Contains(t, out, fmt.Sprintf("process          %s: running, alive yes", f.self))
	assert.Contains(t, out, "needs attention  no")
	assert.Contains(t, out, "network          active 10.88.0.2/24, mac 02:11:22:33:44:55, tap vmtap0a580002 on vmflow0, gateway 10.88.0.1")

	code, out, stderr = runShow(t, "--state-dir", f.dir, "-o", "json", idRunning)
	require.Equal(t, cli.ExitOK, code, stderr)
	var js struct {
		lsRow
		Creator string          `json:"creator"`
		Record  json.RawMessage `json:"record"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &js), out)
	assert.Equal(t, idRunning, js.ID)
	assert.True(t, js.Process.Alive)
	assert.Contains(t, out, `"address": "10.88.0.2/24"`)
	assert.Contains(t, out, `"mac": "02:11:22:33:44:55"`)
	assert.Equal(t, "spawn/vm-running (run run-vm-running)", js.Creator)
	rec, err := store.DecodeRecord(js.Record)
	require.NoError(t, err, "the record is record.json as the store writes it")
	assert.Equal(t, int32(os.Getpid()), rec.GetProcess().GetPid())
}

// TestShowUnreadableRecord: a record that cannot be decoded is shown as
// such, with the reason and the file's path, not as a failure of show.
func TestShowUnreadableRecord(t *testing.T) {
	f := newHostFixture(t)
	path := f.recordPath(t, idBad)
	code, out, stderr := runShow(t, "--state-dir", f.dir, idBad)
	require.Equal(t, cli.ExitOK, code, stderr)
	assert.Contains(t, out, "state            unreadable")
	assert.Contains(t, out, "record           "+path)
	assert.Regexp(t, `error +record of instance vm-bad .*invalid instance record`, out)
	assert.Contains(t, out, "- record unreadable: "+path)
	assert.NotContains(t, out, "record.json:\n", "no record to print")

	code, out, stderr = runShow(t, "--state-dir", f.dir, "-o", "json", idBad)
	require.Equal(t, cli.ExitOK, code, stderr)
	var js map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &js), out)
	assert.Equal(t, cli.StateUnreadable, js["state"])
	assert.Equal(t, path, js["record_path"])
	assert.NotContains(t, js, "record")
}

// TestShowWhileLocked: show takes no instance lock, so it answers while the
// agent holds one (a stop ladder can hold it for seconds).
func TestShowWhileLocked(t *testing.T) {
	f := newHostFixture(t)
	l, err := f.st.Lock(context.Background(), idRunning)
	require.NoError(t, err)
	defer l.Unlock()
	done := make(chan int, 1)
	go func() {
		code, _, _ := runShow(t, "--state-dir", f.dir, idRunning)
		done <- code
	}()
	select {
	case code := <-done:
		assert.Equal(t, cli.ExitOK, code)
	case <-time.After(10 * time.Second):
		t.Fatal("show waited for the instance lock")
	}
}

func TestShowBadArgs(t *testing.T) {
	f := newHostFixture(t)
	for _, args := range [][]string{{}, {"a", "b"}, {"../etc"}, {"-o", "yaml", idRunning}} {
		code, _, _ := runShow(t, append([]string{"--state-dir", f.dir}, args...)...)
		assert.Equal(t, cli.ExitUsage, code, "%q", args)
	}
	code, _, stderr := runShow(t, "--state-dir", f.dir, "vm-nope")
	assert.Equal(t, cli.ExitError, code)
	assert.True(t, strings.Contains(stderr, "not found"), stderr)
}
