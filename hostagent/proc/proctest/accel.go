package proctest

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"time"
)

// AccelEnv names the variable that chooses the accelerator for every test
// and benchmark that runs QEMU: "tcg" forces TCG on a machine that has KVM,
// so the suite can be proved green both ways on one machine; "kvm" demands
// KVM (launches fail where it is unusable); empty or "auto" picks KVM where
// it is usable and TCG otherwise.
const AccelEnv = "VMFLOW_TEST_ACCEL"

// tcgSlowdown scales the deadlines of waits on QEMU under TCG: QEMU itself
// starts about as fast either way, but without KVM the machine also runs
// every guest by emulation, and a loaded 2-core CI machine once missed a
// 10 s QMP deadline that a KVM run never comes near.
const tcgSlowdown = 3

var accelChoice struct {
	once  sync.Once
	accel string // "kvm" or "tcg"
	why   string
}

// Accel is the tests' accelerator, "kvm" or "tcg", from AccelEnv and
// kvmUsable (vmm.CheckKVM's answer, passed in from above); an unknown AccelEnv
// panics so a typo never tests the other one.
func Accel(kvmUsable error) string {
	accelChoice.once.Do(func() {
		switch v := strings.ToLower(strings.TrimSpace(os.Getenv(AccelEnv))); v {
		case "tcg":
			accelChoice.accel, accelChoice.why = "tcg", AccelEnv+"=tcg"
		case "kvm":
			accelChoice.accel, accelChoice.why = "kvm", AccelEnv+"=kvm"
		case "", "auto":
			switch {
			case kvmUsable != nil:
				accelChoice.accel, accelChoice.why = "tcg", kvmUsable.Error()
			case !KVMOpens():
				accelChoice.accel, accelChoice.why = "tcg", "/dev/kvm does not open read-write"
			default:
				accelChoice.accel, accelChoice.why = "kvm", "/dev/kvm is usable"
			}
		default:
			panic(fmt.Sprintf("%s=%q: want tcg, kvm, auto or empty", AccelEnv, v))
		}
	})
	return accelChoice.accel
}

// AccelReason says why Accel chose what it chose (after a call to Accel).
func AccelReason() string { return accelChoice.why }

// ScaleDeadline scales d, a deadline on a QEMU wait, to the accelerator:
// longer under TCG.
func ScaleDeadline(accel string, d time.Duration) time.Duration {
	if accel == "tcg" {
		return d * tcgSlowdown
	}
	return d
}
