"""The images of the kind-style cluster, built locally (no registry is reachable here):

- the **node image** ``cilia-node:<k8s version>`` from ``tools/kind/node.Dockerfile`` on the
  Debian base ``cilia-base:bookworm`` (``scripts/images.py`` makes it with debootstrap when
  missing): containerd, runc, iptables, iproute2, kmod, Debian's CNI plugins, tini, the
  kubelet from the Go build cache (``scripts/kubelet-tools.sh``) and ``tools/kind/entrypoint.sh``;
- the **CoreDNS image** ``cilia-coredns:<coredns version>`` (``tools/kind/coredns.Dockerfile``):
  the static ``coredns`` of ``scripts/coredns.sh`` alone, FROM scratch (no shell or libc needed,
  and a node imports a few MB instead of the 290 MB base);
- the **sandbox image** ``cilia.test/testpod:1``: the OCI tarball of the static ``testpod``
  program (:func:`cilia_testkit.kubelet.write_oci_image`), also a pod image for tests
  (``testpod serve PORT`` answers "hello from <hostname> on <port>").

An image is rebuilt only when its inputs change: their sha256 is the image label
``io.cilia.kind.inputs``. Builds use the engine's legacy builder (``DOCKER_BUILDKIT=0``: the
machine's docker CLI has no buildx) with ``--network host`` (apt reaches the Debian mirror),
one at a time per machine (flock ``/tmp/cilia-images-kind.lock``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

from cilia_testkit import ROOT
from cilia_testkit.kind.docker import DockerError, docker, inspect
from cilia_testkit.kubeapi import binary_missing, default_bin_dir
from cilia_testkit.ociimage import IMAGE as SANDBOX_IMAGE
from cilia_testkit.ociimage import write_oci_image

TOOLS = ROOT / "tools" / "kind"
#: The base image of the project's images (scripts/images.py builds it with debootstrap).
BASE_IMAGE = "cilia-base:bookworm"
#: Seconds one image build may take (apt in the node image: ~30 s warm, minutes cold).
BUILD_TIMEOUT = 1200.0
#: The label holding the sha256 of an image's inputs.
INPUTS_LABEL = "io.cilia.kind.inputs"

__all__ = [
    "SANDBOX_IMAGE", "coredns_bin_dir", "coredns_image", "coredns_version", "ensure_coredns_image",
    "ensure_node_image", "k8s_version", "node_image", "write_sandbox_image",
]  # fmt: skip

Progress = Callable[[str], None]


def _say(msg: str) -> None:
    print(f"[kind] {msg}", file=sys.stderr, flush=True)


def _pinned(path: pathlib.Path, key: str) -> str:
    for line in path.read_text().splitlines():
        if line.startswith(f"{key}="):
            return line.split("=", 1)[1].strip()
    raise ValueError(f"{key} is not set in {path}")


def k8s_version() -> str:
    """``K8S_VERSION`` of tools/kube/versions.env (e.g. ``v1.37.2``)."""
    return _pinned(ROOT / "tools" / "kube" / "versions.env", "K8S_VERSION")


def coredns_version() -> str:
    """``COREDNS_VERSION`` of tools/coredns/versions.env (e.g. ``v1.15.0``)."""
    return _pinned(ROOT / "tools" / "coredns" / "versions.env", "COREDNS_VERSION")


def node_image() -> str:
    """The node image's name: ``cilia-node:<k8s version>``."""
    return f"cilia-node:{k8s_version()}"


def coredns_image() -> str:
    """The CoreDNS image's name: ``cilia-coredns:<coredns version>``."""
    return f"cilia-coredns:{coredns_version()}"


def coredns_bin_dir() -> pathlib.Path:
    """Where scripts/coredns.sh puts ``coredns``:
    ``${CILIA_CACHE_DIR:-~/.cache/cilia}/coredns/<version>/bin``."""
    cache = pathlib.Path(os.environ.get("CILIA_CACHE_DIR") or pathlib.Path.home() / ".cache/cilia")
    return cache / "coredns" / coredns_version() / "bin"


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    with open("/tmp/cilia-images-kind.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _digest(paths: list[pathlib.Path], extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for path in paths:
        h.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:32]


def _current(name: str, inputs: str) -> bool:
    image = inspect("image", name)
    labels = ((image or {}).get("Config") or {}).get("Labels") or {}
    return bool(labels.get(INPUTS_LABEL) == inputs)


