"""The on-disk DEL queue: DELs the agent could not take because it was unreachable.

File format (``QueuedDel`` in proto/cilia/agent/v1/agent.proto): one file per DEL,
``<dir>/<unix ms>-<sha256(container_id + "/" + ifname)[:16]>.del`` holding a ``QueuedDel``
in protobuf binary form, written to ``.<name>.tmp`` first and renamed, so the agent never
reads a partial file. The agent replays every ``*.del`` in name order before it serves
requests, then deletes it (upstream: cilium-cni's ``/var/run/cilium/deleteQueue``).

Imported only on that path: it needs the messages (:mod:`cilia_cni.wire`) but not the agent
client.
"""

from __future__ import annotations

import hashlib
import os
import time

from cilia_cni import wire
from cilia_cni.errors import AgentUnavailable

#: Mode of the queue directory when the plugin creates it (root only, like the socket).
QUEUE_DIR_MODE = 0o700
#: Mode of a queue file.
QUEUE_FILE_MODE = 0o600
SUFFIX = ".del"


def entry_key(container_id: str, ifname: str) -> str:
    """The 16 hex digits naming one attachment's queue file (after ``<unix ms>-``)."""
    return hashlib.sha256(f"{container_id}/{ifname}".encode()).hexdigest()[:16]


def enqueue(directory: str, limit: int, request: wire.DelRequest, why: str) -> str:
    """Queue ``request``; return the file's path (an existing one for the same attachment).

    A DEL already queued for (container_id, ifname) is not queued twice: the runtime
    repeats DELs while the agent is down, and one replay is enough.

    Raises:
        AgentUnavailable: the queue holds ``limit`` files already (netconf
            ``del-queue-max``), or the directory cannot be created or written.
    """
    key = entry_key(request.container_id, request.ifname)
    hint = f"cilia-agent is unreachable ({why})"
    try:
        os.makedirs(directory, mode=QUEUE_DIR_MODE, exist_ok=True)
        names = [n for n in os.listdir(directory) if n.endswith(SUFFIX)]
    except OSError as exc:
        raise AgentUnavailable(
            f"{hint} and the DEL queue directory {directory} is unusable ({exc.strerror}): "
            "fix the netconf field `del-queue-dir` or start cilia-agent; the runtime will retry",
            str(exc),
        ) from None
    for name in names:
        if name.endswith(f"-{key}{SUFFIX}"):
            return os.path.join(directory, name)
    if len(names) >= limit:
        raise AgentUnavailable(
            f"{hint} and its DEL queue {directory} is full ({len(names)} of {limit}, netconf "
            "`del-queue-max`): start cilia-agent so it replays the queue; the runtime will retry"
        )
    now_ms = int(time.time() * 1000)
    name = f"{now_ms:013d}-{key}{SUFFIX}"
    path = os.path.join(directory, name)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    data = wire.QueuedDel(request=request, queued_at_unix_ms=now_ms).SerializeToString()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, QUEUE_FILE_MODE)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except OSError as exc:
        try:  # noqa: SIM105 - contextlib is not worth its import time here
            os.unlink(tmp)
        except OSError:
            pass
        raise AgentUnavailable(
            f"{hint} and the DEL could not be queued in {directory} ({exc.strerror}): "
            "the runtime will retry",
            str(exc),
        ) from None
    return path
