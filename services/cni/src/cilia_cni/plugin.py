"""One plugin run: environment + stdin in, result or error JSON out, exit status back.

Order of checks (first failure wins): CNI_COMMAND (4), stdin readable (5) and at most
:data:`MAX_STDIN_BYTES` (6), VERSION is
answered here; then the other CNI_* variables (4), stdin JSON (6), ``cniVersion`` (1,
also when the command is newer than the version: CHECK < 0.4.0, GC/STATUS < 1.1.0), the
plugin's netconf keys (7), CNI_ARGS, labels, annotations and prevResult (4/7), the agent
socket (11; 50 for STATUS; DEL queues itself on disk), the agent's answer (see
:mod:`cilia_cni.agent`). The agent client (HTTP/2, :mod:`cilia_cni.wire` messages) is
imported only for that last step.
"""

from __future__ import annotations

import os
import stat
import sys
import time

from cilia_cni import jsonio, netconf
from cilia_cni.errors import (
    AgentTimeout,
    AgentUnavailable,
    AgentUnreachable,
    CheckMismatch,
    CniError,
    DecodingFailure,
    IncompatibleVersion,
    InternalError,
    InvalidNetworkConfig,
    IOFailure,
    PluginNotAvailable,
)
from cilia_cni.invocation import (
    Invocation,
    parse_cni_args,
    parse_command,
    parse_invocation,
    show,
)
from cilia_cni.log import EventLog

# typing is not imported at run time (start-up cost); mypy honours this constant.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from cilia_cni.agent import AgentClient


#: Largest network configuration read from stdin, bytes (16 MiB). A netconf is a few KiB;
#: GC's keep-list for 10,000 pods is ~0.8 MiB. More is refused with code 6 before decoding
#: (``cilia-cni < /dev/zero`` must not grow without bound). The stdin reader of
#: ``__main__`` reads at most one byte more than this.
MAX_STDIN_BYTES = 16 * 1024 * 1024


def run(
    env: Mapping[str, str], read_stdin: Callable[[], bytes], plugin_type: str
) -> tuple[int, str]:
    """Execute one CNI invocation.

    Args:
        env: the process environment (CNI_* variables).
        read_stdin: returns stdin, at most ``MAX_STDIN_BYTES + 1`` bytes of it (called at
            most once, after CNI_COMMAND is known); more than :data:`MAX_STDIN_BYTES` is
            code 6.
        plugin_type: the name this binary was exec'd as (accepted as netconf ``type``).

    Returns:
        ``(exit status, stdout text)``: ``0`` with the result JSON (ADD), the version
        JSON (VERSION) or ``""`` (DEL, CHECK, GC, STATUS); ``1`` with the spec error JSON
        ``{"cniVersion", "code", "msg", "details"}``. Never raises for any input.
    """
    conf: dict[str, object] | None = None
    log: EventLog | None = None
    started = time.monotonic()
    _TIMINGS.clear()
    try:
        command = parse_command(env)
        try:
            raw = read_stdin()
        except (OSError, ValueError) as exc:
            raise IOFailure(f"cannot read the network configuration from stdin: {exc}") from None
        if len(raw) > MAX_STDIN_BYTES:
            raise DecodingFailure(
                f"network configuration on stdin is larger than {MAX_STDIN_BYTES} bytes "
                f"(cilia-cni's MAX_STDIN_BYTES, {MAX_STDIN_BYTES // 1024 // 1024} MiB): "
                "not read further"
            )
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
        _check_command_version(command, conf_version)
        config = netconf.parse(conf, conf_version, plugin_type)
        log = EventLog(config.log_file, command, invocation.container_id, invocation.ifname)
        log.write("info", f"{command} started", netns=invocation.netns, cniVersion=conf_version)
        out = _COMMANDS[command](invocation, conf, config, log)
        log.write(
            "info",
            f"{command} succeeded",
            durationMs=_ms(started),
            **_TIMINGS,
            result=out or None,
        )
        return 0, out
    except CniError as exc:
        return 1, _error(exc, conf, log, started)
    except BaseException as exc:  # the boundary: never a traceback
        err = InternalError(f"cilia-cni internal error: {type(exc).__name__}: {exc}")
        return 1, _error(err, conf, log, started)


