package store

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// The test binary re-executes itself as a second agent process: a writer the
// parent kills mid-write, a holder of an instance lock, or a concurrent
// updater. helperEnv selects the role; the other variables carry arguments.
const (
	helperEnv   = "VMFLOW_STORE_TEST_HELPER"
	helperDir   = "VMFLOW_STORE_TEST_DIR"
	helperID    = "VMFLOW_STORE_TEST_ID"
	helperCount = "VMFLOW_STORE_TEST_COUNT"
)

func TestMain(m *testing.M) {
	if role := os.Getenv(helperEnv); role != "" {
		os.Exit(runHelper(role))
	}
	os.Exit(m.Run())
}

// withAfterTemp installs the writer hook that runs between the temp file's
// fsync and its rename (test only).
func withAfterTemp(fn func(tmp string)) Option {
	return func(s *Store) { s.afterTemp = fn }
}

// runHelper is the helper process's main. It talks to the parent through
// lines on stdout and waits on stdin: when the parent closes stdin (or dies)
// the helper exits, so no helper outlives its test.
func runHelper(role string) int {
	dir, id := os.Getenv(helperDir), os.Getenv(helperID)
	ctx := context.Background()
	waitParent := func() { _, _ = io.Copy(io.Discard, os.Stdin) }
	switch role {
	case "crash-writer":
		// Park between temp write and rename until the parent SIGKILLs us.
		s, err := New(dir, withAfterTemp(func(tmp string) {
			fmt.Printf("TEMP %s\n", tmp)
			waitParent()
			os.Exit(3) // the parent closed stdin instead of killing: fail
		}))
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		_, err = s.Update(ctx, id, func(r *vmflowv1.InstanceRecord) error {
			r.LastError = "written by the crashing writer"
			r.RestartCount = 999
			return nil
		})
		fmt.Fprintln(os.Stderr, "update returned:", err)
		return 4
	case "indexer":
		// An agent's store: the index open (the agent lock held) until the
		// parent SIGKILLs us or closes stdin.
		s, err := New(dir)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		if err := s.OpenIndex(ctx, func(context.Context) (map[uint32]bool, error) { return nil, nil }); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		fmt.Println("INDEXED")
		waitParent()
		return 0
	case "sleeper":
		// A live process for a record to name; it ends when the parent
		// closes stdin.
		fmt.Println("READY")
		waitParent()
		return 0
	case "lock-holder":
		s, err := New(dir)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		l, err := s.Lock(ctx, id)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		fmt.Println("LOCKED")
		waitParent()
		if err := l.Unlock(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		return 0
	case "incrementer":
		n, err := strconv.Atoi(os.Getenv(helperCount))
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		s, err := New(dir)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		fmt.Println("READY")
		// Start together with the other incrementer: the parent closes
		// stdin once both are ready.
		waitParent()
		if err := increment(ctx, s, id, n); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		return 0
	default:
		fmt.Fprintln(os.Stderr, "unknown helper role", role)
		return 2
	}
}

// increment bumps restart_count n times, each a read-modify-write under the
// lock: without mutual exclusion two incrementers lose updates.
func increment(ctx context.Context, s *Store, id string, n int) error {
	for range n {
		_, err := s.Update(ctx, id, func(r *vmflowv1.InstanceRecord) error {
			r.RestartCount++
			return nil
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// helper is a running helper process.
type helper struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string
	done  chan error
}

func startHelper(t *testing.T, role, dir, id string, extraEnv ...string) *helper {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"="+role, helperDir+"="+dir, helperID+"="+id)
	cmd.Env = append(cmd.Env, extraEnv...)
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	h := &helper{cmd: cmd, stdin: stdin, lines: make(chan string, 16), done: make(chan error, 1)}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			h.lines <- sc.Text()
		}
		close(h.lines)
		err := cmd.Wait()
		if err != nil && stderr.Len() > 0 {
			err = fmt.Errorf("%w; stderr: %s", err, stderr.String())
		}
		h.done <- err
	}()
	t.Cleanup(func() {
		_ = stdin.Close()
		_ = cmd.Process.Kill()
		<-h.done
	})
	return h
}

// expectLine waits (with a deadline, no sleeps) for the helper's next line.
func (h *helper) expectLine(t *testing.T, prefix string) string {
	t.Helper()
	select {
	case line, ok := <-h.lines:
		require.True(t, ok, "helper exited before printing %q", prefix)
		require.True(t, strings.HasPrefix(line, prefix), "helper said %q, want prefix %q", line, prefix)
		return strings.TrimSpace(strings.TrimPrefix(line, prefix))
	case <-time.After(30 * time.Second):
		require.FailNow(t, "timed out waiting for helper", "want %q", prefix)
		return ""
	}
}

// wait waits for the helper to exit and returns its error.
func (h *helper) wait(t *testing.T) error {
	t.Helper()
	select {
	case err := <-h.done:
		h.done <- err // let Cleanup's receive succeed too
		return err
	case <-time.After(60 * time.Second):
		require.FailNow(t, "timed out waiting for helper to exit")
		return nil
	}
}

// newStore opens a store in a short temp dir: socket paths must stay under
// 107 bytes, and t.TempDir's names grow with the test's name.
func newStore(t *testing.T) *Store {
	t.Helper()
	dir, err := os.MkdirTemp("", "vst")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	s, err := New(dir)
	require.NoError(t, err)
	return s
}

func testSpec() *vmflowv1.VMSpec {
	return &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 128, Machine: "none", Accel: "kvm", Uuid: "2f1e1c3a-0000-4000-8000-000000000001"}
}

func wantRecord(id string) *vmflowv1.InstanceRecord {
	return &vmflowv1.InstanceRecord{Id: id, Spec: testSpec(), RestartPolicy: "on-failure", RestartMaxAttempts: 3}
}

// mustCreate creates id and returns its record.
func mustCreate(t *testing.T, s *Store, id string) *vmflowv1.InstanceRecord {
	t.Helper()
	rec, err := s.Create(context.Background(), wantRecord(id))
	require.NoError(t, err)
	return rec
}

// moveTo drives id from Creating to state along allowed transitions.
func moveTo(t *testing.T, s *Store, id string, state vmflowv1.InstanceState) {
	t.Helper()
	ctx := context.Background()
	path := map[vmflowv1.InstanceState][]vmflowv1.InstanceState{
		creating:      nil,
		running:       {running},
		exited:        {running, exited},
		deleting:      {deleting},
		releaseFailed: {deleting, releaseFailed},
	}[state]
	for _, st := range path {
		if st == deleting {
			require.NoError(t, s.MarkManualStop(ctx, id))
		}
		_, err := s.Transition(ctx, id, st)
		require.NoError(t, err)
	}
	rec, err := s.Get(id)
	require.NoError(t, err)
	require.Equal(t, state, rec.GetState())
}

// vgpuLease is a vGPU lease in phase, for tests that build records.
func vgpuLease(v *vmflowv1.VgpuLease, phase vmflowv1.ClaimPhase) *vmflowv1.Lease {
	return &vmflowv1.Lease{Phase: phase, Resource: &vmflowv1.Lease_Vgpu{Vgpu: v}}
}

// applyTo applies steps to r in memory, as Locked.Apply does before it writes.
func applyTo(t testing.TB, r *vmflowv1.InstanceRecord, steps ...Step) {
	t.Helper()
	require.NoError(t, applySteps(steps)(r))
}
