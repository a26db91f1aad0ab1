#!/usr/bin/env bash
# Install what Cilia needs on a fresh Debian 12 machine (DESIGN.md §6), idempotently.
#   scripts/setup.sh               (make setup; what `make demo`, `make up` and `make cluster-up`
#                                  need): Debian packages (Redis, iproute2, ping, the reference
#                                  CNI plugins, iptables, clang-14 and libbpf for the eBPF
#                                  objects, bpftool) and the .venv with every service's command.
#   scripts/setup.sh --test-tools  (make test-setup; what `make test` needs on top): the Docker
#                                  engine and containerd, and the tools built or fetched once and
#                                  cached by version: the Kubernetes control plane and kubelet
#                                  (Go), the upstream hubble CLI, kube-rbac-proxy, the frozen
#                                  cilia-cni, buf, cytoscape.js and Debian's chromium.
# Safe to re-run; each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_TEST_TOOLS=0
case ${1:-} in
  --test-tools) WITH_TEST_TOOLS=1 ;;
  "") ;;
  *) printf '[setup] unknown argument %s (usage: scripts/setup.sh [--test-tools])\n' "$1" >&2; exit 2 ;;
esac
ROOT=$PWD
PY=${PYTHON:-python3}
VENV=$ROOT/.venv
log() { printf '[setup] %s\n' "$*" >&2; }
# `make bpf` compiles the eBPF programs with clang-14 (libbpf-dev's bpf_helpers.h,
# linux-libc-dev's uapi headers); the agent loads the objects with libbpf1.
BPF_PKGS=(clang-14 libbpf-dev libbpf1 linux-libc-dev)
# `make cni-shim` links the static cilia-cni with gcc against glibc's libc.a (libc6-dev)
CNI_PKGS=(gcc libc6-dev)

APT_PKGS=(redis-server iproute2 iputils-ping containernetworking-plugins iptables
          kmod bpftool python3-venv)
# only for the tests: the Docker engine (images, kind-style nodes), containerd + runc (the
# kubelet test node), iperf3 (benches), python3-dev (Python.h + libpython for the frozen
# cilia-cni's launcher, Debian's python3)
TEST_APT_PKGS=(docker.io docker-compose debootstrap containerd runc iperf3 python3-dev)
if [[ $WITH_TEST_TOOLS == 1 ]]; then APT_PKGS+=("${TEST_APT_PKGS[@]}"); fi
# several checkouts (or a test and a setup) may install at once: wait for dpkg's lock
APT_WAIT=(-o DPkg::Lock::Timeout=600)
missing=()
for p in "${APT_PKGS[@]}" "${BPF_PKGS[@]}" "${CNI_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    log "missing Debian packages: ${missing[*]} (run as root or install them)"; exit 2
  fi
  log "installing Debian packages: ${missing[*]}"
  apt-get "${APT_WAIT[@]}" update -qq
  DEBIAN_FRONTEND=noninteractive apt-get "${APT_WAIT[@]}" install -y -qq "${missing[@]}" >/dev/null
fi

# kubectl applies the chart's render (deploy/helm/cilia) in the deploy tests. The current kubectl comes
# from the Kubernetes/Google Cloud apt repository when the machine has one configured; otherwise
# Debian's kubernetes-client.
if [[ $WITH_TEST_TOOLS == 1 ]] && ! command -v kubectl >/dev/null && [[ $(id -u) -eq 0 ]]; then
  kubectl_pkg=kubernetes-client
  if apt-cache policy kubectl 2>/dev/null | grep -q 'Candidate: [0-9]'; then kubectl_pkg=kubectl; fi
  log "installing kubectl ($kubectl_pkg)"
  DEBIAN_FRONTEND=noninteractive apt-get "${APT_WAIT[@]}" install -y -qq "$kubectl_pkg" >/dev/null \
    || log "kubectl could not be installed; the deploy and e2e tests that apply manifests will fail and say so"
fi

# A Docker engine for the image tests (make images, tests of services/*/Dockerfile, the
# safe-agent-updater's Docker mode): Debian's docker.io. There is no systemd here, so start
# dockerd in the background (log: /var/log/cilia-dockerd.log) unless the socket answers.
if [[ $WITH_TEST_TOOLS == 1 && $(id -u) -eq 0 ]] && command -v dockerd >/dev/null \
   && ! /usr/bin/docker info >/dev/null 2>&1; then
  log "starting dockerd (log /var/log/cilia-dockerd.log)"
  setsid nohup dockerd >>/var/log/cilia-dockerd.log 2>&1 < /dev/null &
  for _ in $(seq 60); do /usr/bin/docker info >/dev/null 2>&1 && break; sleep 0.5; done
  /usr/bin/docker info >/dev/null 2>&1 || { log "dockerd did not come up: see /var/log/cilia-dockerd.log"; exit 2; }
fi

if [[ ! -x $VENV/bin/python ]]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.cilia-setup
# this script is an input too: a changed install step reinstalls an existing .venv
inputs=$(cat scripts/setup.sh constraints.txt proto/pyproject.toml proto/setup.py \
         lib/*/pyproject.toml services/*/pyproject.toml $(find proto/cilia -name '*.proto' | sort) \
         | sha256sum | cut -c1-16)
