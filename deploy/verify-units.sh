#!/usr/bin/env bash
# verify-units.sh: `systemd-analyze verify` the vmflow units in a scratch root
# that looks like an installed host: the binaries at their ExecStart paths,
# the environment files at their EnvironmentFile paths, the units in
# /etc/systemd/system, and the distribution's own units (sysinit.target,
# network-online.target, ...) so dependencies resolve. Any message from
# verify fails the check: systemd only warns about unknown keys, keys in the
# wrong section and missing executables, and each of those means the unit
# does not do what it says.
#
# Usage: deploy/verify-units.sh [BIN_DIR]   (default: bin/ of the repository)
# Installs Debian's systemd package when systemd-analyze is missing.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
bindir=${1:-$repo/bin}

if ! command -v systemd-analyze >/dev/null; then
	echo ">> installing Debian's systemd (for systemd-analyze)"
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd
fi

for b in vmflow-hostagent vmflow-worker; do
	if [[ ! -x $bindir/$b ]]; then
		echo "verify-units: $bindir/$b missing: run make build" >&2
		exit 1
	fi
done

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/usr/local/bin" "$root/etc/systemd/system" "$root/etc/vmflow" "$root/usr/lib/systemd"
cp "$bindir/vmflow-hostagent" "$bindir/vmflow-worker" "$root/usr/local/bin/"
cp "$here/vmflow-hostagent.service" "$here/vmflow-worker.service" "$root/etc/systemd/system/"
# The units name /etc/vmflow/*.env; the examples are what gets installed.
cp "$here/vmflow-hostagent.env" "$root/etc/vmflow/hostagent.env"
cp "$here/vmflow-worker.env" "$root/etc/vmflow/worker.env"
# The distribution's units, for the targets the vmflow units order against.
sysunits=/usr/lib/systemd/system
[[ -d $sysunits ]] || sysunits=/lib/systemd/system
cp -r "$sysunits" "$root/usr/lib/systemd/system"

# Debian 12 (systemd 252) has --root, --man, --generators and
# --recursive-errors. --man=no: the Documentation= links are file:// paths
# of the installed docs, not man pages. --recursive-errors=no: only our
# units' own problems, not those of the distribution units they pull in.
out=$(systemd-analyze verify --root="$root" --man=no --generators=no --recursive-errors=no \
	vmflow-hostagent.service vmflow-worker.service 2>&1) || {
	echo "$out" >&2
	echo "verify-units: systemd-analyze verify failed" >&2
	exit 1
}
if [[ -n $out ]]; then
	echo "$out" >&2
	echo "verify-units: systemd-analyze verify printed warnings (treated as errors)" >&2
	exit 1
fi
echo "verify-units: vmflow-hostagent.service and vmflow-worker.service verify clean ($(systemd-analyze --version | head -1))"
