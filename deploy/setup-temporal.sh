#!/usr/bin/env bash
# setup-temporal.sh: prepare a Temporal namespace for vmflow. Idempotent: run
# it on every deploy; it creates what is missing and changes nothing else.
#
#   1. the namespace (TEMPORAL_NAMESPACE, default "default"), if missing,
#      with RETENTION (default 720h) of closed workflow histories;
#   2. the four search attributes the workflows upsert: VmInstanceId,
#      VmHostId, VmStage (Keyword) and VmNeedsAttention (Bool). Without them
#      every vmflow workflow task fails.
#
# Connection: the temporal CLI's own settings, the same ones the vmflow
# binaries read: TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TEMPORAL_TLS_*,
# TEMPORAL_API_KEY, or a profile (TEMPORAL_CONFIG_FILE, TEMPORAL_PROFILE).
# Works the same against `temporal server start-dev`.
#
# Environment:
#   TEMPORAL     the temporal CLI (default: temporal in PATH)
#   RETENTION    retention of a namespace this script creates (default 720h)
#   WAIT         how long to wait for a new namespace to be usable (default 60s)
#
# On Temporal Cloud namespaces and search attributes are managed with the
# Cloud console or tcld, not with the operator API this script uses.
set -euo pipefail

temporal=${TEMPORAL:-temporal}
ns=${TEMPORAL_NAMESPACE:-default}
retention=${RETENTION:-720h}
wait_s=${WAIT:-60s}
wait_s=${wait_s%s}

# name=type, one per line. Keep in step with tclient.SearchAttributes().
attrs=(
	VmInstanceId=Keyword
	VmHostId=Keyword
	VmStage=Keyword
	VmNeedsAttention=Bool
)

t() { "$temporal" "$@" --namespace "$ns"; }

# 1. Namespace. describe fails both for "not found" and for a broken
# connection: only the first may lead to a create.
if out=$(t operator namespace describe 2>&1); then
	echo "setup-temporal: namespace $ns exists"
elif grep -qi 'not found' <<<"$out"; then
	echo "setup-temporal: creating namespace $ns (retention $retention)"
	t operator namespace create --retention "$retention" \
		--description "vmflow: VM and vGPU workflows"
else
	echo "$out" >&2
	echo "setup-temporal: cannot describe namespace $ns" >&2
	exit 1
fi

# A new namespace reaches every frontend through the namespace cache a few
# seconds after create: until then its search attributes cannot be listed.
deadline=$((SECONDS + wait_s))
until out=$(t operator search-attribute list --output json 2>&1); do
	if ((SECONDS >= deadline)); then
		echo "$out" >&2
		echo "setup-temporal: namespace $ns not usable after ${wait_s}s" >&2
		exit 1
	fi
	sleep 1
done

# 2. Search attributes, ONE CALL PER ATTRIBUTE: CLI v1.5.1 accepts repeated
# --name with one --type, but pairs names with types by index and silently
# adds only the first name. The CLI itself accepts an attribute that exists
# with the same type (no change) and refuses one with another type, which
# is what we want: a wrong type needs a person, not a script.
for a in "${attrs[@]}"; do
	name=${a%%=*} type=${a#*=}
	if t operator search-attribute create --name "$name" --type "$type" >/dev/null; then
		echo "setup-temporal: search attribute $name ($type) present"
	else
		echo "setup-temporal: search attribute $name ($type) could not be created" >&2
		exit 1
	fi
done

# Check: every attribute is there with its type.
list=$(t operator search-attribute list --output json)
for a in "${attrs[@]}"; do
	name=${a%%=*} type=${a#*=}
	want="INDEXED_VALUE_TYPE_$(tr '[:lower:]' '[:upper:]' <<<"$type")"
	if ! grep -q "\"$name\": *\"$want\"" <<<"$list"; then
		echo "$list" >&2
		echo "setup-temporal: $name is not registered as $type" >&2
		exit 1
	fi
done
echo "setup-temporal: namespace $ns ready for vmflow"
