package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/client"

	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/network"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/internal/crashpoint"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/stacktest"
	"vmflow/workflows"
)

// The crash matrix: one run per crash point, and
// one per activity of spawn and delete with the worker killed right after
// that activity completed. Each run has a stack of its own (host id, state
// dir, simulator, agent, worker) against the shared dev server, spawns an
// instance with a vGPU (two in the several cases) under QEMU -machine none and deletes it, restarting
// whatever died, then checks the host: after the spawn exactly one QEMU, one
// device, one record; after the delete none of them and no socket.
//
// VMFLOW_CRASH_PARALLEL sets how many runs go at once (default 4);
// VMFLOW_CRASH_ONLY=substring runs only the cases whose name contains it.

// crashCapFast caps every host activity's StartToClose, so a killed agent
// is noticed in seconds (worker --activity-timeout-cap).
const crashCapFast = 5 * time.Second

// crashWorkflowWait bounds each of spawn and delete in one run.
const crashWorkflowWait = 2 * time.Minute

// scenario is what a run does besides spawn then delete.
type scenario int

const (
	// plainRun: spawn, then delete with a 1 s graceful timeout
	// (-machine none ignores the power button, so quit ends it).
	_ scenario = iota
	// stuckRun freezes QEMU (SIGSTOP) before the delete: QMP does not
	// answer, quit has no effect, and the ladder goes on to SIGKILL.
	stuckRun
	// reconcileRun makes the delete's release fail (the delete parks in
	// release-failed with an hour's backoff), clears the fault and
	// triggers the host's reconcile Schedule, which releases the claim.
	reconcileRun
	// migrateRun starts the agent unarmed, and after the spawn kills it,
	// rewrites the record in the shape before leases and starts it armed:
	// the point is in the migration agent start runs.
	migrateRun
	// severalRun spawns with two vGPUs: the points armed at their second
	// hit crash between the first device and the second.
	severalRun
	// rollbackRun asks for one vGPU more than the host has: the claim
	// fails part-way and undoes what it made, the spawn fails, and nothing
	// is left. The neighbour spawns only after it, so the two never race
	// for the last device.
	rollbackRun
	// passthroughRun spawns with two whole GPUs (the agent runs with
	// --gpu-passthrough all) instead of a vGPU.
	passthroughRun
)

// passthroughPoints run in a passthroughRun; the sysfs write point is also
// armed at later writes (a bind is three to four writes per function).
var passthroughPoints = []string{crashpoint.PassthroughIntentWritten, crashpoint.PassthroughSysfsWritten,
	crashpoint.PassthroughActivated, crashpoint.PassthroughReleasing, crashpoint.PassthroughReturned, crashpoint.PassthroughReleased}

// severalPoints are armed at their second hit in a severalRun: the second
// vGPU's intent, device and activation, and its release.
var severalPoints = []string{crashpoint.ClaimIntentWritten, crashpoint.ClaimDeviceCreated, crashpoint.ClaimActivated,
	crashpoint.ReleaseReleasing, crashpoint.ReleaseWritten, crashpoint.ReleaseRecorded}

// quarantinePoints run with a release that fails: once with each vGPU
// driver, once with whole GPUs.
var quarantinePoints = []string{crashpoint.QuarantineDue, crashpoint.QuarantineWritten}

// quarantineAfter is the quarantine runs' --gpu-quarantine-after: more than
// one, so a count lost to the kill would show.
const quarantineAfter = 2

type crashCase struct {
	name     string
	point    string // VMFLOW_CRASHPOINT for the agent's first start; "" for none
	workflow string // worker cases: "spawn" or "delete"
	activity string // worker cases: killed after this activity completed
	scenario scenario
	vendor   bool // the agent runs the vendor-VFIO driver (else mdev)
	// quarantine: the agent quarantines after quarantineAfter failed
	// releases, and the delete's release fails (see quarantineDuringDelete).
	quarantine bool
	network    bool // the agent has a network and the instances ask for it (q35, TCG)
}

// vendorProfile is a profile of the simulator's vendor-VFIO VFs; the mdev
// runs use noneSpawn's.
const vendorProfile = "NVIDIA L40-1Q"

// agentLogLine is the agent's log message when each activity succeeded: a
// worker case kills the worker as soon as the agent says it (the history
// shows the completion only after the worker may already have moved on).
var agentLogLine = map[string]string{
	workflows.ActivityCreateRecord:  "record created",
	workflows.ActivityClaimDevices:  "vGPU claimed",
	workflows.ActivityLaunchVM:      "VM running",
	workflows.ActivityBeginDelete:   "delete begun",
	workflows.ActivityStopVM:        "VM stopped",
	workflows.ActivityWaitVMExit:    "thread group gone",
	workflows.ActivityReleaseLeases: "leases released",
	workflows.ActivityTearDown:      "runtime files removed",
	workflows.ActivityDeleteRecord:  "record deleted",
	// The combined activities of new runs: their last step's line.
	workflows.ActivityPrepareSpawn:   "vGPU claimed",
	workflows.ActivityStopInstance:   "thread group gone",
	workflows.ActivityRemoveInstance: "record deleted",
}

// crashOutcome is one row of the matrix's table.
type crashOutcome struct {
	name       string
	point      string // the point, without @N
	hit        string
	restarts   int
	spawn      string
	delete     string
	notes      []string
	violations []string
	done       bool
}

