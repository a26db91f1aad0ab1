#!/usr/bin/env bash
# Build the unmodified upstream `hubble` CLI once and cache it, for the e2e tests that run it
# against cilia-relay and cilia-agent (tests/e2e/test_hubble_cli.py) and for users who want it.
#
#   scripts/hubble-cli.sh          build when missing, print the binary's path on stdout
#   scripts/hubble-cli.sh --path   print where the binary is (or would be); build nothing
#
# Source: the Go module proxy. Since Hubble 1.17 the CLI's source lives in the Cilium module
# (`github.com/cilium/cilium/hubble`, package main); the `github.com/cilium/hubble` repository is
# only a wrapper that imports it, and the proxy here refuses every v1.x version of that wrapper
# module, so the same CLI is built from `github.com/cilium/cilium` at the pinned tag, with the
# version stamped the way upstream's hubble/Makefile stamps it (`-X .../hubble/pkg.Version=`).
#
# Cache: ${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/hubble/<version>/hubble; a present binary is
# reused, so setup pays the build once per version and machine (measured: 417 s wall, 4 min
# CPU with `nice -n 10` on 2 busy cores, mostly downloading and compiling Kubernetes client
# libraries; 18 s when Go's module and build caches are warm).
# Exit status: 0 built or cached; 2 the build failed or Go is missing — when
# CILIA_REQUIRE_PRIVILEGED=1 (CI) that fails setup, otherwise it is reported and setup goes on
# (the e2e test then skips with that reason).
set -euo pipefail

# The one place the version is pinned (a v1.19.x tag whose module the Go proxy serves).
HUBBLE_VERSION=${HUBBLE_VERSION:-1.19.7}

CACHE=${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/hubble/$HUBBLE_VERSION
BIN=$CACHE/hubble
log() { printf '[hubble-cli] %s\n' "$*" >&2; }

if [[ ${1:-} == --path ]]; then
  echo "$BIN"
  exit 0
fi
if [[ -x $BIN ]] && "$BIN" version >/dev/null 2>&1; then
  echo "$BIN"
  exit 0
fi

fail() {
  log "$*"
  if [[ ${CILIA_REQUIRE_PRIVILEGED:-0} == 1 ]]; then
    log "CILIA_REQUIRE_PRIVILEGED=1: the upstream hubble CLI is required"
  fi
  exit 2
}

command -v go >/dev/null || fail "go is not installed: cannot build hubble $HUBBLE_VERSION"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Every step checks its own status: `set -e` does not apply inside a function whose caller
# tests it (`if ! build`).
build() {
  cd "$work" || return 1
  # A throw-away main module that requires the Cilium module, plus the replace directives
  # Cilium's own go.mod carries at this tag (none is imported by the CLI; they keep the
  # module graph identical to upstream's).
  printf 'module cilia.local/hubblecli\n\ngo 1.25.0\n\nrequire github.com/cilium/cilium v%s\n' \
    "$HUBBLE_VERSION" > go.mod || return 1
  export GOFLAGS=-mod=mod
  local gomod
  gomod=$(nice -n 10 go mod download -json "github.com/cilium/cilium@v$HUBBLE_VERSION" \
          | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p') || return 1
  [[ -f $gomod ]] || return 1
  { grep '^replace ' "$gomod" || true; } >> go.mod
  nice -n 10 go get "github.com/cilium/cilium/hubble@v$HUBBLE_VERSION" || return 1
  mkdir -p "$CACHE" || return 1
  CGO_ENABLED=0 nice -n 10 go build -trimpath -o "$CACHE/hubble.tmp" \
    -ldflags "-s -w -X github.com/cilium/cilium/hubble/pkg.Version=v$HUBBLE_VERSION" \
    github.com/cilium/cilium/hubble || return 1
  mv "$CACHE/hubble.tmp" "$BIN"
}

start=$(date +%s)
log "building hubble v$HUBBLE_VERSION from github.com/cilium/cilium/hubble (nice -n 10) into $CACHE"
if ! (build) >&2; then
  rm -f "$CACHE/hubble.tmp"
  rmdir "$CACHE" 2>/dev/null || true
  fail "building hubble v$HUBBLE_VERSION failed (see the go output above)"
fi
log "built $("$BIN" version) in $(($(date +%s) - start)) s"
echo "$BIN"
