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
ROOT=$PWD
TOOLS=$ROOT/tools/kube
DIR=$ROOT/tools/e2e
log() { printf '[e2e-tools] %s\n' "$*" >&2; }

if ! command -v go >/dev/null && [[ -x /usr/local/go/bin/go ]]; then PATH=/usr/local/go/bin:$PATH; fi

# shellcheck source=../tools/kube/versions.env
source "$TOOLS/versions.env"
CACHE=${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/kube/$K8S_VERSION
BIN=$CACHE/bin

if [[ ${1:-} == --print-bin ]]; then echo "$BIN"; exit 0; fi

grep -Eq "^(require )?[[:space:]]*k8s.io/kubernetes $K8S_VERSION( // indirect)?\$" "$DIR/go.mod" \
  || { log "tools/e2e/go.mod does not require k8s.io/kubernetes $K8S_VERSION (copy the require/replace set of tools/kube/kubernetes/go.mod, go mod tidy)"; exit 2; }

mkdir -p "$BIN"
exec 9>"$CACHE/.lock"
if ! flock -n 9; then
  log "another build is running into $CACHE; waiting for it"
  flock 9
fi

# build NAME CGO CMD...: CMD writes $out.tmp (the placeholder @OUT@)
build() {
  local name=$1 cgo=$2; shift 2
  local out=$BIN/$name stampf=$BIN/.$name.inputs marker=$BIN/$name.unavailable inputs
  local cmd=("${@//@OUT@/$out.tmp}")
  inputs=$(cat "$TOOLS/versions.env" "$DIR"/go.* "$DIR"/*.go <(go version) <(echo "${*}") \
           | sha256sum | cut -c1-16)
  if [[ -x $out && -f $stampf && $(cat "$stampf") == "$inputs" ]]; then return 0; fi
  local logf=$CACHE/build-$name.log t0=$SECONDS
  log "building $name; log $logf — the first build takes minutes"
  if (cd "$DIR" && CGO_ENABLED=$cgo GOFLAGS="${GOFLAGS:-} -mod=mod" nice -n 10 "${cmd[@]}") >"$logf" 2>&1; then
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
      printf 'cannot build %s: `cd tools/e2e && CGO_ENABLED=%s %s` failed:\n' "$name" "$cgo" \
        "$(printf '%q ' "${cmd[@]}" | sed 's/ $//')"
      tail -n 20 "$logf"
    } > "$marker"
    log "$(cat "$marker")"
  fi
}

build agnhost 0 go build -trimpath "-ldflags=-s -w" -o @OUT@ k8s.io/kubernetes/test/images/agnhost
build ginkgo 0 go build -trimpath "-ldflags=-s -w" -o @OUT@ github.com/onsi/ginkgo/v2/ginkgo
build e2e-network.test 1 go test -c -trimpath "-ldflags=-s -w" -o @OUT@ .
echo "$BIN"
