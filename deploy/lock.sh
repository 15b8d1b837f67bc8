#!/usr/bin/env bash
# Regenerates deploy/requirements.lock, the pins the image installs under (deploy/Dockerfile):
# chainspec[gpu]'s dependencies for the base image's CPython 3.11 on Linux x86_64, resolved
# by uv from the index's metadata alone (no wheel is downloaded). Needs uv
# (`pip install uv`); run it after any change to pyproject.toml's dependencies, and pass
# `--upgrade` to move every pin to its newest allowed release.
set -euo pipefail
cd "$(dirname "$0")/.."
"${UV:-uv}" pip compile pyproject.toml --extra gpu --python-version 3.11 \
    --python-platform x86_64-manylinux_2_28 --custom-compile-command "deploy/lock.sh" \
    -o deploy/requirements.lock "$@"
