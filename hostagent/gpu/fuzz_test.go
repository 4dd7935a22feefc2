package gpu

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

// FuzzParseGPUFilter: --gpu-passthrough comes from an operator. A filter
// that parses offers only display-class functions, prints back to a
// string that parses to the same filter, and nothing panics.
func FuzzParseGPUFilter(f *testing.F) {
	for _, s := range []string{"", "all", "ALL", "10de:2335", "10de:2335,10DE:2330", " 10de:2335 , 1002:74a1 ", "10de", ",", "all,10de:2335", "10de:233g"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		flt, err := ParseGPUFilter(s)
		if err != nil {
			return
		}
		again, err := ParseGPUFilter(flt.String())
		if err != nil || again.String() != flt.String() {
			t.Fatalf("%q -> %q does not parse back (%v)", s, flt.String(), err)
		}
		for _, id := range strings.Split(flt.String(), ",") {
			v, d, _ := strings.Cut(id, ":")
			if flt.Match(PCIFunction{Vendor: v, Device: d, Class: 0x040300}) {
				t.Fatalf("%q offers an audio function", s)
			}
		}
	})
}
