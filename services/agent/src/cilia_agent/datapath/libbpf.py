"""The few libbpf calls the agent makes itself, through Debian's ``libbpf.so.1`` (ctypes).

Pinned maps are opened by path (``BPF_OBJ_GET``) and read and written with
``BPF_MAP_*_ELEM``, so the load balancer's writer, ``cilia-agent bpf … list``, ``cilia-agent
service list`` and the tests need neither bcc nor the agent (upstream ``cilium-dbg bpf``
reads pinned maps the same way).
cgroup attachments are BPF links (``BPF_LINK_CREATE``) pinned on bpffs: the pin keeps the
program attached while no process holds it, ``BPF_LINK_UPDATE`` swaps the program of a
running link atomically (an agent restart), and removing the pin detaches it.

libbpf 1.x returns ``-errno`` (and sets ``errno``); every failure here raises
:class:`LibbpfError` with the call, the object and ``strerror``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import pathlib
from collections.abc import Iterator
from typing import Generic, TypeVar

from cilia_agent.datapath.errors import DatapathError

K = TypeVar("K", bound=ctypes.Structure | ctypes.c_uint32 | ctypes.c_uint16)
V = TypeVar("V", bound=ctypes.Structure | ctypes.c_uint8)

BPF_ANY = 0


class LibbpfError(DatapathError):
    """A libbpf call failed; ``errno`` holds the error number."""

    def __init__(self, message: str, err: int) -> None:
        super().__init__(f"{message}: {os.strerror(err)}")
        self.errno = err


_lib: ctypes.CDLL | None = None


def libbpf() -> ctypes.CDLL:
    """The loaded ``libbpf.so.1`` with the prototypes used here.

    Raises:
        LibbpfError: the library is missing (``apt-get install libbpf1``).
    """
    global _lib
    if _lib is None:
        name = ctypes.util.find_library("bpf") or "libbpf.so.1"
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError as exc:
            raise LibbpfError(
                f"libbpf is not available ({exc}); apt-get install libbpf1", 0
            ) from exc
        lib.bpf_obj_get.argtypes = [ctypes.c_char_p]
        lib.bpf_obj_pin.argtypes = [ctypes.c_int, ctypes.c_char_p]
        for fn in (lib.bpf_map_get_next_key, lib.bpf_map_lookup_elem):
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.bpf_map_update_elem.argtypes = [
            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64
        ]  # fmt: skip
        lib.bpf_map_delete_elem.argtypes = [ctypes.c_int, ctypes.c_void_p]
        lib.bpf_link_create.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        lib.bpf_link_update.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        for fn in (
            lib.bpf_obj_get, lib.bpf_obj_pin, lib.bpf_map_get_next_key, lib.bpf_map_lookup_elem,
            lib.bpf_map_update_elem, lib.bpf_map_delete_elem, lib.bpf_link_create,
            lib.bpf_link_update,
        ):  # fmt: skip
            fn.restype = ctypes.c_int
        _lib = lib
    return _lib


def _err(rc: int) -> int:
    return ctypes.get_errno() or -rc or errno.EIO


def obj_get(path: pathlib.Path, what: str = "object") -> int:
    """A new fd of the object (``what``: "map", "link" …, for the message) pinned at ``path``.

    Raises:
        LibbpfError: no such pin (``errno`` ENOENT) or no permission.
    """
    fd = libbpf().bpf_obj_get(str(path).encode())
    if fd < 0:
        raise LibbpfError(f"cannot open pinned {what} {path}", _err(fd))
    return int(fd)


def obj_pin(fd: int, path: pathlib.Path) -> None:
    """Pin ``fd`` at ``path`` (on bpffs). Raises LibbpfError (EEXIST when taken)."""
    rc = libbpf().bpf_obj_pin(fd, str(path).encode())
    if rc < 0:
        raise LibbpfError(f"cannot pin at {path}", _err(rc))


def link_create(prog_fd: int, target_fd: int, attach_type: int) -> int:
    """``BPF_LINK_CREATE`` of ``prog_fd`` on ``target_fd`` (a cgroup dir); returns the link fd.

    Links on a cgroup always run beside the cgroup's other programs (multi-attach).

    Raises:
        LibbpfError: the kernel refused (e.g. the program's expected attach type differs).
    """
    fd = libbpf().bpf_link_create(prog_fd, target_fd, attach_type, None)
    if fd < 0:
        raise LibbpfError(f"cannot attach program (attach type {attach_type})", _err(fd))
    return int(fd)


def link_update(link_fd: int, prog_fd: int) -> None:
    """Replace the program of the link ``link_fd`` by ``prog_fd`` atomically.

    Raises:
        LibbpfError: the link is defunct or the program does not fit it.
    """
    rc = libbpf().bpf_link_update(link_fd, prog_fd, None)
    if rc < 0:
        raise LibbpfError("cannot replace the program of a link", _err(rc))


class PinnedMap(Generic[K, V]):
    """A pinned hash map, read and written through its path.

    Args:
        path: the pin, e.g. ``/sys/fs/bpf/cilia/cilium_lb4_services_v2``.
        key_type, value_type: ctypes layouts (``datapath.layout``, ``loadbalancer.layout``).

    Raises:
        LibbpfError: no such pin, no permission (root needed), or libbpf missing.
    """

    def __init__(self, path: pathlib.Path, key_type: type[K], value_type: type[V]) -> None:
        self.path = path
        self.key_type = key_type
        self.value_type = value_type
        self.fd = obj_get(path, "map")

    def lookup(self, key: K) -> V | None:
        """The value of ``key``, or None."""
        value = self.value_type()
        if libbpf().bpf_map_lookup_elem(self.fd, ctypes.byref(key), ctypes.byref(value)) != 0:
            return None
        return value

    def update(self, key: K, value: V) -> None:
        """Insert or replace ``key``.

        Raises:
            LibbpfError: the map is full (``errno`` E2BIG) or another kernel error.
        """
        rc = libbpf().bpf_map_update_elem(self.fd, ctypes.byref(key), ctypes.byref(value), BPF_ANY)
        if rc != 0:
            raise LibbpfError(f"cannot update {self.path.name}", _err(rc))

    def delete(self, key: K) -> bool:
        """Delete ``key``; returns False when it was absent.

        Raises:
            LibbpfError: a kernel error other than ENOENT.
        """
        rc = libbpf().bpf_map_delete_elem(self.fd, ctypes.byref(key))
        if rc == 0:
            return True
        err = _err(rc)
        if err == errno.ENOENT:
            return False
        raise LibbpfError(f"cannot delete from {self.path.name}", err)

    def items(self) -> Iterator[tuple[K, V]]:
        """Every (key, value), in the kernel's iteration order (copies)."""
        lib = libbpf()
        key = self.key_type()
        nxt = self.key_type()
        first = True
        while True:
            rc = lib.bpf_map_get_next_key(
                self.fd, None if first else ctypes.byref(key), ctypes.byref(nxt)
            )
            if rc != 0:
                return
            first = False
            ctypes.memmove(ctypes.byref(key), ctypes.byref(nxt), ctypes.sizeof(key))
            value = self.value_type()
            if lib.bpf_map_lookup_elem(self.fd, ctypes.byref(key), ctypes.byref(value)) != 0:
                continue  # deleted between the two calls
            out = self.key_type()
            ctypes.memmove(ctypes.byref(out), ctypes.byref(key), ctypes.sizeof(key))
            yield out, value

    def close(self) -> None:
        """Close the map's file descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> PinnedMap[K, V]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
