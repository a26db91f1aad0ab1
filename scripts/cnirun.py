"""Run a CNI plugin binary exactly as a container runtime (libcni) does, and make pods as netns.

Shared by ``scripts/demo.py``, ``tests/e2e`` and ``bench/`` so the exec contract is written
once. Standard library only: it is imported by the demo before anything else is checked.

What libcni does for each plugin of a conflist, and what :func:`plugin_netconf` and
:func:`invoke` reproduce (CNI spec 1.0.0, anchors.md §2; libcni ``pkg/invoke``):

- stdin is the plugin's own object from ``plugins[]`` with the list's ``name`` and
  ``cniVersion`` injected, plus ``args`` (here ``args.cni.labels``, the CNI conventions'
  list of ``{"key", "value"}``) and, for DEL, ``prevResult`` = the cached ADD result;
- the environment is the caller's plus ``CNI_COMMAND``, ``CNI_CONTAINERID``, ``CNI_NETNS``,
  ``CNI_IFNAME``, ``CNI_ARGS`` (``IgnoreUnknown=1;K8S_POD_NAMESPACE=…;K8S_POD_NAME=…;
  K8S_POD_INFRA_CONTAINER_ID=…`` as containerd/CRI-O send it) and ``CNI_PATH``;
- the result (or the error JSON) is read from stdout; the exit status says which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import re
import secrets
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN = ROOT / ".run"
VENV_BIN = ROOT / ".venv" / "bin"
CILIA_CNI = VENV_BIN / "cilia-cni"
STACK = ROOT / "scripts" / "stack.sh"
CONFLIST = RUN / "cni" / "net.d" / "05-cilia.conflist"
AGENT_SOCKET = RUN / "cilia.sock"
NETNS_DIR = pathlib.Path("/var/run/netns")
# Seconds one plugin exec may take before the caller gives up (the plugin has its own
# agent timeouts; this only guards the caller against a hung binary).
DEFAULT_EXEC_TIMEOUT_SECONDS = 60.0


class CniRunError(RuntimeError):
    """A plugin invocation that was expected to succeed failed; carries the full exchange."""


@dataclasses.dataclass(frozen=True)
class CniOutcome:
    """What one plugin exec returned.

    Attributes:
        command: ``ADD``, ``DEL``, ``CHECK`` or ``VERSION``.
        returncode: exit status (0 success).
        stdout: raw stdout (result JSON on success, error JSON on failure, per spec).
        stderr: raw stderr (logs; not part of the contract).
        seconds: wall-clock duration of the exec (fork to exit), in seconds.
    """

    command: str
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def json(self) -> dict[str, Any]:
        """stdout parsed as a JSON object; ``{}`` when stdout is empty (DEL success)."""
        if not self.stdout.strip():
            return {}
        value = json.loads(self.stdout)
        if not isinstance(value, dict):
            raise CniRunError(f"{self.command}: stdout is JSON but not an object: {self.stdout!r}")
        return value

    def check(self) -> CniOutcome:
        """Return self when the exec succeeded; raise :class:`CniRunError` otherwise."""
        if self.returncode != 0:
            raise CniRunError(
                f"CNI {self.command} exited {self.returncode}\n"
                f"stdout: {self.stdout.strip()}\nstderr: {self.stderr.strip()[-2000:]}"
            )
        return self


def load_conflist(path: pathlib.Path = CONFLIST) -> dict[str, Any]:
    """Read a ``.conflist`` written by the agent.

    Raises:
        FileNotFoundError: no conflist (the agent is not ready or not running).
        ValueError: not a JSON object with a non-empty ``plugins`` list.
    """
    conf = json.loads(path.read_text())
    if not isinstance(conf, dict) or not conf.get("plugins"):
        raise ValueError(f"{path}: not a CNI network configuration list: {conf!r}")
    return conf


def plugin_netconf(
    conflist: Mapping[str, Any],
    *,
    index: int = 0,
    labels: Mapping[str, str] | None = None,
    prev_result: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Build the stdin libcni gives plugin ``index`` of ``conflist``.

    Returns a new dict: the plugin object plus ``name`` and ``cniVersion`` from the list,
    ``args.cni.labels`` (``[{"key", "value"}]``, CNI conventions) when ``labels`` is given,
    and ``prevResult`` when given (DEL/CHECK).
    """
    conf = dict(conflist["plugins"][index])
    conf["name"] = conflist["name"]
    conf["cniVersion"] = conflist["cniVersion"]
    if labels:
        conf["args"] = {
            "cni": {"labels": [{"key": k, "value": v} for k, v in sorted(labels.items())]}
        }
    if prev_result is not None:
        conf["prevResult"] = dict(prev_result)
    return conf


