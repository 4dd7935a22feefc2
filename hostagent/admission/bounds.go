package admission

import (
	"fmt"

	"vmflow/hostagent/store"
)

// Bounds of the string fields that reach the agent from outside, in bytes.
const (
	// MaxCmdlineBytes: x86's boot protocol gives the kernel command line
	// 2048 bytes with its NUL (COMMAND_LINE_SIZE); a longer one is cut by
	// the kernel, and an unbounded one once made a record too large to read
	// back (the instance could not be deleted).
	MaxCmdlineBytes = 2047
	// MaxPathBytes is PATH_MAX without its NUL.
	MaxPathBytes = 4095
	// MaxProfileBytes: vGPU profile names are short ("NVIDIA A100-4C",
	// "GRID RTX6000-4Q"); sysfs name files hold one line.
	MaxProfileBytes = 128
	// MaxUUIDBytes: the canonical 8-4-4-4-12 form.
	MaxUUIDBytes = 36
	// MaxWorkflowIDBytes is the Temporal server's default limit.maxIDLength.
	MaxWorkflowIDBytes = 1000
	// MaxRunIDBytes: run ids are UUIDs; room for another server's form.
	MaxRunIDBytes = 128
	// maxEnumBytes bounds the enum-like fields (machine, accel,
	// restart_policy), which are checked against their few values anyway:
	// the bound keeps a refusal's message short.
	maxEnumBytes = 32
)

// MaxBytes is the one table of bounds: every string field of a request that
// reaches the agent (SpawnRequest, the record's VMSpec, ClaimVGPURequest,
// BeginDeleteRequest) by its proto name. Ids must also match
// contract.IDPattern. A record built from bounded fields stays far below the
// store's record size limit.
var MaxBytes = map[string]int{
	"instance_id":                    store.MaxIDLen,
	"host_id":                        store.MaxIDLen,
	"kernel":                         MaxPathBytes,
	"initrd":                         MaxPathBytes,
	"disk":                           MaxPathBytes,
	"cmdline":                        MaxCmdlineBytes,
	"vgpu_profile":                   MaxProfileBytes,
	"uuid":                           MaxUUIDBytes,
	"machine":                        maxEnumBytes,
	"accel":                          maxEnumBytes,
	"restart_policy":                 maxEnumBytes,
	"network":                        maxEnumBytes,
	"hugepages":                      maxEnumBytes,
	"numa":                           maxEnumBytes,
	"only_if_created_by_workflow_id": MaxWorkflowIDBytes,
	"only_if_created_by_run_id":      MaxRunIDBytes,
	"gpu_passthrough_model":          len("10de:2335"),
}

// CheckBound refuses (FieldError, ErrInvalid) a value longer than field's
// bound in MaxBytes, or a field without one, so every new field gets a bound.
func CheckBound(field, value string) error {
	max, ok := MaxBytes[field]
	if !ok {
		return &FieldError{Field: field, Reason: "has no bound in spec.MaxBytes"}
	}
	if len(value) > max {
		return &FieldError{Field: field, Reason: fmt.Sprintf("%d bytes, longer than %d", len(value), max)}
	}
	return nil
}
