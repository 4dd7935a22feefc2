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

// startPublisher runs a view publisher of a 4-CPU host until the test
// ends, with a local look every checkEvery.
func startPublisher(t *testing.T, debounce, checkEvery time.Duration) (*store.Store, *lease.Capacity, *viewPublisher, *publishes) {
	st, err := store.New(t.TempDir())
	require.NoError(t, err)
	capacity, err := lease.NewCapacity(lease.CapacityConfig{Store: st, CPUs: 4, MemoryMiB: 16384, MemoryReserveMiB: 1024, Draining: st.RefuseWhileDraining})
	require.NoError(t, err)
	sent := &publishes{}
	p := newViewPublisher(&lease.Offers{Store: st, Capacity: capacity},
		func(v *vmflowv1.HostView) { v.HostId = "h1" }, sent.publish, debounce, checkEvery, zap.NewNop())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { p.run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	waitUntil(t, func() bool { return sent.count() == 1 }, "the view published at start")
	return st, capacity, p, sent
}

// TestViewPublishedAtStartAndOnChangeOnly: the agent publishes its view
// when it starts, never for a nudge that changed nothing, and once for a
// burst of changes nudged within the debounce. No local look runs here
// (one an hour) and the debounce is the production default's second, so
// a loaded machine does not split the burst.
func TestViewPublishedAtStartAndOnChangeOnly(t *testing.T) {
	const debounce = time.Second
	st, capacity, p, sent := startPublisher(t, debounce, time.Hour)
	assert.Equal(t, "h1", sent.last().GetHostId())
	assert.EqualValues(t, 16, sent.last().GetVcpusFree())
	assert.NotEmpty(t, sent.last().GetPublishedAt())

	p.Changed()
	time.Sleep(debounce + 300*time.Millisecond) // the nudge was looked at
	assert.Equal(t, 1, sent.count(), "a nudge that changed nothing publishes nothing")

	// Five grants, each nudging: one publish, of all five.
	ctx := context.Background()
	for i := range 5 {
		id := "vm" + string(rune('a'+i))
		spec := &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none", Accel: "kvm"}
		_, err := st.Create(ctx, &vmflowv1.InstanceRecord{Id: id, Spec: spec}, store.Reserving(capacity.Reserve(id, spec)))
		require.NoError(t, err)
		p.Changed()
	}
	waitUntil(t, func() bool { return sent.count() == 2 }, "the burst published")
	assert.EqualValues(t, 11, sent.last().GetVcpusFree(), "the first nudge waited out the debounce for the other four")
	assert.EqualValues(t, 5, sent.last().GetInFlight())
	time.Sleep(debounce + 300*time.Millisecond)
	assert.Equal(t, 2, sent.count(), "a burst of five nudges goes out in one publish")
}

// TestViewPublishesADrainAtALocalLook: local looks publish nothing while
// nothing changes, and a drain made outside the agent (the CLI: no nudge)
// goes out at the next one, once.
func TestViewPublishesADrainAtALocalLook(t *testing.T) {
	st, _, _, sent := startPublisher(t, 50*time.Millisecond, 20*time.Millisecond)
	time.Sleep(200 * time.Millisecond) // ten local looks
	assert.Equal(t, 1, sent.count(), "an idle host publishes nothing")

	_, err := st.Drain(context.Background(), "maintenance", time.Now())
	require.NoError(t, err)
	waitUntil(t, func() bool { return sent.count() == 2 }, "the drain published")
	assert.True(t, sent.last().GetDraining())
	assert.Equal(t, "maintenance", sent.last().GetDrainReason())
	time.Sleep(100 * time.Millisecond)
	assert.Equal(t, 2, sent.count(), "published once")
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
