// Package evdev reads what the guest's init needs of Linux input events
// (struct input_event records from /dev/input/eventN) and of sysfs device
// numbers: enough to see the ACPI power button pressed.
package evdev

import (
	"encoding/binary"
	"fmt"
	"strconv"
	"strings"
	"unsafe"
)

// Input event constants from linux/input-event-codes.h.
const (
	evKey    = 0x01
	keyPower = 116
)

// Size is sizeof(struct input_event): a struct timeval (two longs)
// then __u16 type, __u16 code, __s32 value. 24 bytes on amd64.
const Size = 2*int(unsafe.Sizeof(uintptr(0))) + 8

// Event is the part of struct input_event the init looks at.
type Event struct {
	Type  uint16
	Code  uint16
	Value int32
}

// IsPowerPress is a KEY_POWER key-down (value 1; 0 is release, 2 repeat).
func (e Event) IsPowerPress() bool {
	return e.Type == evKey && e.Code == keyPower && e.Value == 1
}

// Parse decodes the whole native-order input_event records in b and returns
// the bytes of a trailing partial record.
func Parse(b []byte) (events []Event, rest []byte) {
	for len(b) >= Size {
		rec := b[Size-8 : Size]
		events = append(events, Event{
			Type:  binary.NativeEndian.Uint16(rec[0:2]),
			Code:  binary.NativeEndian.Uint16(rec[2:4]),
			Value: int32(binary.NativeEndian.Uint32(rec[4:8])),
		})
		b = b[Size:]
	}
	return events, b
}

// ParseDevNumber parses a sysfs dev file ("13:64\n").
func ParseDevNumber(s string) (major, minor uint32, err error) {
	majStr, minStr, ok := strings.Cut(strings.TrimSpace(s), ":")
	if !ok {
		return 0, 0, fmt.Errorf("dev number %q: want MAJOR:MINOR", s)
	}
	ma, err := strconv.ParseUint(majStr, 10, 32)
	if err != nil {
		return 0, 0, fmt.Errorf("dev number %q: major: %w", s, err)
	}
	mi, err := strconv.ParseUint(minStr, 10, 32)
	if err != nil {
		return 0, 0, fmt.Errorf("dev number %q: minor: %w", s, err)
	}
	return uint32(ma), uint32(mi), nil
}
