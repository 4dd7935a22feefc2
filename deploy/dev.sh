#!/usr/bin/env bash
# deploy/dev.sh: what `make dev` runs once the binaries, the Temporal CLI and
# the guest exist. In the foreground, with one prefixed log stream:
#
#   temporal   bin/temporal server start-dev (SQLite in .dev/temporal.db,
#              frontend :7233, UI :8233, vmflow's four search attributes)
#   vgpu-sim   the FUSE vGPU simulator mounted at .dev/sys (faults: .dev/ctl)
#   worker     bin/vmflow-worker (task queue vmflow)
#   agent      bin/vmflow-hostagent run for this host (state in .dev/state)
#
# HOSTS=N (default 1) runs N agents on this machine, as N hosts: host 1 is
# the one above (host id $HOST_ID, .dev/state, .dev/sys, .dev/ctl); host i
# from 2 on has host id $HOST_ID-i and its own state dir, simulator mount and
# fault folder in .dev/hosts/i/ (its processes log as agent-i, vgpu-sim-i).
# .dev/hosts.list names them, one "host-id state-dir" a line, for make demo.
#
# Ctrl-C (or SIGTERM) stops everything it started, in order: the VMs (so
# their agent reaps them), the agent, the worker, the simulator (unmounted),
# Temporal. Running it again reuses .dev/: workflows, history and records.
#
# Environment: DEV_IP (default 127.0.0.1; 0.0.0.0 serves the UI to other
# machines), DEV_PORT (7233), DEV_UI_PORT (8233), HOST_ID (the hostname),
# GUEST_DIR (.cache/guest), HOSTS (1).
set -euo pipefail

# shellcheck source=deploy/dev/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/dev/common.sh"
cd "$ROOT"

DEVLOG="$BIN/vmflow-devlog"

say() { printf '%s\n' "$*" | "$DEVLOG" dev; }
die() {
	say "error: $*"
	shutdown
	exit 1
}

# gone PID: the process has exited (no /proc entry, or a zombie waiting
# for us to reap it; kill -0 would still succeed on a zombie).
gone() {
	local st
	st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 0
	[ -z "$st" ] || [ "$st" = Z ]
}

# wait_ready WHAT TIMEOUT PID CMD...: run CMD until it succeeds; fail if the
# process PID exits first or TIMEOUT seconds pass.
wait_ready() {
	local what=$1 timeout=$2 pid=$3
	shift 3
	local start
	start=$(now)
	local deadline=$((SECONDS + timeout))
	until "$@" >/dev/null 2>&1; do
		if gone "$pid"; then die "$what: the process exited (its log is above)"; fi
		if ((SECONDS >= deadline)); then die "$what: not ready after ${timeout}s"; fi
		sleep 0.2 # poll interval of a bounded wait
	done
	say "$what: ready in $(since "$start")s"
}

PIDS=()
declare -A PID_OF=()

# start NAME CMD...: run CMD in its own session (so the terminal's Ctrl-C
# reaches only this script, which then stops things in order) with its
# output going through the prefixer.
start() {
	local name=$1
	shift
	setsid "$@" > >(exec "$DEVLOG" "$name") 2>&1 &
	PID_OF[$name]=$!
	PIDS+=($!)
}

# stop NAME TIMEOUT: SIGTERM, SIGKILL after TIMEOUT seconds, then reap.
stop() {
	local name=$1 timeout=$2 pid=${PID_OF[$1]:-}
	[ -n "$pid" ] || return 0
	if ! gone "$pid"; then
		kill -TERM "$pid" 2>/dev/null || true
		local deadline=$((SECONDS + timeout))
		while ! gone "$pid"; do
			if ((SECONDS >= deadline)); then
				say "$name did not stop within ${timeout}s: SIGKILL"
				kill -KILL "$pid" 2>/dev/null || true
				deadline=$((SECONDS + 10))
			fi
			sleep 0.1 # poll interval of a bounded wait
		done
	fi
	wait "$pid" 2>/dev/null || true
	unset "PID_OF[$name]"
}