def _version_reply(conf: Mapping[str, object]) -> dict[str, object]:
    """VERSION never fails on the version (as libcni's skel): a runtime speaking a version
    we do not must still learn which ones we do. The reply is in the requested version
    when we speak it, else in the newest."""
    version = conf.get("cniVersion")
    if not isinstance(version, str) or version not in netconf.SUPPORTED_VERSIONS:
        version = netconf.NEWEST_VERSION
    return {"cniVersion": version, "supportedVersions": list(netconf.SUPPORTED_VERSIONS)}


def _check_command_version(command: str, version: str) -> None:
    """CHECK exists from spec 0.4.0, GC and STATUS from 1.1.0 (skel refuses with code 1)."""
    since = {"CHECK": netconf.CHECK_SINCE, "GC": netconf.GC_STATUS_SINCE}.get(command)
    if command == "STATUS":
        since = netconf.GC_STATUS_SINCE
    if since is not None and not netconf.version_at_least(version, since):
        raise IncompatibleVersion(
            f"cniVersion {version!r} does not allow {command} (needs {since} or newer): "
            f"set `cniVersion` of the network config list to {since} or newer"
        )


def _add(
    invocation: Invocation, conf: Mapping[str, object], config: netconf.NetConf, log: EventLog
) -> str:
    prev = netconf.parse_prev_result(conf, "ADD")
    cni_args = parse_cni_args(invocation.cni_args)
    labels = netconf.parse_labels(conf)
    annotations = netconf.parse_annotations(conf)
    _check_socket(config.agent_socket, "ADD")
    from cilia_cni import result, wire

    request = wire.AddRequest(
        container_id=invocation.container_id,
        ifname=invocation.ifname,
        netns=invocation.netns,
        labels=labels,
        annotations=annotations,
        pod_namespace=cni_args.get("K8S_POD_NAMESPACE", ""),
        pod_name=cni_args.get("K8S_POD_NAME", ""),
        mtu=config.mtu,
        prev_result=jsonio.dumps(prev) if prev is not None else "",
    )
    with _client(config) as client:
        try:
            response = client.add(request, config.add_timeout)
            _TIMINGS["agentMs"] = round(client.call_ms, 1)
        except AgentTimeout as exc:
            # The agent may still finish the ADD after our deadline: undo it.
            _rollback(client, invocation, config, exc)
            raise
        try:
            if prev is not None:
                # Chained after another plugin: pass its result on (spec "Chaining"),
                # adding any interface the agent reports that it does not name.
                out = result.convert(config.cni_version, prev)
                known = {i.get("name") for i in out["interfaces"]}  # type: ignore[attr-defined]
                if response.interfaces:
                    built = result.build(config.cni_version, response)["interfaces"]
                    for itf in built:  # type: ignore[attr-defined]
                        if itf["name"] not in known:
                            out["interfaces"].append(itf)  # type: ignore[attr-defined]
                return _dump(out)
            return _dump(result.build(config.cni_version, response))
        except CniError as exc:
            _rollback(client, invocation, config, exc)
            raise


def _rollback(
    client: AgentClient, invocation: Invocation, config: netconf.NetConf, exc: CniError
) -> None:
    """Best-effort Del after an ADD that failed on our side; the outcome goes to details."""
    from cilia_cni import wire

    request = wire.DelRequest(
        container_id=invocation.container_id, ifname=invocation.ifname, netns=invocation.netns
    )
    try:
        client.delete(request, config.del_timeout)
        outcome = "rolled back with Del"
    except CniError as del_exc:
        outcome = f"rollback Del failed too ({del_exc.msg}); the runtime's DEL will retry it"
    exc.details = f"{exc.details}; {outcome}" if exc.details else outcome


