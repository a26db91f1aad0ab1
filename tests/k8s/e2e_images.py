"""The container images the upstream Kubernetes network e2e specs run, built here (no registry
is reachable) under exactly the names the e2e framework asks the kubelet for
(``k8s.io/kubernetes/test/utils/image``, manifest.go of v1.37.2), so no image-repository
override is needed:

================================================================  ==============================
``registry.k8s.io/e2e-test-images/agnhost:2.66.1``                 Debian + the tools upstream's
                                                                   image adds (dig, curl, nc,
                                                                   ip, iperf, socat, bash), the
                                                                   ``agnhost`` binary built from
                                                                   k8s.io/kubernetes (scripts/
                                                                   e2e-tools.sh), ``/coredns``,
                                                                   porter's TLS pair, uid 1000
``registry.k8s.io/e2e-test-images/glibc-dns-testing:2.1.1``        Debian + dnsutils (upstream:
                                                                   the same on a glibc base)
``registry.k8s.io/e2e-test-images/busybox:1.37.0-2``               Debian + busybox-static
``registry.k8s.io/e2e-test-images/nginx:1.27.0-2``                 Debian's nginx, foreground
``registry.k8s.io/pause:3.10.2``                                   ``agnhost pause``
================================================================  ==============================

Every image starts ``FROM`` the project's Debian base ``cilia-base:bookworm`` (scripts/
images.py builds it); Debian packages come from the host's mirror during the build (host
network), then the engine's layer cache. They are test tooling and never shipped.

Usage (the conformance runner, tests/k8s/conformance.py)::

    names = ensure_e2e_images(bin_dir)   # bin_dir holds agnhost (scripts/e2e-tools.sh)
    cluster.load_images(names)
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tempfile
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: The Debian base every image starts from (scripts/images.py).
BASE = "cilia-base:bookworm"
#: Seconds one ``docker build`` may take (apt from the mirror on a cold cache).
BUILD_TIMEOUT = 900
#: The k8s.io/kubernetes module the agnhost TLS pair (porter/localhost.{crt,key}) comes from.
K8S_MODULE = "k8s.io/kubernetes"

AGNHOST = "registry.k8s.io/e2e-test-images/agnhost:2.66.1"
GLIBC_DNS = "registry.k8s.io/e2e-test-images/glibc-dns-testing:2.1.1"
BUSYBOX = "registry.k8s.io/e2e-test-images/busybox:1.37.0-2"
NGINX = "registry.k8s.io/e2e-test-images/nginx:1.27.0-2"
PAUSE = "registry.k8s.io/pause:3.10.2"

_APT = (
    "RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
    "--no-install-recommends {pkgs} && rm -rf /var/lib/apt/lists/*\n"
)

_DOCKERFILES: dict[str, str] = {
    AGNHOST: (
        f"FROM {BASE}\n"
        + _APT.format(
            pkgs="bind9-dnsutils curl netcat-openbsd iproute2 iperf bash util-linux "
            "socat ca-certificates"
        )
        + "COPY agnhost coredns localhost.crt localhost.key /\n"
        "RUN mkdir /uploads && ln -s agnhost /agnhost-2 "
        "&& groupadd -g 50000 group-defined-in-image "
        "&& useradd -u 1000 -M -G group-defined-in-image user-defined-in-image\n"
        "WORKDIR /\n"
        "EXPOSE 80 8080 8081 9376 5000\n"
        'ENTRYPOINT ["/agnhost"]\nCMD ["pause"]\n'
    ),
    GLIBC_DNS: f"FROM {BASE}\n" + _APT.format(pkgs="bind9-dnsutils"),
    BUSYBOX: (
        f"FROM {BASE}\n"
        + _APT.format(pkgs="busybox-static")
        + "RUN mkdir -p /opt/busybox && busybox --install -s /opt/busybox\n"
        "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/opt/busybox\n"
        'CMD ["sh"]\n'
    ),
    NGINX: (
        f"FROM {BASE}\n"
        + _APT.format(pkgs="nginx-light")
        + 'EXPOSE 80\nCMD ["nginx", "-g", "daemon off;"]\n'
    ),
    PAUSE: 'FROM scratch\nCOPY agnhost /agnhost\nENTRYPOINT ["/agnhost", "pause"]\n',
}

#: Every image this module builds, in build order.
IMAGES = tuple(_DOCKERFILES)


class E2EImageError(RuntimeError):
    """An image could not be built (the tail of the build's output in the message)."""


def _k8s_module_dir() -> pathlib.Path:
    got = subprocess.run(
        ["go", "list", "-m", "-f", "{{.Dir}}", K8S_MODULE],
        cwd=ROOT / "tools" / "e2e",
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={**os.environ, "PATH": "/usr/local/go/bin:" + os.environ.get("PATH", "")},
    )
    if got.returncode != 0 or not got.stdout.strip():
        raise E2EImageError(f"cannot locate {K8S_MODULE} in the module cache: {got.stderr[-500:]}")
    return pathlib.Path(got.stdout.strip())


def ensure_e2e_images(
    bin_dir: pathlib.Path, coredns: pathlib.Path, progress: Callable[[str], None] = print
) -> list[str]:
    """Build every image of :data:`IMAGES` (the engine's cache makes a rebuild quick) and
    return their names.

    Args:
        bin_dir: the directory holding the static ``agnhost`` (scripts/e2e-tools.sh).
        coredns: the static ``coredns`` binary (scripts/coredns.sh), ``/coredns`` in agnhost.
        progress: receives one line per image.

    Raises:
        E2EImageError: agnhost or coredns is missing, or a build failed.
    """
    agnhost = bin_dir / "agnhost"
    for need in (agnhost, coredns):
        if not need.is_file():
            raise E2EImageError(f"{need} is missing (scripts/e2e-tools.sh, scripts/coredns.sh)")
    porter = _k8s_module_dir() / "test" / "images" / "agnhost" / "porter"
    with tempfile.TemporaryDirectory(prefix="cilia-e2e-img.") as tmp:
        ctx = pathlib.Path(tmp)
        shutil.copy(agnhost, ctx / "agnhost")
        shutil.copy(coredns, ctx / "coredns")
        for name in ("localhost.crt", "localhost.key"):
            shutil.copy(porter / name, ctx / name)
        for image, dockerfile in _DOCKERFILES.items():
            (ctx / "Dockerfile").write_text(dockerfile)
            progress(f"building {image}")
            got = subprocess.run(
                [
                    "docker",
                    "build",
                    "--network",
                    "host",
                    "--label",
                    "io.cilia.test=e2e",
                    "-t",
                    image,
                    str(ctx),
                ],
                capture_output=True,
                text=True,
                check=False,
                timeout=BUILD_TIMEOUT,
            )
            if got.returncode != 0:
                raise E2EImageError(f"docker build {image} failed:\n{got.stderr[-3000:]}")
    return list(IMAGES)
