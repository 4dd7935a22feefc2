package store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"google.golang.org/protobuf/encoding/protojson"

	"vmflow/internal/crashpoint"
	"vmflow/internal/errdefs"
	"vmflow/internal/fsx"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// DefaultQEMUUIDRange is the agent's --qemu-uid-range default: 65,536 uids
// nothing hands out. Debian's useradd gives each user a subordinate range
// of SUB_UID_COUNT (65536) uids from SUB_UID_MIN (100000) up to SUB_UID_MAX
// (600100000), so a range below 600100000 can be some user's rootless
// containers' uids; systemd-nspawn picks container ranges from 524288 to
// 1879048191 and keeps 2147352576 and up (the foreign range, and the
// values a signed 32-bit uid cannot hold). 1879048192-2147352575 is
// systemd's unused space: the default lies there. Agents sharing a machine
// need disjoint ranges; CheckUIDRange refuses one that /etc hands out.
var DefaultQEMUUIDRange = UIDRange{First: 1_900_000_000, Last: 1_900_065_535}

// ErrUIDRangeTaken: the configured --qemu-uid-range overlaps uids the host
// gives to someone else (an account, a group, a subordinate range in
// /etc/subuid or /etc/subgid): a process of theirs could run as a VM's uid.
var ErrUIDRangeTaken = errdefs.Misconfigured.New("qemu uid range overlaps uids the host hands out")

// ErrNoFreeUID: every uid of the range is in a record or held by a process.
var ErrNoFreeUID = errdefs.NoUID.New("no free qemu uid in the range")

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

// ParseUIDRange reads "FIRST-LAST", refusing uid 0, 4294967295 (setresuid's
// "no change") and 65534 (nobody, shared by many services).
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

// AssignQEMUUID gives the locked instance a uid of its own from r (keeping a
// free current one) and writes it with steps in one write, under the host-wide
// uid lock (invariant 15). The caller knows no QEMU of it runs. Can't tell is
// taken. inUse is every uid some process holds (a /proc scan): without the
// index it runs at every assignment; with it (OpenIndex), only at the seed,
// and again only for a uid a process held then that its instance would keep.
func (l *Locked) AssignQEMUUID(ctx context.Context, r UIDRange, inUse func(context.Context) (map[uint32]bool, error),
	steps ...Step) (*vmflowv1.InstanceRecord, error) {
	if err := l.held(); err != nil {
		return nil, err
	}
	if r.First == 0 || r.First > r.Last {
		return nil, errdefs.Misconfigured.Errorf("assign qemu uid to %s: invalid range %s", l.id, r)
	}
	hl, err := lockFile(ctx, filepath.Join(l.s.root, uidLockFile))
	if err != nil {
		return nil, fmt.Errorf("assign qemu uid to %s: %w", l.id, err)
	}
	defer hl.Release(false)
	var rec *vmflowv1.InstanceRecord
	err = l.s.guardWrite(func() (err error) {
		rec, err = l.assignUID(ctx, r, inUse, steps)
		return err
	})
	return rec, err
}

