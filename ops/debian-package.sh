# Sourced by ops/install-*.sh: installs one of Debian's packages for the tests and tools that run it
# themselves (nothing here starts or enables its service: invoke-rc.d finds no init system in a
# container, and each run starts its own on a free port). Needs root or password-less sudo; otherwise
# prints what to do and fails.
#
#   install_debian_package PACKAGE WHAT_NEEDS_IT [ELSEWHERE]
#
# ELSEWHERE: how to provide it without apt-get (a line of the message; the default: install it).

install_debian_package() {
    local package=$1 needed_by=$2 elsewhere=${3:-"install $1 by other means"}
    local as_root
    if [ "$(id -u)" = 0 ]; then
        as_root=()
    elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        as_root=(sudo -n)
    else
        cat >&2 <<MSG
$package is not installed, and this user cannot install system packages.
  Debian/Ubuntu: sudo apt-get install --no-install-recommends $package
  elsewhere: $elsewhere
$needed_by; then re-run make.
MSG
        return 1
    fi
    if ! command -v apt-get >/dev/null; then
        echo "$package is not installed and this is not a Debian-like system (no apt-get): $elsewhere" >&2
        return 1
    fi
    echo "installing $package (Debian's package)..."
    # An index too old to name the package's current version is refreshed once, then the install retried.
    # The frontend is set through env: sudo's env_reset would drop it from sudo's own environment.
    if ! "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$package" >/dev/null; then
        "${as_root[@]}" apt-get update -q >/dev/null
        "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$package" >/dev/null
    fi
}