func crashCases() []crashCase {
	var cases []crashCase
	for _, vendor := range []bool{false, true} {
		for _, p := range crashpoint.All {
			c := crashCase{name: "agent/" + p, point: p, vendor: vendor, network: strings.HasPrefix(p, "network.")}
			if vendor {
				if c.network || strings.HasPrefix(p, "capacity.") {
					continue // the network's and the ledger's points do not depend on the vGPU driver
				}
				c.name = "agent-vendor/" + p
			}
			switch p {
			case crashpoint.StopKillSent:
				c.scenario = stuckRun
			case crashpoint.ReconcileReleased:
				c.scenario = reconcileRun
			case crashpoint.StoreMigrated:
				c.scenario = migrateRun
			case crashpoint.ClaimRollingBack, crashpoint.ClaimRolledBack:
				c.scenario = rollbackRun
			}
			c.quarantine = slices.Contains(quarantinePoints, p)
			if slices.Contains(passthroughPoints, p) {
				if vendor {
					continue // the vGPU driver plays no part
				}
				c.scenario = passthroughRun
			}
			cases = append(cases, c)
		}
		for _, p := range severalPoints {
			c := crashCase{name: "agent-several/" + p + "@2", point: p + "@2", vendor: vendor, scenario: severalRun}
			if vendor {
				c.name = "agent-vendor-several/" + p + "@2"
			}
			cases = append(cases, c)
		}
	}
	// The generic atomic write is hit by every record write: arm it at
	// later writes too (the 2nd is the claim's intent, the 4th the pid,
	// the 7th the move to deleting, the 10th the stop ladder's gone, the
	// 12th the release recorded; the 6th is the manual-stop marker).
	for _, n := range []int{2, 4, 6, 7, 10, 12} {
		for _, p := range []string{crashpoint.StoreWriteTemp, crashpoint.StoreWriteRenamed} {
			spec := p + "@" + strconv.Itoa(n)
			cases = append(cases, crashCase{name: "agent/" + spec, point: spec})
		}
	}
	for _, p := range []string{crashpoint.PassthroughIntentWritten + "@2", crashpoint.PassthroughActivated + "@2", crashpoint.PassthroughReleased + "@2",
		crashpoint.PassthroughSysfsWritten + "@2", crashpoint.PassthroughSysfsWritten + "@5", crashpoint.PassthroughSysfsWritten + "@9",
		crashpoint.PassthroughSysfsWritten + "@12", crashpoint.PassthroughSysfsWritten + "@15"} {
		cases = append(cases, crashCase{name: "agent-passthrough/" + p, point: p, scenario: passthroughRun})
	}
	for _, p := range quarantinePoints {
		cases = append(cases, crashCase{name: "agent-passthrough/" + p, point: p, scenario: passthroughRun, quarantine: true})
	}
	// The activities new runs schedule (the combined ones: each step's
	// own crash points are in the agent cases above).
	for _, a := range []string{workflows.ActivityPrepareSpawn, workflows.ActivityLaunchVM} {
		cases = append(cases, crashCase{name: "worker/spawn/" + a, workflow: "spawn", activity: a})
	}
	for _, a := range []string{workflows.ActivityStopInstance, workflows.ActivityReleaseLeases, workflows.ActivityRemoveInstance} {
		cases = append(cases, crashCase{name: "worker/delete/" + a, workflow: "delete", activity: a})
	}
	if only := os.Getenv("VMFLOW_CRASH_ONLY"); only != "" {
		cases = slices.DeleteFunc(cases, func(c crashCase) bool { return !strings.Contains(c.name, only) })
	}
	return cases
}

func crashParallel(t *testing.T) int {
	v := os.Getenv("VMFLOW_CRASH_PARALLEL")
	if v == "" {
		return 4
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		t.Fatalf("VMFLOW_CRASH_PARALLEL=%q: want a positive integer", v)
	}
	return n
}

func TestCrashMatrix(t *testing.T) {
	timeTest(t)
	if testing.Short() {
		t.Skip("the crash matrix takes minutes; not in -short")
	}
	requireQEMU(t)
	requireGuest(t)
	buildBinaries(t) // once, before the runs race for it

	cases := crashCases()
	if len(cases) == 0 {
		t.Skip("VMFLOW_CRASH_ONLY matches no case")
	}
	outcomes := make([]*crashOutcome, len(cases))
	// Subtests run from goroutines (testing allows concurrent Run calls)
	// rather than t.Parallel, so the width is this semaphore's, not
	// -parallel's (GOMAXPROCS, 2 here): the runs mostly wait on timeouts.
	sem := make(chan struct{}, crashParallel(t))
	var wg sync.WaitGroup
	begin := time.Now()
	for i, c := range cases {
		o := &crashOutcome{name: c.name, point: strings.SplitN(c.point, "@", 2)[0], hit: "-", spawn: "-", delete: "-"}
		outcomes[i] = o
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			t.Run(c.name, func(t *testing.T) { runCrashCase(t, c, o) })
		}()
	}
	wg.Wait()
	t.Logf("crash matrix: %d runs in %s", len(cases), time.Since(begin).Round(time.Second))

	var b strings.Builder
	fmt.Fprintf(&b, "\n%-44s | %-5s | %-8s | %-30s | %-30s | %s\n", "case", "hit", "restarts", "spawn", "delete", "violations / notes")
	violations := 0
	hitPoints := map[string]bool{}
	for _, o := range outcomes {
		if !o.done {
			o.violations = append(o.violations, "run aborted (see its log)")
		}
		violations += len(o.violations)
		if o.hit == "yes" {
			hitPoints[o.point] = true
		}
		detail := strings.Join(o.violations, "; ")
		if len(o.notes) > 0 {
			detail = strings.TrimPrefix(detail+"; notes: "+strings.Join(o.notes, "; "), "; ")
		}
		fmt.Fprintf(&b, "%-44s | %-5s | %-8d | %-30s | %-30s | %s\n", o.name, o.hit, o.restarts, clip(o.spawn, 30), clip(o.delete, 30), detail)
	}
	t.Log(b.String())
	if os.Getenv("VMFLOW_CRASH_ONLY") == "" {
		for _, p := range crashpoint.All {
			if !hitPoints[p] {
				t.Errorf("crash point %s was never hit in the matrix", p)
			}
		}
	}
	if violations > 0 {
		t.Errorf("crash matrix: %d invariant violations (table above)", violations)
	}
}

