package cli

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/internal/contract"
	"vmflow/internal/safetext"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// States ls and show print for an instance without a readable record, beside
// the record states (store.StateName).
const (
	StateUnreadable = "unreadable" // record.json exists but cannot be read or decoded
	StateNoRecord   = "no-record"  // a directory without record.json
)

// Instance is what ls and show report about one instance. It is built from
// the record without the instance lock and without writing anything, so it
// is safe to take while the agent runs; it is a snapshot, not a decision.
type Instance struct {
	ID         string `json:"id"`
	State      string `json:"state"`
	RecordPath string `json:"record_path"`
	// Error says why the record could not be read (State unreadable).
	Error string `json:"error,omitempty"`
	// Process is the liveness of the recorded QEMU identity (pid, start
	// time and boot id all matched; a reused pid reads as exited).
	Process     *proc.Status `json:"process,omitempty"`
	ClaimPhase  string       `json:"claim_phase,omitempty"`
	ClaimDevice string       `json:"claim_device,omitempty"`
	// GPUDevices names every GPU device of the instance's claim, in claim
	// order (ClaimDevice is the first): the held ones, or when none is held
	// the released ones.
	GPUDevices []string `json:"gpu_devices,omitempty"`
	// ClaimHeld is absent when the record cannot be read: unknown, not no.
	ClaimHeld *bool `json:"claim_held,omitempty"`
	// The network lease's address (with its prefix), MAC, TAP and phase
	// ("released" once given back); empty without one.
	Address      string     `json:"address,omitempty"`
	MAC          string     `json:"mac,omitempty"`
	TAP          string     `json:"tap,omitempty"`
	NetworkPhase string     `json:"network_phase,omitempty"`
	ManualStop   bool       `json:"manual_stop"`
	CreatedAt    *time.Time `json:"created_at,omitempty"`
	AgeSeconds   int64      `json:"age_seconds,omitempty"`
	// NeedsAttention names every reason an operator should look; empty
	// (never null in JSON) when there is none.
	NeedsAttention []string `json:"needs_attention"`

	rec *vmflowv1.InstanceRecord
}

// inspectHost reads every instance directory of st; an unreadable record is an
// Instance of its own (invariant 12), the error only "cannot list".
func inspectHost(st *store.Store, now time.Time) ([]*Instance, error) {
	ids, err := st.IDs()
	if err != nil {
		return nil, err
	}
	insts := make([]*Instance, 0, len(ids))
	for _, id := range ids {
		insts = append(insts, inspectInstance(st, id, now))
	}
	markSharedDevices(insts)
	return insts, nil
}

// inspectInstance reads one instance; a missing record is StateNoRecord.
func inspectInstance(st *store.Store, id string, now time.Time) *Instance {
	p, _ := st.Paths(id) // ids come from IDs or were validated by the caller
	in := &Instance{ID: id, RecordPath: p.Record, NeedsAttention: []string{}}
	if marked, err := st.ManualStop(id); err == nil {
		in.ManualStop = marked
	}
	rec, err := st.Get(id)
	switch {
	case errors.Is(err, store.ErrNotFound):
		in.State = StateNoRecord
		in.attention("directory without record.json (a create that stopped before its first write)")
		return in
	case err != nil:
		in.State = StateUnreadable
		in.Error = err.Error()
		in.attention("record unreadable: " + p.Record)
		return in
	}
	in.rec = rec
	in.State = store.StateName(rec.GetState())
	held := store.ClaimHeld(rec)
	in.ClaimHeld = &held
	if rec.GetCreatedAt() != nil {
		t := rec.GetCreatedAt().AsTime()
		in.CreatedAt = &t
		in.AgeSeconds = int64(now.Sub(t).Seconds())
	}
	if rec.GetProcess() != nil {
		s := proc.Inspect(store.IdentityOf(rec.GetProcess()))
		in.Process = &s
	}
	leases := store.HeldVGPUs(rec)
	if !held {
		leases = store.VGPUs(rec)
	}
	for _, c := range leases {
		in.GPUDevices = append(in.GPUDevices, store.ClaimDevice(c.GetVgpu()))
	}
	whole := store.HeldPassthrough(rec)
	for _, c := range whole {
		in.GPUDevices = append(in.GPUDevices, store.PassthroughDevices(c)...)
	}
	if len(leases) == 0 && len(whole) > 0 {
		leases = whole
		held = true
		in.ClaimHeld = &held
	}
	if len(leases) > 0 {
		in.ClaimPhase = claimPhaseName(leases[0].GetPhase())
		in.ClaimDevice = in.GPUDevices[0]
		if !held {
			in.ClaimPhase = "released"
		}
	}
	if l := store.Network(rec); l != nil {
		n := l.GetNetwork()
		in.Address, in.MAC, in.TAP, in.NetworkPhase = n.GetAddress(), n.GetMac(), n.GetTap(), claimPhaseName(l.GetPhase())
		if !store.LeaseHeld(l) {
			in.NetworkPhase = "released"
		}
	}
	in.checkRecord(rec, now)
	return in
}

// checkRecord adds why a readable record needs an operator, naming a held claim
// in Deleting too: the delete that stays there is the stuck one.
func (in *Instance) checkRecord(rec *vmflowv1.InstanceRecord, now time.Time) {
	if rec.GetState() == vmflowv1.InstanceState_INSTANCE_STATE_RELEASE_FAILED {
		for _, c := range store.HeldLeases(rec) {
			if c.GetReleaseAttempts() > 0 {
				in.attention(fmt.Sprintf("%s release failed %d time(s): %s", leaseWord(c), c.GetReleaseAttempts(), orNone(c.GetLastReleaseError())))
			}
		}
	}
	if rec.GetState() == vmflowv1.InstanceState_INSTANCE_STATE_DELETING && store.ClaimHeld(rec) {
		in.attention(fmt.Sprintf("being deleted with its vGPU claim still held (phase %s)", in.ClaimPhase))
	}
	if r := rec.GetNeedsAttention(); r != "" {
		// Written by the agent when it stopped acting by itself (a restart
		// the host's admission policy refused).
		if at := rec.GetNeedsAttentionAt(); at != nil {
			r += fmt.Sprintf(" (%s ago)", fmtAge(now.Sub(at.AsTime())))
		}
		in.attention(r)
	}
	if ls := rec.GetLaunchStartedAt(); ls != nil && rec.GetProcess() == nil {
		in.attention(fmt.Sprintf("launch marker without a process (set %s ago): a QEMU may run that the record does not name; the agent adopts or kills it at re-attach",
			fmtAge(now.Sub(ls.AsTime()))))
	}
	if s := in.Process; s != nil {
		switch {
		case s.State == proc.StateUnknown:
			in.attention("liveness of the recorded process unknown (counted as alive): " + s.Err)
		case !s.Alive:
			why := "gone"
			if boot, err := proc.BootID(); err == nil && rec.GetProcess().GetBootId() != boot {
				why = "from an earlier boot"
			}
			in.attention(fmt.Sprintf("recorded QEMU pid %d is %s (the agent is down or has not recorded the exit yet)", s.PID, why))
		}
	}
	if rec.GetState() == vmflowv1.InstanceState_INSTANCE_STATE_RUNNING && rec.GetProcess() == nil {
		in.attention("state running without a recorded process")
	}
}

// markSharedDevices flags a device named by more than one held claim
// (invariant 10: one device, one claim) on every instance involved.
func markSharedDevices(insts []*Instance) {
	byDevice := map[string][]string{}
	for _, in := range insts {
		if !in.claimHeld() {
			continue
		}
		for _, d := range in.GPUDevices {
			byDevice[d] = append(byDevice[d], in.ID)
		}
	}
	for _, in := range insts {
		if !in.claimHeld() {
			continue
		}
		for _, d := range in.GPUDevices {
			if ids := byDevice[d]; len(ids) > 1 {
				in.attention(fmt.Sprintf("vGPU %s is claimed by %d instances: %s", d, len(ids), strings.Join(ids, ", ")))
			}
		}
	}
}

// leaseWord names a lease for an operator: "vGPU <device>", "whole GPU
// (IOMMU group <n>)", or its kind.
func leaseWord(c *vmflowv1.Lease) string {
	switch {
	case c.GetVgpu() != nil:
		return "vGPU " + store.ClaimDevice(c.GetVgpu())
	case c.GetGpuPassthrough() != nil:
		return "whole GPU (IOMMU group " + c.GetGpuPassthrough().GetIommuGroup() + ")"
	case c.GetNetwork() != nil:
		return "network"
	}
	return store.LeaseKind(c)
}

func (in *Instance) claimHeld() bool { return in.ClaimHeld != nil && *in.ClaimHeld }

func (in *Instance) attention(reason string) { in.NeedsAttention = append(in.NeedsAttention, reason) }

// claimPhaseName is "intent", "active", "releasing", or the number of a
// phase this build does not know.
func claimPhaseName(p vmflowv1.ClaimPhase) string {
	name, ok := vmflowv1.ClaimPhase_name[int32(p)]
	if !ok {
		return "phase(" + strconv.Itoa(int(p)) + ")"
	}
	return strings.ToLower(strings.TrimPrefix(name, "CLAIM_PHASE_"))
}

// fmtAge is a duration the way ls shows ages: 45s, 12m, 3h5m, 2d4h.
func fmtAge(d time.Duration) string {
	if d < 0 {
		d = 0
	}
	switch {
	case d < time.Minute:
		return strconv.Itoa(int(d.Seconds())) + "s"
	case d < time.Hour:
		return strconv.Itoa(int(d.Minutes())) + "m"
	case d < 24*time.Hour:
		return fmt.Sprintf("%dh%dm", int(d.Hours()), int(d.Minutes())%60)
	default:
		return fmt.Sprintf("%dd%dh", int(d.Hours())/24, int(d.Hours())%24)
	}
}

