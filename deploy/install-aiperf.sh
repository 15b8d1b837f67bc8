#!/usr/bin/env bash
# Install NVIDIA's AIPerf, the third-party load generator that
# tests/integration/test_tooling_compat.py runs against `chainspec serve` unchanged, into
# its own venv outside the repo (it pins its own numpy, transformers, pydantic, ...):
# ${CHAINSPEC_TOOLS_CACHE:-~/.cache/chainspec}/aiperf-venv. Measured: ~40 s from PyPI,
# ~1.2 GB. Idempotent: kept when that venv already has the pinned version. Without a
# Python >= 3.10 it says so and exits 0 (the test then skips, or fails under
# CHAINSPEC_REQUIRE_TOOLS=1).
set -euo pipefail

VERSION="0.13.0"
VENV="${CHAINSPEC_TOOLS_CACHE:-$HOME/.cache/chainspec}/aiperf-venv"
PY="$(command -v python3.11 || command -v python3 || true)"

if [ -x "$VENV/bin/aiperf" ] && "$VENV/bin/python" -m pip show aiperf 2>/dev/null \
        | grep -q "^Version: $VERSION$"; then
    echo "aiperf $VERSION already in $VENV"
    exit 0
fi
if [ -z "$PY" ] || ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "install-aiperf: needs Python >= 3.10 (python3.11); aiperf not installed" >&2
    exit 0
fi
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "aiperf==$VERSION"
echo "installed aiperf $VERSION into $VENV"