def _del(
    invocation: Invocation, conf: Mapping[str, object], config: netconf.NetConf, log: EventLog
) -> str:
    """DEL ignores CNI_ARGS, labels and prevResult so that cleanup never fails on them.

    With the agent unreachable (socket absent, not a socket, refusing) the DEL is queued
    on disk for the agent to replay at start, and succeeds.
    """
    from cilia_cni import wire

    request = wire.DelRequest(
        container_id=invocation.container_id, ifname=invocation.ifname, netns=invocation.netns
    )
    try:
        _check_socket(config.agent_socket, "DEL")
        with _client(config) as client:
            client.delete(request, config.del_timeout)
            _TIMINGS["agentMs"] = round(client.call_ms, 1)
    except AgentUnreachable as exc:
        from cilia_cni import delqueue

        path = delqueue.enqueue(config.del_queue_dir, config.del_queue_max, request, exc.msg)
        log.write("warning", "agent unreachable, DEL queued for the agent to replay", file=path)
    return ""


def _check(
    invocation: Invocation, conf: Mapping[str, object], config: netconf.NetConf, log: EventLog
) -> str:
    """CHECK: the agent compares the netns and its endpoint with prevResult.

    Refused here with code 102 (:class:`CheckMismatch`), before asking the agent: the
    ``sandbox`` of prevResult's interface is not CNI_NETNS; prevResult.ips holds no address
    for that interface (the agent then checks the one it assigned is listed).
    """
    prev = netconf.parse_prev_result(conf, "CHECK")
    if prev is None:
        raise InvalidNetworkConfig(
            "network config field `prevResult` is missing: CHECK needs the cached ADD result "
            "(the runtime passes it)"
        )
    interfaces = prev.get("interfaces") or []
    assert isinstance(interfaces, list)
    index = next(
        (
            i
            for i, itf in enumerate(interfaces)
            if itf.get("name") == invocation.ifname and itf.get("sandbox")
        ),
        None,
    )
    if index is None:
        index = next(
            (i for i, itf in enumerate(interfaces) if itf.get("name") == invocation.ifname), None
        )
    if index is None:
        raise InvalidNetworkConfig(
            f"network config field `prevResult.interfaces` has no interface named "
            f"{invocation.ifname!r} (CNI_IFNAME): it is not this attachment's result"
        )
    sandbox = str(interfaces[index].get("sandbox") or "")
    if sandbox and not _same_netns(sandbox, invocation.netns):
        raise CheckMismatch(
            f"prevResult.interfaces[{index}].sandbox {show(sandbox)} is not CNI_NETNS "
            f"{show(invocation.netns)}: the cached result is another sandbox's; "
            "the runtime should DEL and ADD the container again"
        )
    ips = prev.get("ips") or []
    routes = prev.get("routes") or []
    assert isinstance(ips, list) and isinstance(routes, list)
    addresses = [ip["address"] for ip in ips if ip.get("interface", index) == index]
    if not addresses:
        raise CheckMismatch(
            f"prevResult.ips has no address for interface {invocation.ifname!r} "
            f"(prevResult.interfaces[{index}]): the container's address is not what the "
            "runtime cached; the runtime should DEL and ADD the container again"
        )
    _check_socket(config.agent_socket, "CHECK")
    from cilia_cni import wire

    request = wire.CheckRequest(
        container_id=invocation.container_id,
        ifname=invocation.ifname,
        netns=invocation.netns,
        addresses=addresses,
        routes=[wire.Route(dst=r["dst"], gw=r.get("gw", "")) for r in routes],
        mac=str(interfaces[index].get("mac", "")),
    )
    with _client(config) as client:
        client.check(request, config.add_timeout)
    return ""


