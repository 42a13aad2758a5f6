#!/usr/bin/env bash
# Installs the PostgreSQL 15 programs that weft's pg tests and peer baselines need (postgres,
# initdb, pgbench, psql) on a Debian/Ubuntu CI machine.
#
# The tests start their own throwaway servers (weft_pg::TempPostgres), so this script makes sure
# the packages do NOT create or start the distribution's default cluster: it installs a
# postgresql-common drop-in with `create_main_cluster = false`, blocks service starts during the
# install (policy-rc.d), and afterwards stops and sets to manual any version-15 cluster that
# exists anyway.
#
# Idempotent: does nothing when /usr/lib/postgresql/15/bin/postgres already exists.
# Non-interactive: DEBIAN_FRONTEND=noninteractive, existing config files are kept.
#
# Usage: .ci/install-postgres.sh [--dry-run]
#   --dry-run   print the commands that change the system instead of running them
#
# Environment (for testing this script): PG_BIN overrides the directory checked for an existing
# installation (default /usr/lib/postgresql/15/bin).
set -euo pipefail

PG_MAJOR=15
PG_BIN="${PG_BIN:-/usr/lib/postgresql/${PG_MAJOR}/bin}"
PACKAGES=("postgresql-${PG_MAJOR}" "postgresql-client-${PG_MAJOR}")
DROPIN_DIR=/etc/postgresql-common/createcluster.d
DROPIN="${DROPIN_DIR}/50-weft-no-main-cluster.conf"
POLICY_RC=/usr/sbin/policy-rc.d

DRY_RUN=0
case "${1:-}" in
    "") ;;
    --dry-run) DRY_RUN=1 ;;
    *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac

log() { echo "install-postgres: $*" >&2; }

if [ -x "${PG_BIN}/postgres" ]; then
    log "PostgreSQL ${PG_MAJOR} is already installed in ${PG_BIN}; nothing to do"
    exit 0
fi

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO=(sudo -n)
    else
        log "must run as root (or with passwordless sudo) to install packages"
        exit 1
    fi
fi

# Runs a command that changes the system (as root), or prints it under --dry-run.
run() {
    if [ "${DRY_RUN}" -eq 1 ]; then
        echo "+ $*"
    else
        "${SUDO[@]}" "$@"
    fi
}

# Writes stdin to file $1 (as root), or prints what would be written under --dry-run.
write_file() {
    if [ "${DRY_RUN}" -eq 1 ]; then
        echo "+ write $1:"
        sed 's/^/|   /'
    else
        "${SUDO[@]}" tee "$1" >/dev/null
    fi
}

if ! command -v apt-get >/dev/null 2>&1; then
    log "apt-get not found: install PostgreSQL ${PG_MAJOR} yourself and set WEFT_PG_BIN to its bin directory"
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
APT_OPTS=(-y -q --no-install-recommends
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)

# 1. No default cluster: postgresql-common reads createcluster.d/*.conf when the server package
#    is configured.
run mkdir -p "${DROPIN_DIR}"
write_file "${DROPIN}" <<'EOF'
# Written by weft's .ci/install-postgres.sh: tests run their own temporary servers.
create_main_cluster = false
EOF

# 2. No service starts while installing (invoke-rc.d asks policy-rc.d; 101 = action forbidden).
#    Only ever remove a policy file this script created.
if [ ! -e "${POLICY_RC}" ]; then
    write_file "${POLICY_RC}" <<'EOF'
#!/bin/sh
# Temporary, from weft's .ci/install-postgres.sh: no service starts during package installs.
exit 101
EOF
    run chmod 0755 "${POLICY_RC}"
    if [ "${DRY_RUN}" -eq 0 ]; then
        trap '"${SUDO[@]}" rm -f "${POLICY_RC}"' EXIT
    else
        echo "+ (on exit) rm -f ${POLICY_RC}"
    fi
fi

# 3. Install, from the distribution if it has PostgreSQL 15, else from apt.postgresql.org.
run apt-get update -q
if ! apt-cache show "postgresql-${PG_MAJOR}" >/dev/null 2>&1; then
    log "postgresql-${PG_MAJOR} is not in the configured repositories; adding apt.postgresql.org"
    run apt-get install "${APT_OPTS[@]}" postgresql-common ca-certificates curl gnupg
    # Adds the PGDG repository and its key, then runs apt-get update.
    run /usr/share/postgresql-common/pgdg/apt.postgresql.org.sh -y
fi
run apt-get install "${APT_OPTS[@]}" "${PACKAGES[@]}"
# pgbench ships in postgresql-15 on current Debian/Ubuntu and PGDG; older layouts had it in
# postgresql-contrib.
if [ "${DRY_RUN}" -eq 0 ] && [ ! -x "${PG_BIN}/pgbench" ]; then
    run apt-get install "${APT_OPTS[@]}" postgresql-contrib
fi

# 4. If a cluster was created or started anyway (older postgresql-common without the drop-in
#    directory, or a cluster left from an earlier install), stop it and keep it from autostarting.
if command -v pg_lsclusters >/dev/null 2>&1; then
    pg_lsclusters --no-header 2>/dev/null | while read -r version cluster _port status _rest; do
        [ "${version}" = "${PG_MAJOR}" ] || continue
        if [ "${status}" = "online" ]; then
            log "stopping the default cluster ${version}/${cluster}"
            run pg_ctlcluster "${version}" "${cluster}" stop
        fi
        start_conf="/etc/postgresql/${version}/${cluster}/start.conf"
        if [ -f "${start_conf}" ] && ! grep -qx 'manual' "${start_conf}"; then
            echo manual | write_file "${start_conf}"
        fi
    done
fi
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
    run systemctl disable --now postgresql.service || true
fi

if [ "${DRY_RUN}" -eq 1 ]; then
    log "dry run: nothing was changed"
    exit 0
fi
for program in postgres initdb pgbench; do
    if [ ! -x "${PG_BIN}/${program}" ]; then
        log "installation finished but ${PG_BIN}/${program} is missing"
        exit 1
    fi
done
log "installed: $("${PG_BIN}/postgres" --version), $("${PG_BIN}/pgbench" --version)"
