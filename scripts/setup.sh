#!/usr/bin/env bash
# One set-up for every entry point (make setup/demo/test, CI, the Dockerfile): installs what is
# missing and nothing else, so a second run takes about a second.
#   scripts/setup.sh            system packages + .venv with the package, test tools and bcc linked in
#   scripts/setup.sh --system   system packages only
#   scripts/setup.sh --runtime  only what the agent needs at run time (the image's final stage):
#                               bcc links LLVM/clang as libraries, so no compiler packages
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(bpfcc-tools python3-bpfcc libbpfcc clang llvm bpftool libbpf-dev linux-headers-amd64
              iproute2 iptables nftables conntrack ethtool wrk python3-venv python3-dev gcc
              procps)  # procps: sysctl, which tests use inside their namespaces

RUNTIME_PACKAGES=(python3 python3-bpfcc libbpfcc bpftool linux-headers-amd64 iproute2 iptables nftables conntrack)

need_root() { [ "$(id -u)" = 0 ] || { echo "setup: must run as root (apt-get, netns, BPF)" >&2; exit 1; }; }

install_system_packages() {
    local missing=()
    for p in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    need_root
    echo "setup: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# Debian's python: bcc (python3-bpfcc) is a pure-Python package over libbcc.so and is linked into the venv.
PYTHON=/usr/bin/python3
[ -x "$PYTHON" ] || PYTHON=$(command -v python3)

install_venv() {
    [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
    local site
    site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    [ -e "$site/bcc" ] || ln -s /usr/lib/python3/dist-packages/bcc "$site/bcc"
    # Reinstall only when the declared dependencies changed.
    local stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
    if [ ! -e "$stamp" ]; then
        .venv/bin/pip install -q --upgrade pip >/dev/null
        .venv/bin/pip install -q -e '.[test]'
        rm -f .venv/.installed-* && touch "$stamp"
    fi
}

case "${1:-}" in
    --runtime) APT_PACKAGES=("${RUNTIME_PACKAGES[@]}"); install_system_packages; exit 0 ;;
    --system) install_system_packages; exit 0 ;;
    "") ;;
    *) echo "setup: unknown option $1 (--system, --runtime)" >&2; exit 2 ;;
esac
# The package's bytecode, compiled once here as the image's pip install compiles it: the editable
# install leaves none, and with PYTHONDONTWRITEBYTECODE set (as the image sets it, and as the
# shells of this project's development machine do) every agent a lab starts would otherwise
# compile ~150 modules again (~0.2 s of CPU at each start, while its initial list runs). Only what
# changed since is compiled; a module edited later is compiled in memory as before, never run
# stale (Python checks each source's mtime and size against its .pyc).
compile_package() {
    .venv/bin/python -m compileall -q ebpf_proxy >/dev/null
}

install_system_packages
install_venv
compile_package
.venv/bin/ebpf-proxy doctor --prepare
