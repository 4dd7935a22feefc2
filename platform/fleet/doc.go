// Package fleet is the fleet view and placement, on the platform side of
// the Temporal line: each host agent publishes its HostView as the memo
// of its FleetHost workflow (Publish: one workflow start, only when the
// view changed, so an idle fleet costs no action), and a placing spawn's
// local activities read every host's view from visibility (Read: a list,
// not an action), score the hosts for the request (Ranked, Score: GPU VMs
// packed, CPU-only VMs spread, reservations in flight counted), skip the
// hosts whose task queue has no poller (DescribeTaskQueue) and return the
// best K. The host's own grant decides; the view is a hint, so a stale one
// costs a refusal and a move to the next candidate, never a double
// booking. `vmflow place` prints the same ranking without reserving.
package fleet
