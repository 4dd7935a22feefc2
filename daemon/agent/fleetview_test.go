package agent

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"

	"vmflow/hostagent/lease"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// publishes records what a publisher sent.
type publishes struct {
	mu sync.Mutex
	vs []*vmflowv1.HostView
}

func (p *publishes) publish(_ context.Context, v *vmflowv1.HostView) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.vs = append(p.vs, v)
	return nil
}

func (p *publishes) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.vs)
}

func (p *publishes) last() *vmflowv1.HostView {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.vs[len(p.vs)-1]
}

// TestViewPublishedAtStartAndOnChangeOnly: the agent publishes its view
// when it starts, then never while nothing changes (however many local
// looks and nudges), once for a burst of changes, and again when a drain
// made outside the agent shows at a local look.
func TestViewPublishedAtStartAndOnChangeOnly(t *testing.T) {
	st, err := store.New(t.TempDir())
	require.NoError(t, err)
	capacity, err := lease.NewCapacity(lease.CapacityConfig{Store: st, CPUs: 4, MemoryMiB: 16384, MemoryReserveMiB: 1024, Draining: st.RefuseWhileDraining})
	require.NoError(t, err)
	var sent publishes
	p := newViewPublisher(&lease.Offers{Store: st, Capacity: capacity},
		func(v *vmflowv1.HostView) { v.HostId = "h1" }, sent.publish, 50*time.Millisecond, 20*time.Millisecond, zap.NewNop())
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() { p.run(ctx); close(done) }()
	defer func() { cancel(); <-done }()

	waitUntil(t, func() bool { return sent.count() == 1 }, "the view published at start")
	assert.Equal(t, "h1", sent.last().GetHostId())
	assert.EqualValues(t, 16, sent.last().GetVcpusFree())
	assert.NotEmpty(t, sent.last().GetPublishedAt())

	// Idle: local looks and nudges that change nothing publish nothing.
	p.Changed()
	time.Sleep(200 * time.Millisecond) // ten local looks: a window where nothing may be sent
	assert.Equal(t, 1, sent.count(), "an idle host publishes nothing")

	// A burst of grants, each nudging: one publish after the debounce.
	for i := range 5 {
		_, err := st.Create(ctx, &vmflowv1.InstanceRecord{Id: "vm" + string(rune('a'+i)), Spec: &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none", Accel: "kvm"}},
			store.Reserving(capacity.Reserve("vm"+string(rune('a'+i)), &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none", Accel: "kvm"})))
		require.NoError(t, err)
		p.Changed()
	}
	waitUntil(t, func() bool { return sent.count() >= 2 && sent.last().GetVcpusFree() == 11 }, "the burst published")
	assert.LessOrEqual(t, sent.count(), 3, "a burst of five changes goes out in one or two publishes, not five")
	assert.EqualValues(t, 5, sent.last().GetInFlight())
	n := sent.count()

	// A drain by the CLI (outside the agent): the next local look sees it.
	_, err = st.Drain(ctx, "maintenance", time.Now())
	require.NoError(t, err)
	waitUntil(t, func() bool { return sent.count() == n+1 }, "the drain published")
	assert.True(t, sent.last().GetDraining())
	assert.Equal(t, "maintenance", sent.last().GetDrainReason())
	time.Sleep(100 * time.Millisecond)
	assert.Equal(t, n+1, sent.count(), "published once")
}

func waitUntil(t *testing.T, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestSameOfferIgnoresInFlight: a launch (in flight down, free the same)
// is no change worth a publish; any free figure is.
func TestSameOfferIgnoresInFlight(t *testing.T) {
	a := &vmflowv1.HostView{HostId: "h1", VcpusFree: 4, InFlight: 2}
	b := &vmflowv1.HostView{HostId: "h1", VcpusFree: 4, InFlight: 1}
	assert.True(t, sameOffer(a, b))
	b.VcpusFree = 3
	assert.False(t, sameOffer(a, b))
	assert.EqualValues(t, 2, a.GetInFlight(), "the views compared are left as they were")
}
