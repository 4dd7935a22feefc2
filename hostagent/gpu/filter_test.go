package gpu_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu"
)

func TestParseGPUFilter(t *testing.T) {
	h200 := gpu.PCIFunction{Vendor: "10de", Device: "2335", Class: 0x030200}
	vga := gpu.PCIFunction{Vendor: "10de", Device: "2684", Class: 0x030000}
	audio := gpu.PCIFunction{Vendor: "10de", Device: "22ba", Class: 0x040300}
	for _, tc := range []struct {
		in      string
		enabled bool
		match   []bool // h200, vga, audio
		str     string
	}{
		{"", false, []bool{false, false, false}, ""},
		{"all", true, []bool{true, true, false}, "all"},
		{" ALL ", true, []bool{true, true, false}, "all"},
		{"10de:2335", true, []bool{true, false, false}, "10de:2335"},
		{"10DE:2335, 10de:2684", true, []bool{true, true, false}, "10de:2335,10de:2684"},
		{"10de:22ba", true, []bool{false, false, false}, "10de:22ba"}, // not display class
	} {
		f, err := gpu.ParseGPUFilter(tc.in)
		require.NoError(t, err, tc.in)
		assert.Equal(t, tc.enabled, f.Enabled(), tc.in)
		assert.Equal(t, tc.str, f.String(), tc.in)
		for i, fn := range []gpu.PCIFunction{h200, vga, audio} {
			assert.Equal(t, tc.match[i], f.Match(fn), "%q on %s", tc.in, fn.ID())
		}
	}
	for _, bad := range []string{"10de", "10de:", "10de:23355", "xyz1:2335", "10de:2335,", "any"} {
		_, err := gpu.ParseGPUFilter(bad)
		assert.ErrorIs(t, err, gpu.ErrInvalid, bad)
	}
}
