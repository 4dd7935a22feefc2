package store

import (
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/hostagent/proc"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// BootMomentNow is now on CLOCK_BOOTTIME with this boot's id, to keep beside
// a wall-clock time; nil when unreadable (Elapsed then uses the wall clock).
func BootMomentNow() *vmflowv1.BootMoment {
	boot, err := proc.BootID()
	if err != nil {
		return nil
	}
	d, err := proc.SinceBoot()
	if err != nil {
		return nil
	}
	return &vmflowv1.BootMoment{BootId: boot, SinceBootNs: uint64(d)}
}

// Elapsed is how long ago a recorded instant was, on CLOCK_BOOTTIME within
// this boot (immune to clock steps), else on the wall clock; never negative,
// so "configured minus Elapsed" never exceeds configured.
func Elapsed(wall *timestamppb.Timestamp, boot *vmflowv1.BootMoment, now time.Time) time.Duration {
	if boot != nil {
		if id, err := proc.BootID(); err == nil && id == boot.GetBootId() {
			if d, err := proc.SinceBoot(); err == nil && uint64(d) >= boot.GetSinceBootNs() {
				return d - time.Duration(boot.GetSinceBootNs())
			}
		}
	}
	if wall == nil {
		return 0
	}
	return max(0, now.Sub(wall.AsTime()))
}
