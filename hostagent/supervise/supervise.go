package supervise

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"

	"go.uber.org/zap"

	"vmflow/hostagent/admission"
	"vmflow/hostagent/network"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	"vmflow/internal/contract"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Defaults for Config.
const (
	DefaultLockTimeout      = time.Minute
	DefaultProgressInterval = 5 * time.Second
)

// Config is what New needs. Only Store is required.
type Config struct {
	// Store holds the instance records (required).
	Store *store.Store
	// QEMU is the QEMU binary; vmm.DefaultBinary looked up in PATH when empty.
	QEMU string
	// Logger receives progress lines, each with instance_id; zap.NewNop when nil.
	Logger *zap.Logger

	// GracefulTimeout is Stop's wait after system_powerdown when the caller
	// passes none (contract.DefaultGracefulTimeout).
	GracefulTimeout time.Duration
	// GroupExitCap bounds the wait for the whole thread group after SIGKILL,
	// and the kill-and-reap of a failed launch (contract.DefaultGroupExitCap:
	// VFIO teardown can take seconds).
	GroupExitCap time.Duration
	// ReadyTimeout bounds fork to QMP "running" (vmm.DefaultReadyTimeout).
	ReadyTimeout time.Duration
	// LockTimeout bounds how long background work (recording an exit, a
	// restart) waits for an instance's store lock (DefaultLockTimeout).
	LockTimeout time.Duration
	// ProgressInterval is how often WaitExit reports progress
	// (DefaultProgressInterval).
	ProgressInterval time.Duration
	// RestartBackoff and RestartBackoffMax shape the restart backoff
	// (DefaultRestartBackoff doubling up to DefaultRestartBackoffMax).
	RestartBackoff    time.Duration
	RestartBackoffMax time.Duration

	// QEMUUIDs is the range every QEMU's own uid is taken from
	// (store.DefaultQEMUUIDRange when zero). Agents sharing a machine need
	// disjoint ranges.
	QEMUUIDs store.UIDRange
	// KVMDevice is the KVM node New checks once (vmm.DefaultKVMDevice when
	// empty): when its group cannot open it, KVM launches fail with
	// vmm.ErrKVMAccess and everything else goes on.
	KVMDevice string
	// EtcDir holds the host's passwd, group, subuid and subgid ("/etc"
	// when empty): a QEMUUIDs range overlapping what they hand out is
	// refused at every launch (store.CheckUIDRange).
	EtcDir string
	// DevRoot holds the VFIO group nodes (<DevRoot>/vfio/<group>) given to
	// a QEMU's uid while it may run ("/dev" when empty).
	DevRoot string
	// Cgroups gives every QEMU a cgroup of its own (vmm.CgroupsFor); nil
	// leaves QEMUs in the agent's. TearDown removes an instance's.
	Cgroups vmm.Cgroups
	// VMIO is the operator's disk I/O bound for every VM (--vm-io-*),
	// applied through its cgroup; a spec's own may only be tighter.
	VMIO vmm.IOLimits
	// JailSetup, when set, jails every QEMU (vmm.Jail) with this binary as
	// the setup stage: the agent's own (os.Executable). Its root is mounted
	// on the folder "root" of the instance's directory.
	JailSetup string
	// FDStore keeps every VM's log pipe for the next agent (systemd's fd
	// store: vmm.NewSystemdFDStore); nil without one (make dev), where
	// what QEMU writes while no agent runs is lost.
	FDStore vmm.FDStore
	// Network puts a VM whose spec asks for a network on the host's bridge
	// at every launch (its TAP made and opened, QEMU given the descriptor);
	// nil: the host has none, and such a launch fails.
	Network *network.Net

	// OnExitRecorded, when set, is called after an exit nobody asked for
	// (a crash, a kill from outside, a guest power-off) is written to the
	// record, with the time from the exit being observable (the reaper
	// returned, or the pidfd became readable) to the record written: the
	// agent's vmflow_exit_detect_seconds. It runs on the watcher goroutine
	// and must not block.
	OnExitRecorded func(detect time.Duration)
	// OnRestartRefused, when set, is called after a restart was refused
	// because PrepareLaunch's admission no longer admits the record
	// (admission.ErrAdmissionRefused) and the refusal is written to the record:
	// the agent's vmflow_restarts_refused_total. It must not block.
	OnRestartRefused func()
	// OnRestartDeviceMissing, when set, is called after a restart failed
	// because its vGPU is missing and could not be re-created
	// (lease.ErrClaimDeviceMissing), with needs_attention written: the
	// agent's vmflow_restarts_device_missing_total. It must not block.
	OnRestartDeviceMissing func()
	// OnGuestLogDropped, when set, is called once per VM whose guest output
	// lost bytes (the log's disk full, failing or behind), with how many,
	// when its log pump ends: the agent's
	// vmflow_guest_log_dropped_bytes_total. It must not block.
	OnGuestLogDropped func(bytes uint64)

	// PrepareLaunch returns the QEMU spec of the locked instance rec. It is
	// called under the instance lock before every launch, the first and
	// every restart alike, so what it checks or sets up (admission, a vGPU
	// device that must exist) holds when QEMU starts. It may update the
	// record through l. An error wrapping admission.ErrAdmissionRefused stops a
	// restart for good: the record gets last_error and needs_attention and
	// nothing is rescheduled (the policy will not change until the agent
	// restarts). It runs as the launch's "ensure leases" stage, after
	// Admit. Default: DefaultPrepareLaunch, which admits nothing against a
	// host policy and refuses a record with a vGPU: the agent sets
	// admission.Assemble.
	PrepareLaunch func(ctx context.Context, l *store.Locked, rec *vmflowv1.InstanceRecord) (vmm.VMSpec, error)
	// Admit, when set, admits the record against this host's policy before
	// every launch (the launch's first stage), before PrepareLaunch holds or
	// opens anything; a refusal wraps admission.ErrAdmissionRefused as
	// PrepareLaunch's does. The agent sets admission.Host.AdmitRecord.
	Admit func(ctx context.Context, rec *vmflowv1.InstanceRecord) error
	// PlaceCapacity, when set, makes the locked instance's share of the
	// host (its capacity lease) active before every launch, right after
	// Admit, and returns the record as written; a refusal
	// (lease.ErrNoHostCapacity) starts nothing. The agent sets
	// lease.Capacity.Place.
	PlaceCapacity func(ctx context.Context, l *store.Locked) (*vmflowv1.InstanceRecord, error)
	// LaunchConcurrency bounds the QEMU starts in flight, fork to QMP
	// ready (DefaultLaunchConcurrency when 0): the rest wait their turn,
	// and each one's ReadyTimeout counts from its own fork.
	LaunchConcurrency int
	// Now stamps records (time.Now when nil).
	Now func() time.Time
}

