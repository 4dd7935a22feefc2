package agent

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"vmflow/daemon"
	"vmflow/hostagent/admission"
	"vmflow/hostagent/store"
	"vmflow/hostagent/supervise"
	"vmflow/hostagent/vmm"
	"vmflow/hostagent/vmm/vmmtest"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// refusingTemporal is a gRPC server that answers every call the way a
// Temporal frontend answers an expired API key.
func refusingTemporal(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer(grpc.UnknownServiceHandler(func(any, grpc.ServerStream) error {
		return status.Error(codes.Unauthenticated, "API key expired")
	}))
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}

// TestAgentOutlivesBadRecordAndRefusedCredentials (invariant 12): a
// truncated record, an agent without a vGPU driver on a host whose records
// hold claims, and a Temporal that refuses the agent's credentials: the
// agent keeps supervising, names the instances whose claims it cannot
// serve, and keeps retrying Temporal with the reason in its log. Before the
// fix the refused dial (and, before that, the truncated record) ended the
// agent, and with it supervision of every VM on the host.
func TestAgentOutlivesBadRecordAndRefusedCredentials(t *testing.T) {
	dir := t.TempDir()
	st, err := store.New(dir)
	require.NoError(t, err)
	ctx := context.Background()
	req := &vmflowv1.SpawnRequest{InstanceId: "claimed", Vcpus: 1, MemoryMib: 64, Machine: "none", VgpuProfile: "GRID A100-4C"}
	_, err = st.Create(ctx, &vmflowv1.InstanceRecord{Id: "claimed", Spec: admission.RecordSpec(req)})
	require.NoError(t, err)
	_, err = st.Apply(ctx, "claimed", store.LeaseIntent(store.VGPULease(&vmflowv1.VgpuLease{Profile: "GRID A100-4C",
		Uuid: "8b6a3a57-4f4e-4b41-9a2c-3f1d2e5a6b7c", Driver: "mdev"}), time.Now()), store.VGPUActive("vgpu:8b6a3a57-4f4e-4b41-9a2c-3f1d2e5a6b7c", "8b6a3a57-4f4e-4b41-9a2c-3f1d2e5a6b7c", ""))
	require.NoError(t, err)
	_, err = st.Create(ctx, &vmflowv1.InstanceRecord{Id: "torn", Spec: admission.RecordSpec(req)})
	require.NoError(t, err)
	p, err := st.Paths("torn")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p.Record, []byte(`{"id": "torn", "sp`), 0o600))

	core, logs := observer.New(zapcore.InfoLevel)
	cfg := Config{
		HostID: "h1", StateDir: dir, VGPUDriver: "none", TaskQueue: "vmflow", ReconcileEvery: time.Minute,
		GracefulTimeout: time.Second, GroupExitCap: time.Second,
		Flags: daemon.Flags{Address: refusingTemporal(t), Namespace: "default", LogLevel: "info", Logger: zap.New(core)},
	}
	actx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- Run(actx, cfg) }()

	require.Eventually(t, func() bool {
		return logs.FilterMessageSnippet("temporal refused the agent").Len() > 0
	}, 30*time.Second, 20*time.Millisecond, "the refusal is logged with its reason")
	select {
	case err := <-done:
		t.Fatalf("the agent stopped on a refused dial: %v", err)
	default:
	}
	refused := logs.FilterMessageSnippet("temporal refused the agent").All()[0]
	assert.Contains(t, refused.ContextMap()["error"], "API key expired")

	unserved := logs.FilterMessageSnippet("has no driver for").All()
	require.Len(t, unserved, 1)
	assert.Equal(t, []interface{}{"claimed"}, unserved[0].ContextMap()["instance_ids"])
	assert.Positive(t, logs.FilterMessageSnippet("supervising").Len(), "supervision went on past the torn record")

	cancel()
	select {
	case err := <-done:
		assert.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("the agent did not stop on cancel")
	}
	// Nothing was done to the torn record's instance.
	b, err := os.ReadFile(p.Record)
	require.NoError(t, err)
	assert.Equal(t, `{"id": "torn", "sp`, string(b))
}

// TestSupervisionWaitsUntilRecordsCanBeListed: when the instances folder
// itself cannot be read (after the store opened), nothing is supervised, so
// the agent does not go on to serve as if the host were empty: it says why
// and retries, and supervises once the folder is back.
func TestSupervisionWaitsUntilRecordsCanBeListed(t *testing.T) {
	dir := t.TempDir()
	st, err := store.New(dir)
	require.NoError(t, err)
	sup, err := supervise.New(supervise.Config{Store: st})
	require.NoError(t, err)
	defer sup.Close()
	instances := filepath.Join(dir, "instances")
	require.NoError(t, os.Rename(instances, instances+".away"))
	require.NoError(t, os.WriteFile(instances, nil, 0o600)) // ENOTDIR for the listing

	core, logs := observer.New(zapcore.InfoLevel)
	done := make(chan error, 1)
	go func() {
		_, err := startSupervision(context.Background(), sup, zap.New(core))
		done <- err
	}()
	require.Eventually(t, func() bool {
		return logs.FilterMessageSnippet("cannot read the instance records").Len() > 0
	}, 30*time.Second, 20*time.Millisecond)
	select {
	case err := <-done:
		t.Fatalf("supervision went on without the records: %v", err)
	default:
	}
	require.NoError(t, os.Remove(instances))
	require.NoError(t, os.Rename(instances+".away", instances))
	select {
	case err := <-done:
		assert.NoError(t, err, "supervises once the folder is readable")
	case <-time.After(30 * time.Second):
		t.Fatal("still waiting after the folder came back")
	}
}

