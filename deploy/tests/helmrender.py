"""Rendering the chart deploy/helm/cilia with the real helm, for the deploy tests.

``helm`` is the upstream CLI scripts/helm-cli.sh builds (version pinned in tools/helm/go.mod,
cached under ``<cache>/helm/<version>/bin/helm``). Nothing here talks to a cluster:
``helm template`` renders offline (``lookup`` answers nothing, so certificates are fresh).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "cilia"
#: The Go module that pins helm's version (scripts/helm-cli.sh reads it too).
HELM_GOMOD = ROOT / "tools" / "helm" / "go.mod"
#: The namespace the deploy tests install into (any works; the chart follows the release's).
NAMESPACE = "cilia-system"
#: Release name of every render.
RELEASE = "cilia"
#: Seconds one helm run may take.
HELM_TIMEOUT = 120
#: The hook annotation: objects carrying it are not part of the release's manifest.
HOOK = "helm.sh/hook"


def helm_version() -> str:
    """The helm release tools/helm/go.mod requires, e.g. ``v4.3.2``.

    Raises:
        AssertionError: go.mod requires none.
    """
    m = re.search(r"^(?:require )?\s*helm\.sh/helm/v4 (v\S+)", HELM_GOMOD.read_text(), re.M)
    assert m, f"{HELM_GOMOD} requires no helm.sh/helm/v4"
    return m.group(1)


def helm_path() -> Path:
    """Where scripts/helm-cli.sh puts the binary (it may be missing)."""
    cache = Path(os.environ.get("CILIA_CACHE_DIR") or Path.home() / ".cache" / "cilia")
    return cache / "helm" / helm_version() / "bin" / "helm"


def helm_missing() -> str | None:
    """Why helm cannot run here (the build's own reason when it failed), or None."""
    path = helm_path()
    if os.access(path, os.X_OK):
        return None
    marker = path.with_name("helm.unavailable")
    if marker.exists():
        return marker.read_text().strip()
    return f"{path} is missing: run scripts/helm-cli.sh (make test-setup builds it)"


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``helm ARGS`` with a private home (no repositories, no plugins; the Kubernetes client's
    discovery cache under it, not in the working directory)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": "/tmp/cilia-helm-test",
        "HELM_CACHE_HOME": "/tmp/cilia-helm-test/cache",
        "HELM_CONFIG_HOME": "/tmp/cilia-helm-test/config",
        "HELM_DATA_HOME": "/tmp/cilia-helm-test/data",
    }
    return subprocess.run(
        [str(helm), *args], capture_output=True, text=True, timeout=HELM_TIMEOUT, env=env,
        check=False,
    )  # fmt: skip


def template(
    helm: Path,
    *,
    values: dict[str, Any] | None = None,
    values_file: Path | None = None,
    namespace: str = NAMESPACE,
) -> subprocess.CompletedProcess[str]:
    """``helm template cilia deploy/helm/cilia -n NAMESPACE`` with ``values`` (nested, written to
    a temporary values file so types stay YAML's, removed after) and/or ``values_file``."""
    args = ["template", RELEASE, str(CHART), "--namespace", namespace]
    if values_file is not None:
        args += ["--values", str(values_file)]
    if not values:
        return run_helm(helm, *args)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="cilia-values-") as f:
        yaml.safe_dump(values, f)
        f.flush()
        return run_helm(helm, *args, "--values", f.name)


def documents(
    out: subprocess.CompletedProcess[str], *, hooks: bool = False
) -> list[dict[str, Any]]:
    """The objects of a successful render; hooks (``helm.sh/hook``) only with ``hooks``.

    Raises:
        AssertionError: helm failed (its stderr is the message).
    """
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    if hooks:
        return docs
    return [d for d in docs if HOOK not in (d["metadata"].get("annotations") or {})]


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The object ``kind``/``name`` of a render.

    Raises:
        AssertionError: not rendered.
    """
    for d in docs:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise AssertionError(f"{kind}/{name} not rendered")


def container(
    docs: list[dict[str, Any]], kind: str, name: str, container_name: str
) -> dict[str, Any]:
    """A container (init or app) of a workload's pod template."""
    spec = find(docs, kind, name)["spec"]["template"]["spec"]
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        if c["name"] == container_name:
            return c
    raise AssertionError(f"{kind}/{name} has no container {container_name}")
