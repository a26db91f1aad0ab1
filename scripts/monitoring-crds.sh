#!/usr/bin/env bash
# The prometheus-operator CRDs (monitoring.coreos.com PodMonitor and ServiceMonitor) that
# deploy/helm/cilia/templates/monitoring.yaml's objects are checked against: the deploy tests install them
# on the test kube-apiserver before `kubectl apply --dry-run=server` of the chart's render.
# Test data only: a cluster gets these CRDs from its own prometheus-operator.
#
# Taken from the prometheus-operator Go module (its example/prometheus-operator-crd/ holds the
# generated CRDs) through the Go module proxy — no other download — and cached by version under
# ${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/prometheus-operator-crds/<version>/.
#
# Usage: scripts/monitoring-crds.sh              fetch if missing, print the directory
#        scripts/monitoring-crds.sh --print-dir  print the directory only
# Exit 1 when they cannot be had and CILIA_REQUIRE_PRIVILEGED=1 (CI); elsewhere the reason is
# written to <dir>/unavailable and the tests skip with it.
set -euo pipefail
#: The newest release the Go module proxy serves of the main module (later tags are refused).
VERSION=v0.85.0
MODULE=github.com/prometheus-operator/prometheus-operator
FILES=(monitoring.coreos.com_podmonitors.yaml monitoring.coreos.com_servicemonitors.yaml)
DIR=${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/prometheus-operator-crds/$VERSION
log() { printf '[monitoring-crds] %s\n' "$*" >&2; }
if ! command -v go >/dev/null && [[ -x /usr/local/go/bin/go ]]; then PATH=/usr/local/go/bin:$PATH; fi

if [[ ${1:-} == --print-dir ]]; then echo "$DIR"; exit 0; fi
have() { local f; for f in "${FILES[@]}"; do [[ -s $DIR/$f ]] || return 1; done; }
if have; then echo "$DIR"; exit 0; fi

mkdir -p "$DIR"
fail() {
  printf '%s\n' "$*" > "$DIR/unavailable"
  log "$*"
  [[ ${CILIA_REQUIRE_PRIVILEGED:-} == 1 ]] && exit 1
  echo "$DIR"
  exit 0
}
command -v go >/dev/null || fail "cannot fetch the prometheus-operator CRDs: no \`go\` on PATH"
# Outside any module (an empty temporary directory), so no go.mod is touched.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! info=$(cd "$tmp" && GOFLAGS= go mod download -json "$MODULE@$VERSION" 2>"$tmp/err"); then
  fail "cannot fetch the prometheus-operator CRDs: \`go mod download -json $MODULE@$VERSION\` failed: $(tail -n 5 "$tmp/err")"
fi
src=$(printf '%s' "$info" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
for f in "${FILES[@]}"; do
  [[ -s $src/example/prometheus-operator-crd/$f ]] || fail "$MODULE@$VERSION has no example/prometheus-operator-crd/$f"
  install -m 0644 "$src/example/prometheus-operator-crd/$f" "$DIR/$f.tmp"
  mv -f "$DIR/$f.tmp" "$DIR/$f"
done
rm -f "$DIR/unavailable"
log "prometheus-operator $VERSION CRDs in $DIR"
echo "$DIR"
