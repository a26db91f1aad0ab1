#!/usr/bin/env bash
# Build the real Kubernetes control plane the tests run against (test tooling, never shipped):
#   etcd                     from go.etcd.io/etcd/server/v3      (tools/kube/etcd)
#   kube-apiserver           from k8s.io/kubernetes              (tools/kube/kubernetes)
#   kube-controller-manager  from k8s.io/kubernetes              (optional)
#   kubectl                  from k8s.io/kubernetes              (optional)
# Versions are pinned once, in tools/kube/versions.env. Sources come from the Go module proxy.
# Each binary is built once, sequentially, with `nice -n 10 go build -trimpath -ldflags='-s -w'`
# (plus -X version stamps for the Kubernetes ones),
# into ${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/kube/<k8s-version>/bin/ and reused while its inputs
# (versions.env, the go.mod/go.sum it was built from, the Go version) are unchanged.
#
# A binary that cannot be built gets NAME.unavailable beside where it would be: the exact command
# and the last lines of its error. The tests read that file and skip with that text (outside CI);
# with CILIA_REQUIRE_PRIVILEGED=1 (CI) a missing etcd or kube-apiserver also fails this script.
# Build times and sizes are appended to <cache>/kube/<k8s-version>/build-times.tsv.
#
# Usage: scripts/kube-tools.sh            build what is missing, print the bin directory
#        scripts/kube-tools.sh --print-bin  print the bin directory only (no build)
#        scripts/kube-tools.sh --regen-gomod  rewrite tools/kube/*/go.mod from versions.env
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS=$PWD/tools/kube
# shellcheck source=lib/gobuild.sh
source scripts/lib/gobuild.sh
gobuild_setup kube-tools

# shellcheck source=../tools/kube/versions.env
source "$TOOLS/versions.env"
CACHE=$GOBUILD_CACHE_ROOT/kube/$K8S_VERSION
BIN=$CACHE/bin

if [[ ${1:-} == --print-bin ]]; then echo "$BIN"; exit 0; fi

regen_gomod() {
  # The staging modules k8s.io/kubernetes replaces with ./staging/... are listed in its own go.mod.
  local info upstream
  info=$(cd "$TOOLS/kubernetes" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION")
  upstream=$(printf '%s' "$info" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  {
    printf 'module cilia.test/tools/kube/kubernetes\n\ngo 1.26.0\n\ngodebug default=go1.26\n\n'
    printf 'require k8s.io/kubernetes %s\n\n' "$K8S_VERSION"
    printf 'tool (\n\tk8s.io/kubernetes/cmd/kube-apiserver\n'
    printf '\tk8s.io/kubernetes/cmd/kube-controller-manager\n\tk8s.io/kubernetes/cmd/kubectl\n)\n\n'
    printf '// k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with ./staging/...\n'
    printf '// (ignored outside that module): pin each to the matching published release.\n'
    printf 'replace (\n'
    grep '=> ./staging' "$upstream" | awk -v v="$K8S_STAGING_VERSION" '{printf "\t%s => %s %s\n", $1, $1, v}'
    printf ')\n'
  } > "$TOOLS/kubernetes/go.mod"
  (cd "$TOOLS/kubernetes" && go mod tidy)
  (cd "$TOOLS/etcd" && go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" && go mod tidy)
  log "rewrote tools/kube/kubernetes/go.mod and tools/kube/etcd/go.mod; commit them with go.sum"
}
if [[ ${1:-} == --regen-gomod ]]; then regen_gomod; exit 0; fi

# The committed go.mod files must agree with versions.env (the one place versions change).
gobuild_require "$TOOLS/kubernetes/go.mod" k8s.io/kubernetes "$K8S_VERSION" "run $0 --regen-gomod"
gobuild_require "$TOOLS/etcd/go.mod" go.etcd.io/etcd/server/v3 "$ETCD_VERSION" "run $0 --regen-gomod"

# One build at a time per cache (several checkouts of this machine share it): wait for the lock.
gobuild_lock "$CACHE"
failed_required=()

# The Kubernetes binaries report their version (/version, kubectl version) from these
# variables, which `make release` stamps; a plain go build would say v0.0.0-master.
K8S_STAMP=$(gobuild_k8s_stamp "$K8S_VERSION")

# build NAME MODULE_DIR PACKAGE REQUIRED(yes|no) [EXTRA_LDFLAGS]
build() {
  local name=$1 dir=$2 pkg=$3 required=$4 ldflags="-s -w${5:-}"
  local files=("$TOOLS/versions.env" "$dir/go.mod" "$dir/go.sum")
  if ! gobuild "$name" "$BIN" "$dir" "" "$ldflags" files \
      go build -trimpath "-ldflags=$ldflags" -o @OUT@ "$pkg"; then
    [[ $required == yes ]] && failed_required+=("$name")
  fi
  return 0
}

build etcd "$TOOLS/etcd" . yes
build kube-apiserver "$TOOLS/kubernetes" k8s.io/kubernetes/cmd/kube-apiserver yes "$K8S_STAMP"
build kube-controller-manager "$TOOLS/kubernetes" k8s.io/kubernetes/cmd/kube-controller-manager no "$K8S_STAMP"
build kubectl "$TOOLS/kubernetes" k8s.io/kubernetes/cmd/kubectl no "$K8S_STAMP"

if ((${#failed_required[@]})) && [[ ${CILIA_REQUIRE_PRIVILEGED:-} == 1 ]]; then
  log "required binaries missing: ${failed_required[*]} (see $BIN/*.unavailable)"
  exit 1
fi
echo "$BIN"
