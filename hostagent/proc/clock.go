package proc

import (
	"fmt"
	"time"

	"golang.org/x/sys/unix"
)

// SinceBoot is CLOCK_BOOTTIME now: the time since this boot, suspend
// included. Unlike the wall clock, nothing steps it (NTP, an operator's
// date, a VM's clock sync); unlike CLOCK_MONOTONIC, it keeps counting
// while the host is suspended. Compared only with values of the same boot
// (BootID).
func SinceBoot() (time.Duration, error) {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err != nil {
		return 0, fmt.Errorf("read CLOCK_BOOTTIME: %w", err)
	}
	return time.Duration(ts.Nano()), nil
}
