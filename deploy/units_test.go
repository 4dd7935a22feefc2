package deploy_test

import (
	"bufio"
	"bytes"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/daemon/agent"
	"vmflow/platform"
)

// unitKeys reads a unit file into section -> key -> values (a key may
// repeat). Comments and blank lines are skipped; no line continuations are
// used in vmflow's units.
func unitKeys(t *testing.T, path string) map[string]map[string][]string {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	out := map[string]map[string][]string{}
	section := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "" || strings.HasPrefix(line, "#") || strings.HasPrefix(line, ";"):
		case strings.HasPrefix(line, "["):
			section = strings.Trim(line, "[]")
			out[section] = map[string][]string{}
		default:
			k, v, ok := strings.Cut(line, "=")
			require.True(t, ok, "line %q", line)
			require.NotEmpty(t, section, "key outside a section: %q", line)
			out[section][k] = append(out[section][k], v)
		}
	}
	require.NoError(t, sc.Err())
	return out
}

// The settings the issue and the design depend on. systemd-analyze verify
// (make units-check) checks the syntax; this checks the intent, so a
// "cleanup" of the unit cannot silently kill every VM on the next upgrade.
func TestHostAgentUnit(t *testing.T) {
	u := unitKeys(t, "vmflow-hostagent.service")
	s := u["Service"]
	assert.Equal(t, []string{"process"}, s["KillMode"], "QEMU must survive an agent restart")
	assert.Equal(t, []string{"always"}, s["Restart"])
	assert.Equal(t, []string{"infinity"}, s["LimitMEMLOCK"], "VFIO pins guest memory")
	assert.Equal(t, []string{"vmflow"}, s["StateDirectory"])
	assert.Equal(t, []string{"1024"}, s["FileDescriptorStoreMax"], "one guest-log pipe per VM")
	assert.Equal(t, []string{"/etc/vmflow/hostagent.env"}, s["EnvironmentFile"])
	assert.True(t, strings.HasPrefix(s["ExecStart"][0], "/usr/local/bin/vmflow-hostagent run "))
	require.Len(t, s["CapabilityBoundingSet"], 1)
	caps := strings.Fields(s["CapabilityBoundingSet"][0])
	assert.ElementsMatch(t, []string{"CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH", "CAP_KILL", "CAP_SETUID", "CAP_SETGID",
		"CAP_CHOWN", "CAP_SYS_ADMIN", "CAP_NET_ADMIN"}, caps, "each capability is documented in the unit; change both (CAP_SYS_ADMIN: the jail's namespaces, mounts and pivot_root; CAP_NET_ADMIN: the bridge, TAPs and NAT)")
	assert.NotContains(t, caps, "CAP_SYS_CHROOT", "the jail pivot_roots, it never chroots")
	// QEMU inherits the unit's namespaces and device policy: none may be set.
	for _, k := range []string{"PrivateTmp", "PrivateDevices", "ProtectSystem", "ProtectHome", "DeviceAllow",
		"ProtectClock", "ProtectKernelModules", "ProtectKernelTunables", "MemoryDenyWriteExecute", "User", "DynamicUser"} {
		assert.NotContains(t, s, k, "%s would break the QEMU processes the agent starts", k)
	}
	assert.Equal(t, []string{"0"}, u["Unit"]["StartLimitIntervalSec"])
}

func TestWorkerUnit(t *testing.T) {
	u := unitKeys(t, "vmflow-worker.service")
	s := u["Service"]
	assert.Equal(t, []string{"always"}, s["Restart"])
	assert.Equal(t, []string{"yes"}, s["DynamicUser"])
	assert.Equal(t, []string{""}, s["CapabilityBoundingSet"], "the worker needs no capability")
	assert.Equal(t, []string{"/etc/vmflow/worker.env"}, s["EnvironmentFile"])
	assert.True(t, strings.HasPrefix(s["ExecStart"][0], "/usr/local/bin/vmflow-worker "))
}

