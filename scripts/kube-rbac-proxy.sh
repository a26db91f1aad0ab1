#!/usr/bin/env bash
# Build kube-rbac-proxy (github.com/brancz/kube-rbac-proxy) — the sidecar that guards the agent's
# and the operator's metrics in the chart deploy/helm/cilia — for the test that scrapes through it
# (deploy/tests/test_metrics_rbac.py). Test tooling only: the manifests use the upstream image.
#
# The version is pinned once, in tools/kube-rbac-proxy/go.mod (the image tag in the chart's values.yaml
# names the same release); the source comes from the Go module proxy. Built once with
# `nice -n 10 go build -trimpath -ldflags='-s -w'` into
# ${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/kube-rbac-proxy/<version>/bin/kube-rbac-proxy and reused
# while its inputs (go.mod, go.sum, the Go version) are unchanged.
#
# When it cannot be built, kube-rbac-proxy.unavailable beside it holds the exact command and the
# last lines of the error; the test skips with that text (outside CI). With
# CILIA_REQUIRE_PRIVILEGED=1 (CI) a failed build also fails this script.
# Build time and size are appended to <cache>/kube-rbac-proxy/<version>/build-times.tsv.
#
# Usage: scripts/kube-rbac-proxy.sh              build if missing, print the binary's path
#        scripts/kube-rbac-proxy.sh --print-bin  print the binary's path only (no build)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=$PWD/tools/kube-rbac-proxy
# shellcheck source=lib/gobuild.sh
source scripts/lib/gobuild.sh
gobuild_setup kube-rbac-proxy

# `go mod tidy` keeps the require in the block (marked indirect: the module is only a tool)
VERSION=$(sed -En 's#^(require )?[[:space:]]*github\.com/brancz/kube-rbac-proxy (v[^ ]+).*#\2#p' "$DIR/go.mod")
[[ -n $VERSION ]] || { log "tools/kube-rbac-proxy/go.mod requires no github.com/brancz/kube-rbac-proxy version"; exit 2; }
CACHE=$GOBUILD_CACHE_ROOT/kube-rbac-proxy/$VERSION
OUT=$CACHE/bin/kube-rbac-proxy
if [[ ${1:-} == --print-bin ]]; then echo "$OUT"; exit 0; fi

gobuild_lock "$CACHE"
ldflags="-s -w"
inputs=("$DIR/go.mod" "$DIR/go.sum")
if ! gobuild kube-rbac-proxy "$CACHE/bin" "$DIR" "" "$ldflags" inputs \
    go build -trimpath "-ldflags=$ldflags" -o @OUT@ github.com/brancz/kube-rbac-proxy/cmd/kube-rbac-proxy; then
  [[ ${CILIA_REQUIRE_PRIVILEGED:-} == 1 ]] && exit 1
fi
echo "$OUT"
