// Package vmflowv1 is vmflow's contract, generated from the .proto files
// beside it: the on-disk instance record the host agent keeps
// (record.proto) and the scalar-only inputs, results, signals and status
// query of the Temporal workflows (workflow.proto), the host activities'
// (activity.proto), and the fleet view each agent publishes and placement
// reads (fleet.proto).
//
// Regenerate with `make proto`; `make lint` fails when the generated Go is
// stale. This file is the only hand-written Go here.
package vmflowv1