def cni_args(pod_namespace: str, pod_name: str, container_id: str) -> str:
    """``CNI_ARGS`` as containerd/CRI-O build it for a Kubernetes pod."""
    return (
        f"IgnoreUnknown=1;K8S_POD_NAMESPACE={pod_namespace};K8S_POD_NAME={pod_name};"
        f"K8S_POD_INFRA_CONTAINER_ID={container_id}"
    )


def invoke(
    command: str,
    *,
    stdin: str | bytes,
    container_id: str | None,
    netns: str | None,
    ifname: str | None = "eth0",
    args: str | None = None,
    plugin: pathlib.Path = CILIA_CNI,
    cni_path: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_EXEC_TIMEOUT_SECONDS,
) -> CniOutcome:
    """Exec ``plugin`` once with the CNI environment; never raises on a non-zero exit.

    A ``None`` for ``container_id``/``netns``/``ifname``/``args`` leaves that variable
    unset (to test the plugin's validation). ``cni_path`` defaults to the plugin's directory.
    ``env`` overrides/extends the inherited environment.

    Raises:
        subprocess.TimeoutExpired: the plugin ran longer than ``timeout`` seconds.
    """
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CNI_")}
    environ["CNI_COMMAND"] = command
    environ["CNI_PATH"] = cni_path if cni_path is not None else str(plugin.parent)
    for key, value in (
        ("CNI_CONTAINERID", container_id),
        ("CNI_NETNS", netns),
        ("CNI_IFNAME", ifname),
        ("CNI_ARGS", args),
    ):
        if value is not None:
            environ[key] = value
    environ.update(env or {})
    data = stdin.encode() if isinstance(stdin, str) else stdin
    start = time.perf_counter()
    proc = subprocess.run(
        [str(plugin)], input=data, capture_output=True, env=environ, timeout=timeout, check=False
    )
    return CniOutcome(
        command=command,
        returncode=proc.returncode,
        stdout=proc.stdout.decode(errors="replace"),
        stderr=proc.stderr.decode(errors="replace"),
        seconds=time.perf_counter() - start,
    )


# ---------------------------------------------------------------------------------------
# Pods as network namespaces.


