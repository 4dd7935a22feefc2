package admission

import (
	"context"

	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// PrepareLaunch returns supervise's Config.PrepareLaunch for a caller with
// one hook: the record admitted (ErrAdmissionRefused, nothing touched), then
// Assemble. The agent sets Config.Admit and Assemble apart instead, so the
// launch's stages admit before they hold anything.
func PrepareLaunch(h Host, devs Devices, attach bool) func(context.Context, *store.Locked, *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
	assemble := Assemble(h, devs, attach)
	return func(ctx context.Context, l *store.Locked, rec *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
		if err := h.AdmitRecord(ctx, rec); err != nil {
			return vmm.VMSpec{}, err
		}
		return assemble(ctx, l, rec)
	}
}
