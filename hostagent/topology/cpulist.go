package topology

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// MaxCPUs bounds a CPU number (and so a CPU list's length): Linux's
// CONFIG_NR_CPUS goes up to 8192, so a number past this is a broken or
// hostile sysfs, and a range such as "0-4294967295" cannot make the
// parser allocate without end.
const MaxCPUs = 1 << 16

// ParseCPUList parses the kernel's CPU list format (cpulist,
// cpu/online, cpuset.cpus: "0-3,8-11", "" for none, one trailing newline
// allowed) into ascending, distinct CPU numbers. Only what sysfs prints
// is accepted (numbers and ranges, no "0-31:2/8" strides); every number
// is below MaxCPUs. An error wraps ErrMalformed.
func ParseCPUList(s string) ([]int, error) {
	s = strings.TrimSuffix(s, "\n")
	cpus := []int{}
	if s == "" {
		return cpus, nil
	}
	if len(s) > maxAttrBytes {
		return nil, fmt.Errorf("topology: CPU list of %d bytes: %w", len(s), ErrMalformed)
	}
	// Ranges first, merged, then expanded: repeats of a wide range cost
	// no more than one, so no input makes the work pass MaxCPUs numbers.
	var ranges [][2]int
	for part := range strings.SplitSeq(s, ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		first, err := cpuNumber(lo)
		if err != nil {
			return nil, fmt.Errorf("topology: CPU list %q: %w", s, err)
		}
		last := first
		if isRange {
			if last, err = cpuNumber(hi); err != nil {
				return nil, fmt.Errorf("topology: CPU list %q: %w", s, err)
			}
			if last < first {
				return nil, fmt.Errorf("topology: CPU list %q: range %s runs backwards: %w", s, part, ErrMalformed)
			}
		}
		ranges = append(ranges, [2]int{first, last})
	}
	slices.SortFunc(ranges, func(a, b [2]int) int { return a[0] - b[0] })
	next := 0 // the lowest CPU not yet listed
	for _, r := range ranges {
		for c := max(r[0], next); c <= r[1]; c++ {
			cpus = append(cpus, c)
		}
		next = max(next, r[1]+1)
	}
	return cpus, nil
}

// cpuNumber is one decimal CPU number below MaxCPUs (no sign, no space).
func cpuNumber(s string) (int, error) {
	if s == "" || len(s) > 6 || strings.TrimLeft(s, "0123456789") != "" {
		return 0, fmt.Errorf("CPU number %q: %w", s, ErrMalformed)
	}
	n, err := strconv.Atoi(s)
	if err != nil || n >= MaxCPUs {
		return 0, fmt.Errorf("CPU number %q: out of range 0..%d: %w", s, MaxCPUs-1, ErrMalformed)
	}
	return n, nil
}

// FormatCPUList is cpus in the kernel's list format ("0-3,8-11"; "" for
// none), as cpulist shows it and cpuset.cpus takes it. cpus need not be
// sorted; repeats are listed once.
func FormatCPUList(cpus []int) string {
	c := slices.Clone(cpus)
	slices.Sort(c)
	c = slices.Compact(c)
	var b strings.Builder
	for i := 0; i < len(c); {
		j := i
		for j+1 < len(c) && c[j+1] == c[j]+1 {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(c[i]))
		if j > i {
			b.WriteByte('-')
			b.WriteString(strconv.Itoa(c[j]))
		}
		i = j + 1
	}
	return b.String()
}
