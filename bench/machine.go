package bench

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"time"

	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/vmm"
	"vmflow/hostagent/vmm/vmmtest"

	"golang.org/x/sys/unix"
)

// Machine describes where the numbers were taken.
type Machine struct {
	Cores     int
	CPUModel  string
	Kernel    string
	MemTotal  string
	Accel     vmm.Accel // what -machine none runs under (vmmtest.Accel)
	AccelWhy  string    // why: proctest.AccelReason
	QEMU      string
	Go        string
	LoadStart string // /proc/loadavg at the start of the run
}

// DescribeMachine reads the machine's description; fields it cannot read
// say why instead of failing the run.
func DescribeMachine(ctx context.Context) Machine {
	m := Machine{Cores: runtime.NumCPU(), Go: runtime.Version(), LoadStart: LoadAvg()}
	var u unix.Utsname
	if err := unix.Uname(&u); err == nil {
		m.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	m.CPUModel = procField("/proc/cpuinfo", "model name")
	m.MemTotal = procField("/proc/meminfo", "MemTotal")
	m.Accel, m.AccelWhy = vmmtest.Accel(), proctest.AccelReason()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "qemu-system-x86_64", "--version").Output()
	if err != nil {
		m.QEMU = fmt.Sprintf("unknown (%v)", err)
	} else {
		m.QEMU = strings.TrimSpace(strings.SplitN(string(out), "\n", 2)[0])
	}
	return m
}

// LoadAvg is the first three fields of /proc/loadavg.
func LoadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return strings.TrimSpace(string(b))
	}
	return strings.Join(f[:3], " ")
}

func procField(path, key string) string {
	f, err := os.Open(path)
	if err != nil {
		return "unknown"
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == key {
			return strings.TrimSpace(v)
		}
	}
	return "unknown"
}

// VmHWM is the peak resident set size of pid (VmHWM in /proc/<pid>/status),
// in KiB.
func VmHWM(pid int) (int64, error) { return StatusNumber(pid, "VmHWM") }

// VmRSS is the resident set size of pid now, in KiB.
func VmRSS(pid int) (int64, error) { return StatusNumber(pid, "VmRSS") }

// StatusNumber is the number of field key in /proc/<pid>/status (KiB for
// the Vm* fields, a count for Threads).
func StatusNumber(pid int, key string) (int64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, fmt.Errorf("%s of %d: %w", key, pid, err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), key+":"); ok {
			var n int64
			if _, err := fmt.Sscan(strings.TrimSpace(v), &n); err != nil {
				return 0, fmt.Errorf("%s of %d: parse %q: %w", key, pid, v, err)
			}
			return n, nil
		}
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("%s of %d: %w", key, pid, err)
	}
	return 0, fmt.Errorf("%s of %d: no %s line", key, pid, key)
}
