package vmm

import (
	"context"
	"fmt"
	"os/exec"
	"regexp"
	"strconv"
	"time"
)

// versionRe matches the first line of `qemu-system-x86_64 --version`:
// "QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)". Some
// builds print two components ("8.0") or a package suffix without parens.
var versionRe = regexp.MustCompile(`(?m)^QEMU emulator version (\d{1,4})\.(\d{1,4})(?:\.(\d{1,4}))?(?:\s*\(([^)\n]*)\))?`)

// ParseVersionOutput reads the version from `qemu-system-* --version`.
func ParseVersionOutput(out string) (Version, error) {
	m := versionRe.FindStringSubmatch(out)
	if m == nil {
		return Version{}, fmt.Errorf("qemu --version: no \"QEMU emulator version X.Y\" line in %q", firstLine(out))
	}
	var v Version
	// The regexp admits only 1-4 digits: Atoi cannot fail or overflow.
	v.QEMU.Major, _ = strconv.Atoi(m[1])
	v.QEMU.Minor, _ = strconv.Atoi(m[2])
	if m[3] != "" {
		v.QEMU.Micro, _ = strconv.Atoi(m[3])
	}
	v.Package = m[4]
	return v, nil
}

func firstLine(s string) string {
	for i, c := range s {
		if c == '\n' {
			return s[:i]
		}
	}
	return s
}

// DetectVersion runs `bin --version` (bounded by ctx and 10 s) and parses it.
func DetectVersion(ctx context.Context, bin string) (Version, error) {
	if bin == "" {
		bin = DefaultBinary
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, "--version").Output()
	if err != nil {
		return Version{}, fmt.Errorf("%s --version: %w", bin, err)
	}
	v, err := ParseVersionOutput(string(out))
	if err != nil {
		return Version{}, fmt.Errorf("%s: %w", bin, err)
	}
	return v, nil
}
