# Shared by deploy/dev.sh and deploy/dev/demo.sh (sourced, not run).

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DEV="$ROOT/.dev"
BIN="$ROOT/bin"
TEMPORAL="$BIN/temporal"
GUEST_DIR=${GUEST_DIR:-$ROOT/.cache/guest}
DEV_PORT=${DEV_PORT:-7233}
DEV_UI_PORT=${DEV_UI_PORT:-8233}
DEV_IP=${DEV_IP:-127.0.0.1}
TASK_QUEUE=vmflow
export TEMPORAL_ADDRESS="$DEV_IP:$DEV_PORT"
export TEMPORAL_NAMESPACE=default

# host_id is the machine's hostname made a valid vmflow id
# (^[a-z0-9][a-z0-9-]{0,62}$): lower case, anything else becomes '-'.
host_id() {
	local h
	h=$(hostname 2>/dev/null || cat /proc/sys/kernel/hostname)
	h=$(printf '%s' "$h" | tr 'A-Z' 'a-z' | sed -e 's/[^a-z0-9-]/-/g' -e 's/^[^a-z0-9]*//' | cut -c1-63)
	printf '%s' "${h:-dev-host}"
}
HOST_ID=${HOST_ID:-$(host_id)}

# now prints seconds since the epoch with milliseconds.
now() { date +%s.%3N; }

# since START prints the seconds elapsed since START (from now).
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }
