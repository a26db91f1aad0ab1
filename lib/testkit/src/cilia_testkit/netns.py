"""Named network namespaces (``ip netns``, root): the sandboxes pods live in.

:class:`NetnsRegistry` hands out names under one prefix per suite (``cilia-e2e-``,
``cilia-bench-``, ``cilia-demo-`` …, each with the creating pid) and deletes what it made;
:meth:`NetnsRegistry.remove_stale` removes what a killed earlier run of the same suite left.
``scripts/stack.sh purge`` removes ``cilia-(demo|e2e|bench)-*`` leftovers of any suite.
"""

from __future__ import annotations

import itertools
import os
import pathlib

from cilia_testkit.host import sh

#: Where ``ip netns`` keeps its named namespaces (iproute2's ``NETNS_RUN_DIR``).
NETNS_DIR = pathlib.Path("/var/run/netns")


def netns_path(name: str) -> str:
    """Path the runtime passes as ``CNI_NETNS`` for a named netns."""
    return str(NETNS_DIR / name)


def create_netns(name: str) -> str:
    """Create netns ``name`` (deleting a stale one first), bring ``lo`` up; return its path.

    Raises:
        subprocess.CalledProcessError: ``ip netns add`` failed (not root?).
    """
    delete_netns(name)
    sh("ip", "netns", "add", name)
    sh("ip", "-n", name, "link", "set", "lo", "up")
    return netns_path(name)


def delete_netns(name: str) -> None:
    """Delete netns ``name`` if it exists (its veth ends go with it)."""
    if (NETNS_DIR / name).exists():
        sh("ip", "netns", "delete", name, check=False)


def list_netns(prefix: str) -> list[str]:
    """Names of existing netns starting with ``prefix``, sorted."""
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))


def netns_links(name: str) -> list[str]:
    """Interface names inside netns ``name`` (``[]`` when the netns does not exist)."""
    out = sh("ip", "-n", name, "-o", "link", "show", check=False)
    if out.returncode != 0:
        return []
    return sorted(line.split(":")[1].strip().split("@")[0] for line in out.stdout.splitlines())


def ping(netns: str, address: str, *, count: int = 1, wait_seconds: int = 2) -> bool:
    """True when ``address`` answers ``count`` pings from inside ``netns`` (the host if "")."""
    argv = ["ping", "-n", "-q", "-i", "0.2", "-c", str(count), "-W", str(wait_seconds), address]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    return sh(*argv, check=False, timeout=count * wait_seconds + 10).returncode == 0


class NetnsRegistry:
    """Network namespaces of one suite: names ``<prefix><pid>-<n>`` (or ``<prefix><suffix>``).

    ``prefix`` names the suite (``cilia-e2e-``); the pid keeps two concurrent runs of the
    same suite apart. :meth:`cleanup` deletes every namespace this registry created;
    :meth:`remove_stale` deletes namespaces with the prefix whose creating pid is gone.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.pid = os.getpid()
        self.created: list[str] = []
        self._counter = itertools.count(1)

    def name(self, suffix: str | None = None) -> str:
        """A fresh name in this registry (``<prefix><pid>-<suffix or n>``); nothing created."""
        return f"{self.prefix}{self.pid}-{suffix if suffix is not None else next(self._counter)}"

    def create(self, name: str | None = None) -> str:
        """Create netns ``name`` (default :meth:`name`) with ``lo`` up; returns its name."""
        name = name or self.name()
        create_netns(name)
        if name not in self.created:
            self.created.append(name)
        return name

    def adopt(self, name: str) -> str:
        """Register a namespace created elsewhere (e.g. by :class:`~cilia_testkit.cni.Pod`)
        so :meth:`cleanup` deletes it; returns ``name``."""
        if name not in self.created:
            self.created.append(name)
        return name

    def cleanup(self) -> None:
        """Delete every namespace this registry created or adopted."""
        while self.created:
            delete_netns(self.created.pop())

    def remove_stale(self) -> list[str]:
        """Delete ``<prefix><pid>-*`` namespaces whose pid no longer runs; returns their names.

        A name without a pid (``<prefix>name``) counts as stale too.
        """
        removed = []
        for name in list_netns(self.prefix):
            pid_text = name[len(self.prefix) :].partition("-")[0]
            alive = pid_text.isdigit() and pathlib.Path(f"/proc/{pid_text}").exists()
            if not alive or (int(pid_text) == self.pid and name not in self.created):
                delete_netns(name)
                removed.append(name)
        return removed


__all__ = [
    "NETNS_DIR",
    "NetnsRegistry",
    "create_netns",
    "delete_netns",
    "list_netns",
    "netns_links",
    "netns_path",
    "ping",
]
