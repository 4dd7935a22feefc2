package store

import (
	"fmt"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"vmflow/hostagent/proc"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// maxRecordSize bounds what the store reads back: a record is a few hundred
// bytes, so anything near this is not a record and must not be slurped. The
// writers refuse to write more (encodeForWrite): what is written must be
// readable.
const maxRecordSize = 1 << 20

var (
	// Proto field names (snake_case) like every other JSON vmflow shows, and
	// indented so an operator can read record.json with cat.
	marshalOpts = protojson.MarshalOptions{UseProtoNames: true, Multiline: true, Indent: "  "}
	// Strict: an unknown field is an error, never silently dropped, so a
	// typo in a hand-edited record or a record from a newer agent is seen.
	unmarshalOpts = protojson.UnmarshalOptions{DiscardUnknown: false}
)

// EncodeRecord renders rec as record.json content. It does not validate rec;
// writers validate before they encode.
func EncodeRecord(rec *vmflowv1.InstanceRecord) ([]byte, error) {
	b, err := marshalOpts.Marshal(rec)
	if err != nil {
		return nil, fmt.Errorf("encode record %s: %w", quoteID(rec.GetId()), err)
	}
	return append(b, '\n'), nil
}

// encodeForWrite encodes rec for the disk, refusing (ErrRecordTooLarge) a
// record DecodeRecord would refuse for its size.
func encodeForWrite(rec *vmflowv1.InstanceRecord) ([]byte, error) {
	b, err := EncodeRecord(rec)
	if err != nil {
		return nil, err
	}
	if len(b) > maxRecordSize {
		return nil, fmt.Errorf("%w: %d bytes encoded, larger than the %d the store reads back", ErrRecordTooLarge, len(b), maxRecordSize)
	}
	return b, nil
}

// DecodeRecord parses record.json strictly, converts an old shape and
// validates it; it never panics, whatever b holds.
func DecodeRecord(b []byte) (*vmflowv1.InstanceRecord, error) {
	if len(b) > maxRecordSize {
		return nil, fmt.Errorf("%w: %d bytes, larger than %d", ErrInvalidRecord, len(b), maxRecordSize)
	}
	rec := &vmflowv1.InstanceRecord{}
	if err := unmarshalOpts.Unmarshal(b, rec); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidRecord, err)
	}
	migrate(rec)
	if err := ValidateRecord(rec); err != nil {
		return nil, err
	}
	return rec, nil
}

// ValidateRecord checks what the store relies on: a valid id, a spec, and
// known enum values (a state we cannot name we cannot reason about).
func ValidateRecord(rec *vmflowv1.InstanceRecord) error {
	if rec == nil {
		return fmt.Errorf("%w: nil", ErrInvalidRecord)
	}
	if err := ValidateID(rec.GetId()); err != nil {
		return fmt.Errorf("%w: id: %w", ErrInvalidRecord, err)
	}
	if rec.GetSpec() == nil {
		return fmt.Errorf("%w: instance %s has no spec", ErrInvalidRecord, rec.GetId())
	}
	if _, ok := transitions[rec.GetState()]; !ok {
		return fmt.Errorf("%w: instance %s has unknown state %d", ErrInvalidRecord, rec.GetId(), rec.GetState())
	}
	if _, ok := vmflowv1.StopStep_name[int32(rec.GetStopStep())]; !ok {
		return fmt.Errorf("%w: instance %s has unknown stop_step %d", ErrInvalidRecord, rec.GetId(), rec.GetStopStep())
	}
	if rec.GetGpuClaim() != nil {
		// Only migrate reads it; a record that still has it (beside a vgpu
		// lease, or set by a writer) is not one the store understands.
		return fmt.Errorf("%w: instance %s has the old gpu_claim field beside its leases", ErrInvalidRecord, rec.GetId())
	}
	if err := validateLeases(rec); err != nil {
		return err
	}
	// Timestamps need no check here: protojson refuses out-of-range ones.
	return nil
}

// CreatedBy reports whether spawn workflowID/runID created rec (invariant 9);
// a record without a creator, and an empty workflowID, match nothing.
func CreatedBy(rec *vmflowv1.InstanceRecord, workflowID, runID string) bool {
	return workflowID != "" && runID != "" &&
		rec.GetCreatedByWorkflowId() == workflowID && rec.GetCreatedByRunId() == runID
}

// CreatorOf describes rec's creator for messages: "<workflow id> (run <run
// id>)", or "an unknown spawn (the record predates creators)".
func CreatorOf(rec *vmflowv1.InstanceRecord) string {
	if rec.GetCreatedByWorkflowId() == "" {
		return "an unknown spawn (the record predates creators)"
	}
	return rec.GetCreatedByWorkflowId() + " (run " + rec.GetCreatedByRunId() + ")"
}

// desiredDiff names the fields in which two records' desired configuration
// (spec and restart settings) differ; empty means the same create request.
func desiredDiff(have, want *vmflowv1.InstanceRecord) []string {
	var diff []string
	hs, ws := have.GetSpec().ProtoReflect(), want.GetSpec().ProtoReflect()
	fields := hs.Descriptor().Fields()
	for i := 0; i < fields.Len(); i++ {
		f := fields.Get(i)
		if !hs.Get(f).Equal(ws.Get(f)) {
			diff = append(diff, fmt.Sprintf("spec.%s %s -> %s", f.Name(), fmtValue(hs.Get(f)), fmtValue(ws.Get(f))))
		}
	}
	if have.GetRestartPolicy() != want.GetRestartPolicy() {
		diff = append(diff, fmt.Sprintf("restart_policy %q -> %q", have.GetRestartPolicy(), want.GetRestartPolicy()))
	}
	if have.GetRestartMaxAttempts() != want.GetRestartMaxAttempts() {
		diff = append(diff, fmt.Sprintf("restart_max_attempts %d -> %d", have.GetRestartMaxAttempts(), want.GetRestartMaxAttempts()))
	}
	if have.GetRestartStableAfterSeconds() != want.GetRestartStableAfterSeconds() {
		diff = append(diff, fmt.Sprintf("restart_stable_after_seconds %d -> %d",
			have.GetRestartStableAfterSeconds(), want.GetRestartStableAfterSeconds()))
	}
	return diff
}

func fmtValue(v protoreflect.Value) string {
	if s, ok := v.Interface().(string); ok {
		return fmt.Sprintf("%q", s)
	}
	return v.String()
}

// cloneRecord deep-copies rec so callers never share memory with the store.
func cloneRecord(rec *vmflowv1.InstanceRecord) *vmflowv1.InstanceRecord {
	return proto.Clone(rec).(*vmflowv1.InstanceRecord)
}

// IdentityOf is the process identity a record holds (zero for nil): one
// conversion, so no reader drops a field such as the boot id.
func IdentityOf(p *vmflowv1.ProcessIdentity) proc.Identity {
	if p == nil {
		return proc.Identity{}
	}
	return proc.Identity{PID: int(p.GetPid()), StartTime: p.GetStartTime(), BootID: p.GetBootId()}
}

// ProcessRecord is the record's form of a process identity.
func ProcessRecord(id proc.Identity) *vmflowv1.ProcessIdentity {
	return &vmflowv1.ProcessIdentity{Pid: int32(id.PID), StartTime: id.StartTime, BootId: id.BootID}
}
