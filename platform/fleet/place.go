package fleet

import (
	"context"
	"slices"
	"sync"
	"time"

	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/worker"
	"go.uber.org/zap"

	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// DefaultK is how many candidates a placement asks for (E2B's best-of-3).
const DefaultK = 3

// Placer is the workflow worker's placement: the local activities
// ChooseHosts and FindInstanceHost (Register), over the fleet view. It
// remembers its own recent choices per host until the host publishes a
// view made after them (or PendingTTL passes), so a burst placed from one
// worker does not pile onto the host its stale view ranks first.
type Placer struct {
	Client client.Client
	Logger *zap.Logger
	// PendingTTL bounds how long a choice counts when its host never
	// republishes (default 30 s).
	PendingTTL time.Duration
	// LiveTTL is how long a poller check stands (default 2 s): a burst
	// asks DescribeTaskQueue once per host, not once per spawn.
	LiveTTL time.Duration
	Now     func() time.Time

	mu      sync.Mutex
	pending map[string][]pendingAsk
	live    map[string]liveAt
}

type pendingAsk struct {
	at  time.Time
	ask Ask
}

type liveAt struct {
	at   time.Time
	live bool
}

// Register registers ChooseHosts and FindInstanceHost under the names
// the workflows call them by.
func (p *Placer) Register(r worker.ActivityRegistry) {
	r.RegisterActivityWithOptions(p.ChooseHosts, activity.RegisterOptions{Name: workflows.LocalActivityChooseHosts})
	r.RegisterActivityWithOptions(p.FindInstanceHost, activity.RegisterOptions{Name: workflows.LocalActivityFindInstanceHost})
}

func (p *Placer) now() time.Time {
	if p.Now == nil {
		return time.Now()
	}
	return p.Now()
}

func (p *Placer) log() *zap.Logger {
	if p.Logger == nil {
		return zap.NewNop()
	}
	return p.Logger
}

// ChooseHosts reads the view and returns the K best live hosts for the
// spawn, leaving out req.exclude; with all, every host scored.
func (p *Placer) ChooseHosts(ctx context.Context, req *vmflowv1.ChooseHostsRequest) (*vmflowv1.ChooseHostsResult, error) {
	spawn := req.GetSpawn()
	a := AskOf(spawn)
	res := &vmflowv1.ChooseHostsResult{Ask: a.String()}
	if spawn.GetInstanceId() != "" {
		prev, err := previousHost(ctx, p.Client, spawn.GetInstanceId(), req.GetRunId())
		if err != nil {
			return nil, err
		}
		if prev != "" {
			res.PreviousHost = prev
			if !req.GetAll() {
				res.Candidates = []*vmflowv1.HostCandidate{{HostId: prev, Live: true, Fits: true,
					Why: "an earlier spawn of this instance was placed here and no delete has completed since"}}
				return res, nil
			}
		}
	}
	views, err := Read(ctx, p.Client, req.GetTaskQueue())
	if err != nil {
		return nil, err
	}
	now := p.now()
	views, inFlight := p.withPending(views, now)
	ranked := Ranked(views, a, inFlight)
	k := int(req.GetK())
	if k <= 0 {
		k = DefaultK
	}
	for _, c := range ranked {
		c.ViewAgeSeconds = ageSeconds(c.GetView(), now)
		if c.GetFits() {
			res.HostsFit++
		}
		if !c.GetFits() || slices.Contains(req.GetExclude(), c.GetHostId()) || (len(res.Candidates) >= k && !req.GetAll()) {
			continue
		}
		live, err := p.isLive(ctx, c.GetHostId(), now)
		if err != nil {
			return nil, err
		}
		c.Live = live
		if !live {
			c.Why = "no agent polls its task queue; " + c.Why
			continue
		}
		if len(res.Candidates) < k {
			res.Candidates = append(res.Candidates, c)
		}
	}
	res.HostsSeen = uint32(len(views))
	if req.GetAll() {
		res.All = ranked
	} else {
		for _, c := range res.Candidates {
			c.View = nil // the marker records the choice, not every view
		}
	}
	if len(res.Candidates) == 0 {
		res.FleetBest = Best(views, a)
	} else if !req.GetAll() {
		p.remember(res.Candidates[0].GetHostId(), a, now)
	}
	if res.PreviousHost != "" {
		// The dry run answers as the spawn would: the earlier host alone.
		res.Candidates = []*vmflowv1.HostCandidate{{HostId: res.PreviousHost, Live: true, Fits: true,
			Why: "an earlier spawn of this instance was placed here and no delete has completed since"}}
	}
	p.log().Debug("placement candidates", zap.String("instance_id", spawn.GetInstanceId()), zap.Int("hosts", len(views)),
		zap.Uint32("fit", res.GetHostsFit()), zap.Int("candidates", len(res.GetCandidates())))
	return res, nil
}

// FindInstanceHost is InstanceHost as a local activity.
func (p *Placer) FindInstanceHost(ctx context.Context, req *vmflowv1.FindInstanceHostRequest) (*vmflowv1.FindInstanceHostResult, error) {
	host, placing, err := InstanceHost(ctx, p.Client, req.GetInstanceId())
	if err != nil {
		return nil, err
	}
	return &vmflowv1.FindInstanceHostResult{HostId: host, Placing: placing}, nil
}

func ageSeconds(v *vmflowv1.HostView, now time.Time) uint32 {
	t, err := time.Parse(time.RFC3339Nano, v.GetPublishedAt())
	if err != nil || now.Before(t) {
		return 0
	}
	return uint32(min(now.Sub(t)/time.Second, 1<<31))
}

// withPending takes this placer's recent choices off the views they are
// newer than, and counts them per host; older ones are dropped.
func (p *Placer) withPending(views []*vmflowv1.HostView, now time.Time) ([]*vmflowv1.HostView, map[string]uint32) {
	ttl := p.PendingTTL
	if ttl <= 0 {
		ttl = 30 * time.Second
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	counts := map[string]uint32{}
	out := make([]*vmflowv1.HostView, 0, len(views))
	for _, v := range views {
		published, _ := time.Parse(time.RFC3339Nano, v.GetPublishedAt())
		keep := p.pending[v.GetHostId()][:0]
		for _, pa := range p.pending[v.GetHostId()] {
			if now.Sub(pa.at) < ttl && pa.at.After(published) {
				keep = append(keep, pa)
				v = Take(v, pa.ask)
				counts[v.GetHostId()]++
			}
		}
		if p.pending != nil {
			p.pending[v.GetHostId()] = keep
		}
		out = append(out, v)
	}
	return out, counts
}

func (p *Placer) remember(host string, a Ask, now time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pending == nil {
		p.pending = map[string][]pendingAsk{}
	}
	p.pending[host] = append(p.pending[host], pendingAsk{at: now, ask: a})
}

func (p *Placer) isLive(ctx context.Context, host string, now time.Time) (bool, error) {
	ttl := p.LiveTTL
	if ttl <= 0 {
		ttl = 2 * time.Second
	}
	p.mu.Lock()
	l, ok := p.live[host]
	p.mu.Unlock()
	if ok && now.Sub(l.at) < ttl {
		return l.live, nil
	}
	live, err := Live(ctx, p.Client, host)
	if err != nil {
		return false, err
	}
	p.mu.Lock()
	if p.live == nil {
		p.live = map[string]liveAt{}
	}
	p.live[host] = liveAt{at: now, live: live}
	p.mu.Unlock()
	return live, nil
}
