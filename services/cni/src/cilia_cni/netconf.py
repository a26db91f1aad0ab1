"""The network configuration on stdin (CNI spec 1.0.0/1.1.0, "Network configuration").

The runtime passes one plugin's config with ``cniVersion`` and ``name`` injected (plus
``runtimeConfig``, ``args``, ``prevResult``). Keys of this plugin are documented in
services/cni/README.md. Only the standard library is imported here.
"""

from __future__ import annotations

import math

from cilia_cni import jsonio
from cilia_cni.errors import DecodingFailure, IncompatibleVersion, InvalidNetworkConfig
from cilia_cni.invocation import is_name, show

# typing is not imported at run time (start-up cost); mypy honours this constant.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

#: CNI spec versions this plugin speaks; results are printed in the netconf's version.
#: 0.1.0/0.2.0 (single ``ip4`` result, no interfaces) are not spoken.
SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
#: First version with CHECK (spec 0.4.0) and with GC/STATUS (spec 1.1.0).
CHECK_SINCE = "0.4.0"
GC_STATUS_SINCE = "1.1.0"
#: Version used for error JSON when the input names none we speak, and for a bare VERSION.
NEWEST_VERSION = SUPPORTED_VERSIONS[-1]
#: The plugin's ``type`` (the binary name the runtime looks up in CNI_PATH).
PLUGIN_TYPE = "cilia-cni"
DEFAULT_AGENT_SOCKET = "/var/run/cilia/cilia.sock"
#: Seconds an ADD may wait for the agent (IP allocation + veth + endpoint creation).
DEFAULT_ADD_TIMEOUT_SECONDS = 30.0
#: Seconds a DEL may wait for the agent (upstream cilium-cni uses 10 s).
DEFAULT_DEL_TIMEOUT_SECONDS = 10.0
#: Upper bound for both timeouts (kubelet's RunPodSandbox CRI timeout is 4 min).
MAX_TIMEOUT_SECONDS = 240.0
#: Linux sun_path is 108 bytes including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
#: Directory of the on-disk DEL queue (files in ``QueuedDel`` form, replayed by the agent).
DEFAULT_DEL_QUEUE_DIR = "/var/run/cilia/del-queue"
#: Queued DELs at most; a DEL finding the queue full fails with code 11.
DEFAULT_DEL_QUEUE_MAX = 256
#: Upper bound of ``del-queue-max`` (each entry is one small file).
MAX_DEL_QUEUE_MAX = 65536
#: Largest agent response message accepted, bytes (grpcio's default receive limit).
DEFAULT_MAX_RESPONSE_BYTES = 4 * 1024 * 1024
#: Bounds of ``agent-max-response-bytes``.
MAX_RESPONSE_BYTES_RANGE = (1024, 256 * 1024 * 1024)
#: containerd's capability carrying the pod's annotations in ``runtimeConfig``.
POD_ANNOTATIONS_CAPABILITY = "io.kubernetes.cri.pod-annotations"


