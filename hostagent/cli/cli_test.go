package cli_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/assert"

	"vmflow/hostagent/cli"
)

// TestMainDispatch: run gets its own flags and nothing else of the command
// line; no command or an unknown one is a usage error that prints the
// usage; help is not.
func TestMainDispatch(t *testing.T) {
	var got []string
	run := func(_ context.Context, args []string) int { got = args; return 7 }
	var out, errOut bytes.Buffer
	io := cli.IO{Stdout: &out, Stderr: &errOut}
	assert.Equal(t, 7, cli.Main(context.Background(), []string{"run", "--host-id", "h1"}, io, run))
	assert.Equal(t, []string{"--host-id", "h1"}, got)

	got = nil
	assert.Equal(t, cli.ExitUsage, cli.Main(context.Background(), nil, io, run))
	assert.Equal(t, cli.ExitUsage, cli.Main(context.Background(), []string{"runn"}, io, run))
	assert.Contains(t, errOut.String(), `unknown command "runn"`)
	assert.Contains(t, errOut.String(), "usage: vmflow-hostagent <command>")
	assert.Nil(t, got, "run is not called for a usage error")

	out.Reset()
	assert.Equal(t, cli.ExitOK, cli.Main(context.Background(), []string{"--help"}, io, run))
	assert.Contains(t, out.String(), "usage: vmflow-hostagent <command>")
	out.Reset()
	assert.Equal(t, cli.ExitOK, cli.Main(context.Background(), []string{"version"}, io, run))
	assert.Contains(t, out.String(), "vmflow-hostagent ")
}
