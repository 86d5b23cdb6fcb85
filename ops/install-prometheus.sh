#!/usr/bin/env bash
# Prometheus for `shunter demo` and the dashboard tests (shunter.cli.demo.prometheus runs it locally).
# Installs Debian's package where it is missing (ops/debian-package.sh); nothing happens when one is
# already there.
set -euo pipefail
source "$(dirname "$0")/debian-package.sh"

if [ -n "${SHUNTER_PROMETHEUS:-}" ]; then
    [ -x "$SHUNTER_PROMETHEUS" ] && exit 0
    echo "SHUNTER_PROMETHEUS=$SHUNTER_PROMETHEUS is not an executable file" >&2
    exit 1
fi
command -v prometheus >/dev/null && exit 0

install_debian_package prometheus "\`shunter demo\` and the dashboard tests run it" \
    "put a Prometheus 2.x binary (https://prometheus.io/download/) on PATH, or name it in SHUNTER_PROMETHEUS=/path/to/prometheus"
prometheus --version | head -1
