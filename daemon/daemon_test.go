package daemon

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/internal/service"
	"vmflow/platform"
	"vmflow/testsupport/otlptest"
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

// TestMainTracing: with an OTLP endpoint in the environment Main traces
// every client the daemon dials (Flags.Temporal) under the daemon's name,
// and sends the last spans before it returns; without one, nothing.
func TestMainTracing(t *testing.T) {
	otlptest.ClearEnv(t)
	m, err := NewMetrics(nil)
	require.NoError(t, err)
	var traced *platform.Tracing
	run := func(_ context.Context, c testConfig) error {
		traced = c.Tracing
		assert.Same(t, c.Tracing, c.Temporal(m, "").Tracing, "every client the daemon dials")
		_, span := c.Tracing.TracerProvider().Tracer("test").Start(context.Background(), "in run")
		span.End()
		return nil
	}
	assert.Equal(t, service.ExitOK, Main(context.Background(), "vmflow-test", nil, parseTest, run))
	assert.Nil(t, traced, "off without an endpoint")

	sink := otlptest.Start(t)
	t.Setenv(platform.EnvOTLPEndpoint, sink.URL())
	// Only the flush at exit can send it within the test.
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")
	assert.Equal(t, service.ExitOK, Main(context.Background(), "vmflow-test", nil, parseTest, run))
	assert.NotNil(t, traced)
	spans := sink.Spans()
	require.Len(t, spans, 1, "sent before Main returned")
	assert.Equal(t, "in run", spans[0].Name)
	assert.Equal(t, "vmflow-test", spans[0].Resource["service.name"])

	// A collector it cannot speak to is a configuration error.
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
	ran := false
	assert.Equal(t, service.ExitUsage, Main(context.Background(), "vmflow-test", nil, parseTest,
		func(context.Context, testConfig) error { ran = true; return nil }))
	assert.False(t, ran)
}
