#!/usr/bin/env bash
# Install Debian's `redis-server` package, the external store of Ray's GCS fault tolerance
# that the head fault-tolerance test drives (tests/integration/test_head_fault_tolerance.py;
# on Kubernetes the chart's `head.gcsFaultTolerance` points at your own Redis instead).
# Idempotent: nothing to do when redis-server is on PATH. Without a usable apt (not Debian,
# or neither root nor passwordless sudo) it says what to install and exits 0, so `make
# tools` still installs the rest; the test then skips (or fails under
# CHAINSPEC_REQUIRE_TOOLS=1). The test starts its own server; the package's service is
# neither needed nor started here.
set -euo pipefail

if command -v redis-server >/dev/null; then
    echo "redis-server already on PATH ($(command -v redis-server))"
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "install-redis: no apt-get here; install Redis 7 (redis-server) and put it on PATH" >&2
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
else
    echo "install-redis: apt-get needs root; run: sudo apt-get install -y redis-server" >&2
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
install() {
    "${SUDO[@]}" apt-get install -y -q --no-install-recommends redis-server
}
# NOTE: a fresh image has no package lists; update only when the first try needs them.
install || { "${SUDO[@]}" apt-get update -q && install; }
command -v redis-server >/dev/null
echo "installed $(redis-server --version)"