// Every TEMPORAL_* variable the SDK's envconfig reads is documented in both
// environment files.
func TestEnvFilesDocumentEverySetting(t *testing.T) {
	vars := []string{"TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE", "TEMPORAL_TLS", "TEMPORAL_TLS_CLIENT_CERT_PATH",
		"TEMPORAL_TLS_CLIENT_KEY_PATH", "TEMPORAL_TLS_CLIENT_CERT_DATA", "TEMPORAL_TLS_CLIENT_KEY_DATA",
		"TEMPORAL_TLS_SERVER_CA_CERT_PATH", "TEMPORAL_TLS_SERVER_CA_CERT_DATA", "TEMPORAL_TLS_SERVER_NAME",
		"TEMPORAL_TLS_DISABLE_HOST_VERIFICATION", "TEMPORAL_API_KEY", "TEMPORAL_CLIENT_AUTHORITY",
		"TEMPORAL_GRPC_META_", "TEMPORAL_CONFIG_FILE", "TEMPORAL_PROFILE",
		platform.EnvOTLPEndpoint} // tracing's switch
	for file, flags := range map[string][]string{
		"vmflow-hostagent.env": {"--host-id", "--state-dir", "--image-root", "--qemu", "--qemu-uid-range", "--kvm-device", "--vgpu-driver",
			"--sysfs-root", "--dev-root", "--vgpu-orphan-grace", "--reconcile-every", "--graceful-timeout",
			"--group-exit-cap", "--metrics-addr", "--log-level", "--address", "--namespace", "--workflow-task-queue",
			"--vgpu-attach", "--holders-ignore-pid", "--jail"},
		"vmflow-worker.env": {"--task-queue", "--metrics-addr", "--log-level", "--address", "--namespace", "--insecure",
			"--release-backoff", "--release-backoff-max", "--host-pickup-timeout", "--unreachable-backoff",
			"--unreachable-backoff-max", "--spawn-host-wait", "--delete-stuck-after", "--activity-timeout-cap", "--stop-timeout",
			"--versioning", "--deployment-name", "--build-id"},
	} {
		b, err := os.ReadFile(file)
		require.NoError(t, err)
		for _, v := range append(vars, flags...) {
			assert.Contains(t, string(b), v, "%s does not document %s", file, v)
		}
	}
}

// Every flag `vmflow-hostagent run` has is documented in the env file: the
// list comes from the flag set itself, so a new flag fails this test until
// it is written down.
func TestHostAgentEnvDocumentsEveryFlag(t *testing.T) {
	var usage bytes.Buffer
	_, err := agent.ParseFlags([]string{"-h"}, &usage)
	require.Error(t, err)
	names := regexp.MustCompile(`(?m)^\s+-([a-z-]+)`).FindAllStringSubmatch(usage.String(), -1)
	require.NotEmpty(t, names)
	env, err := os.ReadFile("vmflow-hostagent.env")
	require.NoError(t, err)
	for _, m := range names {
		assert.Contains(t, string(env), "--"+m[1], "vmflow-hostagent.env does not document --%s", m[1])
	}
}

// Both env files serve metrics on loopback only: /metrics, /healthz and
// /readyz have no authentication (README.md, "Exposing metrics"). Fails if
// a file binds :9464 or :9465 (every interface).
func TestEnvFilesBindMetricsToLoopback(t *testing.T) {
	for file, want := range map[string]string{"vmflow-hostagent.env": "127.0.0.1:9464", "vmflow-worker.env": "127.0.0.1:9465"} {
		b, err := os.ReadFile(file)
		require.NoError(t, err)
		var flags []string
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, "="); ok && strings.HasPrefix(k, "VMFLOW_") && strings.HasSuffix(k, "_FLAGS") {
				flags = strings.Fields(v)
			}
		}
		addr := ""
		for i, f := range flags {
			if f == "--metrics-addr" && i+1 < len(flags) {
				addr = flags[i+1]
			} else if v, ok := strings.CutPrefix(f, "--metrics-addr="); ok {
				addr = v
			}
		}
		assert.Equal(t, want, addr, "%s --metrics-addr", file)
		host, _, err := net.SplitHostPort(addr)
		require.NoError(t, err)
		ip := net.ParseIP(host)
		assert.True(t, ip != nil && ip.IsLoopback(), "%s binds %q, not loopback", file, addr)
	}
}

// TestREADMENamesTestsThatExist: the threat model (and every other
// paragraph of deploy/README.md) points at test files as its evidence; a
// test renamed or removed must not leave the document pointing at nothing.
// Brace lists (`dir/{a,b}_test.go`) are expanded.
func TestREADMENamesTestsThatExist(t *testing.T) {
	b, err := os.ReadFile("README.md")
	require.NoError(t, err)
	re := regexp.MustCompile("`([a-z0-9_/.-]*(?:\\{[a-z0-9_,]+\\})?[a-z0-9_]*_test\\.go)`")
	var names []string
	for _, m := range re.FindAllStringSubmatch(string(b), -1) {
		p := m[1]
		if i := strings.IndexByte(p, '{'); i >= 0 {
			j := strings.IndexByte(p, '}')
			for _, alt := range strings.Split(p[i+1:j], ",") {
				names = append(names, p[:i]+alt+p[j+1:])
			}
			continue
		}
		names = append(names, p)
	}
	require.NotEmpty(t, names)
	for _, n := range names {
		if !strings.Contains(n, "/") {
			n = filepath.Join("deploy", n) // this folder's own tests
		}
		_, err := os.Stat(filepath.Join("..", n))
		assert.NoError(t, err, "deploy/README.md names %s", n)
	}
}
