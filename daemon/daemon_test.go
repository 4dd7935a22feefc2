package daemon

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"testing"

	"github.com/stretchr/testify/assert"

	"vmflow/internal/service"
)

type testConfig struct{ Flags }

func parseTest(args []string, stderr io.Writer) (testConfig, error) {
	var c testConfig
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(stderr)
	c.Register(fs, Help{Work: "tasks", Refused: "exits", Version: true})
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	return c, c.Check()
}

// TestMainExitCodes: one mapping for both daemons, so a refused
// configuration exits 2 whichever daemon refused it, and a failed run 1.
func TestMainExitCodes(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		err  error
		want int
		ran  bool
	}{
		{"runs", nil, nil, service.ExitOK, true},
		{"help", []string{"--help"}, nil, service.ExitOK, false},
		{"version", []string{"--version"}, nil, service.ExitOK, false},
		{"bad flag", []string{"--bogus"}, nil, service.ExitUsage, false},
		{"bad stop timeout", []string{"--stop-timeout", "-1s"}, nil, service.ExitUsage, false},
		{"bad log level", []string{"--log-level", "loud"}, nil, service.ExitUsage, false},
		{"refused configuration", nil, fmt.Errorf("tls: %w", UsageError(errors.New("no CA"))), service.ExitUsage, true},
		{"failed run", nil, errors.New("dial: refused"), service.ExitError, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ran := false
			run := func(_ context.Context, c testConfig) error {
				ran = true
				assert.NotNil(t, c.Logger, "Main gives run its logger")
				return tc.err
			}
			assert.Equal(t, tc.want, Main(context.Background(), "vmflow-test", tc.args, parseTest, run))
			assert.Equal(t, tc.ran, ran)
		})
	}
}