func orNone(s string) string {
	if s == "" {
		return "(no error recorded)"
	}
	return s
}

// viewFlags are the flags ls and show share.
type viewFlags struct {
	stateDir string
	output   string
}

func (v *viewFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&v.stateDir, "state-dir", contract.DefaultStateDir, "the agent's state directory (as given to run)")
	fs.StringVar(&v.output, "o", "table", "output: table or json")
}

func (v *viewFlags) check() error {
	if v.output != "table" && v.output != "json" {
		return fmt.Errorf("-o %q: want table or json", v.output)
	}
	return nil
}

// parseView parses the flags of a read-only view command (ls, show). ok
// false: the command ends with code (help printed, or a usage error said).
// pos are its positional arguments, flags before or after them.
func parseView(name, help string, args []string, out IO) (pos []string, v viewFlags, code int, ok bool) {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(out.Stderr)
	fs.Usage = func() { fmt.Fprint(out.Stderr, help) }
	v.register(fs)
	pos, err := parseAnywhere(fs, args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, v, ExitOK, false
		}
		return nil, v, ExitUsage, false
	}
	if err := v.check(); err != nil {
		fmt.Fprintf(out.Stderr, "%s: %v\n", name, err)
		return nil, v, ExitUsage, false
	}
	return pos, v, 0, true
}

const lsHelp = `usage: vmflow-hostagent ls [--state-dir DIR] [-o table|json]

Lists this host's instances from their records, like virsh list: id, state,
QEMU pid and whether that process (pid, start time and boot id) is alive,
the vGPU claim's phase and device, age, and why the instance needs attention
(an unreadable record, a failed vGPU release, a launch marker without a
process, a claim held by a record being deleted, a recorded process that is
gone, a device claimed twice, a restart the host's admission policy
refused). A record that cannot be read is listed as
"unreadable" with its path; it never hides the others.

Read-only and lock-free: safe while the agent runs (records are replaced by
rename, so a read sees the old one or the new one). Run as root.

exit status: 0 listed, 1 the state directory cannot be read, 2 usage error
`

// Ls implements "vmflow-hostagent ls".
func Ls(args []string, out IO) int {
	pos, v, code, ok := parseView("ls", lsHelp, args, out)
	if !ok {
		return code
	}
	if len(pos) > 0 {
		fmt.Fprintf(out.Stderr, "ls: unexpected arguments %q\n", pos)
		return ExitUsage
	}
	st, err := store.Open(v.stateDir)
	if err != nil {
		fmt.Fprintf(out.Stderr, "ls: %v\n", err)
		return ExitError
	}
	insts, err := inspectHost(st, time.Now())
	if err != nil {
		fmt.Fprintf(out.Stderr, "ls: %v\n", err)
		return ExitError
	}
	if v.output == "json" {
		writeJSON(out.Stdout, insts)
		return ExitOK
	}
	writeTable(out.Stdout, insts)
	return ExitOK
}

func writeTable(w io.Writer, insts []*Instance) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSTATE\tPID\tALIVE\tVGPU\tIP\tAGE\tNEEDS ATTENTION")
	for _, in := range insts {
		pid, alive := "-", "-"
		if in.Process != nil {
			pid = strconv.Itoa(in.Process.PID)
			alive = aliveWord(*in.Process)
		}
		gpu := "-"
		if in.ClaimPhase != "" {
			gpu = in.ClaimPhase + " " + orDash(strings.Join(in.GPUDevices, ","))
		}
		ip := "-"
		if in.Address != "" {
			ip = in.Address
			if in.NetworkPhase != claimPhaseName(vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE) {
				ip += " (" + in.NetworkPhase + ")"
			}
		}
		age := "-"
		if in.CreatedAt != nil {
			age = fmtAge(time.Duration(in.AgeSeconds) * time.Second)
		}
		attn := "-"
		if len(in.NeedsAttention) > 0 {
			attn = strings.Join(in.NeedsAttention, "; ")
		}
		cols := []string{in.ID, in.State, pid, alive, gpu, ip, age, attn}
		for i, c := range cols {
			cols[i] = safetext.Escape(c) // a tab or newline in a field would forge a column or a row
		}
		fmt.Fprintln(tw, strings.Join(cols, "\t"))
	}
	_ = tw.Flush() // a write error to stdout has nowhere better to go
}

// aliveWord is the ALIVE column: yes, no, or "unknown" (counted as alive).
func aliveWord(s proc.Status) string {
	switch {
	case s.State == proc.StateUnknown:
		return "unknown"
	case s.State == proc.StateZombieLeader:
		return "yes (zombie leader)"
	case s.Alive:
		return "yes"
	default:
		return "no"
	}
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// writeJSON writes v indented, with the C1 and bidirectional controls
// encoding/json passes through escaped as well.
func writeJSON(w io.Writer, v any) {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return // Instances always marshal
	}
	_, _ = w.Write(append(safetext.EscapeJSON(b), '\n')) // stdout errors have nowhere to go
}
