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
ROOT=$PWD
TOOLS=$ROOT/tools/kube
log() { printf '[kubelet-tools] %s\n' "$*" >&2; }

if ! command -v go >/dev/null && [[ -x /usr/local/go/bin/go ]]; then PATH=/usr/local/go/bin:$PATH; fi

# shellcheck source=../tools/kube/versions.env
source "$TOOLS/versions.env"
CACHE=${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/kube/$K8S_VERSION
BIN=$CACHE/bin
DIR=$TOOLS/kubelet

if [[ ${1:-} == --print-bin ]]; then echo "$BIN"; exit 0; fi

grep -Eq "^(require )?[[:space:]]*k8s.io/kubernetes $K8S_VERSION( // indirect)?\$" "$DIR/go.mod" \
  || { log "tools/kube/kubelet/go.mod does not require k8s.io/kubernetes $K8S_VERSION (copy tools/kube/kubernetes/go.mod, keep the kubelet/kube-scheduler tool block, go mod tidy)"; exit 2; }

mkdir -p "$BIN"
# Shares the lock of scripts/kube-tools.sh: one Go build at a time per cache.
exec 9>"$CACHE/.lock"
if ! flock -n 9; then
  log "another build is running into $CACHE; waiting for it"
  flock 9
fi

k8s_minor=${K8S_VERSION#v1.}; k8s_minor=${k8s_minor%%.*}
K8S_STAMP=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  K8S_STAMP+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
  K8S_STAMP+=" -X $pkg.gitTreeState=clean"
done

# build NAME PACKAGE [MODULE_DIR] [LDFLAGS]
build() {
  local name=$1 pkg=$2 dir=${3:-$DIR} ldflags=${4:-"-s -w$K8S_STAMP"}
  local out=$BIN/$name stampf=$BIN/.$name.inputs marker=$BIN/$name.unavailable inputs
  inputs=$(cat "$TOOLS/versions.env" "$dir"/go.* "$dir"/*.go <(go version) <(echo "$ldflags") \
           | sha256sum | cut -c1-16)
  if [[ -x $out && -f $stampf && $(cat "$stampf") == "$inputs" ]]; then return 0; fi
  local cmd=(nice -n 10 go build -trimpath "-ldflags=$ldflags" -o "$out.tmp" "$pkg")
  local logf=$CACHE/build-$name.log t0=$SECONDS
  log "building $name ($pkg); log $logf — the first build takes minutes"
  # testpod must be static (it is alone in its image): CGO_ENABLED=0 for it only
  local cgo=1
  [[ $name == testpod ]] && cgo=0
  if (cd "$dir" && CGO_ENABLED=$cgo GOFLAGS="${GOFLAGS:-} -mod=mod" "${cmd[@]}") >"$logf" 2>&1; then
    mv -f "$out.tmp" "$out"
    echo "$inputs" > "$stampf"
    rm -f "$marker"
    local secs=$((SECONDS - t0)) size
    size=$(stat -c %s "$out")
    printf '%s\t%s\t%ss\t%s bytes\t%s\n' "$(date -u +%FT%TZ)" "$name" "$secs" "$size" \
      "$(go version | cut -d' ' -f3)" >> "$CACHE/build-times.tsv"
    log "built $name in ${secs}s ($((size / 1048576)) MiB)"
  else
    rm -f "$out.tmp"
    {
      printf 'cannot build %s: `cd tools/kube/%s && CGO_ENABLED=%s %s` failed:\n' "$name" "$(basename "$dir")" "$cgo" \
        "$(printf '%q ' "${cmd[@]}" | sed 's/ $//')"
      tail -n 20 "$logf"
    } > "$marker"
    log "$(cat "$marker")"
  fi
}

build kubelet k8s.io/kubernetes/cmd/kubelet
build kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler
build testpod . "$TOOLS/testpod" "-s -w"
echo "$BIN"
