package vmm

import (
	"bufio"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// listenEnv makes the re-executed test binary a restarted agent: it takes
// what LISTEN_FDS hands it and prints each name, its first line, whether it
// is close-on-exec, and whether LISTEN_FDS is still set.
const listenEnv = "VMFLOW_VMM_TEST_LISTEN"

func runListenHelper() {
	st, err := NewSystemdFDStore()
	if err != nil || st == nil {
		println("no store", err)
		os.Exit(1)
	}
	f := st.Take("vmflow-log.vm1-7")
	if f == nil {
		println("nothing handed back")
		os.Exit(1)
	}
	flags, _ := unix.FcntlInt(f.Fd(), unix.F_GETFD, 0)
	line, _ := bufio.NewReader(f).ReadString('\n')
	os.Stdout.WriteString("line " + strings.TrimSpace(line) + "\n")
	if flags&unix.FD_CLOEXEC != 0 {
		os.Stdout.WriteString("cloexec\n")
	}
	if os.Getenv("LISTEN_FDS") == "" {
		os.Stdout.WriteString("env unset\n")
	}
	os.Exit(0)
}
