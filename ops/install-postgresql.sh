#!/usr/bin/env bash
# PostgreSQL's server for the Batch API store's tests (tests/integration/postgres.py starts one of its own
# on a free port). Installs Debian's package where initdb is missing (ops/debian-package.sh); nothing
# happens when one is already there.
set -euo pipefail
source "$(dirname "$0")/debian-package.sh"

if compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || command -v initdb >/dev/null; then
    exit 0
fi
install_debian_package postgresql "The Batch API store's PostgreSQL tests start one" \
    "install PostgreSQL's server so that initdb is on PATH"
ls /usr/lib/postgresql/*/bin/initdb