// Supervisor owns the VMs of one host. Create it with New, call Start once
// to re-attach what outlived the previous agent, and Close when done (the
// VMs keep running).
type Supervisor struct {
	cfg   Config
	st    *store.Store
	log   *zap.Logger
	hooks testHooks

	ctx    context.Context // ends with Close: background work stops
	cancel context.CancelFunc
	wg     sync.WaitGroup

	// kvm is /dev/kvm as New found it: the supplementary group a KVM QEMU
	// gets, or the error every KVM launch returns.
	kvm vmm.KVMAccess

	mu     sync.Mutex
	insts  map[string]*instance
	closed bool

	// starts holds a token per QEMU start in flight (LaunchConcurrency).
	starts chan struct{}
}

// DefaultLaunchConcurrency is one QEMU start in flight per host CPU, at
// least 2 and at most 16: a start is CPU-bound (QEMU's own start-up, the
// jail's mounts), and a 200-VM burst on 2 cores that started every QEMU at
// once let some miss their ReadyTimeout.
func DefaultLaunchConcurrency() int { return min(max(runtime.NumCPU(), 2), 16) }

// testHooks are seams only tests set, on a new Supervisor before it does
// any work; all nil in production.
type testHooks struct {
	// beforeRecorded runs inside OnStarted, after the fork and before the
	// pid is in the record: the agent-kill test blocks here to be killed
	// while only the launch marker says a QEMU may exist.
	beforeRecorded func(id string, pid proc.Identity)
	// afterStarted runs inside OnStarted, after the pid is in the record:
	// the agent-restart test blocks here to be killed between fork and QMP.
	afterStarted func(id string, pid proc.Identity)
	// readProcMem stands in for reading another process's environ or
	// cmdline while looking for an unrecorded QEMU (nil: the real read):
	// the bounded-scan test blocks here as the kernel's read does while the
	// target's mmap lock is held.
	readProcMem func(path string) ([]byte, error)
	// launchStages, when set, gives the stages a launch runs (launchStages
	// in, the test's list out): the undo tests cut the list and fail the
	// next stage.
	launchStages func([]launchStage) []launchStage
}

