#!/usr/bin/env bash
# deploy/dev/demo.sh: `make demo`, against a running `make dev`. Spawns the
# small guest with a simulated vGPU, waits until it is up, shows its status
# and its record, deletes it (the guest powers itself off on the ACPI
# button), checks the host is clean, and prints each step's time.
#
# Against `make dev HOSTS=N` (it lists its hosts in .dev/hosts.list) it does
# this on every host at once, one guest per host, and prints each host's
# run after the other.
set -euo pipefail

# shellcheck source=deploy/dev/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$ROOT"

T="$TEMPORAL"
ID="demo-$(date +%H%M%S)"
STATE="$DEV/state/instances/$ID"
SYS="$DEV/sys"
TIMES=()

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
fail() {
	echo "demo: $*" >&2
	exit 1
}
# results prints the Results part of `temporal workflow execute` (it also
# lists every history event, too long for a demo).
results() { sed -n '/^Results:/,$p' <<<"$1"; }
took() { TIMES+=("$(printf '%-38s %6ss' "$1" "$2")"); }

"$T" operator cluster health >/dev/null 2>&1 ||
	fail "no Temporal at $TEMPORAL_ADDRESS: start make dev in another shell first"
[ -e "$GUEST_DIR/vmlinuz" ] || fail "no guest in $GUEST_DIR: make guest"

# Several hosts: run this script once per host, all at once, each with its
# host's id and state dir (DEMO_HOST, DEMO_STATE), then show their outputs.
if [ -z "${DEMO_HOST:-}" ] && [ -s "$DEV/hosts.list" ] && (($(wc -l <"$DEV/hosts.list") > 1)); then
	tmp=$(mktemp -d)
	trap 'rm -rf "$tmp"' EXIT
	pids=() names=()
	n=0
	while read -r host state; do
		n=$((n + 1))
		DEMO_HOST=$host DEMO_STATE=$state DEMO_ID="$ID-$n" "$0" >"$tmp/$n" 2>&1 &
		pids+=($!) names+=("$host")
	done <"$DEV/hosts.list"
	echo "demo: one guest on each of ${#pids[@]} hosts (${names[*]}), all at once"
	rc=0
	for i in "${!pids[@]}"; do
		wait "${pids[i]}" || rc=1
		printf '\n\033[1m######## host %s\033[0m\n' "${names[i]}"
		cat "$tmp/$((i + 1))"
	done
	exit "$rc"
fi
if [ -n "${DEMO_HOST:-}" ]; then
	HOST_ID=$DEMO_HOST ID=$DEMO_ID
	STATE="$DEMO_STATE/instances/$ID" SYS="$(dirname "$DEMO_STATE")/sys"
fi

step "spawn $ID (guest under TCG, vGPU GRID A100-4C) on host $HOST_ID"
t0=$(now)
out=$(timeout 120 "$T" workflow execute --task-queue "$TASK_QUEUE" --type SpawnInstance --workflow-id "spawn/$ID" \
	--input "{\"instance_id\":\"$ID\",\"host_id\":\"$HOST_ID\",\"vcpus\":1,\"memory_mib\":256,\"machine\":\"q35\",\"accel\":\"tcg\",\"kernel\":\"$GUEST_DIR/vmlinuz\",\"initrd\":\"$GUEST_DIR/initrd.img\",\"cmdline\":\"console=ttyS0 panic=-1\",\"vgpu_profile\":\"GRID A100-4C\"}" 2>&1) ||
	fail "spawn/$ID failed or took over 120 s: $T workflow query --workflow-id spawn/$ID --name status"$'\n'"$out"
results "$out"
took "spawn (workflow, QMP running)" "$(since "$t0")"

step "wait for the guest's init: 'vmflow-guest: up' on its serial console"
deadline=$((SECONDS + 120))
until grep -q 'vmflow-guest: up' "$STATE/qemu.log" 2>/dev/null; do
	((SECONDS < deadline)) || fail "guest not up after 120 s; see $STATE/qemu.log"
	sleep 0.1 # poll interval of a bounded wait
done
took "guest booted (spawn to init up)" "$(since "$t0")"
grep 'vmflow-guest' "$STATE/qemu.log"

step "status of spawn/$ID"
t1=$(now)
"$T" workflow query --workflow-id "spawn/$ID" --name status
took "status query" "$(since "$t1")"
echo "record $STATE/record.json (state, process, GPU claim):"
grep -E '"(state|pid|uuid|profile|phase)"' "$STATE/record.json" | sed 's/^/  /'

step "delete $ID (system_powerdown; the guest powers itself off)"
# Hold the console log open: the delete removes the instance's folder, and
# the guest's last words are read through this descriptor afterwards.
exec 7<"$STATE/qemu.log"
cat <&7 >/dev/null
t2=$(now)
# A delete never fails, it waits (e.g. a vGPU release that keeps failing):
# bound the demo's wait and say where to look.
out=$(timeout 120 "$T" workflow execute --task-queue "$TASK_QUEUE" --type DeleteInstance --workflow-id "delete/$ID" \
	--input "{\"instance_id\":\"$ID\",\"host_id\":\"$HOST_ID\",\"graceful_timeout_seconds\":30}" 2>&1) ||
	fail "delete/$ID not finished after 120 s: $T workflow query --workflow-id delete/$ID --name status"$'\n'"$out"
results "$out"
took "delete (stop, release vGPU, record)" "$(since "$t2")"
"$T" workflow query --workflow-id "delete/$ID" --name status
echo "the guest's console during the delete:"
grep -E 'vmflow-guest|reboot' <&7 | sed 's/^/  /' || true
exec 7<&-

step "host state"
if [ -e "$STATE/record.json" ]; then fail "record still there: $STATE/record.json"; fi
echo "record gone; vGPU devices left in the simulator: $(find "$SYS/bus/mdev/devices" -mindepth 1 -maxdepth 1 | wc -l)"
if pgrep -f -- "$STATE/" >/dev/null; then fail "a QEMU of $ID still runs"; fi
echo "no QEMU of $ID"

step "timings"
printf '  %s\n' "${TIMES[@]}"
printf '  %-38s %6ss\n' "total" "$(since "$t0")"
