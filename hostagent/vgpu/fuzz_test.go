package vgpu

import (
	"strings"
	"testing"
)

// FuzzParseCreatable: NVIDIA's creatable_vgpu_types is read from sysfs (or
// from whatever a driver bug puts there). Every parsed type has a positive
// id and a name without line breaks or surrounding space; nothing panics.
func FuzzParseCreatable(f *testing.F) {
	for _, s := range []string{
		"ID    : vGPU Name\n557   : NVIDIA L40S-1Q\n558   : NVIDIA L40S-2Q\n",
		"",
		"ID : vGPU Name\n",
		"0 : free\n-3 : negative\n99999999999999999999 : overflow\n",
		"12:a:b:c\n  7  :  spaced name  \r\n",
		":\n:::\nabc : def\n",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		for _, vt := range parseCreatable(s) {
			if vt.id <= 0 {
				t.Fatalf("type id %d from %q", vt.id, s)
			}
			if strings.ContainsAny(vt.name, "\n") || vt.name != strings.TrimSpace(vt.name) {
				t.Fatalf("type name %q from %q", vt.name, s)
			}
		}
	})
}
