"""The CNI_* environment of one plugin invocation (CNI spec 1.0.0/1.1.0, "Parameters").

Only the standard library is imported here: this runs on every pod operation.
"""

from __future__ import annotations

import os

from cilia_cni.errors import InvalidEnvironment

# typing is not imported at run time (start-up cost); mypy honours this constant.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

#: Commands implemented (CNI spec 1.1.0; CHECK needs cniVersion >= 0.4.0, GC and STATUS 1.1.0).
COMMANDS = ("ADD", "DEL", "CHECK", "VERSION", "STATUS", "GC")
#: Commands that act on one attachment and need CNI_CONTAINERID and CNI_IFNAME.
ATTACHMENT_COMMANDS = ("ADD", "DEL", "CHECK")
#: Longest CNI_CONTAINERID accepted, in characters: cilia-agent's limit (1-255 of the
#: libcni characters; containerd and CRI-O ids are 64 hex characters). Longer is code 4.
MAX_CONTAINER_ID_CHARS = 255
#: Linux IFNAMSIZ (16) minus the terminating NUL.
MAX_IFNAME_BYTES = 15
_MAX_SHOWN = 80


def is_name(value: str) -> bool:
    """Whether ``value`` matches ``[a-zA-Z0-9][a-zA-Z0-9_.-]*`` in full: libcni's rule for
    container ids (pkg/utils ValidateContainerID) and the spec's for network names.
    (String methods, not ``re``: the regex module's import costs more than the check.)"""
    return (
        value.isascii()
        and value[:1].isalnum()
        and value.replace("_", "").replace(".", "").replace("-", "").isalnum()
    )