func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n-1] + "…"
}

// runCrashCase is one run of the matrix; it fills o as it goes, so a run
// that aborts still says how far it got.
func runCrashCase(t *testing.T, c crashCase, o *crashOutcome) {
	workerArgs := []string{"--activity-timeout-cap", crashCapFast.String()}
	switch c.scenario {
	case stuckRun:
		// powerdown (2 s QMP timeout) + quit's wait (5 s) + SIGKILL must
		// fit one StopVM attempt.
		workerArgs = []string{"--activity-timeout-cap", "15s"}
	case reconcileRun:
		// Only the reconcile (or a retry signal) may end the delete's wait.
		workerArgs = append(workerArgs, "--release-backoff", "1h", "--release-backoff-max", "1h")
	}
	if c.network {
		// A q35 guest's launch (TAP, filter, QEMU under TCG) takes seconds
		// on a loaded machine: 5 s left a restarted agent's LaunchVM no room.
		workerArgs = []string{"--activity-timeout-cap", "15s"}
	}
	if c.quarantine {
		// Only a retry signal may end the delete's wait.
		workerArgs = append(workerArgs, "--release-backoff", "1h", "--release-backoff-max", "1h")
	}
	e := newEnv(t, envOptions{noStart: true, workerArgs: workerArgs, network: c.network})
	if c.vendor {
		e.agent.Args = append(e.agent.Args, "--vgpu-driver", "vendor") // the last flag wins
	}
	if c.scenario == passthroughRun {
		e.agent.Args = append(e.agent.Args, "--gpu-passthrough", "all")
	}
	if c.quarantine {
		e.agent.Args = append(e.agent.Args, "--gpu-quarantine-after", strconv.Itoa(quarantineAfter))
	}
	id := "crash-" + suffix(t)
	plainEnv := slices.Clone(e.agent.Env)
	armedEnv := append(slices.Clone(plainEnv), crashpoint.EnvVar+"="+c.point)
	if c.point != "" && c.scenario != migrateRun {
		e.agent.Env = armedEnv
	}
	d := &crashDriver{e: e, c: c, o: o, plainEnv: plainEnv, neighbour: "crash-nb-" + suffix(t)}
	if msg, ok := agentLogLine[c.activity]; ok {
		e.agent.LineWatch = true
		d.logSaid = e.agent.Watch(func(line string) bool { return strings.Contains(line, `"msg":"`+msg+`"`) })
	}
	e.agent.Start(t)
	e.worker.Start(t)

	// Spawn.
	spawnRun := e.startSpawn(d.spawnRequest(id))
	var res vmflowv1.SpawnResult
	err := d.drive(spawnRun, "spawn", &res)
	o.spawn = outcomeOf(err)
	switch {
	case c.scenario == rollbackRun:
		if err == nil || !strings.Contains(err.Error(), workflows.ErrTypeNoCapacity) {
			o.violations = append(o.violations, fmt.Sprintf("a spawn asking for more vGPUs than the host has: want %s, got %v", workflows.ErrTypeNoCapacity, err))
		}
		// Nothing bound once the spawn failed (its clean-up's delete may
		// still be removing the record, leases gone already).
		o.violations = append(o.violations, d.checkLedger("after the failed spawn")...)
		if d.neighbourRun == nil {
			d.neighbourRun = e.startSpawn(d.spawnRequest(d.neighbour))
		}
	case err != nil:
		o.violations = append(o.violations, "spawn failed: "+short(err))
	}
	d.waitNeighbour()
	if err == nil {
		o.violations = append(o.violations, d.checkSpawned(id)...)
	}
	o.violations = append(o.violations, d.checkNeighbour("after spawn")...)
	if c.scenario == migrateRun && err == nil {
		o.violations = append(o.violations, d.restartOldShape(id, armedEnv)...)
	}

	// Delete.
	var qemu proc.Identity
	if rec, err := e.st.Get(id); err == nil && rec.GetProcess() != nil {
		qemu = store.IdentityOf(rec.GetProcess())
	}
	switch c.scenario {
	case stuckRun:
		if !qemu.Valid() {
			o.violations = append(o.violations, "stuck scenario: no QEMU recorded to freeze")
		} else if err := proc.Signal(qemu, syscall.SIGSTOP); err != nil {
			o.violations = append(o.violations, fmt.Sprintf("stuck scenario: SIGSTOP %v: %v", qemu, err))
		}
	case reconcileRun:
		e.sim.Set(t, vgpusim.CtlFailRelease, "EBUSY")
	}
	var quarantined []string
	if c.quarantine {
		quarantined = d.quarantineWant(id)
		e.sim.Set(t, d.quarantineFault(), "EIO")
	}
	delRun := e.startDelete(id, 1)
	switch {
	case c.scenario == reconcileRun:
		d.reconcileDuringDelete(id)
	case c.quarantine:
		d.quarantineDuringDelete(id, quarantined)
	}
	err = d.drive(delRun, "delete", nil)
	o.delete = outcomeOf(err)
	if err != nil {
		o.violations = append(o.violations, "delete failed: "+short(err))
	}
	d.waitNeighbour()
	o.violations = append(o.violations, d.checkDeleted(id)...)
	if c.quarantine {
		o.violations = append(o.violations, d.checkQuarantine("after delete", id, quarantined)...)
	}
	o.violations = append(o.violations, d.checkNeighbour("after delete")...)
	if d.neighbourRun != nil {
		// The neighbour's own delete, unarmed: the host ends empty.
		if err := e.startDelete(d.neighbour, 1).Get(e.ctx(crashWorkflowWait), nil); err != nil {
			o.violations = append(o.violations, "neighbour's delete failed: "+short(err))
		}
		o.violations = append(o.violations, d.checkDeleted(d.neighbour)...)
	}
	o.hit = d.hitWord()
	o.restarts = d.restarts
	o.done = true
	for _, v := range o.violations {
		t.Errorf("violation: %s", v)
	}
	for _, n := range o.notes {
		t.Logf("note: %s", n)
	}
}

