package workflows

import (
	"go.temporal.io/sdk/workflow"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// FleetHost holds one host's published view: the agent starts it as
// fleet-host/<host_id> with the view as its memo (FleetViewMemo), ending
// the run that held the last one, and placement reads the memos from
// visibility. The run waits, with no timer and no command, until the
// next publish terminates it: an idle host costs nothing. An operator
// retires a host for good by terminating its run (readers offer its view
// for fleet.HandoverGrace more: a publish ends runs the same way).
func (w *Workflows) FleetHost(ctx workflow.Context, v *vmflowv1.HostView) error {
	workflow.GetLogger(ctx).Info("host view published", "host_id", v.GetHostId(), "published_at", v.GetPublishedAt())
	return workflow.Await(ctx, func() bool { return false })
}
