package proc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
)

// ReadUIDs returns pid's real, effective, saved and filesystem uids from
// status, which takes no mmap lock (no hang on VFIO teardown); ErrNotFound.
func ReadUIDs(pid int) ([4]uint32, error) {
	b, err := os.ReadFile(procRoot + "/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		if gone(err) {
			return [4]uint32{}, fmt.Errorf("pid %d: %w", pid, ErrNotFound)
		}
		return [4]uint32{}, fmt.Errorf("read status of pid %d: %w", pid, err)
	}
	return parseUIDs(pid, b)
}

func parseUIDs(pid int, status []byte) ([4]uint32, error) {
	var out [4]uint32
	for line := range bytes.SplitSeq(status, []byte{'\n'}) {
		rest, ok := bytes.CutPrefix(line, []byte("Uid:"))
		if !ok {
			continue
		}
		f := bytes.Fields(rest)
		if len(f) != 4 {
			return out, fmt.Errorf("pid %d: status Uid line %q: want 4 fields", pid, line)
		}
		for i, s := range f {
			n, err := strconv.ParseUint(string(s), 10, 32)
			if err != nil {
				return out, fmt.Errorf("pid %d: status Uid line %q: %w", pid, line, err)
			}
			out[i] = uint32(n)
		}
		return out, nil
	}
	return out, fmt.Errorf("pid %d: status has no Uid line", pid)
}

// UIDsInUse returns every uid some process holds now; an unreadable status
// fails the scan, as its uid is unknown and callers reuse only free uids.
func UIDsInUse(ctx context.Context) (map[uint32]bool, error) {
	used := map[uint32]bool{}
	err := eachPID(ctx, func(pid int) error {
		ids, err := ReadUIDs(pid)
		if errors.Is(err, ErrNotFound) {
			return nil
		}
		for _, u := range ids {
			used[u] = true
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("scan processes: %w", err)
	}
	return used, nil
}
