#!/usr/bin/env bash
# setup-postgres.sh: create Temporal's two PostgreSQL databases (persistence
# and visibility) and bring their schemas to the version the server needs,
# with temporal-sql-tool from go.temporal.io/server (make temporal-server
# builds both into bin/). Idempotent: create-database and setup-schema leave
# an existing database and schema version alone, update-schema applies only
# the versions still missing. Run it on every deploy, before the server;
# then deploy/setup-temporal.sh against the running server.
#
# Environment:
#   SQL_TOOL     temporal-sql-tool (default: temporal-sql-tool in PATH)
#   SCHEMA_DIR   the module's schema/postgresql/v12 (required: it must match
#                the server's version; `go env GOMODCACHE`/go.temporal.io/
#                server@v1.29.1/schema/postgresql/v12 after make temporal-server)
#   SQL_HOST, SQL_PORT, SQL_USER, SQL_PASSWORD   the connection, read by the
#                tool itself (defaults here: 127.0.0.1, 5432, temporal, none)
#   TEMPORAL_PG_DB, TEMPORAL_PG_VISIBILITY_DB    database names, as in
#                postgresql.yaml (temporal, temporal_visibility)
set -euo pipefail

tool=${SQL_TOOL:-temporal-sql-tool}
schema=${SCHEMA_DIR:?SCHEMA_DIR: the server module\'s schema/postgresql/v12}
export SQL_PLUGIN=postgres12
export SQL_HOST=${SQL_HOST:-127.0.0.1} SQL_PORT=${SQL_PORT:-5432} SQL_USER=${SQL_USER:-temporal}

for pair in "${TEMPORAL_PG_DB:-temporal}=temporal" "${TEMPORAL_PG_VISIBILITY_DB:-temporal_visibility}=visibility"; do
	db=${pair%%=*} dir=$schema/${pair#*=}/versioned
	if [ ! -d "$dir" ]; then
		echo "setup-postgres: no schema folder $dir" >&2
		exit 1
	fi
	echo "setup-postgres: database $db (schema $dir)"
	"$tool" --db "$db" create-database
	"$tool" --db "$db" setup-schema -v 0.0
	"$tool" --db "$db" update-schema -d "$dir"
done
echo "setup-postgres: databases ready"