def _same_netns(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name the same netns (equal, or the same inode)."""
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def _gc(
    invocation: Invocation, conf: Mapping[str, object], config: netconf.NetConf, log: EventLog
) -> str:
    """GC: the agent releases every attachment not in ``cni.dev/valid-attachments``
    (or ``cni.dev/attachments``); neither key present is code 7, nothing released."""
    valid = netconf.parse_attachments(conf)
    _check_socket(config.agent_socket, "GC")
    from cilia_cni import wire

    request = wire.GCRequest(
        valid_attachments=[
            wire.Attachment(container_id=cid, ifname=ifname) for cid, ifname in valid
        ]
    )
    with _client(config) as client:
        response = client.gc(request, config.add_timeout)
    log.write(
        "info",
        "GC released attachments",
        released=[f"{a.container_id}/{a.ifname}" for a in response.released],
    )
    return ""


def _status(
    invocation: Invocation, conf: Mapping[str, object], config: netconf.NetConf, log: EventLog
) -> str:
    """STATUS: 0 when the agent is ready and some pool has a free address, else 50."""
    try:
        _check_socket(config.agent_socket, "STATUS")
        with _client(config) as client:
            status = client.status(config.add_timeout)
    except AgentUnavailable as exc:
        raise PluginNotAvailable(exc.msg, exc.details) from None
    if not status.ready:
        raise PluginNotAvailable(
            f"cilia-agent is not ready: {status.message or 'no reason given'}; wait for it or "
            f"check it (cilia-agent status --socket {config.agent_socket})"
        )
    free = sum(max(0, p.capacity - p.used) for p in status.pools)
    if free == 0:
        pools = ", ".join(f"{p.pool} {p.used}/{p.capacity}" for p in status.pools) or "none"
        raise PluginNotAvailable(
            f"cilia-agent has no free pod address (pools used/capacity: {pools}): new pods "
            "cannot be added until addresses are released or the node gets more CIDRs"
        )
    return ""


_COMMANDS = {"ADD": _add, "DEL": _del, "CHECK": _check, "GC": _gc, "STATUS": _status}


#: Where one run's time went (milliseconds), added to the log line of the outcome:
#: ``clientImportMs`` (the agent client: hpack, hyperframe, cilia_cni.wire),
#: ``agentMs`` (the agent calls).
_TIMINGS: dict[str, float] = {}


def _load_client() -> None:
    """Import the agent client and the generated messages, timed once."""
    if "cilia_cni.agent" in sys.modules:
        return
    started = time.monotonic()
    import cilia_cni.agent  # noqa: F401 - imported for its side effect (h2grpc, wire)

    _TIMINGS["clientImportMs"] = _ms(started)


def _client(config: netconf.NetConf) -> AgentClient:
    from cilia_cni.agent import AgentClient

    return AgentClient(config.agent_socket, config.max_response_bytes)


def _check_socket(path: str, op: str) -> None:
    """Fail fast (before importing the agent client) when the agent's socket is absent."""
    hint = "start or check cilia-agent (cilia-agent status --socket " + path + ")"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise AgentUnreachable(
            f"cilia-agent socket {path} does not exist, cannot {op}: {hint}; the netconf "
            "field `agent-socket` names it"
        ) from None
    except OSError as exc:
        raise AgentUnreachable(
            f"cilia-agent socket {path} is not accessible ({exc.strerror}): {hint}"
        ) from None
    if not stat.S_ISSOCK(mode):
        raise AgentUnreachable(
            f"cilia-agent socket {path} is not a unix socket, cannot {op}: {hint}"
        )
    _load_client()


def _error(
    exc: CniError, conf: Mapping[str, object] | None, log: EventLog | None, started: float
) -> str:
    if log is not None:
        log.write(
            "error",
            exc.msg,
            code=exc.code,
            details=exc.details,
            durationMs=_ms(started),
            **_TIMINGS,
        )
    return _dump(
        {
            "cniVersion": netconf.error_version(conf),
            "code": exc.code,
            "msg": exc.msg,
            "details": exc.details,
        }
    )


def _dump(obj: Mapping[str, object]) -> str:
    return jsonio.dumps(obj) + "\n"


def _ms(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 1)
