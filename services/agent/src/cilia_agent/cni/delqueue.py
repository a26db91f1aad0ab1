"""Replay of the DEL queue the CNI plugin writes while the agent is unreachable.

Format (``cilia.agent.v1.QueuedDel``, written by ``cilia-cni``): one file per DEL,
``<dir>/<unix ms>-<sha256(container_id/ifname)[:16]>.del``, protobuf binary, written
to a dot-prefixed temporary name and renamed. The agent replays every ``*.del`` in
name order (= queue order) after restoring its endpoints and before it serves the
socket, through the same code path as the Del RPC, and deletes each file once its
DEL succeeded. A file that cannot be decoded or names an invalid attachment is
renamed to ``<name>.corrupt`` and logged (never a crash); a DEL that fails
(netlink/state error) keeps its file for the next start. A queued DEL never deletes
an endpoint created after it was queued (a newer attachment of the same key).
Upstream: cilium-cni's ``/var/run/cilium/deleteQueue``, drained by the agent.
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Protocol

from google.protobuf.message import DecodeError

from cilia.agent.v1 import agent_pb2
from cilia_agent.endpoint.errors import InvalidRequest

log = logging.getLogger(__name__)

SUFFIX = ".del"
CORRUPT_SUFFIX = ".corrupt"


class Deleter(Protocol):
    """What replay calls (``EndpointManager.delete``)."""

    def __call__(
        self, container_id: str, ifname: str, netns: str = "", *, not_after_ms: int = 0
    ) -> Awaitable[bool]:
        """Delete the attachment; True when an endpoint existed."""


@dataclass
class ReplayReport:
    """File names replayed (deleted something / nothing), kept after a failure, corrupt."""

    deleted: list[str] = field(default_factory=list)
    nothing: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)


def _move_aside(path: pathlib.Path, reason: str) -> None:
    aside = path.with_name(path.name + CORRUPT_SUFFIX)
    try:
        path.rename(aside)
    except OSError as exc:
        log.error(
            "cannot move a corrupt DEL queue file aside",
            extra={"path": str(path), "reason": str(exc)},
        )
    log.error(
        "corrupt DEL queue file moved aside",
        extra={"path": str(path), "moved_to": str(aside), "reason": reason},
    )


def _decode(path: pathlib.Path) -> agent_pb2.QueuedDel:
    msg = agent_pb2.QueuedDel()
    msg.ParseFromString(path.read_bytes())
    if not msg.HasField("request") or not msg.request.container_id or not msg.request.ifname:
        raise ValueError("no request, container_id or ifname")
    return msg


async def replay(directory: pathlib.Path, delete: Deleter) -> ReplayReport:
    """Replay every queued DEL in ``directory`` (missing directory: nothing to do).

    Returns what happened to each file. Never raises for a bad file or a failed DEL.
    """
    report = ReplayReport()
    try:
        names = sorted(
            p.name for p in directory.iterdir() if p.name.endswith(SUFFIX) and p.name[0] != "."
        )
    except FileNotFoundError:
        return report
    except OSError as exc:
        log.error("cannot read the DEL queue", extra={"dir": str(directory), "reason": str(exc)})
        return report
    for name in names:
        path = directory / name
        try:
            msg = _decode(path)
        except (OSError, DecodeError, ValueError) as exc:
            _move_aside(path, str(exc))
            report.corrupt.append(name)
            continue
        req = msg.request
        try:
            existed = await delete(
                req.container_id, req.ifname, req.netns, not_after_ms=msg.queued_at_unix_ms
            )
        except InvalidRequest as exc:
            _move_aside(path, str(exc))
            report.corrupt.append(name)
            continue
        except Exception as exc:
            log.error(
                "queued DEL failed, kept for the next start",
                extra={"path": str(path), "container_id": req.container_id, "reason": str(exc)},
            )
            report.failed.append(name)
            continue
        path.unlink(missing_ok=True)
        (report.deleted if existed else report.nothing).append(name)
        log.info(
            "queued DEL replayed",
            extra={
                "container_id": req.container_id,
                "ifname": req.ifname,
                "deleted": existed,
                "queued_at_unix_ms": msg.queued_at_unix_ms,
            },
        )
    return report
