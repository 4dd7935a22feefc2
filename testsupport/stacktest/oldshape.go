package stacktest

import (
	"fmt"
	"os"

	"google.golang.org/protobuf/encoding/protojson"

	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// WriteOldShape rewrites id's record in the pre-lease shape (its vGPU lease as
// gpu_claim), as after an upgrade, and returns the lease. The agent must not
// write the record meanwhile.
func WriteOldShape(st *store.Store, id string) (*vmflowv1.Lease, error) {
	rec, err := st.Get(id)
	if err != nil {
		return nil, fmt.Errorf("old shape %s: %w", id, err)
	}
	l := store.VGPU(rec)
	if l == nil {
		return nil, fmt.Errorf("old shape %s: the record holds no vGPU lease", id)
	}
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