// TestAgentRefusesInsecureTransportAndKeepsSupervising: plaintext to a
// non-loopback Temporal without --insecure is refused, said once in the log
// and on /readyz, and the agent goes on supervising without a connection
// (invariant 12) until it is stopped. Fails if the agent dials it.
func TestAgentRefusesInsecureTransportAndKeepsSupervising(t *testing.T) {
	dir := t.TempDir()
	core, logs := observer.New(zapcore.InfoLevel)
	metricsAddr := freeAddr(t)
	cfg := Config{
		// TEST-NET-1: never routed; a dial would hang, not fail.
		HostID: "h1", StateDir: dir, VGPUDriver: "none", TaskQueue: "vmflow", ReconcileEvery: time.Minute,
		GracefulTimeout: time.Second, GroupExitCap: time.Second,
		Flags: daemon.Flags{Address: "192.0.2.1:7233", Namespace: "default", LogLevel: "info", MetricsAddr: metricsAddr,
			Logger: zap.New(core)},
	}
	t.Setenv("TEMPORAL_CONFIG_FILE", filepath.Join(dir, "absent.toml"))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg) }()

	var ready string
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://" + metricsAddr + "/readyz")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		ready = string(b)
		// Until the transport is checked, /readyz says the worker is not
		// polling yet: wait for the refusal itself, after re-attach.
		return resp.StatusCode == http.StatusServiceUnavailable && strings.Contains(ready, "not a loopback address") &&
			!strings.Contains(ready, "reattach")
	}, 30*time.Second, 20*time.Millisecond, "readyz: %s", ready)
	assert.Contains(t, ready, "--insecure")
	// The alert on an agent without Temporal reads this.
	resp, err := http.Get("http://" + metricsAddr + "/metrics")
	require.NoError(t, err)
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	assert.Contains(t, string(b), "\nvmflow_temporal_connected 0\n")

	refused := logs.FilterMessageSnippet("insecure transport refused")
	require.Equal(t, 1, refused.Len(), "said once")
	assert.Contains(t, refused.All()[0].ContextMap()["error"], "192.0.2.1:7233")
	assert.Positive(t, logs.FilterMessageSnippet("supervising").Len())
	assert.Zero(t, logs.FilterMessageSnippet("temporal not reachable").Len(), "never dialed")
	select {
	case err := <-done:
		t.Fatalf("the agent stopped on a refused transport: %v", err)
	default:
	}
	cancel()
	select {
	case err := <-done:
		assert.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("the agent did not stop on cancel")
	}
}

// At start the fd store loses the log pipes of instances without a record,
// and keeps a recorded instance's, an unreadable record's (its uid is
// unknown) and any name that is not a vmflow log pipe.
func TestPruneFDStoreKeepsWhatRecordsName(t *testing.T) {
	dir := t.TempDir()
	st, err := store.New(dir)
	require.NoError(t, err)
	ctx := context.Background()
	req := &vmflowv1.SpawnRequest{InstanceId: "live", Vcpus: 1, MemoryMib: 64, Machine: "none"}
	for _, id := range []string{"live", "torn"} {
		_, err = st.Create(ctx, &vmflowv1.InstanceRecord{Id: id, Spec: admission.RecordSpec(req)})
		require.NoError(t, err)
	}
	l, err := st.Lock(ctx, "live")
	require.NoError(t, err)
	rec, err := l.AssignQEMUUID(ctx, store.UIDRange{First: 1900000001, Last: 1900000001},
		func(context.Context) (map[uint32]bool, error) { return nil, nil })
	require.NoError(t, err)
	require.Equal(t, uint32(1900000001), rec.GetQemuUid())
	l.Unlock()
	p, err := st.Paths("torn")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p.Record, []byte(`{"id": "torn", "sp`), 0o600))

	n := vmmtest.NewSystemd(t)
	handed := map[string]*os.File{}
	names := []string{vmm.LogFDName("live", 1900000001), vmm.LogFDName("live", 1900000002), vmm.LogFDName("torn", 1900000003),
		vmm.LogFDName("deleted", 1900000001), "someone-else"}
	for _, name := range names {
		r, w, err := os.Pipe()
		require.NoError(t, err)
		t.Cleanup(func() { r.Close(); w.Close() })
		handed[name] = r
	}
	sd := vmm.SystemdFDStoreFor(n.Path, handed)
	core, logs := observer.New(zapcore.InfoLevel)
	pruneFDStore(st, sd, zap.New(core))

	dropped := []string{names[1], names[3]} // a uid the record does not have; no record
	require.Eventually(t, func() bool { return len(n.Messages()) >= len(dropped) }, 5*time.Second, time.Millisecond)
	assert.ElementsMatch(t, []string{"FDSTOREREMOVE=1\nFDNAME=" + dropped[0], "FDSTOREREMOVE=1\nFDNAME=" + dropped[1]}, n.Messages())
	for _, name := range names {
		if name == dropped[0] || name == dropped[1] {
			assert.Nil(t, sd.Take(name), name)
		} else {
			assert.NotNil(t, sd.Take(name), name)
		}
	}
	require.Equal(t, 1, logs.FilterMessageSnippet("dropped the log pipes").Len())
}
