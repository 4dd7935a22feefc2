package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"vmflow/hostagent/store"
	"vmflow/internal/safetext"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

const showHelp = `usage: vmflow-hostagent show [--state-dir DIR] [-o table|json] <instance-id>

Shows one instance, like virsh dominfo: its state and stop step, the
liveness of its recorded QEMU process (pid, start time and boot id), the
vGPU claim, restarts and the last exit, the last error, the spawn that
created it, why it needs attention, and the record itself. A record that
cannot be read is shown as "unreadable" with the reason and the file's path.

Read-only and lock-free: safe while the agent runs, also while the agent
holds the instance's lock. Run as root.

exit status: 0 shown (also an unreadable record), 1 no such instance or the
state directory cannot be read, 2 usage error (or an invalid id)
`

// Show implements "vmflow-hostagent show".
func Show(args []string, out IO) int {
	pos, v, code, ok := parseView("show", showHelp, args, out)
	if !ok {
		return code
	}
	if len(pos) != 1 {
		fmt.Fprint(out.Stderr, showHelp)
		return ExitUsage
	}
	id := pos[0]
	if err := store.ValidateID(id); err != nil {
		fmt.Fprintf(out.Stderr, "show: %v\n", err)
		return ExitUsage
	}
	st, err := store.Open(v.stateDir)
	if err != nil {
		fmt.Fprintf(out.Stderr, "show: %v\n", err)
		return ExitError
	}
	// The whole host, not just id: a device claimed twice shows only
	// against the other records.
	insts, err := inspectHost(st, time.Now())
	if err != nil {
		fmt.Fprintf(out.Stderr, "show: %v\n", err)
		return ExitError
	}
	var in *Instance
	for _, i := range insts {
		if i.ID == id {
			in = i
		}
	}
	if in == nil {
		fmt.Fprintf(out.Stderr, "show: instance %s: %v under %s\n", id, store.ErrNotFound, st.StateDir())
		return ExitError
	}
	if v.output == "json" {
		writeJSON(out.Stdout, showJSON(in))
		return ExitOK
	}
	writeShow(out.Stdout, in)
	return ExitOK
}

// ShowOutput is show's JSON: the Instance ls prints, plus what only show
// says. Record is record.json as the store writes it (snake_case), absent
// when it cannot be read.
type ShowOutput struct {
	*Instance
	Creator   string          `json:"creator,omitempty"`
	LastError string          `json:"last_error,omitempty"`
	Record    json.RawMessage `json:"record,omitempty"`
}

func showJSON(in *Instance) ShowOutput {
	o := ShowOutput{Instance: in}
	if in.rec != nil {
		o.Creator = store.CreatorOf(in.rec)
		o.LastError = in.rec.GetLastError()
		if b, err := store.EncodeRecord(in.rec); err == nil {
			o.Record = b
		}
	}
	return o
}

func writeShow(w io.Writer, in *Instance) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	// Every value may hold what a caller, QEMU or a guest wrote (the
	// creator's workflow id, QEMU's stderr in last_error): escaped, it can
	// neither drive the terminal nor forge a row.
	row := func(k, format string, a ...any) {
		fmt.Fprintf(tw, "%s\t%s\n", k, safetext.Escape(fmt.Sprintf(format, a...)))
	}
	row("instance", "%s", in.ID)
	rec := in.rec
	state := in.State
	if rec != nil && rec.GetStopStep() != vmflowv1.StopStep_STOP_STEP_NONE {
		state += ", stop step " + strings.ToLower(strings.TrimPrefix(rec.GetStopStep().String(), "STOP_STEP_"))
	}
	row("state", "%s", state)
	row("record", "%s", in.RecordPath)
	if in.Error != "" {
		row("error", "%s", in.Error)
	}
	row("manual stop", "%s", yesNo(in.ManualStop))
	if rec != nil {
		created := "-"
		if in.CreatedAt != nil {
			created = fmt.Sprintf("%s (%s ago)", in.CreatedAt.UTC().Format(time.RFC3339), fmtAge(time.Duration(in.AgeSeconds)*time.Second))
		}
		row("created", "%s by %s", created, store.CreatorOf(rec))
		row("process", "%s", processLine(in))
		leases := store.VGPUs(rec)
		if len(leases) == 0 && len(store.HeldPassthrough(rec)) == 0 {
			row("vGPU", "none")
		}
		for _, c := range leases {
			row("vGPU", "%s", claimLine(c))
		}
		for _, c := range rec.GetLeases() {
			if p := c.GetGpuPassthrough(); p != nil {
				phase := claimPhaseName(c.GetPhase())
				if !store.LeaseHeld(c) {
					phase = "released"
				}
				row("whole GPU", "%s IOMMU group %s: %s (%s), %d failed release(s)%s", phase, p.GetIommuGroup(),
					strings.Join(store.PassthroughDevices(c), " "), orDash(p.GetModel()), c.GetReleaseAttempts(), lastError(c))
			}
		}
		row("network", "%s", networkLine(in))
		row("capacity", "%s", capacityLine(rec))
		row("restarts", "%d (policy %s, max %d)", rec.GetRestartCount(), orDefault(rec.GetRestartPolicy(), "never"), rec.GetRestartMaxAttempts())
		if rec.GetLastExit() != nil || rec.GetLastExitStatus() != "" {
			row("last exit", "%s (code %d) at %s", orDefault(rec.GetLastExitStatus(), "-"), rec.GetLastExitCode(),
				rec.GetLastExit().AsTime().UTC().Format(time.RFC3339))
		}
		row("last error", "%s", orDefault(rec.GetLastError(), "-"))
	}
	if len(in.NeedsAttention) == 0 {
		row("needs attention", "no")
	} else {
		row("needs attention", "yes")
		for _, r := range in.NeedsAttention {
			row("", "- %s", r)
		}
	}
	_ = tw.Flush()
	if rec != nil {
		if b, err := store.EncodeRecord(rec); err == nil {
			fmt.Fprintf(w, "\n%s:\n%s", store.RecordFile, safetext.EscapeJSON(b))
		}
	}
}

