#!/usr/bin/env bash
# Build the upstream Kubernetes network e2e tests for `make conformance` (test tooling, never
# shipped), from k8s.io/kubernetes at the cluster's version (tools/kube/versions.env):
#   e2e-network.test  `go test -c` of tools/e2e: the specs of test/e2e/network and
#                     test/e2e/network/netpol with the upstream e2e framework (~8 min cold on
#                     2 cores, 113 MB stripped)
#   agnhost           k8s.io/kubernetes/test/images/agnhost (static), the program of the
#                     e2e-test-images/agnhost image the specs run (tests/k8s/e2e_images.py)
#   ginkgo            the ginkgo CLI (github.com/onsi/ginkgo/v2 at the framework's version):
#                     runs the binary's specs in parallel processes (--procs)
# Same cache as scripts/kube-tools.sh and scripts/kubelet-tools.sh:
# ${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/kube/<version>/bin/, rebuilt only when the inputs
# (versions.env, tools/e2e/go.mod + go.sum + *.go, the Go version, the flags) change; one Go build
# at a time per cache (the same lock). A binary that cannot be built gets NAME.unavailable (the
# command and the last lines of its error), which the conformance runner reports instead of
# running.
#
# Usage: scripts/e2e-tools.sh              build what is missing, print the bin directory
#        scripts/e2e-tools.sh --print-bin  print the bin directory only (no build)
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS=$PWD/tools/kube
DIR=$PWD/tools/e2e
# shellcheck source=lib/gobuild.sh
source scripts/lib/gobuild.sh
gobuild_setup e2e-tools

# shellcheck source=../tools/kube/versions.env
source "$TOOLS/versions.env"
CACHE=$GOBUILD_CACHE_ROOT/kube/$K8S_VERSION
BIN=$CACHE/bin
if [[ ${1:-} == --print-bin ]]; then echo "$BIN"; exit 0; fi

gobuild_require "$DIR/go.mod" k8s.io/kubernetes "$K8S_VERSION" \
  "copy the require/replace set of tools/kube/kubernetes/go.mod, go mod tidy"
gobuild_lock "$CACHE"
inputs=("$TOOLS/versions.env" "$DIR"/go.* "$DIR"/*.go)

# build NAME CGO CMD...: the command (its text is the stamp's flags) writes @OUT@
build() {
  local name=$1 cgo=$2; shift 2
  gobuild "$name" "$BIN" "$DIR" "$cgo" "$*" inputs "$@" || true
}

build agnhost 0 go build -trimpath "-ldflags=-s -w" -o @OUT@ k8s.io/kubernetes/test/images/agnhost
build ginkgo 0 go build -trimpath "-ldflags=-s -w" -o @OUT@ github.com/onsi/ginkgo/v2/ginkgo
build e2e-network.test 1 go test -c -trimpath "-ldflags=-s -w" -o @OUT@ .
echo "$BIN"
