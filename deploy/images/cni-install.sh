#!/bin/sh
# cilia-cni-install: copy the frozen cilia-cni plugin from this image onto the host, atomically.
# Run by the agent DaemonSet's `install-cni-binaries` init container (deploy/helm/cilia) with
# the host's /opt/cni mounted at /host/opt/cni; works the same with `docker run -v`.
#
# The plugin is a directory: the executable `cilia-cni` and `.cilia-cni/` (at least
# `cilia-cni.version`). The image ships the static executable (services/cni/shim: no libc or
# Python needed on the host; its logic runs in the agent pod's `cni-server` container); the
# frozen PyInstaller bundle (services/cni/freeze, libpython etc. in `.cilia-cni/`) installs the
# same way.
#
#   1. the bundle (/opt/cilia/cni-bin) is copied to <host lib dir>/<version>-<content hash>
#      through a temporary directory and rename(2), unless that exact copy exists already;
#   2. the host's <bin dir>/cilia-cni becomes a symbolic link to that copy's executable,
#      made under a temporary name in the same directory and renamed over the old one: a
#      runtime that execs cilia-cni meanwhile gets either the old or the new plugin, never
#      half a file, and never a bundle whose executable and support directory come from two
#      versions (they are swapped together, as one directory). The link is resolved by the
#      kernel at exec (no shell in between; the launcher finds its bundle through
#      /proc/self/exe, and answers a stdin that is a directory itself). Earlier versions
#      installed a two-line sh wrapper here, which cost one sh exec (~1.4 ms) per call.
#   3. copies other than the new one and the one the previous link (or wrapper) named are
#      removed (a runtime may still be exec'ing the previous one).
#
# Environment (defaults in brackets):
#   CILIA_CNI_BIN_DIR   bin dir as mounted here [/host/opt/cni/bin]
#   CILIA_CNI_LIB_DIR   where the bundle copies go, as mounted here [/host/opt/cni/cilia]
#   CILIA_CNI_HOST_LIB_DIR  the same directory as the HOST sees it [/opt/cni/cilia]
#   CILIA_CNI_BUNDLE    the bundle to install [/opt/cilia/cni-bin]
# Exit status: 0 installed (or already current), 1 on any failure (nothing half-written).
set -eu
bin_dir=${CILIA_CNI_BIN_DIR:-/host/opt/cni/bin}
lib_dir=${CILIA_CNI_LIB_DIR:-/host/opt/cni/cilia}
host_lib=${CILIA_CNI_HOST_LIB_DIR:-/opt/cni/cilia}
src=${CILIA_CNI_BUNDLE:-/opt/cilia/cni-bin}
say() { echo "cilia-cni-install: $*" >&2; }

[ -x "$src/cilia-cni" ] && [ -d "$src/.cilia-cni" ] \
  || { say "no cilia-cni bundle at $src (cilia-cni and .cilia-cni/)"; exit 1; }
# The bundle must answer VERSION with an empty environment before it goes anywhere.
echo '{"cniVersion": "1.0.0"}' | env -i CNI_COMMAND=VERSION "$src/cilia-cni" >/dev/null \
  || { say "$src/cilia-cni does not answer CNI VERSION"; exit 1; }
version=$(cat "$src/.cilia-cni/cilia-cni.version")
hash=$(cd "$src" && find . -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-12)
id="$version-$hash"
mkdir -p "$bin_dir" "$lib_dir"
if [ ! -d "$lib_dir/$id" ]; then
  tmp=$(mktemp -d "$lib_dir/.tmp-$id.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  cp -a "$src/." "$tmp/"
  chmod 0755 "$tmp"
  mv -T "$tmp" "$lib_dir/$id"
  trap - EXIT
  say "copied the plugin to $host_lib/$id"
fi
# The copy the current plugin runs: the directory of a link's target <copy>/cilia-cni, or (wrappers of
# earlier versions: venv-era `exec <copy>/bin/cilia-cni`, `exec <copy>/bin/python
# <copy>/bin/cilia-cni`, frozen `exec <copy>/cilia-cni`) the first path under .../cilia/ on a
# line starting with `exec`.
if [ -L "$bin_dir/cilia-cni" ]; then
  # <host lib dir>/<copy>/cilia-cni, whatever the lib dir is called: <copy> is the parent's name
  previous=$(readlink "$bin_dir/cilia-cni")
  previous=${previous%/cilia-cni}
  previous=${previous##*/}
else
  previous=$(sed -n 's|^exec [^ ]*/cilia/\([^/ ]*\)/.*|\1|p' "$bin_dir/cilia-cni" 2>/dev/null | head -n 1 || true)
fi
link="$bin_dir/.cilia-cni.$$"
rm -f "$link"
ln -s "$host_lib/$id/cilia-cni" "$link"
mv -fT "$link" "$bin_dir/cilia-cni"
say "installed $bin_dir/cilia-cni -> $host_lib/$id/cilia-cni"
for old in "$lib_dir"/*; do
  name=${old##*/}
  [ -d "$old" ] || continue
  [ "$name" = "$id" ] || [ "$name" = "$previous" ] || rm -rf "$old"
done
