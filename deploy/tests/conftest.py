"""Fixtures of the deploy tests: the test-only tools ``make test-setup`` builds or fetches — the
upstream helm CLI that renders the chart (scripts/helm-cli.sh) and, for the
metrics-behind-RBAC checks, kube-rbac-proxy and the monitoring CRDs (scripts/kube-rbac-proxy.sh,
scripts/monitoring-crds.sh).

Each fixture skips with the script's own reason when its tool is missing (through
``cilia_testkit.skips``, so in CI, ``CILIA_REQUIRE_PRIVILEGED=1``, a missing tool fails).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from helmrender import documents, helm_missing, helm_path, template

from cilia_testkit import skips

ROOT = Path(__file__).resolve().parents[2]
#: The Go module that pins kube-rbac-proxy's version (scripts/kube-rbac-proxy.sh reads it too).
KUBE_RBAC_PROXY_GOMOD = ROOT / "tools" / "kube-rbac-proxy" / "go.mod"
#: scripts/monitoring-crds.sh's pinned prometheus-operator release (its VERSION=).
MONITORING_CRDS_SCRIPT = ROOT / "scripts" / "monitoring-crds.sh"
#: The prometheus-operator CRDs of the kinds the chart's monitoring.yaml uses.
MONITORING_CRD_FILES = (
    "monitoring.coreos.com_podmonitors.yaml",
    "monitoring.coreos.com_servicemonitors.yaml",
)


def _cache() -> Path:
    return Path(os.environ.get("CILIA_CACHE_DIR") or Path.home() / ".cache" / "cilia")


def kube_rbac_proxy_version() -> str:
    """The kube-rbac-proxy release tools/kube-rbac-proxy/go.mod requires, e.g. ``v0.19.1``.

    Raises:
        AssertionError: go.mod requires none.
    """
    m = re.search(
        r"^(?:require )?\s*github\.com/brancz/kube-rbac-proxy (v\S+)",
        KUBE_RBAC_PROXY_GOMOD.read_text(),
        re.MULTILINE,
    )
    assert m, f"{KUBE_RBAC_PROXY_GOMOD} requires no github.com/brancz/kube-rbac-proxy"
    return m.group(1)


@pytest.fixture(scope="session")
def kube_rbac_proxy_bin() -> Path:
    """The kube-rbac-proxy binary scripts/kube-rbac-proxy.sh built
    (``<cache>/kube-rbac-proxy/<version>/bin/kube-rbac-proxy``); skips with the build's
    reason when it is missing."""
    path = _cache() / "kube-rbac-proxy" / kube_rbac_proxy_version() / "bin" / "kube-rbac-proxy"
    if not os.access(path, os.X_OK):
        marker = path.with_name("kube-rbac-proxy.unavailable")
        skips.require(
            marker.read_text().strip()
            if marker.exists()
            else f"{path} is missing: run scripts/kube-rbac-proxy.sh (make test-setup builds it)"
        )
    return path


@pytest.fixture(scope="session")
def monitoring_crds() -> list[Path]:
    """The PodMonitor and ServiceMonitor CRD files scripts/monitoring-crds.sh fetched
    (``<cache>/prometheus-operator-crds/<version>/``); skips with its reason when missing."""
    m = re.search(r"^VERSION=(\S+)", MONITORING_CRDS_SCRIPT.read_text(), re.MULTILINE)
    assert m, f"{MONITORING_CRDS_SCRIPT} has no VERSION="
    directory = _cache() / "prometheus-operator-crds" / m.group(1)
    paths = [directory / name for name in MONITORING_CRD_FILES]
    if not all(p.is_file() for p in paths):
        marker = directory / "unavailable"
        skips.require(
            marker.read_text().strip()
            if marker.exists()
            else f"{directory} lacks {MONITORING_CRD_FILES}: run scripts/monitoring-crds.sh"
        )
    return paths


@pytest.fixture(scope="session")
def helm() -> Path:
    """The upstream helm binary scripts/helm-cli.sh built; skips with the build's reason when
    it is missing (fails in CI)."""
    skips.require(helm_missing())
    return helm_path()


@pytest.fixture(scope="session")
def rendered(helm: Path) -> list[dict[str, object]]:
    """The chart rendered with its default values into cilia-system, plus the prometheus-operator
    monitors (prometheus.serviceMonitor.enabled, off by default) so they are checked too; hooks
    left out (not part of the release's manifest)."""
    return documents(template(helm, values={"prometheus": {"serviceMonitor": {"enabled": True}}}))
