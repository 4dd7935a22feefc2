package store

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/internal/errdefs"
)

// TestDrainMarker: drain keeps the first drain's reason and time, undrain
// says whether there was one, a torn marker drains (fail closed), and the
// refusal names the reason in the Draining class.
func TestDrainMarker(t *testing.T) {
	s, err := New(t.TempDir())
	require.NoError(t, err)
	ctx := context.Background()
	_, on, err := s.Draining()
	require.NoError(t, err)
	assert.False(t, on)
	assert.NoError(t, s.RefuseWhileDraining())

	_, err = s.Drain(ctx, "", time.Now())
	assert.ErrorIs(t, err, errdefs.InvalidInput, "a reason is required")

	t0 := time.Date(2026, 12, 7, 9, 0, 0, 0, time.UTC)
	d, err := s.Drain(ctx, "rack 4 power work", t0)
	require.NoError(t, err)
	assert.Equal(t, "rack 4 power work", d.Reason)
	again, err := s.Drain(ctx, "another reason", t0.Add(time.Hour))
	require.NoError(t, err)
	assert.Equal(t, d, again, "a second drain keeps the first")
	err = s.RefuseWhileDraining()
	assert.ErrorIs(t, err, ErrDraining)
	assert.Equal(t, errdefs.Draining, errdefs.ClassOf(err))
	assert.Contains(t, err.Error(), "rack 4 power work")
	assert.Contains(t, err.Error(), "2026-12-07T09:00:00Z")

	was, err := s.Undrain(ctx)
	require.NoError(t, err)
	assert.True(t, was)
	was, err = s.Undrain(ctx)
	require.NoError(t, err)
	assert.False(t, was)
	assert.NoError(t, s.RefuseWhileDraining())

	require.NoError(t, os.WriteFile(s.drainPath(), []byte("{torn"), 0o600))
	d, on, err = s.Draining()
	require.NoError(t, err)
	assert.True(t, on, "a marker that cannot be parsed drains")
	assert.Contains(t, d.Reason, "unreadable")
	assert.ErrorIs(t, s.RefuseWhileDraining(), ErrDraining)
}
