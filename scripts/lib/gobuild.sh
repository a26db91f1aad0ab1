# shellcheck shell=bash
# The one skeleton of the Go tool builds (sourced by scripts/kube-tools.sh, kubelet-tools.sh,
# e2e-tools.sh, coredns.sh, helm-cli.sh, kube-rbac-proxy.sh). Each script names its tool, its
# version and its Go module; this file does what they all did the same way:
#
# - cache by version: ${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/<tool>/<version>/bin/NAME, reused
#   while a stamp of its inputs (bin/.NAME.inputs: the sha256 of the input files, `go version`
#   and the build's flags text) is unchanged;
# - one Go build at a time per cache directory: `flock` on <cache>/.lock (several checkouts of
#   this machine share the cache), waiting with a log line when another build holds it;
# - `nice -n 10`, `-mod=mod` added to GOFLAGS (go fills go.sum in a fresh clone), the output
#   written to NAME.tmp and renamed when the build succeeded;
# - on failure NAME.unavailable beside the binary: the exact command and the last 20 lines of
#   its log (<cache>/build-NAME.log); the tests read it and skip (or fail in CI) with that text;
# - build time and size appended to <cache>/build-times.tsv.
#
# Functions (each script first calls gobuild_setup TAG):
#   gobuild_setup TAG                  log() prefixed [TAG] on stderr; /usr/local/go/bin on PATH
#                                      when `go` is not (Go 1.26 lives there on our machines)
#   gobuild_lock CACHE                 mkdir CACHE/bin, hold CACHE/.lock on fd 9 for the script
#   gobuild_require GOMOD MODULE VERSION HINT
#                                      exit 2 with HINT unless GOMOD requires MODULE VERSION
#   gobuild_k8s_stamp VERSION          the -X flags that make Kubernetes binaries report VERSION
#   gobuild NAME BIN DIR CGO STAMP INPUTS_ARRAY CMD...
#                                      build NAME into BIN (see the function); 0 built or cached,
#                                      1 failed (NAME.unavailable written)

GOBUILD_CACHE_ROOT=${CILIA_CACHE_DIR:-$HOME/.cache/cilia}

gobuild_setup() {
  GOBUILD_TAG=$1
  log() { printf '[%s] %s\n' "$GOBUILD_TAG" "$*" >&2; }
  if ! command -v go >/dev/null && [[ -x /usr/local/go/bin/go ]]; then PATH=/usr/local/go/bin:$PATH; fi
}

gobuild_lock() {
  local cache=$1
  mkdir -p "$cache/bin"
  exec 9>"$cache/.lock"
  if ! flock -n 9; then
    log "another build is writing $cache; waiting for it"
    flock 9
  fi
}

gobuild_require() {
  local gomod=$1 module=$2 version=$3 hint=$4
  grep -Eq "^(require )?[[:space:]]*${module//./\\.} $version( // indirect)?\$" "$gomod" \
    || { log "${gomod#"$PWD"/} does not require $module $version ($hint)"; exit 2; }
}

gobuild_k8s_stamp() {
  local version=$1 minor pkg stamp=""
  minor=${version#v1.}; minor=${minor%%.*}
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    stamp+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    stamp+=" -X $pkg.gitTreeState=clean"
  done
  printf '%s' "$stamp"
}

# gobuild NAME BIN DIR CGO STAMP INPUTS_ARRAY CMD...
#   NAME          the binary's name: BIN/NAME, BIN/.NAME.inputs, BIN/NAME.unavailable
#   DIR           the Go module the command runs in
#   CGO           CGO_ENABLED for the build ("" = Go's default)
#   STAMP         text that enters the inputs stamp besides the files (the flags)
#   INPUTS_ARRAY  the name of an array of the files that enter the stamp (a caller's array;
#                 any name but the function's own locals, which start with _gobuild_ or are
#                 name, bin, dir, cgo, stamp, out, stampf, marker, cache, cmd, logf, t0, secs, size)
#   CMD...        the build command without `nice`; @OUT@ stands for the output file
gobuild() {
  local name=$1 bin=$2 dir=$3 cgo=$4 stamp=$5
  local -n gobuild_files=$6
  shift 6
  local out=$bin/$name
  local stampf=$bin/.$name.inputs marker=$bin/$name.unavailable _gobuild_hash
  local cache=${bin%/bin}
  local cmd=("${@//@OUT@/$out.tmp}")
  _gobuild_hash=$(cat "${gobuild_files[@]}" <(go version 2>/dev/null || true) <(echo "$stamp") \
           | sha256sum | cut -c1-16)
  if [[ -x $out && -f $stampf && $(cat "$stampf") == "$_gobuild_hash" ]]; then return 0; fi
  if ! command -v go >/dev/null; then
    printf 'cannot build %s: no `go` on PATH (Go 1.26 is needed)\n' "$name" > "$marker"
    log "$(cat "$marker")"
    return 1
  fi
  local logf=$cache/build-$name.log t0=$SECONDS
  log "building $name in ${dir#"$PWD"/}; log $logf — the first build takes minutes"
  if (cd "$dir" && env ${cgo:+CGO_ENABLED=$cgo} GOFLAGS="${GOFLAGS:-} -mod=mod" \
        nice -n 10 "${cmd[@]}") >"$logf" 2>&1; then
    mv -f "$out.tmp" "$out"
    echo "$_gobuild_hash" > "$stampf"
    rm -f "$marker"
    local secs=$((SECONDS - t0)) size
    size=$(stat -c %s "$out")
    printf '%s\t%s\t%ss\t%s bytes\t%s\n' "$(date -u +%FT%TZ)" "$name" "$secs" "$size" \
      "$(go version | cut -d' ' -f3)" >> "$cache/build-times.tsv"
    log "built $name in ${secs}s ($((size / 1048576)) MiB)"
  else
    rm -f "$out.tmp"
    {
      printf 'cannot build %s: `cd %s && %s%s` failed:\n' "$name" "${dir#"$PWD"/}" \
        "${cgo:+CGO_ENABLED=$cgo }" "$(printf '%q ' "${cmd[@]}" | sed 's/ $//')"
      tail -n 20 "$logf"
    } > "$marker"
    log "$(cat "$marker")"
    return 1
  fi
}
