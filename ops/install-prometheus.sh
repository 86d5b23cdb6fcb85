#!/usr/bin/env bash
# Prometheus for `shunter demo` and the dashboard tests (shunter.cli.demo.prometheus runs it locally).
# Installs Debian's package where it is missing and this user may install system packages (root, or
# password-less sudo); otherwise says what to do and fails. Nothing happens when one is already there.
set -euo pipefail

if [ -n "${SHUNTER_PROMETHEUS:-}" ]; then
    [ -x "$SHUNTER_PROMETHEUS" ] && exit 0
    echo "SHUNTER_PROMETHEUS=$SHUNTER_PROMETHEUS is not an executable file" >&2
    exit 1
fi
command -v prometheus >/dev/null && exit 0

if [ "$(id -u)" = 0 ]; then
    as_root=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    cat >&2 <<'MSG'
Prometheus is not installed, and this user cannot install system packages.
  Debian/Ubuntu: sudo apt-get install --no-install-recommends prometheus
  elsewhere: put a Prometheus 2.x binary (https://prometheus.io/download/) on PATH,
             or name it in SHUNTER_PROMETHEUS=/path/to/prometheus
`shunter demo` and the dashboard tests run it; then re-run make.
MSG
    exit 1
fi
if ! command -v apt-get >/dev/null; then
    echo "Prometheus is not installed and this is not a Debian-like system (no apt-get): put a Prometheus" \
         "2.x binary on PATH, or name it in SHUNTER_PROMETHEUS" >&2
    exit 1
fi
echo "installing Prometheus (Debian's package)..."
export DEBIAN_FRONTEND=noninteractive
# The package's service is not started: invoke-rc.d finds no init system in a container, and on a
# systemd host Shunter never uses it (each run starts its own Prometheus on a free port).
if ! "${as_root[@]}" apt-get install -y -q --no-install-recommends prometheus >/dev/null; then
    "${as_root[@]}" apt-get update -q >/dev/null
    "${as_root[@]}" apt-get install -y -q --no-install-recommends prometheus >/dev/null
fi
prometheus --version | head -1