// WithDefaults is c with every zero field that has a default set to it.
func (c Config) WithDefaults() Config {
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	if c.GracefulTimeout <= 0 {
		c.GracefulTimeout = contract.DefaultGracefulTimeout
	}
	if c.GroupExitCap <= 0 {
		c.GroupExitCap = contract.DefaultGroupExitCap
	}
	if c.ReadyTimeout <= 0 {
		c.ReadyTimeout = vmm.DefaultReadyTimeout
	}
	if c.LockTimeout <= 0 {
		c.LockTimeout = DefaultLockTimeout
	}
	if c.ProgressInterval <= 0 {
		c.ProgressInterval = DefaultProgressInterval
	}
	if c.RestartBackoff <= 0 {
		c.RestartBackoff = DefaultRestartBackoff
	}
	if c.RestartBackoffMax <= 0 {
		c.RestartBackoffMax = DefaultRestartBackoffMax
	}
	if c.PrepareLaunch == nil {
		c.PrepareLaunch = DefaultPrepareLaunch
	}
	if c.LaunchConcurrency <= 0 {
		c.LaunchConcurrency = DefaultLaunchConcurrency()
	}
	if c.QEMUUIDs == (store.UIDRange{}) {
		c.QEMUUIDs = store.DefaultQEMUUIDRange
	}
	if c.DevRoot == "" {
		c.DevRoot = "/dev"
	}
	if c.EtcDir == "" {
		c.EtcDir = "/etc"
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

// New checks cfg and returns a Supervisor. It touches no VM; Start does.
func New(cfg Config) (*Supervisor, error) {
	if cfg.Store == nil {
		return nil, errors.New("supervise: Config.Store is required")
	}
	cfg = cfg.WithDefaults()
	kvm := vmm.CheckKVM(cfg.KVMDevice)
	if kvm.Err != nil {
		// Not fatal: TCG launches, re-attach and stops go on (invariant 12).
		cfg.Logger.Warn("no usable KVM: spawns that ask for it are refused, accel \"tcg\" runs without it", zap.Error(kvm.Err))
	}
	if err := store.CheckUIDRange(cfg.QEMUUIDs, cfg.EtcDir); err != nil {
		// Not fatal either: running VMs are supervised, launches refused.
		cfg.Logger.Warn("launches will be refused", zap.Error(err))
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Supervisor{
		cfg: cfg, st: cfg.Store, log: cfg.Logger,
		ctx: ctx, cancel: cancel, kvm: kvm,
		insts:  map[string]*instance{},
		starts: make(chan struct{}, cfg.LaunchConcurrency),
	}, nil
}

// Close stops background work and releases pidfds and QMP connections; the
// VMs keep running for the next Start. Idempotent.
func (s *Supervisor) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	insts := make([]*instance, 0, len(s.insts))
	for _, in := range s.insts {
		insts = append(insts, in)
	}
	s.mu.Unlock()
	s.cancel()
	for _, in := range insts {
		in.cancelRestart()
	}
	// Watchers end on the cancelled context and close their VMs.
	s.wg.Wait()
	return nil
}

// goBackground runs fn in a goroutine Close waits for; after Close it does
// not run fn at all.
func (s *Supervisor) goBackground(fn func()) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		fn()
	}()
	return true
}

// DefaultPrepareLaunch is Config.PrepareLaunch's default: the record's spec
// alone. It refuses (ErrNoSpec) a vGPU or images, which need the agent's wiring.
func DefaultPrepareLaunch(_ context.Context, _ *store.Locked, rec *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
	if rec.GetSpec() == nil {
		return vmm.VMSpec{}, fmt.Errorf("instance %s: %w: the record has no spec", rec.GetId(), ErrNoSpec)
	}
	if rec.GetSpec().GetVgpuProfile() != "" || store.ClaimHeld(rec) || len(store.HeldPassthrough(rec)) > 0 {
		return vmm.VMSpec{}, fmt.Errorf("instance %s: %w: it has a vGPU; set Config.PrepareLaunch", rec.GetId(), ErrNoSpec)
	}
	if s := rec.GetSpec(); s.GetKernel() != "" || s.GetInitrd() != "" || s.GetDisk() != "" {
		return vmm.VMSpec{}, fmt.Errorf("instance %s: %w: it has images; set Config.PrepareLaunch", rec.GetId(), ErrNoSpec)
	}
	return admission.ForRecord(rec, nil), nil
}