// short is the end of an error's text: the wrapping workflow and activity
// errors say little, the innermost cause is last.
func short(err error) string {
	s := err.Error()
	if len(s) > 220 {
		s = "…" + s[len(s)-219:]
	}
	return s
}

func outcomeOf(err error) string {
	if err == nil {
		return "ok"
	}
	var te *timeoutError
	if errors.As(err, &te) {
		return "timeout at " + te.stage
	}
	return "failed"
}

type timeoutError struct{ stage string }

func (e *timeoutError) Error() string {
	return "did not finish in " + crashWorkflowWait.String() + "; stage " + e.stage
}

// crashDriver watches one run: it restarts the agent when it died (armed
// only for its first start) and kills the worker after the case's activity.
type crashDriver struct {
	e        *env
	c        crashCase
	o        *crashOutcome
	plainEnv []string

	restarts     int
	workerKilled bool
	// logSaid receives the agent's log line of the case's activity.
	logSaid <-chan stacktest.Line

	// neighbour is a second instance spawned right after the first agent
	// restart: whatever the crashed run's retries do must leave it alone
	// (one device, one claim; destroy only what you created).
	neighbour    string
	neighbourRun client.WorkflowRun
	neighbourErr error
	neighbourOK  bool
	// neighbourReported: its failed spawn is in the violations once.
	neighbourReported bool
}

func (d *crashDriver) spawnRequest(id string) *vmflowv1.SpawnRequest {
	r := d.e.noneSpawn(id, true)
	if d.c.network {
		r = d.e.netSpawn(id, true)
	}
	if d.c.vendor {
		r.VgpuProfile = vendorProfile
	}
	if id == d.neighbour && d.c.scenario == severalRun && d.c.vendor {
		r.VgpuProfile = "" // the instance holds both VFs of the simulator
	}
	if id != d.neighbour {
		switch d.c.scenario {
		case severalRun:
			r.VgpuCount = 2
		case passthroughRun:
			r.VgpuProfile, r.GpuPassthroughCount = "", 2
		case rollbackRun:
			// One more than the simulator's two GPUs (two VFs) hold of it.
			r.VgpuCount = 3
			if !d.c.vendor {
				r.VgpuProfile = "GRID A100-40C"
			}
		}
	}
	return r
}

// waitNeighbour waits for the neighbour's spawn, once.
func (d *crashDriver) waitNeighbour() {
	if d.neighbourRun == nil || d.neighbourOK || d.neighbourErr != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), crashWorkflowWait)
	defer cancel()
	result := make(chan error, 1)
	go func() { result <- d.neighbourRun.Get(ctx, nil) }()
	for {
		select {
		case err := <-result:
			d.neighbourErr = err
			d.neighbourOK = err == nil
			return
		case <-time.After(poll): // the poll of a deadline-bounded wait
		}
		d.restartAgentIfDead()
	}
}

