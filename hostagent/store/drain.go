package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"vmflow/internal/errdefs"
	"vmflow/internal/fsx"
)

// The drain marker: while <state-dir>/draining exists the host grants no
// new VM (the capacity ledger's Reserve refuses, lease.CapacityConfig
// Draining), and its running VMs, their restarts and their deletes go on.
// It is host state, like the quarantine: written and removed by
// `vmflow-hostagent drain` / `undrain` beside a running agent, under the
// admission lock, so a grant either saw the marker or was written before
// it (never half of each), and kept across agent restarts and reboots.
const drainFile = "draining"

// ErrDraining: the host is draining and grants no new VM. A refusal that
// writes nothing; placement moves on to the next host.
var ErrDraining = errdefs.Draining.New("host draining")

// Drain is the marker's content.
type Drain struct {
	// Reason is the operator's, shown by the fleet view and the refusal.
	Reason string    `json:"reason"`
	Since  time.Time `json:"since"`
}

// MaxDrainReason bounds a drain's reason (it travels in every refusal and
// in the host's published view).
const MaxDrainReason = 200

func (s *Store) drainPath() string { return filepath.Join(s.root, drainFile) }

// Drain writes the marker with reason (kept as is when the host already
// drains: Since stays the first drain's). It returns the marker in place.
func (s *Store) Drain(ctx context.Context, reason string, now time.Time) (Drain, error) {
	if reason == "" {
		return Drain{}, errdefs.InvalidInput.Errorf("drain: a reason is required")
	}
	if len(reason) > MaxDrainReason {
		return Drain{}, errdefs.InvalidInput.Errorf("drain: the reason is %d bytes, at most %d", len(reason), MaxDrainReason)
	}
	var d Drain
	err := s.Admitting(ctx, func() error {
		have, on, err := s.Draining()
		if err == nil && on {
			d = have
			return nil
		}
		d = Drain{Reason: reason, Since: now.UTC()}
		data, err := json.Marshal(d)
		if err != nil {
			return err
		}
		return fsx.WriteFile(s.drainPath(), data, nil)
	})
	if err != nil {
		return Drain{}, fmt.Errorf("drain: %w", err)
	}
	return d, nil
}

// Undrain removes the marker; it reports whether there was one.
func (s *Store) Undrain(ctx context.Context) (bool, error) {
	var was bool
	err := s.Admitting(ctx, func() error {
		err := os.Remove(s.drainPath())
		switch {
		case errors.Is(err, fs.ErrNotExist):
			return nil
		case err != nil:
			return err
		}
		was = true
		return fsx.SyncDir(s.root)
	})
	if err != nil {
		return false, fmt.Errorf("undrain: %w", err)
	}
	return was, nil
}

// Draining reads the marker: on is whether the host drains. A marker that
// cannot be parsed drains (fail closed) with a reason that says so; err
// is for a marker that cannot be read at all.
func (s *Store) Draining() (d Drain, on bool, err error) {
	data, err := os.ReadFile(s.drainPath())
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return Drain{}, false, nil
	case err != nil:
		return Drain{}, true, fmt.Errorf("read the drain marker: %w", err)
	}
	if err := json.Unmarshal(data, &d); err != nil || d.Reason == "" {
		return Drain{Reason: "drain marker " + s.drainPath() + " unreadable: remove it with undrain"}, true, nil
	}
	return d, true, nil
}

// RefuseWhileDraining is the capacity ledger's Draining hook: ErrDraining
// with the reason while the host drains (or cannot tell), else nil.
func (s *Store) RefuseWhileDraining() error {
	d, on, err := s.Draining()
	switch {
	case err != nil:
		return fmt.Errorf("%w: %w", ErrDraining, err)
	case on:
		return fmt.Errorf("%w since %s: %s", ErrDraining, d.Since.Format(time.RFC3339), d.Reason)
	}
	return nil
}
