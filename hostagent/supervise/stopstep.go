package supervise

import (
	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// stopSteps is the one table of a stop step's names: the record's enum,
// vmm's step, the name StopVM reports for a step it had to take ("" for the
// ends of the ladder, which are not steps taken; also the name of the
// step's span) and the span of the wait after it.
var stopSteps = []struct {
	rec     vmflowv1.StopStep
	vmm     vmm.StopStep
	reached string
	wait    string
}{
	{vmflowv1.StopStep_STOP_STEP_NONE, vmm.StepNone, "", ""},
	{vmflowv1.StopStep_STOP_STEP_POWERDOWN_SENT, vmm.StepPowerdownSent, "powerdown", "graceful-wait"},
	{vmflowv1.StopStep_STOP_STEP_QUIT_SENT, vmm.StepQuitSent, "quit", "quit-wait"},
	{vmflowv1.StopStep_STOP_STEP_KILLED, vmm.StepKillSent, "kill", "kill-wait"},
	{vmflowv1.StopStep_STOP_STEP_GONE, vmm.StepGone, "", ""},
}

func stepFromProto(s vmflowv1.StopStep) vmm.StopStep {
	for _, p := range stopSteps {
		if p.rec == s {
			return p.vmm
		}
	}
	return vmm.StepNone
}

func stepToProto(s vmm.StopStep) vmflowv1.StopStep {
	for _, p := range stopSteps {
		if p.vmm == s {
			return p.rec
		}
	}
	return vmflowv1.StopStep_STOP_STEP_NONE
}

// StepReached is the name StopVM reports for step s when it was taken
// ("powerdown", "quit", "kill"), and false for the ends of the ladder.
func StepReached(s vmm.StopStep) (string, bool) {
	for _, p := range stopSteps {
		if p.vmm == s {
			return p.reached, p.reached != ""
		}
	}
	return "", false
}

// stepSpans names the spans of step s and of the wait after it; false for
// the ends of the ladder.
func stepSpans(s vmm.StopStep) (step, wait string, ok bool) {
	for _, p := range stopSteps {
		if p.vmm == s {
			return p.reached, p.wait, p.reached != ""
		}
	}
	return "", "", false
}