// drive waits for run's result, restarting a dead agent unarmed and, in a
// worker case, killing and restarting the worker once the case's activity
// completed in this workflow.
func (d *crashDriver) drive(run client.WorkflowRun, which string, valuePtr any) error {
	ctx, cancel := context.WithTimeout(context.Background(), crashWorkflowWait)
	defer cancel()
	result := make(chan error, 1)
	go func() { result <- run.Get(ctx, valuePtr) }()
	tick := time.NewTicker(poll)
	defer tick.Stop()
	mine := d.c.workflow == which
	for {
		var logSaid <-chan stacktest.Line
		if mine && !d.workerKilled {
			logSaid = d.logSaid
		}
		select {
		case err := <-result:
			if ctx.Err() != nil {
				stage := "?"
				if st, serr := d.e.status(run.GetID()); serr == nil {
					stage = st.GetStage()
				}
				return &timeoutError{stage: stage}
			}
			if mine && !d.workerKilled {
				d.o.notes = append(d.o.notes, "the workflow finished before the worker could be killed")
			}
			return err
		case <-logSaid:
			// At once: the worker must die before it handles the
			// workflow task the completion schedules.
			d.killWorker()
			continue
		case <-tick.C: // the poll of a deadline-bounded wait
		}
		d.restartAgentIfDead()
		if mine && !d.workerKilled && d.logSaid == nil && d.activityCompleted(run.GetID(), d.c.activity) {
			d.killWorker()
		}
	}
}

func (d *crashDriver) killWorker() {
	d.workerKilled = true
	d.e.worker.Kill(d.e.t)
	d.e.worker.Start(d.e.t)
}

func (d *crashDriver) restartAgentIfDead() {
	if !d.e.agent.Exited() {
		return
	}
	d.e.agent.Env = d.plainEnv
	d.e.agent.Start(d.e.t)
	d.restarts++
	if d.neighbourRun == nil && d.c.scenario != rollbackRun {
		d.neighbourRun = d.e.startSpawn(d.spawnRequest(d.neighbour))
	}
}

// restartOldShape kills the agent, rewrites id's record in the shape before
// leases, and starts the agent with env (armed at the migration); drive
// restarts it unarmed once it died. Once an agent is serving again, the
// file must hold the lease in the current shape.
func (d *crashDriver) restartOldShape(id string, env []string) []string {
	d.e.agent.Kill(d.e.t)
	if _, err := stacktest.WriteOldShape(d.e.st, id); err != nil {
		return []string{err.Error()}
	}
	d.e.agent.Env = env
	d.e.agent.Start(d.e.t)
	var migrated bool
	err := stacktest.PollUntil(d.e.ctx(crashWorkflowWait), poll, func() bool {
		d.restartAgentIfDead()
		paths, err := d.e.st.Paths(id)
		if err != nil {
			return false
		}
		b, err := os.ReadFile(paths.Record)
		migrated = err == nil && !bytes.Contains(b, []byte(`"gpu_claim"`)) && bytes.Contains(b, []byte(`"leases"`))
		return migrated
	})
	if err != nil {
		return []string{fmt.Sprintf("the old-shape record of %s was not migrated: %v", id, err)}
	}
	return nil
}

// hitWord says whether the armed point fired, from the agent's log.
func (d *crashDriver) hitWord() string {
	if d.c.point == "" {
		if d.workerKilled {
			return "yes"
		}
		return "no"
	}
	b, err := os.ReadFile(d.e.agent.Log)
	if err != nil {
		d.e.t.Errorf("agent log: %v", err)
		return "?"
	}
	name := strings.SplitN(d.c.point, "@", 2)[0]
	if strings.Contains(string(b), "crashpoint "+name+": SIGKILL") {
		return "yes"
	}
	return "no"
}

// activityCompleted reports whether workflowID's history has a completed
// activity of type activity.
func (d *crashDriver) activityCompleted(workflowID, activity string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	it := d.e.c.GetWorkflowHistory(ctx, workflowID, "", false, enumspb.HISTORY_EVENT_FILTER_TYPE_ALL_EVENT)
	types := map[int64]string{}
	for it.HasNext() {
		ev, err := it.Next()
		if err != nil {
			return false // looked again at the next poll
		}
		if a := ev.GetActivityTaskScheduledEventAttributes(); a != nil {
			types[ev.GetEventId()] = a.GetActivityType().GetName()
		}
		if a := ev.GetActivityTaskCompletedEventAttributes(); a != nil && types[a.GetScheduledEventId()] == activity {
			return true
		}
	}
	return false
}

// reconcileDuringDelete waits until the delete parks in release-failed,
// clears the release fault and triggers the host's reconcile, which
// releases the claim. If the reconcile's wake-up of the delete is lost (the
// agent died between the release and its report), the delete is woken by
// the retry signal an operator would send, and the run says so.
func (d *crashDriver) reconcileDuringDelete(id string) {
	e := d.e
	delID := workflows.DeleteWorkflowID(id)
	waitFor(e.t, crashWorkflowWait, "delete parked in release-failed", func() (bool, string) {
		d.restartAgentIfDead()
		st, err := e.status(delID)
		if err != nil {
			return false, err.Error()
		}
		return st.GetStage() == workflows.StageReleaseFailed, st.GetStage()
	})
	e.sim.Clear(e.t, vgpusim.CtlFailRelease)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := e.c.ScheduleClient().GetHandle(ctx, workflows.ReconcileScheduleID(e.hostID)).Trigger(ctx, client.ScheduleTriggerOptions{}); err != nil {
		e.t.Fatalf("trigger reconcile: %v", err)
	}
	// The claim is released by the reconcile (the point kills the agent
	// right after); the delete stays parked until something wakes it.
	waitFor(e.t, crashWorkflowWait, "the reconcile released the claim", func() (bool, string) {
		d.restartAgentIfDead()
		rec, err := e.st.Get(id)
		if err != nil {
			return false, err.Error()
		}
		return !store.ClaimHeld(rec), fmt.Sprintf("claim %v", store.VGPU(rec))
	})
	waitFor(e.t, 30*time.Second, "the agent restarted after the reconcile", func() (bool, string) {
		d.restartAgentIfDead()
		return d.restarts > 0 || d.hitWord() == "no", fmt.Sprintf("restarts %d", d.restarts)
	})
	// Give the (retried) reconcile its chance to wake the delete.
	woken := false
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) && !woken {
		d.restartAgentIfDead()
		if st, err := e.status(delID); err == nil && st.GetStage() != workflows.StageReleaseFailed {
			woken = true
		}
		time.Sleep(poll) // the poll of a deadline-bounded wait
	}
	if !woken {
		// The retried reconcile wakes every deleting record whose claim is
		// released, so a lost wake-up is a defect: the delete would wait out
		// its backoff. The signal only lets the run finish.
		d.o.violations = append(d.o.violations, "reconcile's wake-up of the parked delete was lost (woken by hand to finish the run)")
		e.cli("workflow", "signal", "--workflow-id", delID, "--name", workflows.RetrySignal, "--input", `{"reason":"crash matrix: reconcile released the claim"}`)
	}
}