def ensure_base_image(progress: Progress = _say) -> str:
    """Make sure ``cilia-base:bookworm`` exists: built by ``scripts/images.py`` (Docker SDK,
    debootstrap; ~1-2 min) through the project's ``.venv`` python when missing.

    Raises:
        DockerError: the build failed (its output tail in the message).
    """
    if inspect("image", BASE_IMAGE) is not None:
        return BASE_IMAGE
    python = ROOT / ".venv" / "bin" / "python"
    progress(f"building {BASE_IMAGE} (debootstrap) with scripts/images.py")
    code = "import sys; sys.path.insert(0, 'scripts'); import images; images.ensure_base_image()"
    got = subprocess.run(
        [str(python if python.exists() else sys.executable), "-c", code], cwd=ROOT,
        capture_output=True, text=True, timeout=BUILD_TIMEOUT, check=False,
    )  # fmt: skip
    if got.returncode != 0 or inspect("image", BASE_IMAGE) is None:
        raise DockerError(f"building {BASE_IMAGE} failed:\n{got.stderr[-2000:]}")
    return BASE_IMAGE


def _build(
    name: str,
    dockerfile: str,
    files: dict[str, pathlib.Path],
    inputs: str,
    build_args: dict[str, str],
    progress: Progress,
) -> str:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cilia-kind-image.") as tmp:
        ctx = pathlib.Path(tmp)
        for arcname, src in files.items():
            try:
                os.link(src, ctx / arcname)  # same file system: no copy of 100 MB binaries
            except OSError:
                shutil.copy2(src, ctx / arcname)
        args = [f"--build-arg={k}={v}" for k, v in build_args.items()]
        progress(f"building {name}")
        docker(
            "build", "--network=host", "--quiet", f"--label={INPUTS_LABEL}={inputs}",
            f"--file={ctx / dockerfile}", f"--tag={name}", *args, str(ctx),
            timeout=BUILD_TIMEOUT, env={"DOCKER_BUILDKIT": "0"},
        )  # fmt: skip
    progress(f"built {name} in {time.monotonic() - started:.1f} s")
    return name


def ensure_node_image(progress: Progress = _say) -> str:
    """Build ``cilia-node:<k8s version>`` unless an image with the same inputs (Dockerfile,
    entrypoint, containerd config, kubelet binary, base image id) exists; returns its name.

    Raises:
        FileNotFoundError: the kubelet is not built (scripts/kubelet-tools.sh).
        DockerError: the build failed.
    """
    reason = binary_missing("kubelet")
    if reason:
        raise FileNotFoundError(reason)
    with _lock():
        base = ensure_base_image(progress)
        base_id = (inspect("image", base) or {}).get("Id", "")
        files = {
            "node.Dockerfile": TOOLS / "node.Dockerfile",
            "entrypoint.sh": TOOLS / "entrypoint.sh",
            "containerd.toml": TOOLS / "containerd.toml",
            "kubelet": default_bin_dir() / "kubelet",
        }
        inputs = _digest(list(files.values()), base_id)
        name = node_image()
        if _current(name, inputs):
            return name
        return _build(
            name, "node.Dockerfile", files, inputs,
            {"BASE": base, "K8S_VERSION": k8s_version()}, progress,
        )  # fmt: skip


def ensure_coredns_image(progress: Progress = _say) -> str:
    """Build ``cilia-coredns:<version>`` from the cached static ``coredns`` unless current;
    returns its name.

    Raises:
        FileNotFoundError: coredns is not built (run scripts/coredns.sh; its
            ``coredns.unavailable`` text when the build failed).
        DockerError: the build failed.
    """
    binary = coredns_bin_dir() / "coredns"
    if not os.access(binary, os.X_OK):
        marker = binary.with_name("coredns.unavailable")
        raise FileNotFoundError(
            marker.read_text().strip() if marker.exists()
            else f"{binary} is missing: run scripts/coredns.sh (minutes the first time)"
        )  # fmt: skip
    with _lock():
        files = {"coredns.Dockerfile": TOOLS / "coredns.Dockerfile", "coredns": binary}
        inputs = _digest(list(files.values()))
        name = coredns_image()
        if _current(name, inputs):
            return name
        return _build(
            name, "coredns.Dockerfile", files, inputs, {"COREDNS_VERSION": coredns_version()},
            progress,
        )  # fmt: skip


def write_sandbox_image(out: pathlib.Path) -> pathlib.Path:
    """The OCI tarball of :data:`SANDBOX_IMAGE` (the static ``testpod``) at ``out``.

    Raises:
        FileNotFoundError: testpod is not built (scripts/kubelet-tools.sh).
    """
    reason = binary_missing("testpod")
    if reason:
        raise FileNotFoundError(reason)
    return write_oci_image(default_bin_dir() / "testpod", out, SANDBOX_IMAGE)
