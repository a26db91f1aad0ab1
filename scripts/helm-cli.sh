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
ROOT=$PWD
DIR=$ROOT/tools/helm
log() { printf '[helm-cli] %s\n' "$*" >&2; }

# Go 1.26 is in /usr/local/go on the project's machines, not always on PATH
if ! command -v go >/dev/null && [[ -x /usr/local/go/bin/go ]]; then PATH=/usr/local/go/bin:$PATH; fi

VERSION=$(sed -En 's#^(require )?[[:space:]]*helm\.sh/helm/v4 (v[^ ]+).*#\2#p' "$DIR/go.mod")
[[ -n $VERSION ]] || { log "tools/helm/go.mod requires no helm.sh/helm/v4 version"; exit 2; }
CACHE=${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/helm/$VERSION
OUT=$CACHE/bin/helm
if [[ ${1:-} == --print-bin ]]; then echo "$OUT"; exit 0; fi

mkdir -p "$CACHE/bin"
# One build at a time per cache (several checkouts of this machine share it).
exec 9>"$CACHE/.lock"
if ! flock -n 9; then
  log "another build is writing $CACHE; waiting for it"
  flock 9
fi

stampf=$CACHE/bin/.helm.inputs marker=$OUT.unavailable
ldflags="-s -w -X helm.sh/helm/v4/internal/version.version=$VERSION -X helm.sh/helm/v4/internal/version.gitTreeState=clean"
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
  printf 'cannot build helm: no `go` on PATH (Go 1.26 is needed)\n' > "$marker"
  fail
fi
cmd=(nice -n 10 go build -trimpath "-ldflags=$ldflags" -o "$OUT.tmp" helm.sh/helm/v4/cmd/helm)
logf=$CACHE/build.log
log "building helm $VERSION; log $logf — the first build takes a few minutes"
t0=$SECONDS
# -mod=mod lets go fill go.sum in a fresh clone; GOFLAGS may carry the project's other flags.
if (cd "$DIR" && CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=mod" "${cmd[@]}") >"$logf" 2>&1; then
  mv -f "$OUT.tmp" "$OUT"
  echo "$inputs" > "$stampf"
  rm -f "$marker"
  secs=$((SECONDS - t0))
  size=$(stat -c %s "$OUT")
  printf '%s\t%s\t%ss\t%s bytes\t%s\n' "$(date -u +%FT%TZ)" helm "$secs" "$size" \
    "$(go version | cut -d' ' -f3)" >> "$CACHE/build-times.tsv"
  log "built helm $VERSION in ${secs}s ($((size / 1048576)) MiB)"
  echo "$OUT"
else
  rm -f "$OUT.tmp"
  {
    printf 'cannot build helm: `cd tools/helm && %s` failed:\n' \
      "$(printf '%q ' "${cmd[@]}" | sed 's/ $//')"
    tail -n 20 "$logf"
  } > "$marker"
  fail
fi
