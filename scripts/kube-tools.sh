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
ROOT=$PWD
TOOLS=$ROOT/tools/kube
log() { printf '[kube-tools] %s\n' "$*" >&2; }

# Go 1.26 is in /usr/local/go on the project's machines, not always on PATH
if ! command -v go >/dev/null && [[ -x /usr/local/go/bin/go ]]; then PATH=/usr/local/go/bin:$PATH; fi

# shellcheck source=../tools/kube/versions.env
source "$TOOLS/versions.env"
CACHE=${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/kube/$K8S_VERSION
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
grep -Eq "^(require )?[[:space:]]*k8s.io/kubernetes $K8S_VERSION( // indirect)?\$" "$TOOLS/kubernetes/go.mod" \
  || { log "tools/kube/kubernetes/go.mod does not require k8s.io/kubernetes $K8S_VERSION: run $0 --regen-gomod"; exit 2; }
grep -Eq "^(require )?[[:space:]]*go.etcd.io/etcd/server/v3 $ETCD_VERSION( // indirect)?\$" "$TOOLS/etcd/go.mod" \
  || { log "tools/kube/etcd/go.mod does not require go.etcd.io/etcd/server/v3 $ETCD_VERSION: run $0 --regen-gomod"; exit 2; }

mkdir -p "$BIN"
# One build at a time per cache (several checkouts of this machine share it): wait for the lock.
exec 9>"$CACHE/.lock"
if ! flock -n 9; then
  log "another kube-tools.sh is building into $CACHE; waiting for it"
  flock 9
fi
failed_required=()

# The Kubernetes binaries report their version (/version, kubectl version) from these
# variables, which `make release` stamps; a plain go build would say v0.0.0-master.
k8s_minor=${K8S_VERSION#v1.}; k8s_minor=${k8s_minor%%.*}
K8S_STAMP=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  K8S_STAMP+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
  K8S_STAMP+=" -X $pkg.gitTreeState=clean"
done

# build NAME MODULE_DIR PACKAGE REQUIRED(yes|no) [EXTRA_LDFLAGS]
build() {
  local name=$1 dir=$2 pkg=$3 required=$4 ldflags="-s -w${5:-}"
  local out=$BIN/$name stampf=$BIN/.$name.inputs marker=$BIN/$name.unavailable
  local inputs
  inputs=$(cat "$TOOLS/versions.env" "$dir/go.mod" "$dir/go.sum" <(go version) <(echo "$ldflags") \
           | sha256sum | cut -c1-16)
  if [[ -x $out && -f $stampf && $(cat "$stampf") == "$inputs" ]]; then
    return 0
  fi
  if ! command -v go >/dev/null; then
    printf 'cannot build %s: no `go` on PATH (Go 1.26 is needed)\n' "$name" > "$marker"
    log "$(cat "$marker")"
    [[ $required == yes ]] && failed_required+=("$name")
    return 0
  fi
  local cmd=(nice -n 10 go build -trimpath "-ldflags=$ldflags" -o "$out.tmp" "$pkg")
  local logf=$CACHE/build-$name.log
  log "building $name ($pkg) in tools/kube/$(basename "$dir"); log $logf — the first build takes minutes"
  local t0=$SECONDS
  # -mod=mod lets go fill go.sum in a fresh clone; GOFLAGS may carry the project's other flags.
  if (cd "$dir" && GOFLAGS="${GOFLAGS:-} -mod=mod" "${cmd[@]}") >"$logf" 2>&1; then
    mv -f "$out.tmp" "$out"
    echo "$inputs" > "$stampf"
    rm -f "$marker"
    local secs=$((SECONDS - t0)) size
    size=$(stat -c %s "$out")
    printf '%s\t%s\t%ss\t%s bytes\t%s\n' "$(date -u +%FT%TZ)" "$name" "$secs" "$size" "$(go version | cut -d' ' -f3)" \
      >> "$CACHE/build-times.tsv"
    log "built $name in ${secs}s ($((size / 1048576)) MiB)"
  else
    rm -f "$out.tmp"
    {
      printf 'cannot build %s: `cd tools/kube/%s && %s` failed:\n' "$name" "$(basename "$dir")" \
        "$(printf '%q ' "${cmd[@]}" | sed 's/ $//')"
      tail -n 20 "$logf"
    } > "$marker"
    log "$(cat "$marker")"
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
