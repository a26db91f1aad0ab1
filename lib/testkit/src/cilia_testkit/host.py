"""Host-side helpers: run a command, poll a condition, read links, flip the FORWARD policy.

Standard library only. Everything that needs root says so in its docstring.
"""

from __future__ import annotations

import contextlib
import hashlib
import pathlib
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterator


def sh(*argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run a host command, capturing text output.

    Raises:
        subprocess.CalledProcessError: non-zero exit and ``check``.
        subprocess.TimeoutExpired: it ran longer than ``timeout`` seconds.
    """
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=timeout)


def wait_for(predicate: Callable[..., object], timeout: float, interval: float = 0.2) -> bool:
    """Poll ``predicate()`` every ``interval`` s until truthy (True) or ``timeout`` s passed
    (False). The predicate runs at least once."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def host_lxc_links() -> list[str]:
    """Names of host interfaces starting with ``lxc`` (pod veth host ends), sorted."""
    out = sh("ip", "-o", "link", "show").stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ": " in line]
    return sorted(n for n in names if n.startswith("lxc"))


def link_ifindex(name: str) -> int:
    """ifindex of host interface ``name``, 0 when it does not exist."""
    try:
        return int((pathlib.Path("/sys/class/net") / name / "ifindex").read_text())
    except (OSError, ValueError):
        return 0


def host_veth_name(container_id: str, ifname: str = "eth0") -> str:
    """Host-side veth name the agent gives an attachment: ``lxc`` + sha256(id/ifname)[:11]
    (cilia-agent ``datapath/linux.py``; 14 characters, under IFNAMSIZ)."""
    return "lxc" + hashlib.sha256(f"{container_id}/{ifname}".encode()).hexdigest()[:11]


@contextlib.contextmanager
def iptables_forward_policy(policy: str) -> Iterator[str]:
    """Set the iptables FORWARD policy to ``policy`` (root) and restore the previous one on
    exit. Yields the previous policy (``ACCEPT`` or ``DROP``)."""
    first = sh("iptables", "-S", "FORWARD").stdout.splitlines()[0]  # "-P FORWARD ACCEPT"
    previous = first.split()[-1]
    sh("iptables", "-P", "FORWARD", policy)
    try:
        yield previous
    finally:
        sh("iptables", "-P", "FORWARD", previous)


def reserve_tcp_port() -> socket.socket:
    """A TCP socket bound to port 0 on all addresses (not listening): the kernel's free port,
    held until the caller closes the socket. For ports a test must name although no server
    of its own binds them (a portmap ``hostPort``, whose DNAT acts before local delivery).
    Read the port with ``sock.getsockname()[1]``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("0.0.0.0", 0))
    return sock


_START_HEADER = re.compile(r"# \d{4}-")


def tail(path: pathlib.Path, lines: int = 30) -> str:
    """Last ``lines`` lines of a component log written since its latest start, or a note.

    Logs are appended across starts; each start writes a ``# <UTC time> <command>`` header
    (:mod:`cilia_testkit.stack`, ``scripts/stack.sh``); older starts are left out.
    """
    if not path.exists():
        return f"({path} missing)"
    text = path.read_text(errors="replace").splitlines()
    starts = [i for i, line in enumerate(text) if _START_HEADER.match(line)]
    current = text[starts[-1] :] if starts else text
    return "\n".join(current[-lines:])


__all__ = [
    "host_lxc_links",
    "host_veth_name",
    "iptables_forward_policy",
    "link_ifindex",
    "reserve_tcp_port",
    "sh",
    "tail",
    "wait_for",
]
