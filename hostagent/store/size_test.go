package store

import (
	"context"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// TestWriteRefusesWhatCannotBeReadBack: a record larger than the reader's
// limit is refused before anything is written. Before the check, a 1.1 MB
// cmdline was written, every later read failed ("larger than 1048576"),
// and the instance could not be deleted.
func TestWriteRefusesWhatCannotBeReadBack(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	huge := strings.Repeat("x", 1100*1000)

	// Create: refused, no directory left behind, the id still free.
	want := wantRecord("big")
	want.Spec.Cmdline = huge
	_, err := s.Create(ctx, want)
	require.ErrorIs(t, err, ErrRecordTooLarge)
	p, err := s.Paths("big")
	require.NoError(t, err)
	_, err = os.Lstat(p.Dir)
	assert.ErrorIs(t, err, os.ErrNotExist, "nothing written for a refused create")
	_, err = s.Get("big")
	assert.ErrorIs(t, err, ErrNotFound)

	// Update: refused, the record on disk stays as it was and readable.
	before := mustCreate(t, s, "vm1")
	_, err = s.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.LastError = huge
		return nil
	})
	require.ErrorIs(t, err, ErrRecordTooLarge)
	got, err := s.Get("vm1")
	require.NoError(t, err, "the existing record stays readable")
	assert.True(t, proto.Equal(before, got), "the existing record stays as it was")

	// And it can still be deleted.
	moveTo(t, s, "vm1", deleting)
	require.NoError(t, s.Delete(ctx, "vm1"))

	// Just below the limit is written and read back.
	rec := wantRecord("edge")
	rec.Spec.Cmdline = strings.Repeat("x", maxRecordSize-1024)
	_, err = s.Create(ctx, rec)
	require.NoError(t, err)
	_, err = s.Get("edge")
	require.NoError(t, err)
}