class NetConf:
    """The validated plugin configuration.

    Attributes:
        cni_version: one of :data:`SUPPORTED_VERSIONS`.
        name: network name (spec rule ``[a-zA-Z0-9][a-zA-Z0-9_.-]*``).
        agent_socket: absolute path of the agent's unix socket (``agent-socket``).
        add_timeout: seconds, ``agent-timeout-seconds`` (default 30, max 240).
        del_timeout: seconds, ``agent-del-timeout-seconds`` (default 10, max 240).
        log_file: absolute path for JSON-line logs (``log-file``), ``""`` = no log.
        mtu: MTU for both veth ends, ``0`` = the agent's ``--mtu`` (``mtu``).
        del_queue_dir: absolute directory of the DEL queue (``del-queue-dir``).
        del_queue_max: most queued DELs, 1..65536 (``del-queue-max``, default 256).
        max_response_bytes: largest agent response message accepted, 1 KiB..256 MiB
            (``agent-max-response-bytes``, default 4 MiB).
    """

    __slots__ = (
        "add_timeout",
        "agent_socket",
        "cni_version",
        "del_queue_dir",
        "del_queue_max",
        "del_timeout",
        "log_file",
        "max_response_bytes",
        "mtu",
        "name",
    )

    def __init__(
        self,
        cni_version: str,
        name: str,
        agent_socket: str = DEFAULT_AGENT_SOCKET,
        add_timeout: float = DEFAULT_ADD_TIMEOUT_SECONDS,
        del_timeout: float = DEFAULT_DEL_TIMEOUT_SECONDS,
        log_file: str = "",
        mtu: int = 0,
        del_queue_dir: str = DEFAULT_DEL_QUEUE_DIR,
        del_queue_max: int = DEFAULT_DEL_QUEUE_MAX,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        self.cni_version = cni_version
        self.name = name
        self.agent_socket = agent_socket
        self.add_timeout = add_timeout
        self.del_timeout = del_timeout
        self.log_file = log_file
        self.mtu = mtu
        self.del_queue_dir = del_queue_dir
        self.del_queue_max = del_queue_max
        self.max_response_bytes = max_response_bytes


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def decode(data: bytes) -> dict[str, object]:
    """Decode stdin into a JSON object.

    Raises:
        DecodingFailure: not UTF-8, not JSON (NaN/Infinity included), too deeply nested,
            not an object, or a string or key holding a lone surrogate escape
            (``"\\ud800"``, the field named): every string of the result is valid Unicode.
    """
    try:
        text = data.decode("utf-8")
        obj = jsonio.loads(text, _reject_constant)
    except UnicodeDecodeError as exc:
        raise DecodingFailure(f"network configuration on stdin is not UTF-8: {exc}") from None
    except ValueError as exc:
        raise DecodingFailure(f"network configuration on stdin is not valid JSON: {exc}") from None
    except RecursionError:
        raise DecodingFailure("network configuration on stdin is nested too deeply") from None
    if not isinstance(obj, dict):
        raise DecodingFailure(
            f"network configuration on stdin must be a JSON object, got {type(obj).__name__}"
        )
    if _has_surrogate_escape(text):
        _reject_surrogates(obj, "")
    return obj


def _has_surrogate_escape(text: str) -> bool:
    """Whether ``text`` holds a JSON escape of a UTF-16 surrogate (``\\u`` then ``d``/``D``
    then ``8``-``f``); UTF-8 input itself cannot encode one (decode rejects it), so a
    string holding a lone surrogate always comes from such an escape. (String methods, not
    ``re``: the regex module's import costs more than the whole check, see jsonio.)"""
    at = text.find("\\u")
    while at >= 0:
        if text[at + 2 : at + 3] in ("d", "D") and text[at + 3 : at + 4] in _SURROGATE_HIGH:
            return True
        at = text.find("\\u", at + 2)
    return False


_SURROGATE_HIGH = frozenset("89abcdefABCDEF")


def _has_surrogate(value: str) -> bool:
    """Whether ``value`` holds a lone surrogate (U+D800-U+DFFF; a valid pair was joined by
    the JSON decoder already): strict UTF-8 encodes every code point but those."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _reject_surrogates(value: object, where: str) -> None:
    """Refuse any key or string holding a lone surrogate (``"\\ud800"``): it is not
    Unicode, and every later UTF-8 encode (protobuf, the log, paths) would fail on it.

    Raises:
        DecodingFailure: naming the field (``args.cni.labels[0].key``) or the key.
    """
    if isinstance(value, str):
        if _has_surrogate(value):
            raise DecodingFailure(
                f"network config field `{where}` is not valid Unicode: it holds a lone "
                "UTF-16 surrogate escape (\\ud800-\\udfff without its pair)"
            )
    elif isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else key
            if _has_surrogate(key):
                shown = key.encode("utf-8", "backslashreplace").decode("ascii", "replace")
                raise DecodingFailure(
                    f"network config key {shown!r} under `{where or '(top level)'}` is not "
                    "valid Unicode: it holds a lone UTF-16 surrogate escape "
                    "(\\ud800-\\udfff without its pair)"
                )
            _reject_surrogates(item, path)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _reject_surrogates(item, f"{where}[{i}]")


def error_version(conf: Mapping[str, object] | None) -> str:
    """The ``cniVersion`` to put in an error: the netconf's when supported, else the newest."""
    if conf is not None:
        version = conf.get("cniVersion")
        if isinstance(version, str) and version in SUPPORTED_VERSIONS:
            return version
    return NEWEST_VERSION


def check_version(conf: Mapping[str, object], *, required: bool = True) -> str:
    """Return the netconf's ``cniVersion`` if this plugin speaks it.

    With ``required=False`` (VERSION) a missing ``cniVersion`` means the newest version.

    Raises:
        InvalidNetworkConfig: ``cniVersion`` is missing (when required) or not a string.
        IncompatibleVersion: ``cniVersion`` is not in :data:`SUPPORTED_VERSIONS`.
    """
    version = conf.get("cniVersion")
    if version is None and not required:
        return NEWEST_VERSION
    if version is None:
        raise InvalidNetworkConfig("network config field `cniVersion` is missing")
    if not isinstance(version, str):
        raise InvalidNetworkConfig(
            f"network config field `cniVersion` must be a string, got {_json_type(version)}"
        )
    if version not in SUPPORTED_VERSIONS:
        raise IncompatibleVersion(
            f"cniVersion {show(version)} is not supported by cilia-cni "
            f"(supported: {', '.join(SUPPORTED_VERSIONS)})"
        )
    return version


def parse(conf: Mapping[str, object], cni_version: str, plugin_type: str) -> NetConf:
    """Validate the plugin's keys of an already version-checked netconf.

    ``plugin_type`` is the name this binary was exec'd as; ``type`` must equal it or
    :data:`PLUGIN_TYPE`.

    Raises:
        InvalidNetworkConfig: a field is missing or has a bad value (the field is named).
    """
    name = conf.get("name")
    if name is None:
        raise InvalidNetworkConfig("network config field `name` is missing")
    if not isinstance(name, str) or not is_name(name):
        raise InvalidNetworkConfig(
            f"network config field `name` must match [a-zA-Z0-9][a-zA-Z0-9_.-]*, got {_shown(name)}"
        )
    ptype = conf.get("type")
    if ptype is None:
        raise InvalidNetworkConfig("network config field `type` is missing")
    if ptype not in (PLUGIN_TYPE, plugin_type):
        raise InvalidNetworkConfig(
            f"network config field `type` must be {PLUGIN_TYPE!r}, got {_shown(ptype)}"
        )
    return NetConf(
        cni_version,
        name,
        agent_socket=_socket_path(conf),
        add_timeout=_timeout(conf, "agent-timeout-seconds", DEFAULT_ADD_TIMEOUT_SECONDS),
        del_timeout=_timeout(conf, "agent-del-timeout-seconds", DEFAULT_DEL_TIMEOUT_SECONDS),
        log_file=_log_file(conf),
        mtu=_mtu(conf),
        del_queue_dir=_del_queue_dir(conf),
        del_queue_max=_del_queue_max(conf),
        max_response_bytes=_max_response_bytes(conf),
    )


def parse_labels(conf: Mapping[str, object]) -> dict[str, str]:
    """Pod labels from the CNI ``args.cni.labels`` convention
    (``"args": {"cni": {"labels": [{"key": "app", "value": "web"}]}}``).

    Returns ``{}`` when ``args``, ``args.cni`` or ``labels`` is absent.

    Raises:
        InvalidNetworkConfig: a level has the wrong JSON type, a key is empty or not a
            string, a value is not a string, or a key repeats (the path is named).
    """
    cni = _args_cni(conf)
    if cni is None:
        return {}
    labels = cni.get("labels")
    if labels is None:
        return {}
    if not isinstance(labels, list):
        raise InvalidNetworkConfig(
            f"network config field `args.cni.labels` must be a list, got {_json_type(labels)}"
        )
    result: dict[str, str] = {}
    for i, item in enumerate(labels):
        where = f"args.cni.labels[{i}]"
        if not isinstance(item, dict):
            raise InvalidNetworkConfig(
                f"network config field `{where}` must be an object {{key, value}}, "
                f"got {_json_type(item)}"
            )
        key, value = item.get("key"), item.get("value", "")
        if not isinstance(key, str) or not key:
            raise InvalidNetworkConfig(
                f"network config field `{where}.key` must be a non-empty string, got {_shown(key)}"
            )
        if not isinstance(value, str):
            raise InvalidNetworkConfig(
                f"network config field `{where}.value` must be a string, got {_shown(value)}"
            )
        if key in result:
            raise InvalidNetworkConfig(
                f"network config field `{where}.key`: label {show(key)} is given twice"
            )
        result[key] = value
    return result


def version_at_least(version: str, minimum: str) -> bool:
    """True when spec ``version`` (``X.Y.Z`` digits) is ``minimum`` or newer."""
    return tuple(int(x) for x in version.split(".")) >= tuple(int(x) for x in minimum.split("."))


def parse_annotations(conf: Mapping[str, object]) -> dict[str, str]:
    """Pod annotations for the agent (IPAM pool selection).

    Read from ``runtimeConfig["io.kubernetes.cri.pod-annotations"]`` (containerd's
    capability, an object of strings) and ``args.cni.annotations`` (an object of strings,
    mirroring ``args.cni.labels``); ``args`` wins on a repeated key. ``{}`` when absent.

    Raises:
        InvalidNetworkConfig: a level is not an object or a value is not a string (the
            path is named).
    """
    result: dict[str, str] = {}
    runtime = conf.get("runtimeConfig")
    if isinstance(runtime, dict):
        result.update(
            _string_map(
                runtime.get(POD_ANNOTATIONS_CAPABILITY),
                f"runtimeConfig.{POD_ANNOTATIONS_CAPABILITY}",
            )
        )
    elif runtime is not None:
        raise InvalidNetworkConfig(
            f"network config field `runtimeConfig` must be an object, got {_json_type(runtime)}"
        )
    cni = _args_cni(conf)
    if cni is not None:
        result.update(_string_map(cni.get("annotations"), "args.cni.annotations"))
    return result


def _string_map(value: object, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidNetworkConfig(
            f"network config field `{where}` must be an object of strings, got {_json_type(value)}"
        )
    for key, item in value.items():
        if not key:
            raise InvalidNetworkConfig(f"network config field `{where}` has an empty key")
        if not isinstance(item, str):
            raise InvalidNetworkConfig(
                f"network config field `{where}.{key}` must be a string, got {_shown(item)}"
            )
    return dict(value)


def _args_cni(conf: Mapping[str, object]) -> dict[str, object] | None:
    args = conf.get("args")
    if args is None:
        return None
    if not isinstance(args, dict):
        raise InvalidNetworkConfig(
            f"network config field `args` must be an object, got {_json_type(args)}"
        )
    cni = args.get("cni")
    if cni is None:
        return None
    if not isinstance(cni, dict):
        raise InvalidNetworkConfig(
            f"network config field `args.cni` must be an object, got {_json_type(cni)}"
        )
    return cni


#: GC's keep-list: spec 1.1.0 names it ``cni.dev/valid-attachments``; libcni (1.2+) sends
#: the same list under both keys, and older runtimes only ``cni.dev/attachments``.
VALID_ATTACHMENTS_KEYS = ("cni.dev/valid-attachments", "cni.dev/attachments")


def parse_attachments(conf: Mapping[str, object]) -> list[tuple[str, str]]:
    """GC's keep-list ``[{"containerID", "ifname"}]`` -> ``[(id, ifname)]``.

    Read from ``cni.dev/valid-attachments`` (spec 1.1.0 "GC"), else from
    ``cni.dev/attachments`` (libcni sends both with the same content). An explicit empty
    list means "keep nothing"; neither key present is refused, since reading it as an
    empty list would release every attachment on the node.

    Raises:
        InvalidNetworkConfig: neither key is present, or the list is not a list of
            objects with non-empty string ``containerID`` and ``ifname`` (the element is
            named).
    """
    key = next((k for k in VALID_ATTACHMENTS_KEYS if conf.get(k) is not None), None)
    if key is None:
        raise InvalidNetworkConfig(
            "network config fields `cni.dev/valid-attachments` and `cni.dev/attachments` are "
            "both missing: GC needs the list of attachments to keep (an empty list keeps "
            "nothing); refusing to release every attachment on the node"
        )
    items = conf[key]
    if not isinstance(items, list):
        raise InvalidNetworkConfig(
            f"network config field `{key}` must be a list, got {_json_type(items)}"
        )
    result: list[tuple[str, str]] = []
    for i, item in enumerate(items):
        where = f"{key}[{i}]"
        if not isinstance(item, dict):
            raise InvalidNetworkConfig(
                f"network config field `{where}` must be an object {{containerID, ifname}}, "
                f"got {_json_type(item)}"
            )
        cid, ifname = item.get("containerID"), item.get("ifname")
        for field, value in (("containerID", cid), ("ifname", ifname)):
            if not isinstance(value, str) or not value:
                raise InvalidNetworkConfig(
                    f"network config field `{where}.{field}` must be a non-empty string, "
                    f"got {_shown(value)}"
                )
        assert isinstance(cid, str) and isinstance(ifname, str)
        result.append((cid, ifname))
    return result


def parse_prev_result(conf: Mapping[str, object], command: str) -> dict[str, object] | None:
    """The runtime's ``prevResult`` as an object (``None`` when absent).

    Shape checked (spec "Success"): ``interfaces`` and ``ips``/``routes`` are lists of
    objects when present, ``ips[].address`` a string, ``ips[].interface`` an index into
    ``interfaces``.

    Raises:
        InvalidNetworkConfig: ``prevResult`` breaks that shape (the path is named).
    """
    prev = conf.get("prevResult")
    if prev is None:
        return None
    if not isinstance(prev, dict):
        raise InvalidNetworkConfig(
            f"network config field `prevResult` must be an object for {command}, "
            f"got {_json_type(prev)}"
        )
    lists: dict[str, list[dict[str, object]]] = {}
    for key in ("interfaces", "ips", "routes"):
        value = prev.get(key, [])
        if value is None:
            value = []
        if not isinstance(value, list) or not all(isinstance(x, dict) for x in value):
            raise InvalidNetworkConfig(
                f"network config field `prevResult.{key}` must be a list of objects, "
                f"got {_shown(value) if not isinstance(value, list) else 'a list with a non-object'}"
            )
        lists[key] = value
    for i, itf in enumerate(lists["interfaces"]):
        for field in ("name", "mac", "sandbox"):
            if not isinstance(itf.get(field, ""), str):
                raise InvalidNetworkConfig(
                    f"network config field `prevResult.interfaces[{i}].{field}` must be a "
                    f"string, got {_shown(itf.get(field))}"
                )
    for i, ip in enumerate(lists["ips"]):
        address = ip.get("address")
        if not isinstance(address, str) or "/" not in address:
            raise InvalidNetworkConfig(
                f"network config field `prevResult.ips[{i}].address` must be a CIDR string, "
                f"got {_shown(address)}"
            )
        index = ip.get("interface")
        if index is not None and (
            isinstance(index, bool)
            or not isinstance(index, int)
            or not 0 <= index < len(lists["interfaces"])
        ):
            raise InvalidNetworkConfig(
                f"network config field `prevResult.ips[{i}].interface` must index "
                f"`prevResult.interfaces` (0..{len(lists['interfaces']) - 1}), got {_shown(index)}"
            )
        if not isinstance(ip.get("gateway", ""), str):
            raise InvalidNetworkConfig(
                f"network config field `prevResult.ips[{i}].gateway` must be a string, "
                f"got {_shown(ip.get('gateway'))}"
            )
    for i, route in enumerate(lists["routes"]):
        for field, required in (("dst", True), ("gw", False)):
            value = route.get(field, None if required else "")
            if not isinstance(value, str):
                raise InvalidNetworkConfig(
                    f"network config field `prevResult.routes[{i}].{field}` must be a string, "
                    f"got {_shown(value)}"
                )
    return prev


def _absolute_path(conf: Mapping[str, object], key: str, default: str) -> str:
    """Return ``conf[key]`` (``default`` when absent) as an absolute path.

    Raises:
        InvalidNetworkConfig: the value is not a string, not absolute, or holds a NUL byte;
            the message names the field ``key``.
    """
    path = conf.get(key, default)
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path:
        raise InvalidNetworkConfig(
            f"network config field `{key}` must be an absolute path, got {_shown(path)}"
        )
    return path


def _del_queue_dir(conf: Mapping[str, object]) -> str:
    return _absolute_path(conf, "del-queue-dir", DEFAULT_DEL_QUEUE_DIR)


def _max_response_bytes(conf: Mapping[str, object]) -> int:
    low, high = MAX_RESPONSE_BYTES_RANGE
    value = conf.get("agent-max-response-bytes", DEFAULT_MAX_RESPONSE_BYTES)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidNetworkConfig(
            f"network config field `agent-max-response-bytes` must be an integer in "
            f"{low}..{high}, got {_shown(value)}"
        )
    return value


def _del_queue_max(conf: Mapping[str, object]) -> int:
    value = conf.get("del-queue-max", DEFAULT_DEL_QUEUE_MAX)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DEL_QUEUE_MAX:
        raise InvalidNetworkConfig(
            f"network config field `del-queue-max` must be an integer in 1..{MAX_DEL_QUEUE_MAX}, "
            f"got {_shown(value)}"
        )
    return value


def _socket_path(conf: Mapping[str, object]) -> str:
    path = _absolute_path(conf, "agent-socket", DEFAULT_AGENT_SOCKET)
    if len(path.encode("utf-8", "surrogatepass")) > MAX_SOCKET_PATH_BYTES:
        raise InvalidNetworkConfig(
            f"network config field `agent-socket` is longer than {MAX_SOCKET_PATH_BYTES} bytes "
            f"(unix socket path limit): {show(path)}"
        )
    return path


def _timeout(conf: Mapping[str, object], key: str, default: float) -> float:
    value = conf.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= MAX_TIMEOUT_SECONDS
    ):
        raise InvalidNetworkConfig(
            f"network config field `{key}` must be a number of seconds in (0, "
            f"{MAX_TIMEOUT_SECONDS:g}], got {_shown(value)}"
        )
    return float(value)


def _log_file(conf: Mapping[str, object]) -> str:
    path = conf.get("log-file", "")
    if not isinstance(path, str) or (path and not path.startswith("/")) or "\x00" in path:
        raise InvalidNetworkConfig(
            f'network config field `log-file` must be an absolute path or "", got {_shown(path)}'
        )
    return path


def _mtu(conf: Mapping[str, object]) -> int:
    mtu = conf.get("mtu", 0)
    if isinstance(mtu, bool) or not isinstance(mtu, int) or not (mtu == 0 or 68 <= mtu <= 65535):
        raise InvalidNetworkConfig(
            f"network config field `mtu` must be 0 (agent default) or 68..65535, got {_shown(mtu)}"
        )
    return mtu


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    return "object"


def _shown(value: object) -> str:
    if isinstance(value, str):
        return show(value)
    if isinstance(value, bool | int | float) or value is None:
        return jsonio.dumps(value)
    return _json_type(value)
