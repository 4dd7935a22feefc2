package proc_test

import (
	"fmt"
	"testing"
	"vmflow/hostagent/proc"
)

// FuzzParseStat: no input panics, and whatever parses is self-consistent.
func FuzzParseStat(f *testing.F) {
	tail := " S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 4242 19 20 21"
	for _, comm := range []string{"qemu-system-x86", "a b", ") (", "((", "))", "x) S 1 2 (y", "", "kvm-nx-lpage-re", "\n", "名前"} {
		f.Add([]byte("123 (" + comm + ")" + tail))
	}
	f.Add([]byte(""))
	f.Add([]byte("("))
	f.Add([]byte(")"))
	f.Add([]byte("1 (x) Z"))
	f.Fuzz(func(t *testing.T, data []byte) {
		st, err := proc.ParseStat(data)
		if err != nil {
			return
		}
		if st.PID <= 0 {
			t.Fatalf("parsed pid %d from %q", st.PID, data)
		}
	})
}

// FuzzParseStatComm: any comm the kernel could print round-trips, and the
// fields after it are never confused with what is inside it.
func FuzzParseStatComm(f *testing.F) {
	for _, comm := range []string{"qemu", "a) Z 9 9 (b", ")", "(", " ", "x)"} {
		f.Add(comm, uint64(4242))
	}
	f.Fuzz(func(t *testing.T, comm string, start uint64) {
		line := fmt.Sprintf("77 (%s) R 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 %d 19 20", comm, start)
		st, err := proc.ParseStat([]byte(line))
		if err != nil {
			t.Fatalf("parse %q: %v", line, err)
		}
		if st.Comm != comm || st.StartTime != start || st.State != 'R' || st.PPID != 1 || st.PID != 77 {
			t.Fatalf("parse %q = %+v", line, st)
		}
	})
}
