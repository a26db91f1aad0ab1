"""Named network namespaces (``ip netns``, root): the sandboxes pods live in.

:class:`NetnsRegistry` hands out names under one prefix per suite (``cilia-e2e-``,
``cilia-bench-``, ``cilia-demo-`` …, each with the creating pid) and deletes what it made;
:meth:`NetnsRegistry.remove_stale` removes what a killed earlier run of the same suite left.
Each namespace made by :func:`create_netns` has its owner recorded: the creating process's pid
and start time in ``OWNER_DIR/<name>`` (removed with the namespace). ``scripts/stack.sh
purge`` deletes the leftovers of any suite (``cilia_testkit.stackctl.LEFTOVER_NETNS``) but
only those whose owner is gone (:func:`netns_owner`): on a shared host another checkout's
running test, demo or cluster keeps its namespaces.
"""

from __future__ import annotations

import itertools
import os
import pathlib

from cilia_testkit.host import sh

#: Where ``ip netns`` keeps its named namespaces (iproute2's ``NETNS_RUN_DIR``).
NETNS_DIR = pathlib.Path("/var/run/netns")
#: One file per namespace made by :func:`create_netns`: ``<pid> <start time>`` of its owner
#: (root's, like the namespaces; outside NETNS_DIR so ``ip netns list`` does not show it).
OWNER_DIR = pathlib.Path("/run/cilia-testkit/netns-owners")


def _start_time(pid: int) -> str:
    """The start time of process ``pid`` (``/proc/<pid>/stat`` field 22, clock ticks since
    boot), "" when it does not run: with the pid it names one process, even after reuse."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 else ""


def netns_owner(name: str) -> int | None:
    """The pid of the running process that owns netns ``name``, else None.

    The owner is the one recorded by :func:`create_netns` (pid and start time must both
    match a live process). A namespace without a record (made by an older test kit) falls
    back to the pid in a :class:`NetnsRegistry` name (``<prefix><pid>-…``) when it runs.
    """
    try:
        pid_text, _, started = (OWNER_DIR / name).read_text().strip().partition(" ")
        pid = int(pid_text)
    except (OSError, ValueError):
        pass
    else:
        return pid if started and _start_time(pid) == started else None
    for part in name.split("-")[2:3]:  # cilia-<suite>-<pid>-…
        if part.isdigit() and _start_time(int(part)):
            return int(part)
    return None


def netns_path(name: str) -> str:
    """Path the runtime passes as ``CNI_NETNS`` for a named netns."""
    return str(NETNS_DIR / name)


def create_netns(name: str, *, owner: int | None = None) -> str:
    """Create netns ``name`` (deleting a stale one first), bring ``lo`` up, record its owner
    (``owner``, default this process: see :func:`netns_owner`); return its path.

    Raises:
        subprocess.CalledProcessError: ``ip netns add`` failed (not root?).
    """
    delete_netns(name)
    sh("ip", "netns", "add", name)
    pid = os.getpid() if owner is None else owner
    OWNER_DIR.mkdir(parents=True, exist_ok=True)
    (OWNER_DIR / name).write_text(f"{pid} {_start_time(pid)}\n")
    sh("ip", "-n", name, "link", "set", "lo", "up")
    return netns_path(name)


def delete_netns(name: str) -> None:
    """Delete netns ``name`` if it exists (its veth ends go with it), and its owner record."""
    if (NETNS_DIR / name).exists():
        sh("ip", "netns", "delete", name, check=False)
    (OWNER_DIR / name).unlink(missing_ok=True)


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
    "netns_owner",
    "netns_path",
    "ping",
]
