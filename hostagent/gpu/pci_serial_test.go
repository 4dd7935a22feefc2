package gpu

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
)

// config is 0x100 bytes of header then ext, the extended capabilities.
func config(ext ...uint32) []byte {
	b := make([]byte, 0x100+4*len(ext))
	for i, v := range ext {
		binary.LittleEndian.PutUint32(b[0x100+4*i:], v)
	}
	return b
}

func TestDeviceSerial(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  []byte
		want string
	}{
		{"64 bytes (not root)", make([]byte, 64), ""},
		{"no extended capabilities", config(0), ""},
		{"DSN first", config(0x0003|1<<16, 0x44332211, 0x88776655), "88-77-66-55-44-33-22-11"},
		// AER (0x0001) at 0x100 pointing to a DSN at 0x10c.
		{"DSN second", config(0x0001|1<<16|0x10c<<20, 0, 0, 0x0003|1<<16, 0x04030201, 0x08070605), "08-07-06-05-04-03-02-01"},
		{"all ones (a card gone from the bus)", config(0xffffffff, 1, 2), ""},
		{"a chain pointing at itself", config(0x0001|0x100<<20, 0, 0), ""},
		{"a chain pointing below 0x100", config(0x0001|0x40<<20, 0, 0), ""},
		{"DSN cut short", config(0x0003|1<<16, 0x44332211), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, deviceSerial(tc.cfg))
		})
	}
}

// FuzzDeviceSerial: any config space, however malformed, ends without a
// panic.
func FuzzDeviceSerial(f *testing.F) {
	f.Add(config(0x0003|1<<16, 1, 2))
	f.Add(config(0x0001|0x100<<20, 0, 0))
	f.Fuzz(func(t *testing.T, cfg []byte) {
		_ = deviceSerial(cfg)
	})
}