// quarantineFault is the simulator's fault that fails this run's release
// and counts toward K (a failed reset quarantines at once and lets the
// release finish, so a whole GPU's run fails its unbind instead).
func (d *crashDriver) quarantineFault() string {
	if d.c.scenario == passthroughRun {
		return vgpusim.CtlFailUnbind
	}
	return vgpusim.CtlFailRelease
}

// quarantineWant lists the devices id's failing release must quarantine:
// the parent GPU of an mdev, the VF of a vendor vGPU, each display
// function of a whole GPU's group.
func (d *crashDriver) quarantineWant(id string) []string {
	rec, err := d.e.st.Get(id)
	if err != nil {
		return nil // checkSpawned has said so
	}
	var want []string
	for _, l := range store.HeldVGPUs(rec) {
		if d.c.vendor {
			want = append(want, store.ClaimDevice(l.GetVgpu()))
		} else {
			want = append(want, l.GetVgpu().GetParent())
		}
	}
	for _, l := range store.HeldPassthrough(rec) {
		for _, f := range l.GetGpuPassthrough().GetFunctions() {
			if f.GetDisplay() {
				want = append(want, f.GetAddr())
			}
		}
	}
	slices.Sort(want)
	return want
}

// quarantined lists the devices the host's quarantine names, each with the
// instance it names; an unreadable file is its error.
func (d *crashDriver) quarantined() (map[string]lease.Quarantined, error) {
	return lease.NewQuarantine(d.e.stateDir, 0, nil).List()
}

// quarantineDuringDelete waits for the delete to park in release-failed
// with want quarantined, then clears the fault and sends the operator's
// retry, which finishes the delete. A kill between the failure's record
// and the quarantine's write costs at most that one count: while the
// quarantine lacks a device, the run retries with the fault still set, and
// the next failure must quarantine it.
func (d *crashDriver) quarantineDuringDelete(id string, want []string) {
	e := d.e
	delID := workflows.DeleteWorkflowID(id)
	retries := 0
	var lastRetry time.Time
	waitFor(e.t, crashWorkflowWait, "the failing release quarantined "+strings.Join(want, ", "), func() (bool, string) {
		d.restartAgentIfDead()
		st, err := e.status(delID)
		if err != nil {
			return false, err.Error()
		}
		if st.GetStage() != workflows.StageReleaseFailed {
			return false, st.GetStage()
		}
		got, err := d.quarantined()
		if err != nil {
			return false, err.Error()
		}
		missing := slices.DeleteFunc(slices.Clone(want), func(dev string) bool { return got[dev].Instance == id })
		if len(missing) == 0 {
			return true, ""
		}
		if retries == 0 {
			d.o.notes = append(d.o.notes, fmt.Sprintf("parked with %v not quarantined yet: retried with the fault set", missing))
		}
		// One retry at a time: the signal takes a moment to move the stage.
		if retries == 3 || time.Since(lastRetry) < 10*time.Second {
			return false, fmt.Sprintf("not quarantined after %d retries: %v (quarantine %v)", retries, missing, got)
		}
		retries++
		lastRetry = time.Now()
		e.cli("workflow", "signal", "--workflow-id", delID, "--name", workflows.RetrySignal, "--input", `{"reason":"crash matrix: fail again"}`)
		return false, "retried"
	})
	e.sim.Clear(e.t, d.quarantineFault())
	e.cli("workflow", "signal", "--workflow-id", delID, "--name", workflows.RetrySignal, "--input", `{"reason":"crash matrix: fault cleared"}`)
}

// checkQuarantine: every device in want is still quarantined for id once
// its instance is gone (only an operator clears it), at the K-th failure or
// the one after (a kill before the write costs at most that one count), and
// nothing else is.
func (d *crashDriver) checkQuarantine(when, id string, want []string) []string {
	got, err := d.quarantined()
	if err != nil {
		return []string{fmt.Sprintf("%s: quarantine: %v", when, err)}
	}
	if len(want) == 0 {
		return []string{when + ": the instance held no GPU to quarantine"}
	}
	var v []string
	for _, dev := range want {
		q := got[dev]
		var n int
		_, _ = fmt.Sscanf(q.Reason, "failed %d times", &n)
		switch {
		case q.Instance != id:
			v = append(v, fmt.Sprintf("%s: %s not quarantined for %s: %v", when, dev, id, got))
		case n < quarantineAfter || n > quarantineAfter+1:
			v = append(v, fmt.Sprintf("%s: %s quarantined at failure %d, want %d or %d: %q", when, dev, n, quarantineAfter, quarantineAfter+1, q.Reason))
		}
		delete(got, dev)
	}
	if len(got) > 0 {
		v = append(v, fmt.Sprintf("%s: devices quarantined that %s's release never failed on: %v", when, id, got))
	}
	return v
}

