package lease

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"time"

	"vmflow/internal/crashpoint"
	"vmflow/internal/errdefs"
	"vmflow/internal/fsx"
)

// DefaultQuarantineAfter is how many failed releases (or resets) of one
// device quarantine it, as hypeman's VF health check does.
const DefaultQuarantineAfter = 2

// QuarantineFile is the quarantine's file in the state dir; QuarantineLock
// the flock every writer (the agent, `devices clear`) takes around its
// read-modify-write.
const (
	QuarantineFile = "gpu-quarantine.json"
	QuarantineLock = "gpu-quarantine.lock"
)

// ErrNotQuarantined: devices clear named a device that is not quarantined.
var ErrNotQuarantined = errdefs.NotFound.New("gpu: device not quarantined")

// Quarantined is why one device is out of placement.
type Quarantined struct {
	Reason string    `json:"reason"`
	Since  time.Time `json:"since"`
	// Instance is the instance whose release failed.
	Instance string `json:"instance_id,omitempty"`
}

// Quarantine is the host's set of GPU devices placement skips: a device
// whose release or reset failed K times (a GPU that may be wedged), kept
// until an operator clears it. It is state, not cache: a file in the state
// dir (QuarantineFile), read-modify-written under QuarantineLock and
// written atomically, so it survives agent restarts and reboots and the
// CLI can change it beside a running agent.
type Quarantine struct {
	path, lock string
	after      int
	now        func() time.Time
}

// NewQuarantine is the quarantine of the state dir; a device is quarantined
// after after failed releases (DefaultQuarantineAfter when 0 or less).
func NewQuarantine(stateDir string, after int, now func() time.Time) *Quarantine {
	if after <= 0 {
		after = DefaultQuarantineAfter
	}
	if now == nil {
		now = time.Now
	}
	return &Quarantine{path: filepath.Join(stateDir, QuarantineFile), lock: filepath.Join(stateDir, QuarantineLock), after: after, now: now}
}

// List reads the quarantine: device id -> why. A missing file is empty.
func (q *Quarantine) List() (map[string]Quarantined, error) {
	if q == nil {
		return map[string]Quarantined{}, nil
	}
	b, err := os.ReadFile(q.path)
	if errors.Is(err, os.ErrNotExist) {
		return map[string]Quarantined{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("gpu quarantine: %w", err)
	}
	m := map[string]Quarantined{}
	if err := json.Unmarshal(b, &m); err != nil {
		// Never guess an empty quarantine: that would hand a wedged GPU out.
		return nil, fmt.Errorf("gpu quarantine %s: %w: %w", q.path, errdefs.Unreadable, err)
	}
	return m, nil
}

// Has reports whether id is quarantined; a quarantine that cannot be read
// counts every device as quarantined (the error says why).
func (q *Quarantine) Has(id string) (bool, error) {
	m, err := q.List()
	if err != nil {
		return true, err
	}
	_, ok := m[id]
	return ok, nil
}

// update applies fn to the quarantine under its lock and writes it back.
func (q *Quarantine) update(ctx context.Context, fn func(map[string]Quarantined) error) error {
	l, err := fsx.LockFile(ctx, q.lock)
	if err != nil {
		return fmt.Errorf("gpu quarantine: %w", err)
	}
	defer func() { _ = l.Release(false) }()
	m, err := q.List()
	if err != nil {
		return err
	}
	if err := fn(m); err != nil {
		return err
	}
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return err
	}
	if err := fsx.WriteFile(q.path, b, nil); err != nil {
		return fmt.Errorf("gpu quarantine: %w", err)
	}
	return nil
}

// Failed records the attempts-th failed release of devices by instance:
// at the threshold they are quarantined with cause as the reason. It
// reports whether it quarantined any.
func (q *Quarantine) Failed(ctx context.Context, instance string, attempts uint32, cause string, devices ...string) (bool, error) {
	if q == nil || int(attempts) < q.after || len(devices) == 0 {
		return false, nil
	}
	crashpoint.Hit(crashpoint.QuarantineDue)
	added := false
	err := q.update(ctx, func(m map[string]Quarantined) error {
		for _, d := range devices {
			if _, ok := m[d]; !ok {
				m[d] = Quarantined{Reason: fmt.Sprintf("release failed %d times: %s", attempts, cause), Since: q.now().UTC(), Instance: instance}
				added = true
			}
		}
		return nil
	})
	if added && err == nil {
		crashpoint.Hit(crashpoint.QuarantineWritten)
	}
	return added, err
}

// Clear puts id back into placement (an operator fixed it) and returns
// what it was quarantined for; ErrNotQuarantined when it was not.
func (q *Quarantine) Clear(ctx context.Context, id string) (Quarantined, error) {
	var was Quarantined
	err := q.update(ctx, func(m map[string]Quarantined) error {
		var ok bool
		if was, ok = m[id]; !ok {
			return fmt.Errorf("%s: %w", id, ErrNotQuarantined)
		}
		delete(m, id)
		return nil
	})
	return was, err
}

// IDs are the quarantined device ids, sorted.
func IDs(m map[string]Quarantined) []string {
	out := make([]string, 0, len(m))
	for id := range m {
		out = append(out, id)
	}
	sort.Strings(out)
	return out
}
