package store

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Elapsed measures on CLOCK_BOOTTIME within a boot, whatever the wall
// clock says; without a moment of this boot it falls back on the wall
// clock, and a wall clock stepped back gives zero, never a negative time
// (which would stretch a wait resumed as "configured minus elapsed").
func TestElapsed(t *testing.T) {
	now := time.Now()
	m := BootMomentNow()
	require.NotNil(t, m)
	future := timestamppb.New(now.Add(time.Hour)) // written before the clock was stepped back an hour
	past := timestamppb.New(now.Add(-time.Hour))

	got := Elapsed(future, m, now)
	assert.GreaterOrEqual(t, got, time.Duration(0))
	assert.Less(t, got, time.Minute, "measured on CLOCK_BOOTTIME, not the stepped wall clock")
	got = Elapsed(past, m, now)
	assert.Less(t, got, time.Minute, "the wall clock stepped forward does not count either")

	assert.Zero(t, Elapsed(future, nil, now), "no moment: the wall clock, never below zero")
	assert.Equal(t, time.Hour, Elapsed(past, nil, now))
	other := &vmflowv1.BootMoment{BootId: "00000000-0000-0000-0000-000000000000", SinceBootNs: m.GetSinceBootNs()}
	assert.Equal(t, time.Hour, Elapsed(past, other, now), "a moment of another boot says nothing")
	assert.Zero(t, Elapsed(nil, nil, now))
}
