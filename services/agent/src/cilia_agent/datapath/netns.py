"""Netlink sockets inside another network namespace, without forking.

pyroute2 0.9's ``IPRoute(netns=...)`` forks a helper process to create the
socket; forking a process that runs gRPC threads is unsafe, and it creates
the namespace when it is missing (``flags=O_CREAT``). Instead the calling
thread briefly enters the namespace with ``setns(2)`` (which affects only that
thread), opens the netlink socket there, and returns. A socket keeps the
namespace it was created in.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable
from typing import TypeVar

from pyroute2 import IPRoute

from cilia_agent.datapath.errors import DatapathError, NetnsNotFound

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> int:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        return ctypes.get_errno()
    return 0


def socket_in(netns: str, create: Callable[[], T]) -> T:
    """Call ``create`` (which opens a socket) inside the namespace at path ``netns`` and
    return what it returned; the calling thread is back in its own namespace afterwards.

    Raises:
        NetnsNotFound: ``netns`` does not exist or is not a network namespace.
        DatapathError: the thread could not return to its own namespace.
    """
    try:
        target = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise NetnsNotFound(netns) from exc
    except OSError as exc:
        raise NetnsNotFound(netns, f"cannot be opened: {exc.strerror}") from exc
    try:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            err = _setns(target)
            if err:
                reason = "is not a network namespace" if err == errno.EINVAL else os.strerror(err)
                raise NetnsNotFound(netns, reason)
            try:
                return create()
            finally:
                err = _setns(home)
                if err:  # pragma: no cover - the kernel refuses to return home
                    raise DatapathError(f"cannot return to the host namespace: {os.strerror(err)}")
        finally:
            os.close(home)
    finally:
        os.close(target)


def iproute_in(netns: str) -> IPRoute:
    """Return an ``IPRoute`` whose socket lives in the namespace at path ``netns``.

    The returned object must be used and closed in the calling thread
    (pyroute2 keeps per-thread sockets).

    Raises:
        NetnsNotFound: ``netns`` does not exist or is not a network namespace.
        DatapathError: the thread could not return to its own namespace.
    """
    return socket_in(netns, IPRoute)


def is_own_netns(path: str) -> bool:
    """True when ``path`` is the network namespace of the calling thread (same device and
    inode as ``/proc/thread-self/ns/net``); False when either cannot be read."""
    try:
        target = os.stat(path)
        own = os.stat("/proc/thread-self/ns/net")
    except OSError:
        return False
    return (target.st_dev, target.st_ino) == (own.st_dev, own.st_ino)


def is_netns(path: str) -> bool:
    """True when ``path`` exists (a bind-mounted namespace file or /proc link)."""
    return bool(path) and os.path.exists(path)