# vm_pids: QEMUs of this dev's hosts: processes whose real uid lies in one
# of their agents' --qemu-uid-range (QEMU's argv names no path to find it
# by: its QMP socket is a descriptor).
vm_pids() {
	local d pid uid last=$((DEV_UID_FIRST + HOSTS * DEV_UIDS_PER_HOST - 1))
	for d in /proc/[0-9]*; do
		pid=${d#/proc/}
		uid=$(awk '$1 == "Uid:" { print $2; exit }' "$d/status" 2>/dev/null) || continue
		if [ -n "$uid" ] && ((uid >= DEV_UID_FIRST && uid <= last)); then
			gone "$pid" || echo "$pid"
		fi
	done
}

# stop_vms: SIGTERM every QEMU of the dev's hosts (QEMU exits cleanly on
# it); while the agents still run they reap them and record their exit.
stop_vms() {
	local pids
	pids=$(vm_pids)
	[ -n "$pids" ] || return 0
	say "stopping VMs (QEMU pids $(echo $pids)); their records stay in their state dirs: delete them after the next make dev"
	# shellcheck disable=SC2086
	kill -TERM $pids 2>/dev/null || true
	local deadline=$((SECONDS + 10))
	while [ -n "$(vm_pids)" ] && ((SECONDS < deadline)); do sleep 0.1; done
	pids=$(vm_pids)
	if [ -n "$pids" ]; then
		say "QEMU still running after 10s: SIGKILL $(echo $pids)"
		# shellcheck disable=SC2086
		kill -KILL $pids 2>/dev/null || true
	fi
}

# HOSTS=N: host 1 keeps the single-host layout (and records); host i >= 2
# lives in .dev/hosts/i. The arrays are indexed by host number.
HOSTS=${HOSTS:-1}
# QEMU uids: DEV_UIDS_PER_HOST per host from the default range's first
# (outside what useradd hands out).
DEV_UID_FIRST=1900000000
DEV_UIDS_PER_HOST=4096
if ! [[ $HOSTS =~ ^[1-9][0-9]*$ ]] || ((HOSTS > 16)); then
	echo "HOSTS=$HOSTS: give a number of hosts from 1 to 16" >&2
	exit 1
fi
declare -a H_ID H_STATE H_SYS H_CTL H_DEV H_AGENT H_SIM H_NETNS
# Each host's network (bridge, TAPs) lives in a namespace of its own, made
# here and deleted at the stop: nothing reaches the machine's own.
DEV_SUBNET=10.88.0.0/24
for ((i = 1; i <= HOSTS; i++)); do
	H_NETNS[i]=vmflow-dev-$i
	if ((i == 1)); then
		H_ID[i]=$HOST_ID H_STATE[i]=$DEV/state H_SYS[i]=$DEV/sys H_CTL[i]=$DEV/ctl H_DEV[i]=$DEV/dev
		H_AGENT[i]=agent H_SIM[i]=vgpu-sim
	else
		# Host ids are at most 63 characters: room for the -i.
		H_ID[i]="${HOST_ID:0:60}-$i" H_STATE[i]=$DEV/hosts/$i/state H_SYS[i]=$DEV/hosts/$i/sys
		H_CTL[i]=$DEV/hosts/$i/ctl H_DEV[i]=$DEV/hosts/$i/dev H_AGENT[i]=agent-$i H_SIM[i]=vgpu-sim-$i
	fi
done

# unmount_sim MOUNT: unmount one simulator if it is mounted.
unmount_sim() {
	if awk -v m="$1" '$2 == m { found = 1 } END { exit !found }' /proc/mounts; then
		say "unmounting $1"
		umount "$1" 2>/dev/null || umount -l "$1"
	fi
}

any_agent() {
	local i
	for ((i = 1; i <= HOSTS; i++)); do
		[ -z "${PID_OF[${H_AGENT[i]}]:-}" ] || return 0
	done
	return 1
}

STOPPING=0
shutdown() {
	((STOPPING == 0)) || return 0
	STOPPING=1
	trap '' INT TERM
	say "stopping: VMs, agents, worker, simulators, Temporal"
	! any_agent || stop_vms
	local i
	# All agents at once (each drains its running activities), then reaped
	# one by one: N agents take one --stop-timeout, not N.
	for ((i = 1; i <= HOSTS; i++)); do
		[ -z "${PID_OF[${H_AGENT[i]}]:-}" ] || kill -TERM "${PID_OF[${H_AGENT[i]}]}" 2>/dev/null || true
	done
	for ((i = 1; i <= HOSTS; i++)); do
		stop "${H_AGENT[i]}" 35 # over the agent's --stop-timeout (25 s): let a running activity finish
	done
	stop worker 35
	stop_vms # any an agent restarted meanwhile (restart policy always)
	for ((i = 1; i <= HOSTS; i++)); do
		ip netns del "${H_NETNS[i]}" 2>/dev/null || true
	done
	for ((i = 1; i <= HOSTS; i++)); do
		stop "${H_SIM[i]}" 10
		unmount_sim "${H_SYS[i]}"
	done
	stop temporal 30
	say "stopped; state kept in $DEV (rm -rf .dev for a fresh start)"
}
# A requested stop that went cleanly is a success.
trap 'shutdown; exit 0' INT TERM

# --- checks ---------------------------------------------------------------
if [ "$(id -u)" != 0 ]; then
	echo "make dev runs as root: QEMU under its own uids, the FUSE simulator, /proc of other processes" >&2
	exit 1
fi
for f in "$TEMPORAL" "$BIN/vmflow-worker" "$BIN/vmflow-hostagent" "$BIN/vmflow-vgpusim" "$GUEST_DIR/vmlinuz" "$GUEST_DIR/initrd.img"; do
	if [ ! -e "$f" ]; then
		echo "missing $f: run make dev (it builds what is missing)" >&2
		exit 1
	fi
done
go build -o "$DEVLOG" ./deploy/dev/devlog
port_busy() { (exec 3<>"/dev/tcp/$DEV_IP/$1") 2>/dev/null; }
for p in "$DEV_PORT" "$DEV_UI_PORT"; do
	if port_busy "$p"; then
		echo "port $p on $DEV_IP is in use: is make dev already running? (DEV_PORT / DEV_UI_PORT pick others)" >&2
		exit 1
	fi
done
for ((i = 1; i <= HOSTS; i++)); do
	mkdir -p "${H_SYS[i]}" "${H_CTL[i]}" "${H_STATE[i]}" "${H_DEV[i]}"
	# A previous run that was killed (-9) left its FUSE mount behind, and
	# its namespace.
	unmount_sim "${H_SYS[i]}"
	ip netns del "${H_NETNS[i]}" 2>/dev/null || true
	ip netns add "${H_NETNS[i]}"
done
for ((i = 1; i <= HOSTS; i++)); do echo "${H_ID[i]} ${H_STATE[i]}"; done >"$DEV/hosts.list"

# --- start ----------------------------------------------------------------
say "vmflow dev stack in $DEV, host id(s) ${H_ID[*]}"
start temporal "$TEMPORAL" server start-dev \
	--db-filename "$DEV/temporal.db" --ip "$DEV_IP" --port "$DEV_PORT" --ui-port "$DEV_UI_PORT" \
	--log-level warn --sqlite-pragma journal_mode=wal --sqlite-pragma synchronous=normal \
	--search-attribute VmInstanceId=Keyword --search-attribute VmHostId=Keyword \
	--search-attribute VmStage=Keyword --search-attribute VmNeedsAttention=Bool
wait_ready "Temporal on $TEMPORAL_ADDRESS" 120 "${PID_OF[temporal]}" "$TEMPORAL" operator search-attribute list

for ((i = 1; i <= HOSTS; i++)); do
	start "${H_SIM[i]}" "$BIN/vmflow-vgpusim" --mount "${H_SYS[i]}" --control "${H_CTL[i]}" --mdev-parents 2 --vendor-vfs 4
	wait_ready "vGPU simulator at ${H_SYS[i]}" 30 "${PID_OF[${H_SIM[i]}]}" test -d "${H_SYS[i]}/bus/mdev"
done

# Release rounds every 10 s at first (production: 30 s) so a stuck delete
# shows a few rounds while you watch.
start worker "$BIN/vmflow-worker" --task-queue "$TASK_QUEUE" --release-backoff 10s --release-backoff-max 2m

agent_args=(--image-root "$GUEST_DIR" --vgpu-attach=false --workflow-task-queue "$TASK_QUEUE")
# Some sandboxes' PID 1 cannot be inspected even by root; the agent would
# count it as a possible VFIO holder and never release a vGPU.
init_err=$(readlink -v /proc/1/fd/0 2>&1 >/dev/null || true)
if [[ $init_err == *"Permission denied"* ]]; then
	say "PID 1's open files are unreadable here: agent runs with --holders-ignore-pid 1"
	agent_args+=(--holders-ignore-pid 1)
fi
for ((i = 1; i <= HOSTS; i++)); do
	# Every QEMU runs as a uid of its own from its agent's range; agents on
	# one machine need disjoint ranges.
	uid_first=$((DEV_UID_FIRST + (i - 1) * DEV_UIDS_PER_HOST))
	start "${H_AGENT[i]}" "$BIN/vmflow-hostagent" run --host-id "${H_ID[i]}" --state-dir "${H_STATE[i]}" \
		--sysfs-root "${H_SYS[i]}" --dev-root "${H_DEV[i]}" \
		--net-netns "${H_NETNS[i]}" --net-subnet "$DEV_SUBNET" \
		--qemu-uid-range "$uid_first-$((uid_first + DEV_UIDS_PER_HOST - 1))" "${agent_args[@]}"
done

has_pollers() {
	local out
	out=$("$TEMPORAL" task-queue describe --task-queue "$1" -o json) && [[ $out == *'"identity"'* ]]
}
wait_ready "worker on task queue $TASK_QUEUE" 60 "${PID_OF[worker]}" has_pollers "$TASK_QUEUE"
for ((i = 1; i <= HOSTS; i++)); do
	wait_ready "${H_AGENT[i]} on task queue vmflow-host-${H_ID[i]}" 60 "${PID_OF[${H_AGENT[i]}]}" has_pollers "vmflow-host-${H_ID[i]}"
done

# --- how to use it --------------------------------------------------------
T=bin/temporal
GUEST_JSON="\"machine\":\"q35\",\"accel\":\"tcg\",\"kernel\":\"$GUEST_DIR/vmlinuz\",\"initrd\":\"$GUEST_DIR/initrd.img\",\"cmdline\":\"console=ttyS0 panic=-1\""
cat <<EOF

  vmflow is running (host$( ((HOSTS == 1)) || echo s) ${H_ID[*]}). Web UI: http://$DEV_IP:$DEV_UI_PORT/namespaces/default/workflows
  In another shell, from $ROOT:

  # spawn a VM: the small Debian guest under TCG (~3 s to boot), with a simulated vGPU
  $T workflow execute --task-queue vmflow --type SpawnInstance --workflow-id spawn/vm1 \\
    --input '{"instance_id":"vm1","host_id":"$HOST_ID","vcpus":1,"memory_mib":256,$GUEST_JSON,"vgpu_profile":"GRID A100-4C"}'
  # ... and one without a vGPU
  $T workflow execute --task-queue vmflow --type SpawnInstance --workflow-id spawn/vm2 \\
    --input '{"instance_id":"vm2","host_id":"$HOST_ID","vcpus":1,"memory_mib":256,$GUEST_JSON}'
  # its serial console
  tail -f .dev/state/instances/vm1/qemu.log
  # one on the host's network (its address is in the result; the bridge is in
  # namespace ${H_NETNS[1]}: ip netns exec ${H_NETNS[1]} ... reaches it)
  $T workflow execute --task-queue vmflow --type SpawnInstance --workflow-id spawn/vm3 \\
    --input '{"instance_id":"vm3","host_id":"$HOST_ID","vcpus":1,"memory_mib":256,$GUEST_JSON,"network":"default"}'

  # delete vm2 (system_powerdown; the guest powers itself off)
  $T workflow execute --task-queue vmflow --type DeleteInstance --workflow-id delete/vm2 \\
    --input '{"instance_id":"vm2","host_id":"$HOST_ID","graceful_timeout_seconds":30}'
  # status of any vmflow workflow
  $T workflow query --workflow-id delete/vm2 --name status

  # a stuck delete: make vGPU releases fail, then delete vm1, which holds a vGPU
  # (start, not execute: it keeps retrying; record and claim stay on the host)
  echo EBUSY > .dev/ctl/fail-release
  $T workflow start --task-queue vmflow --type DeleteInstance --workflow-id delete/vm1 \\
    --input '{"instance_id":"vm1","host_id":"$HOST_ID","graceful_timeout_seconds":30}'
  $T workflow list --query 'VmNeedsAttention=true'
  $T workflow query --workflow-id delete/vm1 --name status
  # fix the cause, then retry it at once
  rm .dev/ctl/fail-release
  $T workflow signal --workflow-id delete/vm1 --name retry

  make demo runs spawn → status → delete with timings$( ((HOSTS == 1)) || echo ", one guest per host"). Ctrl-C here stops everything.

EOF

# --- run until Ctrl-C or until a process dies -----------------------------
while true; do
	wait -n "${PIDS[@]}" || true
	for name in "${!PID_OF[@]}"; do
		if gone "${PID_OF[$name]}"; then
			die "$name exited unexpectedly (its log is above)"
		fi
	done
done
