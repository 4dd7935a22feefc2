package contract

import (
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

var idRE = regexp.MustCompile(IDPattern)

// CheckID is IDPattern by hand: the two agree on every input, and a valid
// id is one plain path component.
func FuzzCheckID(f *testing.F) {
	for _, seed := range []string{"", "a", "vm1", "vm-1", "-a", "..", ".", "/", "a/b", "VM", "a\x00",
		strings.Repeat("a", 63), strings.Repeat("a", 64), strings.Repeat("z", 200), "é", "a\n", "a-"} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, id string) {
		err := CheckID(id)
		if (err == nil) != idRE.MatchString(id) {
			t.Fatalf("CheckID(%q) = %v, regexp match = %v", id, err, idRE.MatchString(id))
		}
		if err == nil && (filepath.Base(id) != id || filepath.Clean(id) != id || id == "." || id == "..") {
			t.Fatalf("valid id %q is not a plain path component", id)
		}
	})
}