def show(value: str) -> str:
    """Quote ``value`` for an error message: ``repr`` (escapes control characters and
    undecodable bytes), cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 4] + "...'"


def _utf8(name: str, value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidEnvironment(f"{name} is not valid UTF-8: {show(value)}") from None
    if "\x00" in value:
        raise InvalidEnvironment(f"{name} contains a NUL character: {show(value)}")
    return value


class Invocation:
    """One invocation's environment, validated for its command.

    Attributes:
        command: one of :data:`COMMANDS` (CNI_COMMAND).
        container_id: CNI_CONTAINERID (libcni rule ``[a-zA-Z0-9][a-zA-Z0-9_.-]*``, at most
            :data:`MAX_CONTAINER_ID_CHARS`);
            empty for VERSION, STATUS and GC.
        netns: CNI_NETNS, an absolute path; required for ADD and CHECK, may be empty for
            DEL, empty for VERSION, STATUS and GC.
        ifname: CNI_IFNAME (1-15 bytes, no ``/``, ``:`` or whitespace, not ``.``/``..``);
            empty for VERSION, STATUS and GC.
        cni_args: raw CNI_ARGS (``K=V;K2=V2``), parsed on demand by :func:`parse_cni_args`.
        path: CNI_PATH split on ``:`` (empty entries dropped); optional, unused so far.
    """

    __slots__ = ("cni_args", "command", "container_id", "ifname", "netns", "path")

    def __init__(
        self,
        command: str,
        container_id: str = "",
        netns: str = "",
        ifname: str = "",
        cni_args: str = "",
        path: tuple[str, ...] = (),
    ) -> None:
        self.command = command
        self.container_id = container_id
        self.netns = netns
        self.ifname = ifname
        self.cni_args = cni_args
        self.path = path


def parse_command(env: Mapping[str, str]) -> str:
    """Return CNI_COMMAND from ``env``.

    Raises:
        InvalidEnvironment: CNI_COMMAND is missing, empty or not one of :data:`COMMANDS`.
    """
    command = env.get("CNI_COMMAND", "")
    if not command:
        raise InvalidEnvironment(
            "required environment variable CNI_COMMAND is missing: cilia-cni is a CNI plugin "
            "exec'd by a container runtime (commands: " + ", ".join(COMMANDS) + ")"
        )
    if command not in COMMANDS:
        raise InvalidEnvironment(
            f"CNI_COMMAND {show(command)} is not supported by this cilia-cni "
            f"(supported: {', '.join(COMMANDS)})"
        )
    return command


def parse_invocation(env: Mapping[str, str], command: str) -> Invocation:
    """Validate the CNI_* variables ``command`` needs (spec 1.1.0: ADD and CHECK need
    CONTAINERID, NETNS, IFNAME; DEL needs CONTAINERID, IFNAME, NETNS optional; GC needs
    CNI_PATH; VERSION and STATUS need nothing).

    Raises:
        InvalidEnvironment: a required variable is missing or a value is malformed
            (the variable is named in the message).
    """
    path = tuple(p for p in env.get("CNI_PATH", "").split(os.pathsep) if p)
    if command not in ATTACHMENT_COMMANDS:
        if command == "GC" and not path:
            raise InvalidEnvironment(
                "required environment variable CNI_PATH is missing for GC (spec 1.1.0)"
            )
        return Invocation(command, path=path)
    container_id = _utf8("CNI_CONTAINERID", env.get("CNI_CONTAINERID", ""))
    if not container_id:
        raise InvalidEnvironment(
            f"required environment variable CNI_CONTAINERID is missing for {command}"
        )
    if len(container_id) > MAX_CONTAINER_ID_CHARS:
        raise InvalidEnvironment(
            f"CNI_CONTAINERID {show(container_id)} is {len(container_id)} characters, longer "
            f"than {MAX_CONTAINER_ID_CHARS} (the limit cilia-agent accepts)"
        )
    if not is_name(container_id):
        raise InvalidEnvironment(
            f"CNI_CONTAINERID {show(container_id)} has invalid characters "
            "(expected [a-zA-Z0-9][a-zA-Z0-9_.-]*)"
        )
    ifname = _utf8("CNI_IFNAME", env.get("CNI_IFNAME", ""))
    if not ifname:
        raise InvalidEnvironment(
            f"required environment variable CNI_IFNAME is missing for {command}"
        )
    _check_ifname(ifname)
    netns = _utf8("CNI_NETNS", env.get("CNI_NETNS", ""))
    if not netns and command != "DEL":
        raise InvalidEnvironment(
            f"required environment variable CNI_NETNS is missing for {command}"
        )
    if netns and not netns.startswith("/"):
        raise InvalidEnvironment(f"CNI_NETNS {show(netns)} is not an absolute path")
    cni_args = _utf8("CNI_ARGS", env.get("CNI_ARGS", ""))
    return Invocation(command, container_id, netns, ifname, cni_args, path)


def _check_ifname(ifname: str) -> None:
    if len(ifname.encode("utf-8")) > MAX_IFNAME_BYTES:
        raise InvalidEnvironment(
            f"CNI_IFNAME {show(ifname)} is longer than {MAX_IFNAME_BYTES} bytes (Linux IFNAMSIZ)"
        )
    # '%' too: the kernel takes "eth%d" as a template and names the link eth0, eth1, ...
    if ifname in (".", "..") or any(c in "/:%" or c.isspace() for c in ifname):
        raise InvalidEnvironment(
            f"CNI_IFNAME {show(ifname)} is not a valid interface name "
            "(no '/', ':', '%' or whitespace; not '.' or '..')"
        )


def parse_cni_args(raw: str) -> dict[str, str]:
    """Parse CNI_ARGS ``K=V;K2=V2`` into a dict (a repeated key keeps the last value).

    Follows libcni ``pkg/types/args.go``: every ``;``-separated pair must be exactly one
    non-empty key, ``=``, and a value without ``=`` (the value may be empty). Unknown keys
    are kept; callers pick what they know (``K8S_POD_NAMESPACE``, ``K8S_POD_NAME``).

    Raises:
        InvalidEnvironment: a pair is malformed (the pair is quoted).
    """
    result: dict[str, str] = {}
    if not raw:
        return result
    for pair in raw.split(";"):
        key, sep, value = pair.partition("=")
        if not sep or not key or "=" in value:
            raise InvalidEnvironment(
                f"CNI_ARGS is malformed: {show(pair)} is not KEY=VALUE (expected 'K=V;K2=V2')"
            )
        result[key] = value
    return result
