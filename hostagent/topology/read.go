package topology

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"vmflow/internal/errdefs"
)

// ErrMalformed: a sysfs or procfs file does not hold what the kernel
// writes there (not a number, a range backwards, a line missing, too
// large, too many entries): a broken or hostile tree, or a kernel this
// package does not know. Retried: sysfs may answer right the next time.
var ErrMalformed = errdefs.Unavailable.New("topology: malformed sysfs")

// Bounds on what one read may take, far past what a kernel writes: a
// sysfs attribute is at most a page, /proc/meminfo a few KiB, a machine
// has at most MAX_NUMNODES (1024) nodes and a few hugepage sizes.
const (
	maxAttrBytes   = 64 << 10
	maxDirEntries  = 4096
	maxNodeID      = 1023
	maxHugepageDir = 64
)

// readAttr reads a small file whole, at most maxAttrBytes: a file that
// is larger is ErrMalformed rather than read on (a FUSE tree may answer
// without end). O_NONBLOCK is not needed: sysfs and procfs reads never
// wait.
func readAttr(path string) (string, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if errors.Is(err, syscall.ELOOP) {
		// The last element is a link: sysfs attributes are files.
		return "", fmt.Errorf("topology: %s is a symlink: %w", path, ErrMalformed)
	}
	if err != nil {
		return "", err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxAttrBytes+1))
	if err != nil {
		return "", err
	}
	if len(b) > maxAttrBytes {
		return "", fmt.Errorf("topology: %s holds more than %d bytes: %w", path, maxAttrBytes, ErrMalformed)
	}
	return string(b), nil
}

// readUint reads a file holding one unsigned decimal number.
func readUint(path string) (uint64, error) {
	s, err := readAttr(path)
	if err != nil {
		return 0, err
	}
	n, err := strconv.ParseUint(strings.TrimSpace(s), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("topology: %s: %w: %w", path, ErrMalformed, err)
	}
	return n, nil
}

// readNames lists the names in dir, at most maxDirEntries of them: more
// is ErrMalformed (no kernel has that many nodes or page sizes).
func readNames(dir string) ([]string, error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var names []string
	for {
		batch, err := f.Readdirnames(256)
		names = append(names, batch...)
		if len(names) > maxDirEntries {
			return nil, fmt.Errorf("topology: %s has more than %d entries: %w", dir, maxDirEntries, ErrMalformed)
		}
		if errors.Is(err, io.EOF) {
			return names, nil
		}
		if err != nil {
			return nil, fmt.Errorf("topology: list %s: %w", dir, err)
		}
	}
}

// meminfoKB returns the kB values of the given keys in a meminfo file
// (/proc/meminfo's "MemTotal:       24683772 kB", or a node's "Node 0
// MemTotal: ..." with prefix "Node 0 "). A key missing is ErrMalformed.
func meminfoKB(path, prefix string, keys ...string) (map[string]uint64, error) {
	s, err := readAttr(path)
	if err != nil {
		return nil, err
	}
	want := make(map[string]bool, len(keys))
	for _, k := range keys {
		want[k] = true
	}
	got := make(map[string]uint64, len(keys))
	for line := range strings.SplitSeq(s, "\n") {
		rest, ok := strings.CutPrefix(line, prefix)
		if !ok {
			continue
		}
		key, val, ok := strings.Cut(rest, ":")
		if !ok || !want[key] {
			continue
		}
		f := strings.Fields(val)
		if len(f) != 2 || f[1] != "kB" {
			return nil, fmt.Errorf("topology: %s: %s%s: %q is not \"N kB\": %w", path, prefix, key, strings.TrimSpace(val), ErrMalformed)
		}
		n, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil || n > 1<<50 { // 1 EiB in kB: no machine has more
			return nil, fmt.Errorf("topology: %s: %s%s %q: %w", path, prefix, key, f[0], ErrMalformed)
		}
		got[key] = n
	}
	for _, k := range keys {
		if _, ok := got[k]; !ok {
			return nil, fmt.Errorf("topology: %s has no %s%s line: %w", path, prefix, k, ErrMalformed)
		}
	}
	return got, nil
}

// readHugepages reads the pools in dir (a node's hugepages/ or
// kernel/mm/hugepages/): one hugepages-<size>kB folder per page size the
// machine has. A missing dir is no pools (hugetlbfs not built in).
func readHugepages(dir string) (map[uint64]HugepagePool, error) {
	pools := map[uint64]HugepagePool{}
	names, err := readNames(dir)
	if errors.Is(err, os.ErrNotExist) {
		return pools, nil
	}
	if err != nil {
		return nil, err
	}
	for _, name := range names {
		kb, ok := strings.CutPrefix(name, "hugepages-")
		if !ok {
			continue
		}
		kb, ok = strings.CutSuffix(kb, "kB")
		size, err := strconv.ParseUint(kb, 10, 32)
		if !ok || err != nil || size == 0 {
			return nil, fmt.Errorf("topology: %s: hugepage folder %q: %w", dir, name, ErrMalformed)
		}
		if len(pools) == maxHugepageDir {
			return nil, fmt.Errorf("topology: %s: more than %d page sizes: %w", dir, maxHugepageDir, ErrMalformed)
		}
		var p HugepagePool
		if p.Total, err = readUint(filepath.Join(dir, name, "nr_hugepages")); err != nil {
			return nil, fmt.Errorf("topology: hugepages %s: %w", name, err)
		}
		if p.Free, err = readUint(filepath.Join(dir, name, "free_hugepages")); err != nil {
			return nil, fmt.Errorf("topology: hugepages %s: %w", name, err)
		}
		// free_hugepages counts surplus pages too, which the kernel frees
		// as soon as they are unused: the pool's own free pages are at
		// most its size.
		p.Free = min(p.Free, p.Total)
		pools[size<<10] = p
	}
	return pools, nil
}
