package store

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// DefaultQEMUUIDRange is the agent's --qemu-uid-range default: 65,536 uids
// no distribution gives to users or services (useradd's SUB_UID_MIN is
// 100000 with 65536 per user, so a host with two or more users holding
// subordinate ranges overlaps it: give such a host another range). Agents
// sharing a machine need disjoint ranges.
var DefaultQEMUUIDRange = UIDRange{First: 200000, Last: 265535}

// ErrNoFreeUID: every uid of the range is in a record or held by a process.
var ErrNoFreeUID = errors.New("no free qemu uid in the range")

// uidLockFile is the host-wide lock AssignQEMUUID takes, in the state dir.
const uidLockFile = "qemu-uid.lock"

// UIDRange is an inclusive range of uids, First <= Last, neither 0.
type UIDRange struct {
	First, Last uint32
}

// String is the flag form, "FIRST-LAST".
func (r UIDRange) String() string { return fmt.Sprintf("%d-%d", r.First, r.Last) }

// Contains reports whether uid lies in r.
func (r UIDRange) Contains(uid uint32) bool { return uid >= r.First && uid <= r.Last }

// ParseUIDRange reads "FIRST-LAST". uid 0 (root) and 4294967295 ((uid_t)-1,
// "no change" to setresuid) are refused, and so is 65534 (nobody: shared by
// every service that runs as it, so never a uid of one VM's own).
func ParseUIDRange(s string) (UIDRange, error) {
	a, b, ok := strings.Cut(s, "-")
	if !ok {
		return UIDRange{}, fmt.Errorf("uid range %q: want FIRST-LAST", s)
	}
	first, err1 := strconv.ParseUint(a, 10, 32)
	last, err2 := strconv.ParseUint(b, 10, 32)
	if err := errors.Join(err1, err2); err != nil {
		return UIDRange{}, fmt.Errorf("uid range %q: %w", s, err)
	}
	r := UIDRange{First: uint32(first), Last: uint32(last)}
	switch {
	case r.First == 0:
		return UIDRange{}, fmt.Errorf("uid range %q: uid 0 is root", s)
	case r.First > r.Last:
		return UIDRange{}, fmt.Errorf("uid range %q: first is above last", s)
	case r.Last == 1<<32-1:
		return UIDRange{}, fmt.Errorf("uid range %q: 4294967295 is (uid_t)-1", s)
	case r.Contains(65534):
		return UIDRange{}, fmt.Errorf("uid range %q: holds 65534 (nobody)", s)
	}
	return r, nil
}

// AssignQEMUUID gives the locked instance a QEMU uid of its own from r and
// writes it into the record together with fn's changes (fn may be nil), in
// one write. It runs under the store's host-wide uid lock, so two
// instances assigning at once never get one uid: the uid chosen appears in
// no other readable record and is held by no process (inUse, a scan of
// /proc taken under the lock). The record's current uid is kept when it
// still passes those checks and lies in r (a restart keeps its uid);
// otherwise the lowest free uid of r is taken. The caller must know no
// QEMU of the instance runs (a launch): a process holding its own uid is
// then a stranger, and the uid is given up.
//
// A record that cannot be read is not counted: its uid is unknown. Its
// QEMU, if one runs, holds its uid and inUse sees it; one that does not run
// gets a new uid at its next launch if its old one was taken meanwhile.
func (l *Locked) AssignQEMUUID(ctx context.Context, r UIDRange, inUse func(context.Context) (map[uint32]bool, error),
	fn func(*vmflowv1.InstanceRecord) error) (*vmflowv1.InstanceRecord, error) {
	if err := l.held(); err != nil {
		return nil, err
	}
	if r.First == 0 || r.First > r.Last {
		return nil, fmt.Errorf("assign qemu uid to %s: invalid range %s", l.id, r)
	}
	hl, err := lockFile(ctx, filepath.Join(l.s.root, uidLockFile))
	if err != nil {
		return nil, fmt.Errorf("assign qemu uid to %s: %w", l.id, err)
	}
	defer hl.Release(false)

	recs, err := l.s.List()
	if _, listed := Unreadable(err); !listed {
		return nil, fmt.Errorf("assign qemu uid to %s: %w", l.id, err)
	}
	taken := map[uint32]string{}
	var cur *vmflowv1.InstanceRecord // this instance's, read by List under l's lock
	for _, rec := range recs {
		switch u := rec.GetQemuUid(); {
		case rec.GetId() == l.id:
			cur = rec
		case u != 0:
			taken[u] = rec.GetId()
		}
	}
	busy, err := inUse(ctx)
	if err != nil {
		return nil, fmt.Errorf("assign qemu uid to %s: %w", l.id, err)
	}
	if cur == nil {
		// Not listed: unreadable (or gone); Get says which.
		if cur, err = l.Get(); err != nil {
			return nil, fmt.Errorf("assign qemu uid: %w", err)
		}
	}
	free := func(u uint32) bool { _, t := taken[u]; return !t && !busy[u] }
	uid := cur.GetQemuUid()
	if uid == 0 || !r.Contains(uid) || !free(uid) {
		uid = 0
		for u := r.First; ; u++ {
			if free(u) {
				uid = u
				break
			}
			if u == r.Last {
				break
			}
		}
	}
	if uid == 0 {
		return nil, fmt.Errorf("assign qemu uid to %s: %w: %s (%d in records, the rest held by processes)",
			l.id, ErrNoFreeUID, r, len(taken))
	}
	rec, err := l.update(func(rec *vmflowv1.InstanceRecord) error {
		rec.QemuUid = uid
		if fn != nil {
			return fn(rec)
		}
		return nil
	}, true)
	if err != nil {
		return nil, fmt.Errorf("assign qemu uid %d: %w", uid, err)
	}
	return rec, nil
}
