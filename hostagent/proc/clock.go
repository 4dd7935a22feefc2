package proc

import (
	"fmt"
	"time"

	"golang.org/x/sys/unix"
)

// SinceBoot is CLOCK_BOOTTIME now: nothing steps it (NTP, date, clock sync)
// and it counts through suspend. Compare only within one boot (BootID).
func SinceBoot() (time.Duration, error) {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err != nil {
		return 0, fmt.Errorf("read CLOCK_BOOTTIME: %w", err)
	}
	return time.Duration(ts.Nano()), nil
}
