package lease

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"time"

	"vmflow/internal/crashpoint"
	"vmflow/internal/errdefs"
	"vmflow/internal/fsx"
)

// DefaultQuarantineAfter is how many failed releases (or resets) of one
// device quarantine it, as hypeman's VF health check does.
const DefaultQuarantineAfter = 2

// QuarantineFile is the quarantine's file in the state dir; StrikesFile
// the count of each device's failures since its last success;
// QuarantineLock the flock every writer (the agent, `devices clear`) takes
// around its read-modify-write of either.
const (
	QuarantineFile = "gpu-quarantine.json"
	StrikesFile    = "gpu-strikes.json"
	QuarantineLock = "gpu-quarantine.lock"
)

var (
	// ErrNotQuarantined: devices clear named a device that is not quarantined.
	ErrNotQuarantined = errdefs.NotFound.New("gpu: device not quarantined")
	// ErrQuarantineUnreadable: the quarantine file cannot be read (torn,
	// not JSON, null): every device it may name counts as quarantined
	// until `devices clear --reset` sets it aside.
	ErrQuarantineUnreadable = errdefs.Unreadable.New("gpu: quarantine unreadable")
	// ErrQuarantineReadable: devices clear --reset on a quarantine that
	// reads fine (nothing to mend; clear devices by id).
	ErrQuarantineReadable = errdefs.InvalidInput.New("gpu: quarantine readable")
)

// Quarantined is why one device is out of placement.
type Quarantined struct {
	Reason string    `json:"reason"`
	Since  time.Time `json:"since"`
	// Instance is the instance whose release failed.
	Instance string `json:"instance_id,omitempty"`
}

// Strike is one device's run of failures: failed binds, unbinds, resets
// and rebinds, never a refusal (the VM may live, a process holds the node)
// nor a wait on a write still in flight, which are not the device's fault.
type Strike struct {
	Count    int       `json:"count"`
	Last     string    `json:"last_error"`
	At       time.Time `json:"at"`
	Instance string    `json:"instance_id,omitempty"`
	// Card is the card that failed, where the device is a card a reboot
	// may swap under the same id (a whole GPU at its PCI address:
	// vendor:device and serial number); "" where not known.
	Card string `json:"card,omitempty"`
}