// assignUID is AssignQEMUUID under the uid lock.
func (l *Locked) assignUID(ctx context.Context, r UIDRange, inUse func(context.Context) (map[uint32]bool, error),
	steps []Step) (*vmflowv1.InstanceRecord, error) {
	cur, err := l.Get()
	if err != nil {
		return nil, fmt.Errorf("assign qemu uid: %w", err)
	}
	// Who holds each uid: the index's, or read from disk now (the records,
	// the ledger, each instance directory's owners, every process).
	var holders uidHolders
	unlock := func() {}
	if ix := l.s.ix.Load(); ix != nil {
		ix.mu.Lock()
		holders, unlock = ix.uids, ix.mu.Unlock
	} else if _, holders, _, err = l.s.readHolders(ctx, inUse); err != nil {
		return nil, fmt.Errorf("assign qemu uid to %s: %w", l.id, err)
	}
	uid, err := l.chooseUID(ctx, r, cur.GetQemuUid(), holders, inUse)
	if err == nil {
		// Held from here on, also if a write below fails: the index may
		// count more uids taken than the disk, never fewer.
		holders.assigned(uid, l.id)
	}
	unlock()
	if err != nil {
		return nil, err
	}
	// The ledger first: from here the uid stays taken even if the record
	// becomes unreadable. A ledger that already says so is not written again.
	path := filepath.Join(l.s.uids, strconv.FormatUint(uint64(uid), 10))
	if b, err := os.ReadFile(path); err != nil || strings.TrimSpace(string(b)) != l.id {
		if err := l.s.writeUID(uid, l.id); err != nil {
			return nil, fmt.Errorf("assign qemu uid %d to %s: %w", uid, l.id, err)
		}
	}
	rec, err := l.update(func(rec *vmflowv1.InstanceRecord) error {
		rec.QemuUid = uid
		return applySteps(steps)(rec)
	}, true)
	if err != nil {
		return nil, fmt.Errorf("assign qemu uid %d: %w", uid, err)
	}
	if old := cur.GetQemuUid(); old != 0 && old != uid {
		// The old uid stays held by this instance in the index until its
		// delete (its files may still be that uid's); the ledger forgets it.
		l.s.dropUID(old, l.id)
	}
	return rec, nil
}

// chooseUID picks instance l's uid from r: cur while free, else the
// lowest free one.
func (l *Locked) chooseUID(ctx context.Context, r UIDRange, cur uint32, holders uidHolders,
	inUse func(context.Context) (map[uint32]bool, error)) (uint32, error) {
	var busy map[uint32]bool
	busyNow := func() (map[uint32]bool, error) {
		var err error
		if busy == nil {
			busy, err = inUse(ctx)
		}
		return busy, err
	}
	// Free only when no other instance holds it (its record, or its files,
	// or a quarantined record's ledger entry), and no process (invariant
	// 2's "can't tell is taken", for uids). A restart keeps its uid. No
	// QEMU of this instance runs, so a process holding the uid is a
	// stranger, and the uid is given up.
	if cur != 0 && r.Contains(cur) {
		ok, err := holders.freeFor(cur, l.id, busyNow)
		if err != nil {
			return 0, fmt.Errorf("assign qemu uid to %s: %w", l.id, err)
		}
		if ok {
			return cur, nil
		}
	}
	for u := r.First; ; u++ {
		ok, err := holders.freeFor(u, l.id, busyNow)
		if err != nil {
			return 0, fmt.Errorf("assign qemu uid to %s: %w", l.id, err)
		}
		if ok {
			return u, nil
		}
		if u == r.Last {
			break
		}
	}
	return 0, fmt.Errorf("assign qemu uid to %s: %w: %s (%d held by records, the files of their instances or processes)",
		l.id, ErrNoFreeUID, r, holders.count())
}

// uidsDir is the uid ledger's directory in the state dir: one file per
// assigned uid, named by the uid, holding the instance id.
const uidsDir = "qemu-uids"

// readUIDLedger reads the ledger (under the uid lock): uid -> instance id, ""
// for an entry that is not an id (it holds its uid all the same).
func (s *Store) readUIDLedger() (map[uint32]string, error) {
	// Under the uid lock no other ledger write is in flight: a temp file
	// is a crashed writer's.
	if err := fsx.RemoveStaleTemps(s.uids); err != nil {
		return nil, fmt.Errorf("read uid ledger: %w", err)
	}
	ents, err := os.ReadDir(s.uids)
	if err != nil {
		return nil, fmt.Errorf("read uid ledger: %w", err)
	}
	out := map[uint32]string{}
	for _, e := range ents {
		u, err := strconv.ParseUint(e.Name(), 10, 32)
		if err != nil || u == 0 {
			continue // a writer's temp file, or not the ledger's
		}
		b, err := os.ReadFile(filepath.Join(s.uids, e.Name()))
		if err != nil {
			return nil, fmt.Errorf("read uid ledger: %w", err)
		}
		id := strings.TrimSpace(string(b))
		if ValidateID(id) != nil {
			id = ""
		}
		out[uint32(u)] = id
	}
	return out, nil
}

