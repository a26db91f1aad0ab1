#!/usr/bin/env bash
# Build the unmodified upstream `helm` CLI (helm.sh/helm/v4, cmd/helm) once and cache it: the
# deploy tests lint, render, install-check and refuse bad values of the chart deploy/helm/cilia
# with the real helm, and users install the chart with it (deploy/README.md).
#
# The version is pinned once, in tools/helm/go.mod (`require helm.sh/helm/v4 vX.Y.Z`); the
# source comes from the Go module proxy. Built with `nice -n 10 go build -trimpath` and the
# version stamped as upstream's Makefile stamps it (-X helm.sh/helm/v4/internal/version.version),
# into ${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/helm/<version>/bin/helm and reused while its inputs
# (go.mod, go.sum, the Go version, the flags) are unchanged.
#
# When it cannot be built, helm.unavailable beside it holds the exact command and the last lines
# of the error; the deploy tests fail in CI and skip with that text elsewhere. With
# CILIA_REQUIRE_PRIVILEGED=1 (CI) a failed build also fails this script.
# Build time and size are appended to <cache>/helm/<version>/build-times.tsv.
#
# Usage: scripts/helm-cli.sh              build if missing, print the binary's path
#        scripts/helm-cli.sh --print-bin  print the binary's path only (no build)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=$PWD/tools/helm
# shellcheck source=lib/gobuild.sh
source scripts/lib/gobuild.sh
gobuild_setup helm-cli

VERSION=$(sed -En 's#^(require )?[[:space:]]*helm\.sh/helm/v4 (v[^ ]+).*#\2#p' "$DIR/go.mod")
[[ -n $VERSION ]] || { log "tools/helm/go.mod requires no helm.sh/helm/v4 version"; exit 2; }
CACHE=$GOBUILD_CACHE_ROOT/helm/$VERSION
OUT=$CACHE/bin/helm
if [[ ${1:-} == --print-bin ]]; then echo "$OUT"; exit 0; fi

gobuild_lock "$CACHE"
ldflags="-s -w -X helm.sh/helm/v4/internal/version.version=$VERSION -X helm.sh/helm/v4/internal/version.gitTreeState=clean"
inputs=("$DIR/go.mod" "$DIR/go.sum")
if ! gobuild helm "$CACHE/bin" "$DIR" 0 "$ldflags" inputs \
    go build -trimpath "-ldflags=$ldflags" -o @OUT@ helm.sh/helm/v4/cmd/helm; then
  [[ ${CILIA_REQUIRE_PRIVILEGED:-} == 1 ]] && exit 1
fi
echo "$OUT"
