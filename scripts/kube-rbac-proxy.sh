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
ROOT=$PWD
DIR=$ROOT/tools/kube-rbac-proxy
log() { printf '[kube-rbac-proxy] %s\n' "$*" >&2; }

# Go 1.26 is in /usr/local/go on the project's machines, not always on PATH
if ! command -v go >/dev/null && [[ -x /usr/local/go/bin/go ]]; then PATH=/usr/local/go/bin:$PATH; fi

# `go mod tidy` keeps the require in the block (marked indirect: the module is only a tool)
VERSION=$(sed -En 's#^(require )?[[:space:]]*github\.com/brancz/kube-rbac-proxy (v[^ ]+).*#\2#p' "$DIR/go.mod")
[[ -n $VERSION ]] || { log "tools/kube-rbac-proxy/go.mod requires no github.com/brancz/kube-rbac-proxy version"; exit 2; }
CACHE=${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/kube-rbac-proxy/$VERSION
OUT=$CACHE/bin/kube-rbac-proxy
if [[ ${1:-} == --print-bin ]]; then echo "$OUT"; exit 0; fi

mkdir -p "$CACHE/bin"
# One build at a time per cache (several checkouts of this machine share it).
exec 9>"$CACHE/.lock"
if ! flock -n 9; then
  log "another build is writing $CACHE; waiting for it"
  flock 9
fi

stampf=$CACHE/bin/.kube-rbac-proxy.inputs marker=$OUT.unavailable
ldflags="-s -w"
inputs=$(cat "$DIR/go.mod" "$DIR/go.sum" <(go version 2>/dev/null || true) <(echo "$ldflags") | sha256sum | cut -c1-16)
if [[ -x $OUT && -f $stampf && $(cat "$stampf") == "$inputs" ]]; then
  echo "$OUT"
  exit 0
fi

fail() {
  log "$(cat "$marker")"
  [[ ${CILIA_REQUIRE_PRIVILEGED:-} == 1 ]] && exit 1
  echo "$OUT"
  exit 0
}
if ! command -v go >/dev/null; then
  printf 'cannot build kube-rbac-proxy: no `go` on PATH (Go 1.26 is needed)\n' > "$marker"
  fail
fi
cmd=(nice -n 10 go build -trimpath "-ldflags=$ldflags" -o "$OUT.tmp" github.com/brancz/kube-rbac-proxy/cmd/kube-rbac-proxy)
logf=$CACHE/build.log
log "building kube-rbac-proxy $VERSION; log $logf — the first build takes a few minutes"
t0=$SECONDS
# -mod=mod lets go fill go.sum in a fresh clone; GOFLAGS may carry the project's other flags.
if (cd "$DIR" && GOFLAGS="${GOFLAGS:-} -mod=mod" "${cmd[@]}") >"$logf" 2>&1; then
  mv -f "$OUT.tmp" "$OUT"
  echo "$inputs" > "$stampf"
  rm -f "$marker"
  secs=$((SECONDS - t0))
  size=$(stat -c %s "$OUT")
  printf '%s\t%s\t%ss\t%s bytes\t%s\n' "$(date -u +%FT%TZ)" kube-rbac-proxy "$secs" "$size" \
    "$(go version | cut -d' ' -f3)" >> "$CACHE/build-times.tsv"
  log "built kube-rbac-proxy $VERSION in ${secs}s ($((size / 1048576)) MiB)"
  echo "$OUT"
else
  rm -f "$OUT.tmp"
  {
    printf 'cannot build kube-rbac-proxy: `cd tools/kube-rbac-proxy && %s` failed:\n' \
      "$(printf '%q ' "${cmd[@]}" | sed 's/ $//')"
    tail -n 20 "$logf"
  } > "$marker"
  fail
fi
