package gpu_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
)

// TestPassthroughNoBindDuringReturn: Return holds no lock, and between
// its writes a function looks unmarked and free (override cleared, the
// probe of its driver still running). A fresh Bind meanwhile refuses it
// (it would record no driver to go back to) rather than take it.
func TestPassthroughNoBindDuringReturn(t *testing.T) {
	e := newPassthrough(t, vgpusim.Options{PCIGPUs: 1}, "all")
	g := vgpusim.PCIGPUAt(0)
	b, err := e.p.Bind(ctxFor(t, 10*time.Second), gpu.BindRequest{Group: g.Group})
	require.NoError(t, err)
	e.sim.Set(t, vgpusim.At(vgpusim.CtlBlockProbe, g.GPU), "")
	done := make(chan error, 1)
	go func() { done <- e.p.Return(ctxFor(t, time.Minute), b) }()
	require.Eventually(t, func() bool { return e.sim.Server.Blocked() > 0 }, 10*time.Second, 10*time.Millisecond, "the return's probe blocks")
	assert.Equal(t, " override=(null)", e.state(t, 0)[g.GPU], "unmarked and unbound meanwhile")

	called := false
	_, err = e.p.Bind(ctxFor(t, 5*time.Second), gpu.BindRequest{Group: g.Group, Intent: func(gpu.Binding) error { called = true; return nil }})
	require.ErrorIs(t, err, gpu.ErrAlreadyBound)
	assert.False(t, called, "no lease for a function being returned")

	e.sim.Clear(t, vgpusim.At(vgpusim.CtlBlockProbe, g.GPU))
	require.NoError(t, <-done)
	assert.Equal(t, "nvidia override=(null)", e.state(t, 0)[g.GPU])
	_, err = e.p.Bind(context.Background(), gpu.BindRequest{Group: g.Group})
	require.NoError(t, err, "free again once returned")
}
