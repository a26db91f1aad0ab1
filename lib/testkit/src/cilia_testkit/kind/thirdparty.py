"""Third-party images the Cilia chart names, made here because no registry is reachable.

The chart's metrics sidecar is upstream's ``quay.io/brancz/kube-rbac-proxy`` (values
``kubeRbacProxy.image``). :func:`ensure_kube_rbac_proxy_image` builds an image under exactly
that name from the binary ``scripts/kube-rbac-proxy.sh`` builds from the Go module proxy
(cached by version), so the chart installs unchanged and the nodes' containerd finds the
image locally (``pullPolicy: IfNotPresent``) once :meth:`KindCluster.load_images` has
imported it.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess

from cilia_testkit import ROOT
from cilia_testkit.kind.docker import DockerError, inspect
from cilia_testkit.kind.image import (
    TOOLS,
    Progress,
    _build,
    _current,
    _digest,
    _lock,
    _say,
    ensure_base_image,
)

KUBE_RBAC_PROXY_REPOSITORY = "quay.io/brancz/kube-rbac-proxy"


def kube_rbac_proxy_version() -> str:
    """The pinned kube-rbac-proxy version (``tools/kube-rbac-proxy/go.mod``), e.g. ``v0.19.1``.

    Raises:
        DockerError: the go.mod names no ``github.com/brancz/kube-rbac-proxy`` version.
    """
    text = (ROOT / "tools" / "kube-rbac-proxy" / "go.mod").read_text()
    found = re.search(r"github\.com/brancz/kube-rbac-proxy (v[0-9][^\s]*)", text)
    if not found:
        raise DockerError("tools/kube-rbac-proxy/go.mod pins no github.com/brancz/kube-rbac-proxy")
    return found.group(1)


def ensure_kube_rbac_proxy_image(progress: Progress = _say) -> str:
    """Build ``quay.io/brancz/kube-rbac-proxy:<pinned version>`` unless current; returns it.

    Raises:
        FileNotFoundError: the binary is not built (``scripts/kube-rbac-proxy.sh``).
        DockerError: the build failed.
    """
    binary = pathlib.Path(
        subprocess.run(
            [str(ROOT / "scripts" / "kube-rbac-proxy.sh"), "--print-bin"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    if not os.access(binary, os.X_OK):
        raise FileNotFoundError(f"{binary} is missing: run scripts/kube-rbac-proxy.sh")
    with _lock():
        base = ensure_base_image(progress)
        base_id = (inspect("image", base) or {}).get("Id", "")
        files = {
            "kube-rbac-proxy.Dockerfile": TOOLS / "kube-rbac-proxy.Dockerfile",
            "kube-rbac-proxy": binary,
        }
        inputs = _digest(list(files.values()), base_id)
        name = f"{KUBE_RBAC_PROXY_REPOSITORY}:{kube_rbac_proxy_version()}"
        if _current(name, inputs):
            return name
        return _build(name, "kube-rbac-proxy.Dockerfile", files, inputs, {"BASE": base}, progress)
