"""One plugin run: environment + stdin in, result or error JSON out, exit status back.

Order of checks (first failure wins): CNI_COMMAND (4), stdin readable (5), VERSION is
answered here; then the other CNI_* variables (4), stdin JSON (6), ``cniVersion`` (1),
the plugin's netconf keys (7), CNI_ARGS and labels for ADD (4/7), the agent socket (11),
the agent's answer (see :mod:`cilia_cni.agent`). grpc is imported only for that last step.

DEL with the agent down returns 11 for now; the on-disk DEL queue replayed by the agent
is a later issue.
"""

from __future__ import annotations

import json
import os
import stat
import time

from cilia_cni import netconf
from cilia_cni.errors import (
    AgentTimeout,
    AgentUnavailable,
    CniError,
    InternalError,
    InvalidNetworkConfig,
    IOFailure,
)
from cilia_cni.invocation import Invocation, parse_cni_args, parse_command, parse_invocation
from cilia_cni.log import EventLog

# typing is not imported at run time (start-up cost); mypy honours this constant.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from cilia_cni.agent import AgentClient


def run(
    env: Mapping[str, str], read_stdin: Callable[[], bytes], plugin_type: str
) -> tuple[int, str]:
    """Execute one CNI invocation.

    Args:
        env: the process environment (CNI_* variables).
        read_stdin: returns all of stdin (called at most once, after CNI_COMMAND is known).
        plugin_type: the name this binary was exec'd as (accepted as netconf ``type``).

    Returns:
        ``(exit status, stdout text)``: ``0`` with the result JSON (ADD), the version
        JSON (VERSION) or ``""`` (DEL); ``1`` with the spec error JSON
        ``{"cniVersion", "code", "msg", "details"}``. Never raises for any input.
    """
    conf: dict[str, object] | None = None
    log: EventLog | None = None
    started = time.monotonic()
    try:
        command = parse_command(env)
        try:
            raw = read_stdin()
        except (OSError, ValueError) as exc:
            raise IOFailure(f"cannot read the network configuration from stdin: {exc}") from None
        decode_error: CniError | None = None
        try:
            conf = netconf.decode(raw) if (raw.strip() or command != "VERSION") else {}
        except CniError as exc:
            decode_error = exc
        if command == "VERSION":
            if decode_error is not None:
                raise decode_error
            assert conf is not None
            return 0, _dump(_version_reply(conf))
        invocation = parse_invocation(env, command)
        if decode_error is not None:
            raise decode_error
        assert conf is not None
        conf_version = netconf.check_version(conf)
        config = netconf.parse(conf, conf_version, plugin_type)
        log = EventLog(config.log_file, command, invocation.container_id, invocation.ifname)
        log.write("info", f"{command} started", netns=invocation.netns, cniVersion=conf_version)
        out = _add(invocation, conf, config) if command == "ADD" else _del(invocation, config)
        log.write("info", f"{command} succeeded", durationMs=_ms(started), result=out or None)
        return 0, out
    except CniError as exc:
        return 1, _error(exc, conf, log, started)
    except BaseException as exc:  # the boundary: never a traceback
        err = InternalError(f"cilia-cni internal error: {type(exc).__name__}: {exc}")
        return 1, _error(err, conf, log, started)


def _version_reply(conf: Mapping[str, object]) -> dict[str, object]:
    version = netconf.check_version(conf, required=False)
    return {"cniVersion": version, "supportedVersions": list(netconf.SUPPORTED_VERSIONS)}


def _add(invocation: Invocation, conf: Mapping[str, object], config: netconf.NetConf) -> str:
    if conf.get("prevResult") is not None:
        raise InvalidNetworkConfig(
            "network config field `prevResult` is set: cilia-cni must be the first plugin of "
            "the list (chaining after another plugin is not supported)"
        )
    cni_args = parse_cni_args(invocation.cni_args)
    labels = netconf.parse_labels(conf)
    _check_socket(config.agent_socket, "ADD")
    from cilia.agent.v1 import agent_pb2
    from cilia_cni import result

    request = agent_pb2.AddRequest(
        container_id=invocation.container_id,
        ifname=invocation.ifname,
        netns=invocation.netns,
        labels=labels,
        pod_namespace=cni_args.get("K8S_POD_NAMESPACE", ""),
        pod_name=cni_args.get("K8S_POD_NAME", ""),
        mtu=config.mtu,
    )
    with _client(config.agent_socket) as client:
        try:
            response = client.add(request, config.add_timeout)
        except AgentTimeout as exc:
            # The agent may still finish the ADD after our deadline: undo it.
            _rollback(client, invocation, config, exc)
            raise
        try:
            return _dump(result.build(config.cni_version, response))
        except CniError as exc:
            _rollback(client, invocation, config, exc)
            raise


def _rollback(
    client: AgentClient, invocation: Invocation, config: netconf.NetConf, exc: CniError
) -> None:
    """Best-effort Del after an ADD that failed on our side; the outcome goes to details."""
    from cilia.agent.v1 import agent_pb2

    request = agent_pb2.DelRequest(
        container_id=invocation.container_id, ifname=invocation.ifname, netns=invocation.netns
    )
    try:
        client.delete(request, config.del_timeout)
        outcome = "rolled back with Del"
    except CniError as del_exc:
        outcome = f"rollback Del failed too ({del_exc.msg}); the runtime's DEL will retry it"
    exc.details = f"{exc.details}; {outcome}" if exc.details else outcome


def _del(invocation: Invocation, config: netconf.NetConf) -> str:
    _check_socket(config.agent_socket, "DEL")
    from cilia.agent.v1 import agent_pb2

    request = agent_pb2.DelRequest(
        container_id=invocation.container_id, ifname=invocation.ifname, netns=invocation.netns
    )
    with _client(config.agent_socket) as client:
        client.delete(request, config.del_timeout)
    return ""


def _client(socket_path: str) -> AgentClient:
    from cilia_cni.agent import AgentClient

    return AgentClient(socket_path)


def _check_socket(path: str, op: str) -> None:
    """Fail fast (without importing grpc) when the agent's socket is absent."""
    hint = "start or check cilia-agent (cilia-agent status --socket " + path + ")"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise AgentUnavailable(
            f"cilia-agent socket {path} does not exist, cannot {op}: {hint}; the netconf "
            "field `agent-socket` names it"
        ) from None
    except OSError as exc:
        raise AgentUnavailable(
            f"cilia-agent socket {path} is not accessible ({exc.strerror}): {hint}"
        ) from None
    if not stat.S_ISSOCK(mode):
        raise AgentUnavailable(
            f"cilia-agent socket {path} is not a unix socket, cannot {op}: {hint}"
        )


def _error(
    exc: CniError, conf: Mapping[str, object] | None, log: EventLog | None, started: float
) -> str:
    if log is not None:
        log.write("error", exc.msg, code=exc.code, details=exc.details, durationMs=_ms(started))
    return _dump(
        {
            "cniVersion": netconf.error_version(conf),
            "code": exc.code,
            "msg": exc.msg,
            "details": exc.details,
        }
    )


def _dump(obj: Mapping[str, object]) -> str:
    return json.dumps(obj) + "\n"


def _ms(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 1)
