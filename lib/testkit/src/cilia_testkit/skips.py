"""Why a test cannot run here: one place for every skip reason of the repository.

Two kinds of functions:

- ``*_missing(...) -> str | None``: the reason a requirement is not met on this host, or
  None when it is (pure checks, usable at collection time and outside pytest);
- ``require_*(...) -> None``: skip the running test with that reason (``pytest.skip``), or
  **fail** it when ``CILIA_REQUIRE_PRIVILEGED=1`` (set by ``.ci/run``: CI runs as root on a
  kernel with BPF, with Docker started, where a skip would hide a missing dependency behind
  a green run).

Reasons name what is missing and how to get it (``scripts/setup.sh`` installs every
Debian package the suites use). The style follows pyroute2's test suite: a test that needs
a kernel feature skips with the reason when it is missing.
"""

from __future__ import annotations

import http.client
import os
import pathlib
import shutil
import socket
from typing import NoReturn

import pytest

#: Environment variable that turns every ``require_*`` skip into a failure (CI).
CI_ENV = "CILIA_REQUIRE_PRIVILEGED"
#: Where bpffs is mounted (the agent pins its maps below it).
BPFFS = pathlib.Path("/sys/fs/bpf")
#: The Docker engine's API socket (Debian's docker.io), unless ``DOCKER_HOST`` names another.
DOCKER_SOCKET = "/var/run/docker.sock"


def in_ci() -> bool:
    """True when a missing requirement must fail the test (``CILIA_REQUIRE_PRIVILEGED=1``)."""
    return os.environ.get(CI_ENV) == "1"


def unsupported(reason: str) -> NoReturn:
    """Skip the running test with ``reason``; in CI fail it instead.

    Raises:
        pytest.skip.Exception: outside CI.
        pytest.fail.Exception: with ``CILIA_REQUIRE_PRIVILEGED=1``; the message says so.
    """
    if in_ci():
        pytest.fail(f"requirement missing in CI ({CI_ENV}=1): {reason}", pytrace=False)
    pytest.skip(reason)


def require(reason: str | None) -> None:
    """:func:`unsupported` with ``reason`` unless it is None (the requirement is met)."""
    if reason is not None:
        unsupported(reason)


def root_missing(purpose: str = "network namespaces, veth, iptables") -> str | None:
    """``"needs root (<purpose>)"`` when the effective uid is not 0, else None."""
    if os.geteuid() != 0:
        return f"needs root ({purpose})"
    return None


def binary_missing(name: str, package: str | None = None) -> str | None:
    """The reason ``name`` is not on ``PATH`` (naming the Debian ``package``), else None."""
    if shutil.which(name) is not None:
        return None
    return (
        f"needs {name!r} on PATH (apt-get install {package or name}; scripts/setup.sh installs it)"
    )


def netns_missing(purpose: str = "network namespaces, veth, iptables") -> str | None:
    """Root and iproute2 (``ip``), what every netns/veth test needs; the first reason or None."""
    return root_missing(purpose) or binary_missing("ip", "iproute2")


def bpf_missing(purpose: str = "BPF_PROG_TEST_RUN, tc and BPF maps") -> str | None:
    """Root, bpffs mounted at ``/sys/fs/bpf`` and Debian's ``libbpf.so.1`` (the agent loads
    the objects ``make bpf`` compiles with it). Returns the first reason or None.
    """
    import ctypes.util

    reason = root_missing(purpose)
    if reason:
        return reason
    if not BPFFS.is_dir():
        return f"bpffs is not mounted at {BPFFS}"
    if ctypes.util.find_library("bpf") is None:
        return "libbpf (Debian libbpf1) is missing; run scripts/setup.sh"
    return None


def docker_missing(timeout: float = 5.0) -> str | None:
    """The reason the Docker engine does not answer ``GET /_ping`` on its unix socket, or None.

    The socket is ``DOCKER_HOST`` when it is ``unix:///path``, else ``/var/run/docker.sock``
    (Debian ``docker.io``; scripts/setup.sh starts dockerd for ``make test``). Another
    ``DOCKER_HOST`` scheme (tcp, ssh) is trusted as given.
    """
    host = os.environ.get("DOCKER_HOST", "")
    if host and not host.startswith("unix://"):
        return None
    path = host.removeprefix("unix://") or DOCKER_SOCKET
    conn = _UnixHTTPConnection(path, timeout)
    try:
        conn.request("GET", "/_ping")
        status = conn.getresponse().status
    except OSError as exc:
        return f"no Docker engine at {path} ({exc}); start dockerd (Debian docker.io)"
    finally:
        conn.close()
    if status != 200:
        return f"the Docker engine at {path} answers /_ping with HTTP {status}"
    return None


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a unix socket (the Docker engine API)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def require_root(purpose: str = "network namespaces, veth, iptables") -> None:
    """Skip (fail in CI) unless running as root. See :func:`root_missing`."""
    require(root_missing(purpose))


def require_binary(name: str, package: str | None = None) -> None:
    """Skip (fail in CI) unless ``name`` is on PATH. See :func:`binary_missing`."""
    require(binary_missing(name, package))


def require_netns(purpose: str = "network namespaces, veth, iptables") -> None:
    """Skip (fail in CI) unless root with iproute2. See :func:`netns_missing`."""
    require(netns_missing(purpose))


def require_bpf(purpose: str = "BPF_PROG_TEST_RUN, tc and BPF maps") -> None:
    """Skip (fail in CI) unless root, bpffs and libbpf are there. See :func:`bpf_missing`."""
    require(bpf_missing(purpose))


def require_docker() -> None:
    """Skip (fail in CI) unless the Docker engine answers. See :func:`docker_missing`."""
    require(docker_missing())


def host_in_use(reason: str) -> NoReturn:
    """Skip because this host's state would make the test wrong (e.g. a real agent already
    serves the default socket the test needs absent): not a missing dependency, so it skips
    in CI too.

    Raises:
        pytest.skip.Exception: always.
    """
    pytest.skip(reason)