func processLine(in *Instance) string {
	if in.Process == nil {
		if in.rec.GetLaunchStartedAt() != nil {
			return "none recorded; a launch began at " + in.rec.GetLaunchStartedAt().AsTime().UTC().Format(time.RFC3339)
		}
		return "none"
	}
	s := in.Process
	line := fmt.Sprintf("%s: %s, alive %s", s.Identity, s.State, aliveWord(*s))
	if s.Tasks > 0 {
		line += fmt.Sprintf(", %d task(s)", s.Tasks)
	}
	if s.Err != "" {
		line += " (" + s.Err + ")"
	}
	return line
}

// claimLine is one vGPU lease for show.
func claimLine(c *vmflowv1.Lease) string {
	v := c.GetVgpu()
	phase, dev := claimPhaseName(c.GetPhase()), store.ClaimDevice(v)
	if !store.LeaseHeld(c) {
		phase = "released"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s: profile %q, driver %s, parent %s, type %s", phase, orDash(dev),
		v.GetProfile(), orDash(v.GetDriver()), orDash(v.GetParent()), orDash(v.GetTypeId()))
	if v.GetUuid() != "" && v.GetUuid() != dev {
		fmt.Fprintf(&b, ", uuid %s", v.GetUuid())
	}
	if c.GetClaimedAt() != nil {
		fmt.Fprintf(&b, ", claimed %s", c.GetClaimedAt().AsTime().UTC().Format(time.RFC3339))
	}
	if c.GetReleasedAt() != nil {
		fmt.Fprintf(&b, ", released %s", c.GetReleasedAt().AsTime().UTC().Format(time.RFC3339))
	}
	if c.GetReleaseAttempts() > 0 {
		fmt.Fprintf(&b, ", %d failed release(s), last: %s", c.GetReleaseAttempts(), orNone(c.GetLastReleaseError()))
	}
	return b.String()
}

// lastError is ", last: <error>" for a lease whose release failed.
func lastError(c *vmflowv1.Lease) string {
	if c.GetLastReleaseError() == "" {
		return ""
	}
	return ", last: " + c.GetLastReleaseError()
}

func networkLine(in *Instance) string {
	l := store.Network(in.rec)
	if l == nil {
		if in.rec.GetSpec().GetNetwork() != "" {
			return "none yet (" + in.rec.GetSpec().GetNetwork() + ", leased at the first launch)"
		}
		return "none"
	}
	n := l.GetNetwork()
	line := fmt.Sprintf("%s %s, mac %s, tap %s on %s, gateway %s", in.NetworkPhase, n.GetAddress(), n.GetMac(), n.GetTap(),
		orDash(n.GetBridge()), n.GetGateway())
	if l.GetReleaseAttempts() > 0 {
		line += fmt.Sprintf(", %d failed release(s), last: %s", l.GetReleaseAttempts(), orNone(l.GetLastReleaseError()))
	}
	return line
}

// capacityLine is the record's share of the host and where it runs:
// "active 2 vCPUs (dedicated), 1280 MiB, NUMA node 1, CPUs 6-7".
func capacityLine(rec *vmflowv1.InstanceRecord) string {
	l := store.Capacity(rec)
	if l == nil {
		return "none (reserved at the next launch)"
	}
	c := l.GetCapacity()
	phase := claimPhaseName(l.GetPhase())
	if !store.LeaseHeld(l) {
		phase = "released"
	}
	line := fmt.Sprintf("%s %d vCPUs", phase, c.GetVcpus())
	if c.GetDedicatedCpus() {
		line += " (dedicated)"
	}
	line += fmt.Sprintf(", %d MiB", c.GetMemoryMib())
	if c.GetHugepages() > 0 {
		line += fmt.Sprintf(" + %d × %d KiB hugepages", c.GetHugepages(), c.GetHugepageKib())
	}
	if nodes := c.GetNumaNodes(); len(nodes) > 0 {
		var ns []string
		for _, n := range nodes {
			ns = append(ns, fmt.Sprint(n))
		}
		line += ", NUMA node " + strings.Join(ns, ",")
	}
	if c.GetCpus() != "" {
		line += ", CPUs " + c.GetCpus()
	}
	if at := c.GetExpiresAt(); at != nil && l.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_INTENT {
		line += ", reserved until " + at.AsTime().UTC().Format(time.RFC3339)
	}
	return line
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func orDefault(s, d string) string {
	if s == "" {
		return d
	}
	return s
}
