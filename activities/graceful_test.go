package activities

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"vmflow/internal/contract"
	"vmflow/workflows"
)

// graceful_timeout_seconds comes from outside (a delete's input): 0 takes
// the agent's default, anything above an hour is capped, so no input can
// park the stop ladder before quit and SIGKILL for years.
func TestGracefulTimeoutCapped(t *testing.T) {
	def := 10 * time.Second
	for _, tc := range []struct {
		in   uint32
		want time.Duration
	}{
		{0, def}, {1, time.Second}, {3600, time.Hour}, {3601, time.Hour}, {math.MaxUint32, time.Hour},
	} {
		assert.Equal(t, tc.want, gracefulTimeout(tc.in, def), "%d s", tc.in)
	}
	assert.Equal(t, contract.MaxGracefulTimeout, time.Duration(workflows.MaxGracefulTimeoutSeconds)*time.Second,
		"the client's bound and the agent's cap are the same")
}
