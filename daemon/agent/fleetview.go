package agent

import (
	"context"
	"time"

	"go.temporal.io/sdk/client"
	"go.uber.org/zap"
	"google.golang.org/protobuf/proto"

	"vmflow/hostagent/lease"
	"vmflow/internal/service"
	"vmflow/platform/fleet"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// viewPublisher keeps this host's published view (platform/fleet.Publish:
// the memo of its FleetHost workflow) equal to what the host offers. It
// publishes when the agent starts and then only when the view changed:
// activities say when they may have changed it (Changed), debounced, and
// a local look every checkEvery (no Temporal call) catches what changes
// outside them: a drain or undrain by the CLI, a reservation that expired,
// a device quarantined or cleared. An idle host publishes nothing; a spawn
// costs one publish (its grant), a delete one (its release), and a burst
// within the debounce one in all.
type viewPublisher struct {
	offers *lease.Offers
	// static fills what the host is (its id, network, KVM, bounds).
	static     func(*vmflowv1.HostView)
	publish    func(context.Context, *vmflowv1.HostView) error
	debounce   time.Duration
	checkEvery time.Duration
	log        *zap.Logger
	nudge      chan struct{}
	// published: the last view published, without its time; nil until
	// the first publish went through.
	published *vmflowv1.HostView
	// onPublish, if set, is told each publish (tests, metrics).
	onPublish func(*vmflowv1.HostView)
}

func newViewPublisher(offers *lease.Offers, static func(*vmflowv1.HostView), publish func(context.Context, *vmflowv1.HostView) error,
	debounce, checkEvery time.Duration, log *zap.Logger) *viewPublisher {
	return &viewPublisher{offers: offers, static: static, publish: publish, debounce: debounce, checkEvery: checkEvery,
		log: log, nudge: make(chan struct{}, 1)}
}

// publishTo is Publish on c to the workflow worker's queue.
func publishTo(c client.Client, queue string) func(context.Context, *vmflowv1.HostView) error {
	return func(ctx context.Context, v *vmflowv1.HostView) error { return fleet.Publish(ctx, c, queue, v) }
}

// defaultFleetCheckEvery is --fleet-check-every's default.
const defaultFleetCheckEvery = 5 * time.Second

// Changed says the host's offer may have changed; it never blocks.
func (p *viewPublisher) Changed() {
	select {
	case p.nudge <- struct{}{}:
	default:
	}
}

// run publishes at once, then on change, until ctx ends.
func (p *viewPublisher) run(ctx context.Context) {
	every := p.checkEvery
	if every <= 0 { // a Config not from ParseFlags: its default
		every = defaultFleetCheckEvery
	}
	check := time.NewTicker(every)
	defer check.Stop()
	p.once(ctx)
	for {
		select {
		case <-ctx.Done():
			return
		case <-check.C:
		case <-p.nudge:
			// Let a burst of changes settle into one publish.
			t := time.NewTimer(p.debounce)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			select { // a nudge that came while settling is this publish's
			case <-p.nudge:
			default:
			}
		}
		p.once(ctx)
	}
}

// once computes the view and publishes it when it differs from the last
// one published (or none was).
func (p *viewPublisher) once(ctx context.Context) {
	v, err := p.offers.View(ctx)
	if err != nil {
		p.log.Warn("fleet view: cannot read what the host offers; the last published view stands", zap.Error(err))
		return
	}
	p.static(v)
	if p.published != nil && sameOffer(v, p.published) {
		return
	}
	out := proto.CloneOf(v)
	out.PublishedAt = time.Now().UTC().Format(time.RFC3339Nano)
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := p.publish(ctx, out); err != nil {
		// The next change or look tries again.
		p.log.Warn("fleet view not published", zap.Error(err))
		return
	}
	p.published = v
	p.log.Info("fleet view published", zap.Bool("draining", v.GetDraining()), zap.Uint32("vcpus_free", v.GetVcpusFree()),
		zap.Uint32("memory_free_mib", v.GetMemoryFreeMib()), zap.Uint32("in_flight", v.GetInFlight()), zap.Int("gpu_offers", len(v.GetGpus())))
	if p.onPublish != nil {
		p.onPublish(out)
	}
}

// sameOffer reports whether a and b offer the same: equal but for
// in_flight, which rides along with the next real change. A launch turns
// a reservation in flight into a running VM without changing what is
// free (the reservation held it already), and costs no publish.
func sameOffer(a, b *vmflowv1.HostView) bool {
	a, b = proto.CloneOf(a), proto.CloneOf(b)
	a.InFlight, b.InFlight = 0, 0
	return proto.Equal(a, b)
}

// agentVersion is this build's, for the view.
func agentVersion() string { return service.Info().Version }