// writeUID records durably that uid is id's.
func (s *Store) writeUID(uid uint32, id string) error {
	// Atomic and durable as a record, through fsx directly: the record
	// writes' crash points count record writes only.
	path := filepath.Join(s.uids, strconv.FormatUint(uint64(uid), 10))
	if err := fsx.WriteFile(path, []byte(id+"\n"), nil); err != nil {
		return fmt.Errorf("write uid ledger: %w", err)
	}
	crashpoint.Hit(crashpoint.StoreUIDLedgerWritten)
	return nil
}

// dropUID removes uid's ledger entry if it still names id; best effort, as the
// next assignment removes a stale one.
func (s *Store) dropUID(uid uint32, id string) {
	path := filepath.Join(s.uids, strconv.FormatUint(uint64(uid), 10))
	b, err := os.ReadFile(path)
	if err != nil || strings.TrimSpace(string(b)) != id {
		return
	}
	_ = os.Remove(path)
}

// lenientUID is the qemu_uid of what still parses of the unreadable record at
// path; 0 when nothing does.
func lenientUID(path string) uint32 {
	f, err := os.Open(path)
	if err != nil {
		return 0
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxRecordSize))
	if err != nil {
		return 0
	}
	rec := &vmflowv1.InstanceRecord{}
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true, AllowPartial: true}).Unmarshal(b, rec); err != nil {
		return 0
	}
	return rec.GetQemuUid()
}

// OwnersIn returns the uids and gids owning dir and its entries, root's
// excepted; a missing dir owns nothing, an unreadable one is an error.
func OwnersIn(dir string) (map[uint32]bool, error) {
	out := map[uint32]bool{}
	add := func(fi fs.FileInfo) {
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			for _, u := range []uint32{st.Uid, st.Gid} {
				if u != 0 {
					out[u] = true
				}
			}
		}
	}
	fi, err := os.Lstat(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return out, nil
	}
	if err != nil {
		return nil, fmt.Errorf("owners of %s: %w", dir, err)
	}
	add(fi)
	ents, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return out, nil
		}
		return nil, fmt.Errorf("owners of %s: %w", dir, err)
	}
	for _, e := range ents {
		fi, err := e.Info()
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("owners of %s: %w", dir, err)
		}
		add(fi)
	}
	return out, nil
}

// CheckUIDRange returns nil when the host's passwd, group, subuid and subgid
// under etc hand out no uid of r, else ErrUIDRangeTaken naming every overlap.
// A missing file hands out nothing; an unreadable one is an error.
func CheckUIDRange(r UIDRange, etc string) error {
	var found []string
	for _, f := range []struct {
		name string
		sub  bool // name:first:count, else name:x:id:...
	}{{"passwd", false}, {"group", false}, {"subuid", true}, {"subgid", true}} {
		path := filepath.Join(etc, f.name)
		b, err := os.ReadFile(path)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return fmt.Errorf("check qemu uid range %s: %w", r, err)
		}
		for n, line := range strings.Split(string(b), "\n") {
			fields := strings.Split(strings.TrimSpace(line), ":")
			var first, count uint64 = 0, 1
			var err error
			switch {
			case f.sub && len(fields) == 3:
				first, err = strconv.ParseUint(fields[1], 10, 32)
				if err == nil {
					count, err = strconv.ParseUint(fields[2], 10, 32)
				}
			case !f.sub && len(fields) >= 3:
				first, err = strconv.ParseUint(fields[2], 10, 32)
			default:
				continue // blank, a comment, or not this file's form
			}
			if err != nil || count == 0 {
				continue
			}
			if first <= uint64(r.Last) && first+count-1 >= uint64(r.First) {
				found = append(found, fmt.Sprintf("%s line %d (%s)", path, n+1, strings.TrimSpace(line)))
			}
		}
	}
	if len(found) > 0 {
		return fmt.Errorf("%w: %s overlaps %s; give the agent a --qemu-uid-range nothing hands out (the default is %s)",
			ErrUIDRangeTaken, r, strings.Join(found, ", "), DefaultQEMUUIDRange)
	}
	return nil
}