// qemusOf lists the processes of instance id (alive or zombie); live
// drops the zombies.
func (d *crashDriver) qemusOf(id string, live bool) []string {
	var out []string
	for _, p := range d.e.processesOf() {
		if !strings.Contains(p, " guest="+id+" ") || (live && strings.Contains(p, " (Z) ")) {
			continue
		}
		out = append(out, p)
	}
	return out
}

// claimListed reports whether the simulator's device list (simDevices)
// holds the claim's device.
func claimListed(devs []string, cl *vmflowv1.VgpuLease) bool {
	for _, dv := range devs {
		if dv == "mdev "+cl.GetUuid() || (cl.GetDeviceId() != "" && strings.HasPrefix(dv, "vf "+cl.GetDeviceId()+" type ")) {
			return true
		}
	}
	return false
}

// checkInstance: exactly one live QEMU of id, the one its record names; the
// record Running with an active claim whose device exists.
func (d *crashDriver) checkInstance(when, id string) []string {
	e := d.e
	var v []string
	var qemus []string
	// A QEMU of a failed attempt may take a moment to be killed and reaped;
	// a leaked one stays.
	deadline := time.Now().Add(5 * time.Second)
	for {
		qemus = d.qemusOf(id, true)
		if len(qemus) == 1 || time.Now().After(deadline) {
			break
		}
		time.Sleep(poll) // the poll of a deadline-bounded wait
	}
	if len(qemus) != 1 {
		v = append(v, fmt.Sprintf("%s: %s has %d live QEMUs, want 1: %s", when, id, len(qemus), strings.Join(qemus, "; ")))
	}
	rec, err := e.st.Get(id)
	if err != nil {
		return append(v, fmt.Sprintf("%s: record of %s: %v", when, id, err))
	}
	if rec.GetState() != vmflowv1.InstanceState_INSTANCE_STATE_RUNNING {
		v = append(v, fmt.Sprintf("%s: %s is %s, want running", when, id, store.StateName(rec.GetState())))
	}
	held := store.HeldVGPUs(rec)
	if want := store.VGPUCount(rec.GetSpec().GetVgpuProfile(), rec.GetSpec().GetVgpuCount()); len(held) != want {
		v = append(v, fmt.Sprintf("%s: %s holds %d vGPU(s), want %d", when, id, len(held), want))
	}
	whole := store.HeldPassthrough(rec)
	if want := store.PassthroughCount(rec.GetSpec()); len(whole) != want {
		v = append(v, fmt.Sprintf("%s: %s holds %d whole GPU(s), want %d", when, id, len(whole), want))
	}
	for _, lease := range whole {
		if lease.GetPhase() != vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE {
			v = append(v, fmt.Sprintf("%s: whole GPU of %s not active: %v", when, id, lease))
		}
	}
	for _, lease := range held {
		cl := lease.GetVgpu()
		if lease.GetPhase() != vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE {
			v = append(v, fmt.Sprintf("%s: claim of %s not active: %v", when, id, lease))
		} else if devs := e.simDevices(); !claimListed(devs, cl) {
			v = append(v, fmt.Sprintf("%s: the device of %s's claim (%s %s) is gone; devices: %v", when, id, cl.GetUuid(), cl.GetDeviceId(), devs))
		}
	}
	if p := rec.GetProcess(); p == nil {
		v = append(v, fmt.Sprintf("%s: record of %s names no QEMU", when, id))
	} else {
		qid := store.IdentityOf(p)
		if !proc.Inspect(qid).Alive {
			v = append(v, fmt.Sprintf("%s: recorded QEMU %v of %s is not alive", when, qid, id))
		} else if len(qemus) == 1 && !strings.HasPrefix(qemus[0], fmt.Sprintf("pid %d ", qid.PID)) {
			v = append(v, fmt.Sprintf("%s: the live QEMU of %s is not the recorded one (%v): %s", when, id, qid, qemus[0]))
		}
	}
	return v
}

// checkLedger: the records are readable, no two held claims name one
// device, and the simulator holds exactly the held claims' devices.
func (d *crashDriver) checkLedger(when string) []string {
	e := d.e
	var v []string
	recs, err := e.st.List()
	if err != nil {
		v = append(v, fmt.Sprintf("%s: unreadable record: %v", when, err))
	}
	devs := e.simDevices()
	owner := map[string]string{}
	held := 0
	for _, r := range recs {
		for _, lease := range store.HeldVGPUs(r) {
			held++
			key := store.ClaimDevice(lease.GetVgpu())
			if other, ok := owner[key]; ok {
				v = append(v, fmt.Sprintf("%s: %s and %s both claim device %s", when, other, r.GetId(), key))
			}
			owner[key] = r.GetId()
		}
	}
	if len(devs) != held {
		v = append(v, fmt.Sprintf("%s: %d vGPU devices for %d held claims: %v", when, len(devs), held, devs))
	}
	v = append(v, d.e.checkWholeGPUs(when, recs)...)
	return append(v, d.checkNetLedger(when, recs)...)
}

