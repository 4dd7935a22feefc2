package lease_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/lease"
	"vmflow/hostagent/store"
	"vmflow/internal/errdefs"
)

// TestDrainingHostGrantsNothing: while the drain marker is there the
// ledger reserves nothing (a Draining refusal, nothing written) and a
// record granted before it stays; undrain grants again. Creates racing a
// drain are each either written before the marker or refused.
func TestDrainingHostGrantsNothing(t *testing.T) {
	h := newCapacityHost(t, 4, 1)
	var err error
	// 16 vCPUs: room for every create here (10), so only the drain refuses.
	h.cap, err = lease.NewCapacity(lease.CapacityConfig{Store: h.st, CPUs: 2, MemoryMiB: 10240, MemoryReserveMiB: 1024,
		CPUOvercommit: 8, MemoryOvercommit: 1, Now: h.clock, Draining: h.st.RefuseWhileDraining})
	require.NoError(t, err)
	ctx := context.Background()

	_, err = h.create("before", vm(1, 128))
	require.NoError(t, err)
	_, err = h.st.Drain(ctx, "kernel upgrade", h.clock())
	require.NoError(t, err)

	_, err = h.create("during", vm(1, 128))
	require.Error(t, err)
	assert.ErrorIs(t, err, store.ErrDraining)
	assert.Equal(t, errdefs.Draining, errdefs.ClassOf(err))
	assert.Contains(t, err.Error(), "kernel upgrade")
	_, err = h.st.Get("during")
	assert.ErrorIs(t, err, store.ErrNotFound, "a refused grant writes nothing")
	_, err = h.st.Get("before")
	assert.NoError(t, err, "what was granted before the drain stays")

	was, err := h.st.Undrain(ctx)
	require.NoError(t, err)
	assert.True(t, was)
	_, err = h.create("after", vm(1, 128))
	assert.NoError(t, err)

	// A burst of creates and one drain: every create that succeeded was
	// written before the drain's marker, so none is newer than it.
	var wg sync.WaitGroup
	var mu sync.Mutex
	var granted []string
	var drainedAt time.Time
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := fmt.Sprintf("burst-%d", i)
			if _, err := h.create(id, vm(1, 128)); err == nil {
				mu.Lock()
				granted = append(granted, id)
				mu.Unlock()
			} else if !errors.Is(err, store.ErrDraining) {
				t.Errorf("%s: %v", id, err)
			}
		}()
		if i == 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, err := h.st.Drain(ctx, "burst", h.clock())
				assert.NoError(t, err)
				mu.Lock()
				drainedAt = time.Now()
				mu.Unlock()
			}()
		}
	}
	wg.Wait()
	_, on, err := h.st.Draining()
	require.NoError(t, err)
	require.True(t, on)
	_, err = h.create("late", vm(1, 128))
	assert.ErrorIs(t, err, store.ErrDraining)
	for _, id := range granted {
		rec, err := h.st.Get(id)
		require.NoError(t, err)
		assert.NotNil(t, store.Capacity(rec), "%s holds its grant", id)
	}
	assert.False(t, drainedAt.IsZero())
}
