package vmm

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func ver(major, minor, micro int) Version {
	var v Version
	v.QEMU.Major, v.QEMU.Minor, v.QEMU.Micro = major, minor, micro
	return v
}

func TestParseVersionOutput(t *testing.T) {
	for _, tc := range []struct {
		name, out string
		want      Version
		pkg       string
		err       bool
	}{
		{name: "debian 12", out: "QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)\nCopyright (c) 2003-2022 Fabrice Bellard and the QEMU Project developers\n",
			want: ver(7, 2, 22), pkg: "Debian 1:7.2+dfsg-7+deb12u18+b3"},
		{name: "upstream 9.1", out: "QEMU emulator version 9.1.0\nCopyright (c) 2003-2024 Fabrice Bellard and the QEMU Project developers\n", want: ver(9, 1, 0)},
		{name: "two components", out: "QEMU emulator version 8.0 (v8.0.0-dirty)\n", want: ver(8, 0, 0), pkg: "v8.0.0-dirty"},
		{name: "10.x", out: "QEMU emulator version 10.0.2 (qemu-10.0.2-1.fc42)\n", want: ver(10, 0, 2), pkg: "qemu-10.0.2-1.fc42"},
		{name: "not qemu", out: "bash: qemu: command not found\n", err: true},
		{name: "empty", out: "", err: true},
		{name: "garbage version", out: "QEMU emulator version x.y\n", err: true},
		{name: "huge number", out: "QEMU emulator version 99999999999999999999.1\n", err: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v, err := ParseVersionOutput(tc.out)
			if tc.err {
				assert.Error(t, err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want.QEMU, v.QEMU)
			assert.Equal(t, tc.pkg, v.Package)
		})
	}
}

func TestDetectVersionOfInstalledQEMU(t *testing.T) {
	bin := requiresQEMU(t)
	v, err := DetectVersion(context.Background(), bin)
	require.NoError(t, err)
	assert.Positive(t, v.QEMU.Major)
	_, err = DetectVersion(context.Background(), "/bin/false")
	assert.Error(t, err)
}
