package supervise

import (
	"bufio"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// hostileQMP serves one connection on a fresh socket as a QEMU a guest took
// over might: a proper greeting and capabilities reply, then one message far
// past any bound.
func hostileQMP(t *testing.T) string {
	t.Helper()
	path := filepath.Join(testDir(t), "q.sock")
	l, err := net.Listen("unix", path)
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = c.Write([]byte(`{"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7}, "package": ""}, "capabilities": []}}` + "\n"))
		line, err := bufio.NewReader(c).ReadBytes('\n')
		if err != nil {
			return
		}
		var cmd struct {
			ID json.RawMessage `json:"id"`
		}
		_ = json.Unmarshal(line, &cmd)
		_, _ = c.Write([]byte(`{"return": {}, "id": ` + string(cmd.ID) + "}\n"))
		_, _ = c.Write([]byte(`{"event": "` + strings.Repeat("X", 1<<20) + `"}` + "\n"))
	}()
	return path
}

// A VM whose QMP connection broke the protocol is marked needing attention
// in its record (ls and show name it); the supervisor keeps watching it.
func TestQMPViolationMarksNeedsAttention(t *testing.T) {
	st, err := store.New(testDir(t))
	require.NoError(t, err)
	s, err := New(Config{Store: st, QEMUUIDs: newUIDRange()})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	const id = "vm-hostile-qmp"
	self, err := proc.ReadIdentity(os.Getpid()) // a live process stands in for QEMU
	require.NoError(t, err)
	_, err = st.Create(ctxT(t, 10*time.Second), &vmflowv1.InstanceRecord{Id: id,
		Spec: &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none"}, Process: store.ProcessRecord(self)})
	require.NoError(t, err)

	vm, err := vmm.Attach(self, vmm.Paths{QMPSocket: hostileQMP(t)})
	require.NoError(t, err)
	in, err := s.instance(id)
	require.NoError(t, err)
	in.setVM(vm)
	s.watch(in, vm)
	_, err = vm.Monitor(ctxT(t, 5*time.Second))
	require.NoError(t, err)

	require.Eventually(t, func() bool {
		rec, err := st.Get(id)
		return err == nil && rec.GetNeedsAttention() != ""
	}, 10*time.Second, 5*time.Millisecond)
	rec, err := st.Get(id)
	require.NoError(t, err)
	assert.Contains(t, rec.GetNeedsAttention(), "QMP protocol violation")
	assert.Contains(t, rec.GetNeedsAttention(), "message longer than")
	assert.NotNil(t, rec.GetNeedsAttentionAt())
	assert.Equal(t, in.vm, vm, "still the watched VM: its exit is still recorded")
}