if [[ ! -f $stamp || $(cat "$stamp") != "$inputs" ]]; then
  log "installing Python packages into $VENV"
  # pip only bootstraps uv (PyPI wheel, pinned); uv installs the rest, here and in every tox env
  # (tox-uv), from one wheel cache (~/.cache/uv): several times faster than pip on 2 cores.
  # constraints.txt pins runtime and build dependencies (setuptools, grpcio-tools for ./proto).
  "$VENV/bin/pip" install -q -c constraints.txt uv 2>&1 | grep -v '^WARNING: Location' || true
  uvpip() {
    "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" \
        -c constraints.txt --build-constraint constraints.txt "$@"
  }
  # hpack, hyperframe: the reference the cni tests check cilia_cni's own HTTP/2 code against
  # (services/cni's `test` extra; the plugin itself no longer imports them).
  uvpip grpcio-tools pytest pytest-timeout hypothesis ruff mypy tox tox-uv types-protobuf \
      types-PyYAML pyinstaller playwright hpack hyperframe
  # --reinstall-package: ./proto is a plain install; rebuild it so changed .proto files count.
  uvpip --reinstall-package cilia-api ./proto -e lib/common -e lib/testkit \
      $(for s in services/*/; do printf -- '-e %s ' "$s"; done)
  echo "$inputs" > "$stamp"
fi

setup_test_tools() {
# buf (proto lint + breaking-change check) from the npm registry.
if [[ ! -x $ROOT/.venv/buf/node_modules/.bin/buf ]] && command -v npm >/dev/null; then
  log "installing buf from npm (@bufbuild/buf)"
  npm install -s --prefix "$ROOT/.venv/buf" @bufbuild/buf@1 >/dev/null 2>&1 \
    || log "buf could not be installed; the proto checks will say so"
fi
# The real Kubernetes control plane the tests run against (etcd, kube-apiserver,
# kube-controller-manager, kubectl): built once from the Go module proxy, cached by version
# under ${CILIA_CACHE_DIR:-~/.cache/cilia}/kube/<version>/bin (scripts/kube-tools.sh; the
# first build takes ~22 min on 2 cores, later runs only check the cache).
scripts/kube-tools.sh >/dev/null
# A real node for tests/e2e/test_kubelet_pod.py: kubelet, kube-scheduler and the static
# testpod program of the test image, same cache (scripts/kubelet-tools.sh; containerd, runc
# and the loopback CNI plugin are the Debian packages above).
scripts/kubelet-tools.sh >/dev/null
# CoreDNS, the cluster DNS of the kind-style test cluster (cilia_testkit.kind), from the Go module
# proxy, cached by version (scripts/coredns.sh; tools/coredns pins it).
scripts/coredns.sh >/dev/null || log "coredns could not be built (see its coredns.unavailable); the kind cluster tests will say so"
# The unmodified upstream hubble CLI (tests/e2e/test_hubble_cli.py runs it against the relay
# and the agents), built once with Go from the Go module proxy and cached by version under
# ${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/hubble/<version>/ (scripts/hubble-cli.sh pins it).
# In CI (CILIA_REQUIRE_PRIVILEGED=1) a failed build fails setup; elsewhere the test skips.
install_hubble_cli() {
  if scripts/hubble-cli.sh >/dev/null; then
    return 0
  fi
  if [[ ${CILIA_REQUIRE_PRIVILEGED:-0} == 1 ]]; then
    log "the upstream hubble CLI could not be built (required in CI)"; exit 2
  fi
  log "the upstream hubble CLI could not be built; tests/e2e/test_hubble_cli.py will skip"
}
install_hubble_cli

# kube-rbac-proxy (the metrics sidecar of the chart deploy/helm/cilia; deploy/tests/test_metrics_rbac.py
# scrapes through the real one) built once with Go from the Go module proxy, cached by version
# under ${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/kube-rbac-proxy/<version>/ (version pinned in
# tools/kube-rbac-proxy/go.mod; the first build took 12.6 min wall, 4.6 CPU-min, on this busy
# 2-core machine, later runs 0.1 s), and the prometheus-operator CRDs
# (PodMonitor, ServiceMonitor) the deploy tests install on the test API server, from the
# prometheus-operator Go module, cached under .../prometheus-operator-crds/<version>/.
# Both scripts fail in CI (CILIA_REQUIRE_PRIVILEGED=1) when they cannot; elsewhere the tests skip.
install_metrics_rbac_tools() {
  scripts/kube-rbac-proxy.sh >/dev/null || { log "kube-rbac-proxy could not be built (required in CI)"; exit 2; }
  scripts/monitoring-crds.sh >/dev/null || { log "the prometheus-operator CRDs could not be fetched (required in CI)"; exit 2; }
}
install_metrics_rbac_tools

# The upstream helm CLI (helm.sh/helm/v4, version pinned in tools/helm/go.mod) built once with Go
# from the Go module proxy, cached by version under ${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/helm/
# <version>/ (scripts/helm-cli.sh; first build 291 s wall on this busy 2-core machine, later runs
# only hash the inputs): the deploy tests lint, render and refuse bad values of deploy/helm/cilia
# with it. Fails setup in CI (CILIA_REQUIRE_PRIVILEGED=1); elsewhere the tests skip with the reason.
scripts/helm-cli.sh >/dev/null || { log "helm could not be built (required in CI)"; exit 2; }

# The self-contained cilia-cni (PyInstaller onedir bundle: runs on a host without Python; the
# cni image ships it and cilia-cni-install puts it on hosts), built once per change of the
# plugin and cached under ${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/cni-bin/<version>-<inputs>/
# (services/cni/freeze/build.py; ~20 s with nice -n 10, later runs only hash the inputs).
install_cni_bin() {
  if nice -n 10 "$VENV/bin/python" services/cni/freeze/build.py >/dev/null; then
    return 0
  fi
  if [[ ${CILIA_REQUIRE_PRIVILEGED:-0} == 1 ]]; then
    log "the frozen cilia-cni could not be built (required in CI)"; exit 2
  fi
  log "the frozen cilia-cni could not be built; its tests and the cni image will say so"
}
install_cni_bin

# cilia-hubble-ui's page draws its graph with cytoscape.js, vendored from the npm registry at
# a pinned version (checked by sha256) into the package's static/vendor/ (not committed), so the
# page needs no network and the image's wheel carries it. The tarball is cached by version
# under ${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/cytoscape/<version>/.
CYTOSCAPE_VERSION=3.34.4
CYTOSCAPE_SHA256=081591ab735b2b6a3b31a3c60f8f3a3e2fee8c92939e0c7820ad1208571b6cd8
vendor_cytoscape() {
  local cache=${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/cytoscape/$CYTOSCAPE_VERSION
  local dest=$ROOT/services/hubble-ui/src/cilia_hubble_ui/static/vendor
  if [[ ! -f $cache/cytoscape.min.js ]]; then
    log "vendoring cytoscape $CYTOSCAPE_VERSION from npm"
    mkdir -p "$cache"
    local tmp; tmp=$(mktemp -d)
    if ! (cd "$tmp" && npm pack -s "cytoscape@$CYTOSCAPE_VERSION" >/dev/null \
          && tar -xzf "cytoscape-$CYTOSCAPE_VERSION.tgz" package/dist/cytoscape.min.js package/LICENSE); then
      rm -rf "$tmp"
      if [[ ${CILIA_REQUIRE_PRIVILEGED:-0} == 1 ]]; then
        log "cytoscape could not be fetched from npm (required in CI)"; exit 2
      fi
      log "cytoscape could not be fetched from npm; cilia-hubble-ui will refuse to start and say so"
      return 0
    fi
    if [[ $(sha256sum "$tmp/package/dist/cytoscape.min.js" | cut -c1-64) != "$CYTOSCAPE_SHA256" ]]; then
      rm -rf "$tmp"; log "cytoscape $CYTOSCAPE_VERSION: sha256 mismatch"; exit 2
    fi
    cp "$tmp/package/LICENSE" "$cache/LICENSE"
    cp "$tmp/package/dist/cytoscape.min.js" "$cache/cytoscape.min.js"
    rm -rf "$tmp"
  fi
  mkdir -p "$dest"
  cmp -s "$cache/cytoscape.min.js" "$dest/cytoscape.min.js" || cp "$cache/cytoscape.min.js" "$dest/"
  cmp -s "$cache/LICENSE" "$dest/cytoscape.LICENSE" || cp "$cache/LICENSE" "$dest/cytoscape.LICENSE"
}
vendor_cytoscape

# Debian's Chromium for the browser test of cilia-hubble-ui's page (tests/e2e/test_hubble_ui.py
# drives it headless through Playwright for Python, installed in the .venv above, pointed at
# /usr/bin/chromium: no browser download).
install_chromium() {
  if dpkg-query -W -f='${Status}' chromium 2>/dev/null | grep -q "install ok installed"; then
    return 0
  fi
  if [[ $(id -u) -ne 0 ]]; then
    log "chromium is missing (apt-get install chromium as root); the browser test will skip"
    return 0
  fi
  log "installing Debian's chromium (browser test of the hubble-ui page)"
  DEBIAN_FRONTEND=noninteractive apt-get "${APT_WAIT[@]}" install -y -qq chromium >/dev/null 2>&1 \
    || { apt-get "${APT_WAIT[@]}" update -qq && DEBIAN_FRONTEND=noninteractive apt-get "${APT_WAIT[@]}" install -y -qq chromium >/dev/null; }
}
install_chromium

}

if [[ $WITH_TEST_TOOLS == 1 ]]; then
  setup_test_tools
else
  log "test tools skipped (the Go-built Kubernetes tools, hubble CLI, kube-rbac-proxy, frozen cilia-cni, buf, cytoscape, chromium): scripts/setup.sh --test-tools (make test-setup) installs them"
fi
log "ready: $VENV/bin holds cilia-operator, cilia-agent, cilia-cni, cilia-relay, cilia-safe-agent-updater, cilia-hubble-ui"