// Quarantine is the host's set of GPU devices placement skips: a device
// whose release or reset failed K times (a GPU that may be wedged), kept
// until an operator clears it. It is state, not cache: a file in the state
// dir (QuarantineFile), read-modify-written under QuarantineLock and
// written atomically, so it survives agent restarts and reboots and the
// CLI can change it beside a running agent.
type Quarantine struct {
	path, strikes, lock string
	after               int
	now                 func() time.Time
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
	return &Quarantine{path: filepath.Join(stateDir, QuarantineFile), strikes: filepath.Join(stateDir, StrikesFile),
		lock: filepath.Join(stateDir, QuarantineLock), after: after, now: now}
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
	var m map[string]Quarantined
	if err := json.Unmarshal(b, &m); err != nil {
		// Never guess an empty quarantine: that would hand a wedged GPU out.
		return nil, fmt.Errorf("gpu quarantine %s: %w: %w", q.path, ErrQuarantineUnreadable, err)
	}
	if m == nil {
		// "null" decodes without error to no map at all: it names no
		// device, but it is no quarantine vmflow wrote, so it may have
		// lost some; as unreadable as a torn file.
		return nil, fmt.Errorf("gpu quarantine %s: %w: it holds null", q.path, ErrQuarantineUnreadable)
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

// locked runs fn under the quarantine's lock.
func (q *Quarantine) locked(ctx context.Context, fn func() error) error {
	l, err := fsx.LockFile(ctx, q.lock)
	if err != nil {
		return fmt.Errorf("gpu quarantine: %w", err)
	}
	defer func() { _ = l.Release(false) }()
	return fn()
}

// update applies fn to the quarantine under its lock and writes it back;
// an unreadable quarantine is not written over.
func (q *Quarantine) update(ctx context.Context, fn func(map[string]Quarantined) error) error {
	return q.locked(ctx, func() error {
		m, err := q.List()
		if err != nil {
			return err
		}
		if err := fn(m); err != nil {
			return err
		}
		return writeJSON(q.path, m)
	})
}

// writeJSON writes v to path atomically (temp file, fsync, rename).
func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	if err := fsx.WriteFile(path, b, nil); err != nil {
		return fmt.Errorf("gpu quarantine: %w", err)
	}
	return nil
}

// Strike counts one failure of each of devices (their bind, unbind,
// reset or rebind failed: the caller decides, never on a refusal or a
// wait) by instance, and quarantines each whose count reaches the
// threshold, with cause as the reason. It returns the devices it
// quarantined now. The count is written before the quarantine, so a kill
// between the two costs no count: the next failure finds it at or past
// the threshold (crash points gpu.quarantine.due and .written).
func (q *Quarantine) Strike(ctx context.Context, instance, cause string, devices ...string) ([]string, error) {
	return q.strike(ctx, false, instance, cause, devices, nil)
}

// StrikeOut counts one failure of each of devices and quarantines them at
// once, whatever their count: a failure that says the device may carry a
// tenant's state to the next (its reset, or the operator's scrub, failed)
// is not worth a second try on someone's VM.
func (q *Quarantine) StrikeOut(ctx context.Context, instance, cause string, devices ...string) ([]string, error) {
	return q.strike(ctx, true, instance, cause, devices, nil)
}

// strike is Strike (StrikeOut when atOnce) with the card each device is
// (cards[i] for devices[i], "" where not known): a device whose count was
// run up by another card (swapped in at its address by a reboot) starts
// its count over, as the card there now is a new device and inherits no
// failure.
func (q *Quarantine) strike(ctx context.Context, atOnce bool, instance, cause string, devices, cards []string) ([]string, error) {
	if q == nil || len(devices) == 0 {
		return nil, nil
	}
	var added []string
	err := q.locked(ctx, func() error {
		strikes := q.readStrikes()
		var due []string
		for i, d := range devices {
			st := strikes[d]
			if i < len(cards) && cards[i] != "" {
				if st.Card != "" && st.Card != cards[i] {
					st = Strike{}
				}
				st.Card = cards[i]
			}
			st.Count++
			st.Last, st.At, st.Instance = cause, q.now().UTC(), instance
			strikes[d] = st
			if st.Count >= q.after || atOnce {
				due = append(due, d)
			}
		}
		if err := writeJSON(q.strikes, strikes); err != nil {
			return err
		}
		if len(due) == 0 {
			return nil
		}
		crashpoint.Hit(crashpoint.QuarantineDue)
		m, err := q.List()
		if err != nil {
			return err
		}
		for _, d := range due {
			if _, ok := m[d]; !ok {
				why := fmt.Sprintf("failed %d times: %s", strikes[d].Count, cause)
				if atOnce {
					why = "quarantined at its first such failure: " + cause
				}
				m[d] = Quarantined{Reason: why, Since: q.now().UTC(), Instance: instance}
				added = append(added, d)
			}
		}
		if len(added) == 0 {
			return nil
		}
		if err := writeJSON(q.path, m); err != nil {
			return err
		}
		crashpoint.Hit(crashpoint.QuarantineWritten)
		return nil
	})
	return added, err
}

// Succeeded ends the run of failures of each of devices (a bind or a
// release of it went through): the threshold counts failures in a row.
// It writes only when one of them had a count.
func (q *Quarantine) Succeeded(ctx context.Context, devices ...string) error {
	if q == nil || len(devices) == 0 {
		return nil
	}
	strikes := q.readStrikes()
	if !slices.ContainsFunc(devices, func(d string) bool { _, ok := strikes[d]; return ok }) {
		return nil
	}
	return q.locked(ctx, func() error {
		strikes := q.readStrikes()
		for _, d := range devices {
			delete(strikes, d)
		}
		return writeJSON(q.strikes, strikes)
	})
}

// Strikes reads every device's run of failures. An unreadable strikes
// file reads as empty: it only delays a quarantine by up to K failures,
// it never hands a quarantined device out.
func (q *Quarantine) Strikes() map[string]Strike {
	if q == nil {
		return map[string]Strike{}
	}
	return q.readStrikes()
}

func (q *Quarantine) readStrikes() map[string]Strike {
	var m map[string]Strike
	if b, err := os.ReadFile(q.strikes); err == nil {
		_ = json.Unmarshal(b, &m) // torn: start the counts over
	}
	if m == nil {
		m = map[string]Strike{}
	}
	return m
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
	if err == nil {
		// A cleared device starts its count over.
		err = q.Succeeded(ctx, id)
	}
	return was, err
}

// Reset sets an unreadable quarantine aside (renamed to
// <file>.unreadable-<time>, kept for the operator) and starts an empty one:
// `devices clear --reset`, the operator's decision that none of the
// devices it may have named stays out. A readable quarantine is left as
// it is (ErrInvalid-like refusal: clear its devices one by one).
func (q *Quarantine) Reset(ctx context.Context) (aside string, err error) {
	err = q.locked(ctx, func() error {
		if _, lerr := q.List(); lerr == nil {
			return fmt.Errorf("gpu quarantine %s is readable: clear its devices by id: %w", q.path, ErrQuarantineReadable)
		} else if !errors.Is(lerr, ErrQuarantineUnreadable) {
			return lerr
		}
		aside = fmt.Sprintf("%s.unreadable-%s", q.path, q.now().UTC().Format("20060102T150405Z"))
		if err := os.Rename(q.path, aside); err != nil {
			return fmt.Errorf("gpu quarantine: set aside: %w", err)
		}
		return writeJSON(q.path, map[string]Quarantined{})
	})
	return aside, err
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
