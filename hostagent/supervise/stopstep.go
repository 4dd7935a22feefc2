package supervise

import (
	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// stopSteps pairs the record's stop steps with vmm's; stepFromProto and
// stepToProto read it both ways, so the two can never disagree.
var stopSteps = []struct {
	rec vmflowv1.StopStep
	vmm vmm.StopStep
}{
	{vmflowv1.StopStep_STOP_STEP_NONE, vmm.StepNone},
	{vmflowv1.StopStep_STOP_STEP_POWERDOWN_SENT, vmm.StepPowerdownSent},
	{vmflowv1.StopStep_STOP_STEP_QUIT_SENT, vmm.StepQuitSent},
	{vmflowv1.StopStep_STOP_STEP_KILLED, vmm.StepKillSent},
	{vmflowv1.StopStep_STOP_STEP_GONE, vmm.StepGone},
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
