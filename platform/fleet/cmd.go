package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"go.temporal.io/sdk/client"
	"google.golang.org/protobuf/encoding/protojson"

	"vmflow/internal/safetext"
	"vmflow/platform"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

const cmdUsage = `usage: vmflow <command> [flags]

commands:
  place   where a spawn would land and why: every host of the fleet scored for
          the request, without reserving anything (a dry run of placement)
  hosts   the fleet view: each host's published free capacity, GPUs, drain

flags (both):
  --task-queue Q      the fleet: the workflow worker's queue its agents publish to (default vmflow)
  --address, --namespace, --insecure   Temporal connection (else TEMPORAL_* as the temporal CLI)
  -o table|json
place:
  --input JSON        the spawn request as SpawnInstance takes it (snake_case keys;
                      host_id left out), e.g. '{"vcpus":2,"memory_mib":2048,"vgpu_profile":"GRID A100-4C"}'
`

// Exit codes of the vmflow command.
const (
	exitOK    = 0
	exitError = 1
	exitUsage = 2
	// exitNoHost: place found no host that can serve the request now.
	exitNoHost = 3
)

// Main is the vmflow command line (`vmflow place`, `vmflow hosts`); it
// returns the exit code.
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) < 1 {
		fmt.Fprint(stderr, cmdUsage)
		return exitUsage
	}
	switch args[0] {
	case "place", "hosts":
	case "-h", "--help", "help":
		fmt.Fprint(stdout, cmdUsage)
		return exitOK
	default:
		fmt.Fprintf(stderr, "unknown command %q\n%s", args[0], cmdUsage)
		return exitUsage
	}
	fs := flag.NewFlagSet(args[0], flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, cmdUsage) }
	queue := fs.String("task-queue", workflows.DefaultTaskQueue, "the fleet's workflow task queue")
	address := fs.String("address", "", "Temporal frontend host:port (overrides TEMPORAL_ADDRESS)")
	namespace := fs.String("namespace", "", "Temporal namespace (overrides TEMPORAL_NAMESPACE)")
	insecure := fs.Bool("insecure", false, "allow an insecure Temporal transport")
	output := fs.String("o", "table", "table or json")
	input := fs.String("input", "", "the spawn request (place)")
	if err := fs.Parse(args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return exitUsage
	}
	if fs.NArg() > 0 || (*output != "table" && *output != "json") {
		fmt.Fprint(stderr, cmdUsage)
		return exitUsage
	}
	var req vmflowv1.SpawnRequest
	if args[0] == "place" {
		if err := protojson.Unmarshal([]byte(*input), &req); err != nil || *input == "" {
			fmt.Fprintf(stderr, "place: --input: a spawn request in JSON is required (%v)\n", err)
			return exitUsage
		}
		if req.GetHostId() != "" {
			fmt.Fprintln(stderr, "place: --input names a host_id: a named spawn is not placed")
			return exitUsage
		}
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	c, err := platform.Dial(ctx, platform.Options{HostPort: *address, Namespace: *namespace, Insecure: *insecure, RetryMax: 2 * time.Second, AttemptTimeout: 10 * time.Second})
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", args[0], err)
		return exitError
	}
	defer c.Close()
	if args[0] == "hosts" {
		return hosts(ctx, c, *queue, *output, stdout, stderr)
	}
	return place(ctx, c, &req, *queue, *output, stdout, stderr)
}

func place(ctx context.Context, c client.Client, req *vmflowv1.SpawnRequest, queue, output string, stdout, stderr io.Writer) int {
	p := &Placer{Client: c}
	res, err := p.ChooseHosts(ctx, &vmflowv1.ChooseHostsRequest{Spawn: req, All: true, TaskQueue: queue})
	if err != nil {
		fmt.Fprintf(stderr, "place: %v\n", err)
		return exitError
	}
	code := exitOK
	if len(res.GetCandidates()) == 0 {
		code = exitNoHost
	}
	if output == "json" {
		b, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(res)
		if err != nil {
			fmt.Fprintf(stderr, "place: %v\n", err)
			return exitError
		}
		fmt.Fprintln(stdout, string(b))
		return code
	}
	fmt.Fprintf(stdout, "asked: %s\n", safetext.Escape(res.GetAsk()))
	switch {
	case res.GetPreviousHost() != "":
		fmt.Fprintf(stdout, "would land on: %s (an earlier spawn of this instance was placed there)\n", safetext.Escape(res.GetPreviousHost()))
	case len(res.GetCandidates()) > 0:
		fmt.Fprintf(stdout, "would land on: %s (then, if it refuses: %s)\n", safetext.Escape(res.GetCandidates()[0].GetHostId()), rest(res.GetCandidates()))
	default:
		fmt.Fprintf(stdout, "no host can serve it now: %s\n", safetext.Escape(res.GetFleetBest()))
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "HOST\tFITS\tLIVE\tSCORE\tVIEW AGE\tWHY")
	for _, h := range res.GetAll() {
		live, score := "-", "-"
		if h.GetFits() {
			live, score = yes(h.GetLive()), fmt.Sprintf("%.1f", h.GetScore())
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%ds\t%s\n", safetext.Escape(h.GetHostId()), yes(h.GetFits()), live, score, h.GetViewAgeSeconds(), safetext.Escape(h.GetWhy()))
	}
	_ = tw.Flush()
	return code
}

func rest(cs []*vmflowv1.HostCandidate) string {
	if len(cs) < 2 {
		return "none"
	}
	s := ""
	for i, c := range cs[1:] {
		if i > 0 {
			s += ", "
		}
		s += safetext.Escape(c.GetHostId())
	}
	return s
}

func yes(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func hosts(ctx context.Context, c client.Client, queue, output string, stdout, stderr io.Writer) int {
	views, err := Read(ctx, c, queue)
	if err != nil {
		fmt.Fprintf(stderr, "hosts: %v\n", err)
		return exitError
	}
	if output == "json" {
		out := make([]json.RawMessage, 0, len(views))
		for _, v := range views {
			b, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(v)
			if err != nil {
				fmt.Fprintf(stderr, "hosts: %v\n", err)
				return exitError
			}
			out = append(out, b)
		}
		b, _ := json.Marshal(out)
		fmt.Fprintln(stdout, string(b))
		return exitOK
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "HOST\tVCPUS FREE\tMEMORY FREE\tIN FLIGHT\tGPUS FREE\tDRAINING\tPUBLISHED")
	for _, v := range views {
		gpus := ""
		for i, g := range v.GetGpus() {
			if i > 0 {
				gpus += ", "
			}
			gpus += fmt.Sprintf("%d %s %q", g.GetFree(), g.GetKind(), g.GetName())
		}
		drain := "no"
		if v.GetDraining() {
			drain = "yes: " + v.GetDrainReason()
		}
		fmt.Fprintf(tw, "%s\t%d/%d\t%d/%d MiB\t%d\t%s\t%s\t%s\n", safetext.Escape(v.GetHostId()), v.GetVcpusFree(), v.GetVcpusTotal(),
			v.GetMemoryFreeMib(), v.GetMemoryTotalMib(), v.GetInFlight(), safetext.Escape(gpus), safetext.Escape(drain), safetext.Escape(v.GetPublishedAt()))
	}
	_ = tw.Flush()
	return exitOK
}
