package store

import (
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/hostagent/proc"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// BootMomentNow is now on CLOCK_BOOTTIME, with this boot's id, for a record
// to keep beside a wall-clock timestamp; nil when either cannot be read
// (Elapsed then falls back on the wall clock).
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

// Elapsed is how long ago an instant a record kept was: measured on
// CLOCK_BOOTTIME when boot is of this boot (a clock step cannot move it),
// else on the wall clock from wall to now (a record of another boot, or
// older than BootMoment), never below zero. A wait that resumes with
// "configured minus Elapsed" is never longer than the configured one. No
// instant recorded at all is zero.
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
