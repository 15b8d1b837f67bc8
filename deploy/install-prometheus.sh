#!/usr/bin/env bash
# Install Debian's `prometheus` package (it brings `prometheus` and `promtool`), which the
# metrics tests drive: `promtool check metrics|rules` and a real Prometheus server.
# Idempotent: nothing to do when both are on PATH. Without a usable apt (not Debian, or
# neither root nor passwordless sudo) it says what to install and exits 0, so `make tools`
# still installs the rest; the tests then skip (or fail under CHAINSPEC_REQUIRE_TOOLS=1).
set -euo pipefail

if command -v promtool >/dev/null && command -v prometheus >/dev/null; then
    echo "prometheus and promtool already on PATH ($(command -v promtool))"
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "install-prometheus: no apt-get here; install Prometheus 2.x (prometheus, promtool)" \
         "and put both on PATH" >&2
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
else
    echo "install-prometheus: apt-get needs root; run: sudo apt-get install -y prometheus" >&2
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
install() {
    "${SUDO[@]}" apt-get install -y -q --no-install-recommends prometheus
}
# NOTE: a fresh image has no package lists; update only when the first try needs them.
install || { "${SUDO[@]}" apt-get update -q && install; }
command -v promtool >/dev/null && command -v prometheus >/dev/null
echo "installed $(prometheus --version 2>&1 | head -n 1)"
