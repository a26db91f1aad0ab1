"""Add and Check requests: their fields, their validation, and the attachment key.

An attachment is named by its key ``(container_id, ifname)`` (CNI); IPAM records an address's
owner as ``"container_id/ifname"`` (:func:`owner_of`). Validation raises one
:class:`~cilia_agent.endpoint.errors.InvalidRequest` naming the first bad field, before any
work is done.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from cilia_agent.endpoint.errors import InvalidRequest

Key = tuple[str, str]
"""An attachment key ``(container_id, ifname)``."""
Keys = list[Key]
Lines = list[str]

_CONTAINER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,254}$")
# Characters the kernel refuses in a name ('/', ':', whitespace: dev_valid_name) or takes as a
# name template ('%': "eth%d" becomes eth0, eth1, ...; dev_alloc_name).
_IFNAME_BAD = re.compile(r"[/\s:%]")
_POOL = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


@dataclass(frozen=True)
class AddParams:
    """Fields of an Add request (see ``cilia.agent.v1.AddRequest``)."""

    container_id: str
    ifname: str
    netns: str
    labels: dict[str, str] = field(default_factory=dict)
    pod_namespace: str = ""
    pod_name: str = ""
    pool: str = ""
    mtu: int = 0
    prev_result: str = ""
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckParams:
    """Fields of a Check request (see ``cilia.agent.v1.CheckRequest``).

    ``addresses`` are CIDR strings, ``routes`` ``(dst cidr, gateway or "")`` pairs; empty
    lists mean "what the agent recorded" (the pod /32 and the default route via the
    router, or for a chained endpoint the prevResult's). ``mac`` "" skips the MAC check.
    """

    container_id: str
    ifname: str
    netns: str = ""
    addresses: list[str] = field(default_factory=list)
    routes: list[tuple[str, str]] = field(default_factory=list)
    mac: str = ""


MAX_SHOWN_CHARS = 80


def shown(value: str) -> str:
    """``repr(value)`` cut to :data:`MAX_SHOWN_CHARS` (the full length is named)."""
    text = repr(value)
    if len(text) <= MAX_SHOWN_CHARS:
        return text
    return f"{text[: MAX_SHOWN_CHARS - 4]}...' ({len(value)} chars)"


def validate_ifname(value: str, field_name: str = "ifname") -> None:
    """Raise InvalidRequest unless ``value`` is a Linux interface name: 1-15 bytes of UTF-8
    (IFNAMSIZ 16 with its NUL), not ``.``/``..``, without ``/``, ``:``, whitespace or ``%``."""
    if not value:
        raise InvalidRequest(field_name, "must not be empty")
    if len(value.encode()) > 15 or value in (".", "..") or _IFNAME_BAD.search(value):
        raise InvalidRequest(field_name, f"{shown(value)} is not a valid interface name")


def validate_add(p: AddParams) -> None:
    """Check every Add field; raises InvalidRequest naming the first bad one."""
    if not _CONTAINER_ID.match(p.container_id):
        raise InvalidRequest(
            "container_id", f"{shown(p.container_id)} must be 1-255 of [A-Za-z0-9_.-]"
        )
    validate_ifname(p.ifname)
    if not p.netns:
        raise InvalidRequest("netns", "must not be empty")
    if not p.netns.startswith("/"):
        raise InvalidRequest("netns", f"{p.netns!r} must be an absolute path")
    if p.pool and not _POOL.match(p.pool):
        raise InvalidRequest("pool", f"{p.pool!r} is not a valid pool name")
    if p.mtu and not 68 <= p.mtu <= 65535:
        raise InvalidRequest("mtu", f"{p.mtu} is outside 68..65535")
    for key in p.labels:
        if not key:
            raise InvalidRequest("labels", "label keys must not be empty")


def owner_of(container_id: str, ifname: str) -> str:
    """The IPAM owner string of an attachment: ``"container_id/ifname"``."""
    return f"{container_id}/{ifname}"


def parse_owner(text: str) -> Key | None:
    """The attachment key of an IPAM owner string, or None when ``text`` is not one
    (:func:`owner_of` wrote it for a valid container id and interface name)."""
    cid, sep, ifname = text.rpartition("/")
    if not sep or not _CONTAINER_ID.match(cid) or _IFNAME_BAD.search(ifname):
        return None
    return (cid, ifname)