// checkNetLedger: no two held network leases name one address, and the
// namespace holds exactly the TAPs of the held active leases (a release
// under way may or may not have removed its TAP yet).
func (d *crashDriver) checkNetLedger(when string, recs []*vmflowv1.InstanceRecord) []string {
	e := d.e
	if e.net == nil {
		return nil
	}
	var v []string
	addr := map[string]string{}
	want := map[string]bool{}
	maybe := map[string]bool{}
	var leased []string
	for _, r := range recs {
		l := store.Network(r)
		if !store.LeaseHeld(l) {
			continue
		}
		n := l.GetNetwork()
		if other, ok := addr[n.GetAddress()]; ok {
			v = append(v, fmt.Sprintf("%s: %s and %s both lease %s", when, other, r.GetId(), n.GetAddress()))
		}
		addr[n.GetAddress()] = r.GetId()
		a, aerr := netip.ParsePrefix(n.GetAddress())
		mac, merr := net.ParseMAC(n.GetMac())
		if aerr == nil && merr == nil {
			leased = append(leased, network.FilterPort(n.GetTap(), mac.String(), a.Addr()))
		} else {
			v = append(v, fmt.Sprintf("%s: %s leases a malformed address %q or MAC %q", when, r.GetId(), n.GetAddress(), n.GetMac()))
		}
		if l.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE && r.GetProcess() != nil {
			want[n.GetTap()] = true
		} else {
			maybe[n.GetTap()] = true
		}
	}
	have := e.taps()
	for _, tp := range have {
		if !want[tp] && !maybe[tp] {
			v = append(v, fmt.Sprintf("%s: TAP %s no held lease names", when, tp))
		}
		delete(want, tp)
	}
	for tp := range want {
		v = append(v, fmt.Sprintf("%s: the TAP %s of a running VM's lease is missing", when, tp))
	}
	// The anti-spoofing filter holds the element (TAP, MAC, address) of
	// each held lease and no other: added before its TAP, removed after its
	// release, rebuilt from the records at every agent start.
	slices.Sort(leased)
	filtered, err := e.netView.FilterPorts()
	switch {
	case err != nil:
		v = append(v, fmt.Sprintf("%s: read the network filter: %v", when, err))
	case !slices.Equal(filtered, leased):
		v = append(v, fmt.Sprintf("%s: the network filter has elements for %v, the held leases name %v", when, filtered, leased))
	}
	return v
}

// checkSpawned: the instance runs as it should and the ledger adds up.
func (d *crashDriver) checkSpawned(id string) []string {
	return append(d.checkInstance("after spawn", id), d.checkLedger("after spawn")...)
}

// checkNeighbour: the neighbour, if one was spawned, spawned and still runs
// untouched.
func (d *crashDriver) checkNeighbour(when string) []string {
	switch {
	case d.neighbourRun == nil:
		return nil
	case d.neighbourErr != nil:
		if d.neighbourReported {
			return nil
		}
		d.neighbourReported = true
		return []string{"neighbour's spawn failed: " + short(d.neighbourErr)}
	}
	return d.checkInstance(when+" (neighbour)", d.neighbour)
}

// checkDeleted: no QEMU of id (alive or zombie), no record, no socket; the
// ledger of what remains adds up.
func (d *crashDriver) checkDeleted(id string) []string {
	e := d.e
	var v []string
	var qemus []string
	deadline := time.Now().Add(10 * time.Second)
	for {
		qemus = d.qemusOf(id, false)
		if len(qemus) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(poll) // the poll of a deadline-bounded wait
	}
	if len(qemus) > 0 {
		v = append(v, fmt.Sprintf("after delete: QEMU of %s left: %s", id, strings.Join(qemus, "; ")))
		// Leave the host clean: kill what leaked, by the identity just
		// read (this run's own state dir names it).
		for _, q := range qemus {
			var pid int
			if _, err := fmt.Sscanf(q, "pid %d ", &pid); err == nil {
				if qid, err := proc.ReadIdentity(pid); err == nil {
					_ = proc.Signal(qid, syscall.SIGKILL) // best effort: the violation is already recorded
				}
			}
		}
	}
	rec, err := e.st.Get(id)
	switch {
	case err == nil:
		v = append(v, fmt.Sprintf("after delete: record of %s left in state %s, claim %v", id, store.StateName(rec.GetState()), store.VGPU(rec)))
	case !errors.Is(err, store.ErrNotFound):
		v = append(v, fmt.Sprintf("after delete: record of %s: %v", id, err))
	}
	if p, err := e.st.Paths(id); err == nil {
		if _, err := os.Lstat(p.Socket); err == nil {
			v = append(v, "after delete: QMP socket left: "+p.Socket)
		}
	}
	v = append(v, d.checkLedger("after delete of "+id)...)
	trash, _ := filepath.Glob(filepath.Join(e.stateDir, "instances", ".deleted-*"))
	if len(trash) > 0 {
		d.o.notes = append(d.o.notes, fmt.Sprintf("trash left until the next agent start: %v", trash))
	}
	return v
}
