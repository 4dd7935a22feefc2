package evdev

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// record encodes one struct input_event the way the kernel writes it.
func record(sec, usec int64, typ, code uint16, value int32) []byte {
	b := make([]byte, Size)
	long := (Size - 8) / 2
	if long == 8 {
		binary.NativeEndian.PutUint64(b[0:], uint64(sec))
		binary.NativeEndian.PutUint64(b[8:], uint64(usec))
	} else {
		binary.NativeEndian.PutUint32(b[0:], uint32(sec))
		binary.NativeEndian.PutUint32(b[4:], uint32(usec))
	}
	rec := b[Size-8:]
	binary.NativeEndian.PutUint16(rec[0:], typ)
	binary.NativeEndian.PutUint16(rec[2:], code)
	binary.NativeEndian.PutUint32(rec[4:], uint32(value))
	return b
}

func TestEventSizeMatchesKernelABI(t *testing.T) {
	// amd64, the only target the guest is built for: timeval is 16 bytes.
	if Size != 24 && Size != 16 {
		t.Fatalf("Size = %d, want 24 (64-bit) or 16 (32-bit)", Size)
	}
}

func TestParseEvents(t *testing.T) {
	const evSyn = 0
	var stream []byte
	stream = append(stream, record(12, 345, evKey, keyPower, 1)...)
	stream = append(stream, record(12, 346, evSyn, 0, 0)...)
	stream = append(stream, record(12, 400, evKey, keyPower, 0)...)
	stream = append(stream, 1, 2, 3) // a partial record

	events, rest := Parse(stream)
	require.Len(t, events, 3)
	assert.Equal(t, Event{Type: evKey, Code: keyPower, Value: 1}, events[0])
	assert.Equal(t, Event{Type: evSyn}, events[1])
	assert.Equal(t, Event{Type: evKey, Code: keyPower, Value: 0}, events[2])
	assert.Equal(t, []byte{1, 2, 3}, rest)

	events, rest = Parse(nil)
	assert.Empty(t, events)
	assert.Empty(t, rest)
}

func TestIsPowerPress(t *testing.T) {
	for _, tc := range []struct {
		name string
		ev   Event
		want bool
	}{
		{"press", Event{evKey, keyPower, 1}, true},
		{"release", Event{evKey, keyPower, 0}, false},
		{"autorepeat", Event{evKey, keyPower, 2}, false},
		{"other key", Event{evKey, 115, 1}, false},
		{"not a key event", Event{0x02, keyPower, 1}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, tc.ev.IsPowerPress())
		})
	}
}

func TestParseDevNumber(t *testing.T) {
	for _, tc := range []struct {
		in           string
		major, minor uint32
		wantErr      bool
	}{
		{in: "13:64\n", major: 13, minor: 64},
		{in: "13:64", major: 13, minor: 64},
		{in: "259:0", major: 259},
		{in: "", wantErr: true},
		{in: "13", wantErr: true},
		{in: "a:1", wantErr: true},
		{in: "1:-1", wantErr: true},
		{in: "1:99999999999", wantErr: true},
	} {
		t.Run(tc.in, func(t *testing.T) {
			major, minor, err := ParseDevNumber(tc.in)
			if tc.wantErr {
				assert.Error(t, err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.major, major)
			assert.Equal(t, tc.minor, minor)
		})
	}
}

func FuzzParseEvents(f *testing.F) {
	f.Add(record(1, 2, evKey, keyPower, 1))
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, b []byte) {
		events, rest := Parse(b)
		if len(rest) >= Size || len(events)*Size+len(rest) != len(b) {
			t.Fatalf("%d events + %d rest bytes from %d bytes", len(events), len(rest), len(b))
		}
	})
}
