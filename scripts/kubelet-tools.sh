#!/usr/bin/env bash
# Build the node half of a real Kubernetes node for the tests (test tooling, never shipped):
#   kubelet         from k8s.io/kubernetes   (tools/kube/kubelet)
#   kube-scheduler  from k8s.io/kubernetes   (tools/kube/kubelet)
#   testpod         tools/kube/testpod: the static program of the tests' pod image
# Same version and cache as scripts/kube-tools.sh (tools/kube/versions.env, K8S_VERSION): the
# binaries land beside kube-apiserver in ${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/kube/<version>/bin/
# and are rebuilt only when their inputs (versions.env, tools/kube/kubelet/go.mod + go.sum, the Go
# version, the ldflags) change. The container runtime is the Debian containerd (scripts/setup.sh).
# They live in their own Go module so that adding them does not change the inputs (and so the
# cached builds) of the control-plane binaries.
#
# Both binaries are optional: one that cannot be built gets NAME.unavailable (the command and the
# last lines of its error), which tests/e2e/test_kubelet_pod.py reads to skip with that text.
#
# Usage: scripts/kubelet-tools.sh              build what is missing, print the bin directory
#        scripts/kubelet-tools.sh --print-bin  print the bin directory only (no build)
set -euo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."
TOOLS=$PWD/tools/kube
DIR=$TOOLS/kubelet
# shellcheck source=lib/gobuild.sh
source scripts/lib/gobuild.sh
gobuild_setup kubelet-tools

# shellcheck source=../tools/kube/versions.env
source "$TOOLS/versions.env"
CACHE=$GOBUILD_CACHE_ROOT/kube/$K8S_VERSION
BIN=$CACHE/bin
if [[ ${1:-} == --print-bin ]]; then echo "$BIN"; exit 0; fi

gobuild_require "$DIR/go.mod" k8s.io/kubernetes "$K8S_VERSION" \
  "copy tools/kube/kubernetes/go.mod, keep the kubelet/kube-scheduler tool block, go mod tidy"
# Shares the lock of scripts/kube-tools.sh: one Go build at a time per cache.
gobuild_lock "$CACHE"
K8S_STAMP=$(gobuild_k8s_stamp "$K8S_VERSION")

# build NAME PACKAGE [MODULE_DIR] [LDFLAGS]
build() {
  local name=$1 pkg=$2 dir=${3:-$DIR} ldflags=${4:-"-s -w$K8S_STAMP"}
  local files=("$TOOLS/versions.env" "$dir"/go.* "$dir"/*.go)
  # testpod must be static (it is alone in its image): CGO_ENABLED=0 for it only
  local cgo=1
  [[ $name == testpod ]] && cgo=0
  gobuild "$name" "$BIN" "$dir" "$cgo" "$ldflags" files \
    go build -trimpath "-ldflags=$ldflags" -o @OUT@ "$pkg" || true
}

build kubelet k8s.io/kubernetes/cmd/kubelet
build kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler
build testpod . "$TOOLS/testpod" "-s -w"
echo "$BIN"