def sh(*argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run a host command, capturing text output.

    Raises:
        subprocess.CalledProcessError: non-zero exit and ``check``.
    """
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=timeout)


def netns_path(name: str) -> str:
    """Path the runtime passes as ``CNI_NETNS`` for a named netns."""
    return str(NETNS_DIR / name)


def create_netns(name: str) -> str:
    """Create netns ``name`` (deleting a stale one first), bring ``lo`` up; return its path."""
    delete_netns(name)
    sh("ip", "netns", "add", name)
    sh("ip", "-n", name, "link", "set", "lo", "up")
    return netns_path(name)


def delete_netns(name: str) -> None:
    """Delete netns ``name`` if it exists (its veth ends go with it)."""
    if (NETNS_DIR / name).exists():
        sh("ip", "netns", "delete", name, check=False)


def list_netns(prefix: str) -> list[str]:
    """Names of existing netns starting with ``prefix``."""
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))


def ping(netns: str, address: str, *, count: int = 1, wait_seconds: int = 2) -> bool:
    """True when ``address`` answers ``count`` pings from inside ``netns`` (host if empty)."""
    argv = ["ping", "-n", "-q", "-i", "0.2", "-c", str(count), "-W", str(wait_seconds), address]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    return sh(*argv, check=False, timeout=count * wait_seconds + 10).returncode == 0


def host_lxc_links() -> list[str]:
    """Names of host interfaces starting with ``lxc`` (pod veth host ends)."""
    out = sh("ip", "-o", "link", "show").stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ": " in line]
    return sorted(n for n in names if n.startswith("lxc"))


@dataclasses.dataclass
class Pod:
    """A pod as the runtime sees it: a netns, a container id, an interface name, labels.

    ``result`` holds the ADD result (the runtime's cache, passed back as ``prevResult``).
    """

    name: str
    namespace: str = "default"
    ifname: str = "eth0"
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    container_id: str = dataclasses.field(default_factory=lambda: secrets.token_hex(32))
    result: dict[str, Any] | None = None

    @property
    def netns(self) -> str:
        """The netns path passed as ``CNI_NETNS``."""
        return netns_path(self.name)

    @property
    def ip(self) -> str:
        """The pod's IPv4 address (no prefix) from the ADD result.

        Raises:
            CniRunError: the pod has no ADD result with an address.
        """
        if not self.result or not self.result.get("ips"):
            raise CniRunError(f"pod {self.name} has no ADD result with ips: {self.result!r}")
        return str(self.result["ips"][0]["address"]).split("/")[0]

    def create_netns(self) -> None:
        """Create the pod's netns (the runtime's sandbox)."""
        create_netns(self.name)

    def add(self, conflist: Mapping[str, Any], **kw: Any) -> CniOutcome:
        """Exec ADD for this pod with ``conflist``'s first plugin; store the result on success."""
        outcome = invoke(
            "ADD",
            stdin=json.dumps(plugin_netconf(conflist, labels=self.labels)),
            container_id=self.container_id,
            netns=self.netns,
            ifname=self.ifname,
            args=cni_args(self.namespace, self.name, self.container_id),
            **kw,
        )
        if outcome.returncode == 0:
            self.result = outcome.json
        return outcome

    def delete(self, conflist: Mapping[str, Any], **kw: Any) -> CniOutcome:
        """Exec DEL for this pod, with the cached ADD result as ``prevResult`` when known."""
        return invoke(
            "DEL",
            stdin=json.dumps(plugin_netconf(conflist, labels=self.labels, prev_result=self.result)),
            container_id=self.container_id,
            netns=self.netns,
            ifname=self.ifname,
            args=cni_args(self.namespace, self.name, self.container_id),
            **kw,
        )

    def destroy_netns(self) -> None:
        """Delete the pod's netns (after DEL, as a runtime does)."""
        delete_netns(self.name)


def stack(
    *argv: str, check: bool = True, timeout: float = 180.0
) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/stack.sh`` with ``argv``; stdout/stderr captured as text.

    Raises:
        subprocess.CalledProcessError: it failed and ``check`` (stderr has the log tail).
    """
    return subprocess.run(
        [str(STACK), *argv], capture_output=True, text=True, check=check, timeout=timeout
    )


def agent_cli(*argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run ``cilia-agent ARGV --socket .run/cilia.sock``; never raises on exit status."""
    return subprocess.run(
        [str(VENV_BIN / "cilia-agent"), *argv, "--socket", str(AGENT_SOCKET)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def operator_cli(*argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run ``cilia-operator ARGV`` against the local stack; never raises on exit status."""
    return subprocess.run(
        [str(VENV_BIN / "cilia-operator"), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def wait_for(predicate: Any, timeout: float, interval: float = 0.2) -> bool:
    """Poll ``predicate()`` every ``interval`` s until truthy or ``timeout`` s passed."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


@contextlib.contextmanager
def iptables_forward_policy(policy: str) -> Iterator[str]:
    """Set the iptables FORWARD policy to ``policy`` and restore the previous one on exit.

    Yields the previous policy (``ACCEPT`` or ``DROP``).
    """
    first = sh("iptables", "-S", "FORWARD").stdout.splitlines()[0]  # "-P FORWARD ACCEPT"
    previous = first.split()[-1]
    sh("iptables", "-P", "FORWARD", policy)
    try:
        yield previous
    finally:
        sh("iptables", "-P", "FORWARD", previous)


def tail(path: pathlib.Path, lines: int = 30) -> str:
    """Last ``lines`` lines of a stack log written since its latest start, or a note.

    ``scripts/stack.sh`` appends to ``.run/<component>.log`` and writes a
    ``# <UTC time> <command>`` header at each start; older starts are left out.
    """
    if not path.exists():
        return f"({path} missing)"
    text = path.read_text(errors="replace").splitlines()
    starts = [i for i, line in enumerate(text) if re.match(r"# \d{4}-", line)]
    current = text[starts[-1] :] if starts else text
    return "\n".join(current[-lines:])


__all__: Sequence[str] = [
    "CONFLIST",
    "CniOutcome",
    "CniRunError",
    "Pod",
    "agent_cli",
    "cni_args",
    "create_netns",
    "delete_netns",
    "host_lxc_links",
    "invoke",
    "iptables_forward_policy",
    "load_conflist",
    "operator_cli",
    "ping",
    "plugin_netconf",
    "stack",
    "wait_for",
]
