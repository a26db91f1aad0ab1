"""libcni emulation: exec a CNI plugin exactly as a container runtime does; pods; conflists.

The ONE emulation shared by ``tests/e2e``, ``tests/contract``, ``bench/`` and the demo, so the
exec contract is written once.

What libcni does for each plugin of a conflist, and what :func:`plugin_netconf` and
:func:`invoke` reproduce (CNI spec 1.0.0, anchors.md §2; libcni ``pkg/invoke``):

- stdin is the plugin's own object from ``plugins[]`` with the list's ``name`` and
  ``cniVersion`` injected, plus ``args`` (here ``args.cni.labels``, the CNI conventions'
  list of ``{"key", "value"}``) and, for DEL, ``prevResult`` = the cached ADD result;
- the environment is the caller's plus ``CNI_COMMAND``, ``CNI_CONTAINERID``, ``CNI_NETNS``,
  ``CNI_IFNAME``, ``CNI_ARGS`` (``IgnoreUnknown=1;K8S_POD_NAMESPACE=…;K8S_POD_NAME=…;
  K8S_POD_INFRA_CONTAINER_ID=…`` as containerd/CRI-O send it) and ``CNI_PATH``;
- the result (or the error JSON) is read from stdout; the exit status says which.

Chained conflists (several plugins) run as libcni's ``AddNetworkList``/``DelNetworkList``:
:func:`exec_list`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cilia_testkit import VENV_BIN
from cilia_testkit.host import host_veth_name
from cilia_testkit.netns import create_netns, delete_netns, netns_path

#: The project's plugin binary (``scripts/setup.sh`` installs it in ``.venv``).
CILIA_CNI = VENV_BIN / "cilia-cni"
#: Debian's reference plugins (containernetworking-plugins), for chaining tests and benches.
DEBIAN_CNI_DIR = pathlib.Path("/usr/lib/cni")
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


def load_conflist(path: pathlib.Path) -> dict[str, Any]:
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


__all__ = [
    "CILIA_CNI",
    "DEBIAN_CNI_DIR",
    "CniOutcome",
    "CniRunError",
    "ListOutcome",
    "Pod",
    "cni_args",
    "exec_list",
    "find_plugin",
    "invoke",
    "list_netconf",
    "load_conflist",
    "plugin_netconf",
]


# -- exec with exactly a given environment (the CNI plugin's own conformance suites) ---------

#: Upper bound for one plugin exec in tests (the plugin's own timeouts are smaller).
EXEC_TIMEOUT_SECONDS = 60
#: Spec error codes plus this plugin's documented ones.
DOCUMENTED_CODES = {1, 3, 4, 5, 6, 7, 8, 11, 50, 100, 101, 102, 999}


def cni_binary() -> str:
    """The installed ``cilia-cni`` console script next to this interpreter (else on PATH);
    ``CILIA_CNI_BINARY`` names another executable instead (e.g. the frozen build as
    ``cilia-cni-install`` installs it, to run the contract suites against it)."""
    override = os.environ.get("CILIA_CNI_BINARY")
    if override:
        assert os.access(override, os.X_OK), f"CILIA_CNI_BINARY={override} is not executable"
        return override
    found = shutil.which("cilia-cni", path=os.path.dirname(sys.executable))
    if found is None:
        found = shutil.which("cilia-cni")
    assert found, "cilia-cni is not installed; run scripts/setup.sh"
    return found


@dataclass
class CniRun:
    """Outcome of one exec: exit status, stdout, stderr and stdout parsed as JSON."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def json(self) -> Any:
        return json.loads(self.stdout)


def exec_cni(
    env: dict[str, str],
    stdin: bytes | str | dict[str, Any] = b"",
    timeout: float = EXEC_TIMEOUT_SECONDS,
) -> CniRun:
    """Exec the real binary with exactly ``env`` (plus PATH) and ``stdin``."""
    if isinstance(stdin, dict):
        stdin = json.dumps(stdin)
    if isinstance(stdin, str):
        stdin = stdin.encode()
    full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
    proc = subprocess.run(
        [cni_binary()], input=stdin, env=full_env, capture_output=True, timeout=timeout, check=False
    )
    run = CniRun(proc.returncode, proc.stdout.decode(), proc.stderr.decode("utf-8", "replace"))
    assert "Traceback" not in run.stdout + run.stderr, run
    return run


def assert_cni_error(run: CniRun, code: int, *needles: str) -> dict[str, Any]:
    """Assert ``run`` is a spec error with ``code`` whose msg contains every needle."""
    assert run.returncode != 0, run
    err = run.json
    assert set(err) == {"cniVersion", "code", "msg", "details"}, err
    assert err["code"] == code, err
    assert isinstance(err["msg"], str) and err["msg"], err
    assert isinstance(err["details"], str), err
    for needle in needles:
        assert needle in err["msg"], (needle, err)
    return err  # type: ignore[no-any-return]
