#!/usr/bin/env bash
# PostgreSQL's server for the Batch API store's tests (tests/integration/postgres.py starts one of its own
# on a free port; nothing here starts or enables a service). Installs Debian's package where initdb is
# missing and this user may install system packages (root, or password-less sudo); otherwise says what to
# do and fails. Nothing happens when one is already there.
set -euo pipefail

if compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || command -v initdb >/dev/null; then
    exit 0
fi
if [ "$(id -u)" = 0 ]; then
    as_root=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    cat >&2 <<'MSG'
PostgreSQL's server is not installed, and this user cannot install system packages.
  Debian/Ubuntu: sudo apt-get install --no-install-recommends postgresql
The Batch API store's PostgreSQL tests start one; then re-run make.
MSG
    exit 1
fi
if ! command -v apt-get >/dev/null; then
    echo "PostgreSQL is not installed and this is not a Debian-like system (no apt-get): install its server" \
         "so that initdb is on PATH" >&2
    exit 1
fi
echo "installing PostgreSQL (Debian's package)..."
export DEBIAN_FRONTEND=noninteractive
# The package's cluster service is not started: invoke-rc.d finds no init system in a container, and the
# tests run a cluster of their own.
if ! "${as_root[@]}" apt-get install -y -q --no-install-recommends postgresql >/dev/null; then
    "${as_root[@]}" apt-get update -q >/dev/null
    "${as_root[@]}" apt-get install -y -q --no-install-recommends postgresql >/dev/null
fi
ls /usr/lib/postgresql/*/bin/initdb
