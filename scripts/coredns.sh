#!/usr/bin/env bash
# Build CoreDNS, the cluster DNS of the kind-style test cluster (test tooling, never shipped):
#   coredns  from github.com/coredns/coredns (tools/coredns: main.go links only the plugins the
#            harness's Corefile uses; the version is pinned in tools/coredns/versions.env + go.mod)
# Sources come from the Go module proxy. Built once with `nice -n 10 go build -trimpath`, static
# (CGO_ENABLED=0: it is alone in its image), into
# ${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/coredns/<version>/bin/coredns and reused while its inputs
# (versions.env, go.mod, go.sum, main.go, the Go version) are unchanged. Build times and sizes are
# appended to <cache>/coredns/<version>/build-times.tsv. A failed build leaves
# coredns.unavailable (the command and the tail of its error) beside where the binary would be.
#
# Usage: scripts/coredns.sh              build if missing, print the bin directory
#        scripts/coredns.sh --print-bin  print the bin directory only (no build)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=$PWD/tools/coredns
# shellcheck source=lib/gobuild.sh
source scripts/lib/gobuild.sh
gobuild_setup coredns

# shellcheck source=../tools/coredns/versions.env
source "$DIR/versions.env"
CACHE=$GOBUILD_CACHE_ROOT/coredns/$COREDNS_VERSION
BIN=$CACHE/bin
if [[ ${1:-} == --print-bin ]]; then echo "$BIN"; exit 0; fi

gobuild_require "$DIR/go.mod" github.com/coredns/coredns "$COREDNS_VERSION" "edit it, go mod tidy"
gobuild_lock "$CACHE"
ldflags="-s -w -X github.com/coredns/coredns/coremain.GitCommit=$COREDNS_VERSION"
inputs=("$DIR/versions.env" "$DIR/go.mod" "$DIR/go.sum" "$DIR/main.go")
gobuild coredns "$BIN" "$DIR" 0 "$ldflags" inputs go build -trimpath "-ldflags=$ldflags" -o @OUT@ . \
  || exit 1
echo "$BIN"
