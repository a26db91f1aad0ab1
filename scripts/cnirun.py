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
import hashlib
import json
import os
import pathlib
import re
import secrets
import shutil
import signal
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
# The stack agent's ``--state-dir`` and ``--bpf-pin-dir`` (its default: scripts/stack.sh sets none).
AGENT_STATE_DIR = RUN / "agent" / "state"
# The stack agent's ``--cni-del-queue-dir`` (DELs the plugin queued while the agent was down).
DEL_QUEUE_DIR = RUN / "del-queue"
BPF_PIN_DIR = pathlib.Path("/sys/fs/bpf/cilia")
# Debian's reference plugins (containernetworking-plugins), for chaining tests.
DEBIAN_CNI_DIR = pathlib.Path("/usr/lib/cni")
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
        killed: the caller SIGKILLed the plugin (``invoke(kill_after=...)``) before it exited.
    """

    command: str
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    killed: bool = False

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
    kill_after: float | None = None,
) -> CniOutcome:
    """Exec ``plugin`` once with the CNI environment; never raises on a non-zero exit.

    A ``None`` for ``container_id``/``netns``/``ifname``/``args`` leaves that variable
    unset (to test the plugin's validation). ``cni_path`` defaults to the plugin's directory.
    ``env`` overrides/extends the inherited environment. With ``kill_after`` (seconds) the
    plugin is SIGKILLed if it still runs then (a runtime or node dying mid-call): the outcome
    has ``killed`` set and ``returncode`` ``-9``.

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
    killed = False
    with subprocess.Popen(
        [str(plugin)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=environ,
    ) as proc:
        try:
            out, err = proc.communicate(
                data, timeout=min(kill_after, timeout) if kill_after is not None else timeout
            )
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            if kill_after is None or kill_after >= timeout:
                raise
            killed = proc.returncode == -signal.SIGKILL
    return CniOutcome(
        command=command,
        returncode=proc.returncode,
        stdout=out.decode(errors="replace"),
        stderr=err.decode(errors="replace"),
        seconds=time.perf_counter() - start,
        killed=killed,
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

    def cni_args(self) -> str:
        """This pod's ``CNI_ARGS`` (see :func:`cni_args`)."""
        return cni_args(self.namespace, self.name, self.container_id)

    @property
    def host_veth(self) -> str:
        """The host end of cilia's veth for this attachment (:func:`host_veth_name`)."""
        return host_veth_name(self.container_id, self.ifname)

    def add_list(
        self,
        conflist: Mapping[str, Any],
        *,
        cni_path: str,
        runtime_config: Mapping[str, Any] | None = None,
        timeout: float = DEFAULT_EXEC_TIMEOUT_SECONDS,
    ) -> ListOutcome:
        """ADD through every plugin of ``conflist`` (:func:`exec_list`); caches the result."""
        outcome = self._exec_list("ADD", conflist, cni_path, runtime_config, timeout, None)
        if outcome.ok:
            self.result = outcome.result
        return outcome

    def delete_list(
        self,
        conflist: Mapping[str, Any],
        *,
        cni_path: str,
        runtime_config: Mapping[str, Any] | None = None,
        timeout: float = DEFAULT_EXEC_TIMEOUT_SECONDS,
    ) -> ListOutcome:
        """DEL through every plugin of ``conflist`` in reverse, with the cached result."""
        return self._exec_list("DEL", conflist, cni_path, runtime_config, timeout, self.result)

    def _exec_list(
        self,
        command: str,
        conflist: Mapping[str, Any],
        cni_path: str,
        runtime_config: Mapping[str, Any] | None,
        timeout: float,
        prev_result: Any,
    ) -> ListOutcome:
        """:func:`exec_list` for this pod's container id, netns, ifname, args and labels."""
        return exec_list(
            command,
            conflist,
            container_id=self.container_id,
            netns=self.netns,
            ifname=self.ifname,
            args=self.cni_args(),
            cni_path=cni_path,
            labels=self.labels,
            runtime_config=runtime_config,
            prev_result=prev_result,
            timeout=timeout,
        )


def host_veth_name(container_id: str, ifname: str = "eth0") -> str:
    """Host-side veth name the agent gives an attachment: ``lxc`` + sha256(id/ifname)[:11]."""
    return "lxc" + hashlib.sha256(f"{container_id}/{ifname}".encode()).hexdigest()[:11]


def netns_links(name: str) -> list[str]:
    """Interface names inside netns ``name`` (``[]`` when the netns does not exist)."""
    out = sh("ip", "-n", name, "-o", "link", "show", check=False)
    if out.returncode != 0:
        return []
    names = [line.split(":")[1].strip().split("@")[0] for line in out.stdout.splitlines()]
    return sorted(names)


# ---------------------------------------------------------------------------------------
# Conflists of several plugins (chaining), as libcni's AddNetworkList / DelNetworkList.


@dataclasses.dataclass(frozen=True)
class ListOutcome:
    """What one conflist operation did.

    Attributes:
        command: ``ADD``, ``DEL`` or ``CHECK``.
        outcomes: the execs run, in run order (the failed one last; libcni stops there).
        result: ADD: the last plugin's result (what libcni caches); else None.
    """

    command: str
    outcomes: tuple[CniOutcome, ...]
    result: dict[str, Any] | None

    @property
    def ok(self) -> bool:
        """Every plugin run exited 0."""
        return all(o.returncode == 0 for o in self.outcomes)

    def check(self) -> ListOutcome:
        """Return self on success; raise :class:`CniRunError` with the failing exchange."""
        for outcome in self.outcomes:
            outcome.check()
        return self


def find_plugin(plugin_type: str, cni_path: str) -> pathlib.Path:
    """The executable ``plugin_type`` in the first ``CNI_PATH`` directory holding it.

    libcni ``invoke.FindInPath``: directories separated by ``:``, first match wins.

    Raises:
        FileNotFoundError: no directory of ``cni_path`` has it.
    """
    for directory in cni_path.split(os.pathsep):
        candidate = pathlib.Path(directory) / plugin_type
        if directory and candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(f"CNI plugin {plugin_type!r} not found in CNI_PATH {cni_path!r}")


def list_netconf(
    conflist: Mapping[str, Any],
    index: int,
    *,
    labels: Mapping[str, str] | None = None,
    prev_result: Mapping[str, Any] | None = None,
    runtime_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """:func:`plugin_netconf` plus libcni's ``runtimeConfig`` injection.

    Only the keys of ``runtime_config`` the plugin declares in its ``capabilities`` object
    (e.g. ``{"portMappings": true}``) are passed, as ``runtimeConfig`` (CNI conventions).
    """
    conf = plugin_netconf(conflist, index=index, labels=labels, prev_result=prev_result)
    capabilities = conf.get("capabilities") or {}
    wanted = {k: v for k, v in (runtime_config or {}).items() if capabilities.get(k)}
    if wanted:
        conf["runtimeConfig"] = wanted
    return conf


def exec_list(
    command: str,
    conflist: Mapping[str, Any],
    *,
    container_id: str,
    netns: str,
    ifname: str = "eth0",
    args: str | None = None,
    cni_path: str,
    labels: Mapping[str, str] | None = None,
    prev_result: Mapping[str, Any] | None = None,
    runtime_config: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_EXEC_TIMEOUT_SECONDS,
) -> ListOutcome:
    """Run ``command`` over every plugin of ``conflist`` as libcni does.

    - ADD: plugins in order; plugin N gets plugin N-1's result as ``prevResult``; stops at
      the first failure (the runtime then calls DEL for the whole list);
    - DEL: plugins in reverse order, each with the cached ADD result ``prev_result``;
      stops at the first failure (the runtime retries);
    - CHECK: plugins in order, each with ``prev_result``.

    Each plugin is the ``type`` found in ``cni_path`` (:func:`find_plugin`), exec'd with
    ``CNI_PATH=cni_path``.

    Raises:
        FileNotFoundError: a plugin type is not in ``cni_path``.
        subprocess.TimeoutExpired: one exec ran longer than ``timeout`` seconds.
    """
    plugins = list(range(len(conflist["plugins"])))
    if command == "DEL":
        plugins.reverse()
    outcomes: list[CniOutcome] = []
    previous = None if command == "ADD" else prev_result
    for index in plugins:
        conf = list_netconf(
            conflist,
            index,
            labels=labels,
            prev_result=previous,
            runtime_config=runtime_config,
        )
        outcome = invoke(
            command,
            stdin=json.dumps(conf),
            container_id=container_id,
            netns=netns,
            ifname=ifname,
            args=args,
            plugin=find_plugin(str(conf["type"]), cni_path),
            cni_path=cni_path,
            timeout=timeout,
        )
        outcomes.append(outcome)
        if outcome.returncode != 0:
            return ListOutcome(command, tuple(outcomes), None)
        if command == "ADD":
            previous = outcome.json
    result = dict(previous) if command == "ADD" and previous is not None else None
    return ListOutcome(command, tuple(outcomes), result)


# ---------------------------------------------------------------------------------------
# The stack's components, its state files and its datapath maps.


def component_pid(name: str) -> int | None:
    """Pid of a running stack component (``redis``, ``operator``, ``agent``, ``relay``).

    Read from ``.run/<name>.pid`` and checked against ``/proc/PID/cmdline`` (pid reuse, a
    zombie) the way ``scripts/stack.sh`` does; None when it does not run.
    """
    binary = {"redis": "redis-server"}.get(name, f"cilia-{name}")
    try:
        pid = int((RUN / f"{name}.pid").read_text().strip())
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if binary.encode() in cmdline else None


def kill_component(name: str, *, timeout: float = 10.0) -> int:
    """SIGKILL a running stack component and wait until it is gone; returns its pid.

    Raises:
        RuntimeError: it is not running, or still alive after ``timeout`` seconds.
    """
    pid = component_pid(name)
    if pid is None:
        raise RuntimeError(f"stack component {name} is not running")
    os.kill(pid, signal.SIGKILL)
    if not wait_for(lambda: _exited(pid), timeout, interval=0.05):
        raise RuntimeError(f"{name} (pid {pid}) still alive {timeout:g}s after SIGKILL")
    return pid


def _exited(pid: int) -> bool:
    """True once every thread of ``pid`` has finished exiting (gone, or a lone zombie leader).

    ``/proc/PID/cmdline`` turns empty as soon as the address space is dropped, but the listening
    sockets close only when the last thread has released the file table; a thread leaves
    ``/proc/PID/task`` after that. Restarting earlier finds the TCP ports still held.
    """
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X") and len(tasks) <= 1


def start_component(name: str, *, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    """``scripts/stack.sh up --timeout S NAME``: (re)start one component, wait until ready.

    Never raises on its exit status (stderr carries the log tail on failure).
    """
    return stack("up", "--timeout", str(int(timeout)), name, check=False, timeout=timeout + 30)


def agent_state_files(kind: str = "endpoints") -> list[pathlib.Path]:
    """Files under the stack agent's ``--state-dir``/``kind`` (``[]`` when absent)."""
    directory = AGENT_STATE_DIR / kind
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_file())


def del_queue_files(directory: pathlib.Path = DEL_QUEUE_DIR) -> list[pathlib.Path]:
    """Queued DEL files waiting for the agent's replay (``[]`` when none or no directory)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))


def bpf_map_dump(name: str, pin_dir: pathlib.Path = BPF_PIN_DIR) -> list[tuple[bytes, bytes]]:
    """Raw ``(key, value)`` bytes of the map pinned at ``pin_dir/name``, read with bpftool.

    Independent of the agent's own map code (Debian's ``bpftool``, root needed).

    Raises:
        FileNotFoundError: bpftool is not installed (``apt-get install bpftool``;
            scripts/setup.sh installs it) or the pin does not exist.
        subprocess.CalledProcessError: bpftool failed.
    """
    if shutil.which("bpftool") is None:
        raise FileNotFoundError("bpftool not on PATH: apt-get install bpftool (scripts/setup.sh)")
    pin = pin_dir / name
    if not pin.exists():
        raise FileNotFoundError(f"no pinned map {pin}")
    out = sh("bpftool", "-j", "map", "dump", "pinned", str(pin))
    entries = json.loads(out.stdout or "[]")

    def raw(hexes: Sequence[str]) -> bytes:
        return bytes(int(h, 16) for h in hexes)

    return [(raw(e["key"]), raw(e["value"])) for e in entries if "key" in e and "value" in e]


def bpf_endpoints(pin_dir: pathlib.Path = BPF_PIN_DIR) -> dict[int, dict[str, Any]]:
    """The datapath's endpoint map: host veth ifindex → ``{ep_id, identity, ipv4}``.

    Layout ``struct endpoint_info`` (bpf/lib/common.h): u32 ep_id, u32 sec_identity,
    be32 ipv4, u8 enforce_ingress, u8 enforce_egress; key u32 ifindex (host order).
    """
    out: dict[int, dict[str, Any]] = {}
    for key, value in bpf_map_dump("cilia_endpoints", pin_dir):
        out[int.from_bytes(key[:4], "little")] = {
            "ep_id": int.from_bytes(value[0:4], "little"),
            "identity": int.from_bytes(value[4:8], "little"),
            "ipv4": ".".join(str(b) for b in value[8:12]),
        }
    return out


def bpf_ipcache(pin_dir: pathlib.Path = BPF_PIN_DIR) -> dict[str, int]:
    """The datapath's ipcache: ``"a.b.c.d/len"`` → security identity.

    Layout ``struct ipcache_key`` u32 prefixlen (host order), be32 ip;
    ``struct ipcache_value`` u32 sec_identity, be32 node_ip.
    """
    out: dict[str, int] = {}
    for key, value in bpf_map_dump("cilia_ipcache", pin_dir):
        prefixlen = int.from_bytes(key[:4], "little")
        out[f"{'.'.join(str(b) for b in key[4:8])}/{prefixlen}"] = int.from_bytes(
            value[:4], "little"
        )
    return out


def link_ifindex(name: str) -> int:
    """ifindex of host interface ``name``, 0 when it does not exist."""
    try:
        return int((pathlib.Path("/sys/class/net") / name / "ifindex").read_text())
    except (OSError, ValueError):
        return 0


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
    "ListOutcome",
    "Pod",
    "agent_cli",
    "agent_state_files",
    "bpf_endpoints",
    "bpf_ipcache",
    "bpf_map_dump",
    "cni_args",
    "component_pid",
    "create_netns",
    "del_queue_files",
    "delete_netns",
    "exec_list",
    "find_plugin",
    "host_lxc_links",
    "host_veth_name",
    "invoke",
    "iptables_forward_policy",
    "kill_component",
    "link_ifindex",
    "list_netconf",
    "load_conflist",
    "netns_links",
    "operator_cli",
    "ping",
    "plugin_netconf",
    "stack",
    "start_component",
    "wait_for",
]
