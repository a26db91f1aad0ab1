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
log() { printf '[coredns] %s\n' "$*" >&2; }
if ! command -v go >/dev/null && [[ -x /usr/local/go/bin/go ]]; then PATH=/usr/local/go/bin:$PATH; fi

# shellcheck source=../tools/coredns/versions.env
source "$DIR/versions.env"
CACHE=${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/coredns/$COREDNS_VERSION
BIN=$CACHE/bin
if [[ ${1:-} == --print-bin ]]; then echo "$BIN"; exit 0; fi

grep -Eq "^(require )?[[:space:]]*github.com/coredns/coredns $COREDNS_VERSION\$" "$DIR/go.mod" \
  || { log "tools/coredns/go.mod does not require github.com/coredns/coredns $COREDNS_VERSION (edit it, go mod tidy)"; exit 2; }

mkdir -p "$BIN"
exec 9>"$CACHE/.lock"
if ! flock -n 9; then log "another build is running into $CACHE; waiting for it"; flock 9; fi

out=$BIN/coredns stampf=$BIN/.coredns.inputs marker=$BIN/coredns.unavailable
ldflags="-s -w -X github.com/coredns/coredns/coremain.GitCommit=$COREDNS_VERSION"
inputs=$(cat "$DIR"/versions.env "$DIR"/go.mod "$DIR"/go.sum "$DIR"/main.go <(go version) <(echo "$ldflags") \
         | sha256sum | cut -c1-16)
if [[ -x $out && -f $stampf && $(cat "$stampf") == "$inputs" ]]; then echo "$BIN"; exit 0; fi
cmd=(nice -n 10 go build -trimpath "-ldflags=$ldflags" -o "$out.tmp" .)
logf=$CACHE/build-coredns.log t0=$SECONDS
log "building coredns $COREDNS_VERSION; log $logf — the first build takes minutes"
if (cd "$DIR" && CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=mod" "${cmd[@]}") >"$logf" 2>&1; then
  mv -f "$out.tmp" "$out"
  echo "$inputs" > "$stampf"
  rm -f "$marker"
  secs=$((SECONDS - t0)) size=$(stat -c %s "$out")
  printf '%s\tcoredns\t%ss\t%s bytes\t%s\n' "$(date -u +%FT%TZ)" "$secs" "$size" "$(go version | cut -d' ' -f3)" \
    >> "$CACHE/build-times.tsv"
  log "built coredns in ${secs}s ($((size / 1048576)) MiB)"
else
  rm -f "$out.tmp"
  { printf 'cannot build coredns: `cd tools/coredns && CGO_ENABLED=0 %s` failed:\n' "$(printf '%q ' "${cmd[@]}" | sed 's/ $//')"
    tail -n 20 "$logf"; } > "$marker"
  log "$(cat "$marker")"
  exit 1
fi
echo "$BIN"
