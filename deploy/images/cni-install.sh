#!/bin/sh
# cilia-cni-install: copy the cilia-cni plugin from this image onto the host, atomically.
# Run by the agent DaemonSet's `install-cni-binaries` init container (deploy/kubernetes) with
# the host's /opt/cni mounted at /host/opt/cni; works the same with `docker run -v`.
#
#   1. /opt/cilia (the plugin's venv) is copied to <host lib dir>/<version>-<content hash>
#      through a temporary directory and rename(2), unless that exact copy exists already;
#   2. the host's <bin dir>/cilia-cni becomes a wrapper exec'ing that copy's launcher
#      (bin/cilia-cni: the copy's python3 -I; a stdin that is a directory is a CNI error), written to a
#      temporary file in the same directory and renamed over the old one: a runtime that
#      execs cilia-cni meanwhile gets either the old or the new plugin, never half a file;
#   3. copies other than the new one and the one the previous wrapper used are removed.
#
# Environment (defaults in brackets):
#   CILIA_CNI_BIN_DIR   bin dir as mounted here [/host/opt/cni/bin]
#   CILIA_CNI_LIB_DIR   where the venv copies go, as mounted here [/host/opt/cni/cilia]
#   CILIA_CNI_HOST_LIB_DIR  the same directory as the HOST sees it [/opt/cni/cilia]
# The host must provide /usr/bin/python3 3.11 (Debian 12), the interpreter of the venv.
# Exit status: 0 installed (or already current), 1 on any failure (nothing half-written).
set -eu
bin_dir=${CILIA_CNI_BIN_DIR:-/host/opt/cni/bin}
lib_dir=${CILIA_CNI_LIB_DIR:-/host/opt/cni/cilia}
host_lib=${CILIA_CNI_HOST_LIB_DIR:-/opt/cni/cilia}
src=/opt/cilia
say() { echo "cilia-cni-install: $*" >&2; }

version=$("$src/bin/python" -c 'import importlib.metadata as m; print(m.version("cilia-cni"))')
hash=$(cd "$src" && find . -type f ! -name '*.pyc' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-12)
id="$version-$hash"
mkdir -p "$bin_dir" "$lib_dir"
if [ ! -d "$lib_dir/$id" ]; then
  tmp=$(mktemp -d "$lib_dir/.tmp-$id.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  cp -a "$src/." "$tmp/"
  mv -T "$tmp" "$lib_dir/$id"
  trap - EXIT
  say "copied the plugin to $host_lib/$id"
fi
# The copy the current wrapper runs (old wrappers: `exec <copy>/bin/python <copy>/bin/cilia-cni`,
# new ones: `exec <copy>/bin/cilia-cni`; both name <copy> last).
previous=$(sed -n 's|^exec .*/cilia/\([^/]*\)/bin/.*|\1|p' "$bin_dir/cilia-cni" 2>/dev/null || true)
wrapper=$(mktemp "$bin_dir/.cilia-cni.XXXXXX")
cat > "$wrapper" <<WRAPPER
#!/bin/sh
# cilia-cni $version, installed by cilia-cni-install from the cilia-cni image ($id).
exec $host_lib/$id/bin/cilia-cni "\$@"
WRAPPER
chmod 0755 "$wrapper"
mv -f "$wrapper" "$bin_dir/cilia-cni"
say "installed $bin_dir/cilia-cni -> $host_lib/$id"
for old in "$lib_dir"/*; do
  name=${old##*/}
  [ -d "$old" ] || continue
  [ "$name" = "$id" ] || [ "$name" = "$previous" ] || rm -rf "$old"
done
