package tclient_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/api/operatorservice/v1"

	"vmflow/internal/tclient"
	"vmflow/testsupport/devserver"
)

// TestCreateCommandsRunAgainstDevServer runs, with the real CLI (v1.5.1),
// the commands the "search attributes missing" hint prints, and checks that
// every attribute exists afterwards with its type. The old hint (several
// --name, one --type) created only the first name.
func TestCreateCommandsRunAgainstDevServer(t *testing.T) {
	srv := devserver.Start(t, devserver.Options{})
	// Names the dev server does not register itself, of two types, several
	// of one type (the case the old hint got wrong).
	want := map[string]enumspb.IndexedValueType{
		"VmflowHintA":    enumspb.INDEXED_VALUE_TYPE_KEYWORD,
		"VmflowHintB":    enumspb.INDEXED_VALUE_TYPE_KEYWORD,
		"VmflowHintC":    enumspb.INDEXED_VALUE_TYPE_KEYWORD,
		"VmflowHintFlag": enumspb.INDEXED_VALUE_TYPE_BOOL,
	}
	hint := tclient.CreateCommands(srv.Namespace(), want)
	for _, c := range strings.Split(hint, " && ") {
		args := strings.Fields(c)
		require.Equal(t, "temporal", args[0], c)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		cmd := exec.CommandContext(ctx, srv.BinaryPath(), append(args[1:], "--address", srv.Address())...)
		// No profile from the developer's config file (it could add TLS).
		cmd.Env = append(os.Environ(), "TEMPORAL_CONFIG_FILE="+filepath.Join(t.TempDir(), "none.toml"))
		out, err := cmd.CombinedOutput()
		cancel()
		require.NoError(t, err, "%s\n%s", c, out)
	}

	c := srv.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := c.OperatorService().ListSearchAttributes(ctx,
		&operatorservice.ListSearchAttributesRequest{Namespace: srv.Namespace()})
	require.NoError(t, err)
	for name, typ := range want {
		have, ok := resp.GetCustomAttributes()[name]
		if assert.True(t, ok, "%s not created by: %s", name, hint) {
			assert.Equal(t, typ, have, name)
		}
	}
}
