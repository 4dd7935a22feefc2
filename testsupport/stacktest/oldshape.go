package stacktest

import (
	"fmt"
	"os"

	"google.golang.org/protobuf/encoding/protojson"

	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// WriteOldShape rewrites id's record in the pre-lease shape (its vGPU lease as
// gpu_claim, and no capacity lease: the ledger came later), as after an
// upgrade, and returns the lease. The agent must not write the record
// meanwhile.
func WriteOldShape(st *store.Store, id string) (*vmflowv1.Lease, error) {
	rec, err := st.Get(id)
	if err != nil {
		return nil, fmt.Errorf("old shape %s: %w", id, err)
	}
	// The old shape held one vGPU claim and nothing else (a capacity lease
	// beside it is dropped: an agent of then wrote none).
	others := len(rec.GetLeases()) - len(store.VGPUs(rec))
	if store.Capacity(rec) != nil {
		others--
	}
	if len(store.VGPUs(rec)) != 1 || others != 0 {
		return nil, fmt.Errorf("old shape %s: the record holds %d leases, %d of them vGPUs; the old shape had one vGPU", id, len(rec.GetLeases()), len(store.VGPUs(rec)))
	}
	l := store.VGPU(rec)
	v := l.GetVgpu()
	rec.Leases = nil
	rec.GpuClaim = &vmflowv1.GpuClaim{Profile: v.GetProfile(), Parent: v.GetParent(), TypeId: v.GetTypeId(), Uuid: v.GetUuid(),
		DeviceId: v.GetDeviceId(), Driver: v.GetDriver(), Phase: l.GetPhase(), ReleaseAttempts: l.GetReleaseAttempts(),
		LastReleaseError: l.GetLastReleaseError(), ReleasedAt: l.GetReleasedAt(), ClaimedAt: l.GetClaimedAt()}
	b, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(rec)
	if err != nil {
		return nil, fmt.Errorf("old shape %s: %w", id, err)
	}
	paths, err := st.Paths(id)
	if err != nil {
		return nil, fmt.Errorf("old shape %s: %w", id, err)
	}
	if err := os.WriteFile(paths.Record, b, 0o600); err != nil {
		return nil, fmt.Errorf("old shape %s: %w", id, err)
	}
	return l, nil
}
