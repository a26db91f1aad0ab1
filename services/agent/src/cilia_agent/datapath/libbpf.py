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
from typing import Any, Generic, TypeVar, cast

from cilia_agent.datapath.errors import DatapathError

K = TypeVar("K", bound=ctypes.Structure | ctypes.c_uint32 | ctypes.c_uint16)
V = TypeVar("V", bound=ctypes.Structure | ctypes.c_uint8 | ctypes.c_uint32 | ctypes.c_uint64)

BPF_ANY = 0
_ENOTSUPP = 524  # the kernel's internal ENOTSUPP, as bpf(2) returns it


LIBBPF_ERRNO_START = 4000  # libbpf.h LIBBPF_ERRNO__START: libbpf's own error numbers


def strerror(err: int) -> str:
    """The text of error number ``err``: ``os.strerror`` for the kernel's, libbpf's
    ``libbpf_strerror`` for libbpf's own (4000 and up, e.g. 4001 "BPF object format invalid"),
    which ``os.strerror`` calls "Unknown error 4001"."""
    if err >= LIBBPF_ERRNO_START and _lib is not None:
        buf = ctypes.create_string_buffer(128)
        if _lib.libbpf_strerror(err, buf, ctypes.sizeof(buf)) == 0:
            return buf.value.decode(errors="replace")
    return os.strerror(err)


class LibbpfError(DatapathError):
    """A libbpf call failed; ``errno`` holds the error number."""

    def __init__(self, message: str, err: int) -> None:
        super().__init__(f"{message}: {strerror(err)}")
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
        lib.bpf_obj_get_info_by_fd.argtypes = [
            ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)
        ]  # fmt: skip
        for fn in (
            lib.bpf_obj_get, lib.bpf_obj_pin, lib.bpf_map_get_next_key, lib.bpf_map_lookup_elem,
            lib.bpf_map_update_elem, lib.bpf_map_delete_elem, lib.bpf_link_create,
            lib.bpf_link_update, lib.bpf_obj_get_info_by_fd,
        ):  # fmt: skip
            fn.restype = ctypes.c_int
        _object_prototypes(lib)
        _lib = lib
    return _lib


class OpenOpts(ctypes.Structure):
    """``struct bpf_object_open_opts`` of libbpf 1.1 (``sz`` first; fields after
    ``kernel_log_level`` unused, so an older or newer libbpf reads what it knows)."""

    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("object_name", ctypes.c_char_p),
        ("relaxed_maps", ctypes.c_bool),
        ("pin_root_path", ctypes.c_char_p),
        ("_attach_prog_fd", ctypes.c_uint32),
        ("kconfig", ctypes.c_char_p),
        ("btf_custom_path", ctypes.c_char_p),
        ("kernel_log_buf", ctypes.c_void_p),
        ("kernel_log_size", ctypes.c_size_t),
        ("kernel_log_level", ctypes.c_uint32),
    ]


class BtfType(ctypes.Structure):
    """``struct btf_type`` (linux/btf.h): name offset, info (kind bits 24-28, vlen 0-15),
    size or type id."""

    _fields_ = [("name_off", ctypes.c_uint32), ("info", ctypes.c_uint32), ("size", ctypes.c_uint32)]


class BtfVarSecinfo(ctypes.Structure):
    """``struct btf_var_secinfo``: one variable of a DATASEC (type id, offset, size)."""

    _fields_ = [("type", ctypes.c_uint32), ("offset", ctypes.c_uint32), ("size", ctypes.c_uint32)]


BTF_KIND_DATASEC = 15

# int (*)(enum libbpf_print_level, const char *fmt, va_list ap): va_list arrives as a pointer
# on x86-64 (an array) and on arm64 (a 32-byte struct, passed by reference).
PRINT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
# int (*)(void *ctx, void *data, size_t size)
RING_SAMPLE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


def _object_prototypes(lib: ctypes.CDLL) -> None:
    """Prototypes of the object, map, BTF and ring-buffer calls (:mod:`datapath.objects`)."""
    vp, cp, i, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t
    protos: dict[str, tuple[list[Any], Any]] = {
        "bpf_object__open_file": ([cp, ctypes.POINTER(OpenOpts)], vp),
        "bpf_object__load": ([vp], i),
        "bpf_object__close": ([vp], None),
        "bpf_object__btf": ([vp], vp),
        "bpf_object__next_map": ([vp, vp], vp),
        "bpf_object__next_program": ([vp, vp], vp),
        "bpf_object__find_program_by_name": ([vp, cp], vp),
        "bpf_object__find_map_by_name": ([vp, cp], vp),
        "bpf_program__fd": ([vp], i),
        "bpf_program__name": ([vp], cp),
        "bpf_map__fd": ([vp], i),
        "bpf_map__name": ([vp], cp),
        "bpf_map__type": ([vp], i),
        "bpf_map__is_internal": ([vp], ctypes.c_bool),
        "bpf_map__set_max_entries": ([vp, ctypes.c_uint32], i),
        "bpf_map__max_entries": ([vp], ctypes.c_uint32),
        "bpf_map__key_size": ([vp], ctypes.c_uint32),
        "bpf_map__value_size": ([vp], ctypes.c_uint32),
        "bpf_map__pin_path": ([vp], cp),
        "bpf_map__initial_value": ([vp, ctypes.POINTER(sz)], vp),
        "bpf_map__set_initial_value": ([vp, vp, sz], i),
        "btf__find_by_name_kind": ([vp, cp, ctypes.c_uint32], ctypes.c_int32),
        "btf__type_by_id": ([vp, ctypes.c_uint32], ctypes.POINTER(BtfType)),
        "btf__name_by_offset": ([vp, ctypes.c_uint32], cp),
        "libbpf_set_print": ([vp], vp),
        "libbpf_strerror": ([i, vp, sz], i),
        "libbpf_num_possible_cpus": ([], i),
        "ring_buffer__new": ([i, RING_SAMPLE_FN, vp, vp], vp),
        "ring_buffer__poll": ([vp, i], i),
        "ring_buffer__consume": ([vp], i),
        "ring_buffer__epoll_fd": ([vp], i),
        "ring_buffer__free": ([vp], None),
    }
    for name, (argtypes, restype) in protos.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype


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


#: ``BPF_PROG_TYPE_SCHED_CLS`` (tc programs) and ``BPF_FUNC_ktime_get_coarse_ns`` (5.11).
PROG_TYPE_SCHED_CLS = 3
FUNC_KTIME_GET_COARSE_NS = 160


# Probes: a three-instruction program loaded through libbpf's ``bpf_prog_load`` with the
# verifier's log on. Why not ``bpftool feature probe`` or ``libbpf_probe_bpf_helper``: Debian
# 12's bpftool 7.1 and libbpf 1.1 recognise an unavailable helper only by the verifier's old
# wording ("unknown func" / "invalid func"); newer kernels say "program of this type cannot
# use helper", so both report *every* helper as available to *every* program type (measured
# on 6.18: all 206 helpers for sched_cls, including the kprobe-only bpf_override_return).
# Upstream Cilium's ``bpf/probes`` do the same: emit a call and read the verdict.
_CALL = 0x85  # BPF_JMP | BPF_CALL
_MOV64_IMM = 0xB7  # BPF_ALU64 | BPF_MOV | BPF_K
_EXIT = 0x95  # BPF_JMP | BPF_EXIT
_LOG_SIZE = 4096
_UNSUPPORTED_HELPER = ("unknown func", "invalid func", "cannot use helper", "cannot call")


class _Insn(ctypes.Structure):
    """``struct bpf_insn`` (8 bytes)."""

    _fields_ = [
        ("code", ctypes.c_uint8),
        ("regs", ctypes.c_uint8),
        ("off", ctypes.c_int16),
        ("imm", ctypes.c_int32),
    ]


class _LoadOpts(ctypes.Structure):
    """libbpf 1.x ``struct bpf_prog_load_opts`` up to ``log_buf`` (``sz`` says how far)."""

    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("attempts", ctypes.c_int),
        ("expected_attach_type", ctypes.c_int),
        ("prog_btf_fd", ctypes.c_uint32),
        ("prog_flags", ctypes.c_uint32),
        ("prog_ifindex", ctypes.c_uint32),
        ("kern_version", ctypes.c_uint32),
        ("attach_btf_id", ctypes.c_uint32),
        ("attach_prog_fd", ctypes.c_uint32),
        ("attach_btf_obj_fd", ctypes.c_uint32),
        ("fd_array", ctypes.c_void_p),
        ("func_info", ctypes.c_void_p),
        ("func_info_cnt", ctypes.c_uint32),
        ("func_info_rec_size", ctypes.c_uint32),
        ("line_info", ctypes.c_void_p),
        ("line_info_cnt", ctypes.c_uint32),
        ("line_info_rec_size", ctypes.c_uint32),
        ("log_level", ctypes.c_uint32),
        ("log_size", ctypes.c_uint32),
        ("log_buf", ctypes.c_char_p),
    ]


def prog_load_probe(
    prog_type: int, insns: list[tuple[int, int]], attach_type: int
) -> tuple[int, str]:
    """Load ``insns`` (``(code, imm)``, registers 0) with the verifier log on.

    Returns ``(errno, log)``: errno 0 = loaded (the program is closed again at once).
    """
    lib = libbpf()
    fn = lib.bpf_prog_load
    fn.argtypes = [
        ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t,
        ctypes.POINTER(_LoadOpts),
    ]  # fmt: skip
    fn.restype = ctypes.c_int
    prog = (_Insn * len(insns))(*[_Insn(code, 0, 0, imm) for code, imm in insns])
    log = ctypes.create_string_buffer(_LOG_SIZE)
    opts = _LoadOpts(sz=ctypes.sizeof(_LoadOpts), expected_attach_type=attach_type)
    opts.log_level, opts.log_size = 1, _LOG_SIZE
    opts.log_buf = ctypes.cast(log, ctypes.c_char_p)
    ctypes.set_errno(0)
    fd = fn(prog_type, b"cilia_probe", b"GPL", ctypes.byref(prog), len(insns), ctypes.byref(opts))
    if fd >= 0:
        os.close(fd)
        return 0, ""
    return ctypes.get_errno() or -fd or errno.EINVAL, log.value.decode(errors="replace")


def helper_available(prog_type: int, helper: int, attach_type: int = 0) -> bool:
    """True when programs of ``prog_type`` (expected attach type ``attach_type``) may call
    helper number ``helper`` on the running kernel: a program calling it is loaded, or
    refused past the helper lookup (for its arguments), so the verifier knows it.

    Raises:
        LibbpfError: not allowed to load programs (EPERM: not root), libbpf missing.
    """
    err, log = prog_load_probe(
        prog_type, [(_CALL, helper), (_MOV64_IMM, 1), (_EXIT, 0)], attach_type
    )
    if err == errno.EPERM:
        raise LibbpfError(f"cannot probe helper {helper}", err)
    return err == 0 or not any(s in log for s in _UNSUPPORTED_HELPER)


def attach_type_available(prog_type: int, attach_type: int) -> bool:
    """True when the kernel loads a program of ``prog_type`` for ``attach_type``.

    Raises:
        LibbpfError: not allowed to load programs (EPERM: not root), libbpf missing.
    """
    err, _ = prog_load_probe(prog_type, [(_MOV64_IMM, 1), (_EXIT, 0)], attach_type)
    if err == errno.EPERM:
        raise LibbpfError(f"cannot probe attach type {attach_type}", err)
    return err == 0


def map_keys(fd: int, key_type: type[K]) -> Iterator[K]:
    """Every key of the map behind ``fd`` (``BPF_MAP_GET_NEXT_KEY`` from the start), in the
    kernel's iteration order, each a fresh ``key_type`` copy; ends at the last key."""
    lib = libbpf()
    key: K | None = None
    while True:
        nxt = key_type()
        rc = lib.bpf_map_get_next_key(fd, None if key is None else ctypes.byref(key),
                                      ctypes.byref(nxt))  # fmt: skip
        if rc != 0:
            return
        key = nxt
        yield nxt


class MapInfo(ctypes.Structure):
    """The leading fields of ``struct bpf_map_info`` (linux/bpf.h); the kernel fills as many
    bytes as it is given (``BPF_OBJ_GET_INFO_BY_FD``)."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * 16),
    ]


def map_info(fd: int, what: str) -> MapInfo:
    """Type, key and value sizes, max_entries and name of the map behind ``fd``.

    Raises:
        LibbpfError: ``fd`` is not a BPF map (``what`` names it in the message).
    """
    info = MapInfo()
    size = ctypes.c_uint32(ctypes.sizeof(info))
    rc = libbpf().bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size))
    if rc != 0:
        raise LibbpfError(f"cannot read the map info of {what}", _err(rc))
    return info


def check_layout(fd: int, what: str, key_type: type[Any], value_type: type[Any]) -> None:
    """Check that the map behind ``fd`` has the key and value sizes of the ctypes layouts:
    the kernel copies ``key_size``/``value_size`` bytes to and from the buffers, so a map of
    another layout (a pin of an older agent or another program, a stale object) would read
    garbage or write past them (a segfault of ``cilia-agent bpf … list``).

    Raises:
        LibbpfError: (``errno`` EINVAL) the sizes differ, both named in the message.
    """
    info = map_info(fd, what)
    want = (ctypes.sizeof(key_type), ctypes.sizeof(value_type))
    if (info.key_size, info.value_size) != want:
        raise LibbpfError(
            f"map {what} has {info.key_size}-byte keys and {info.value_size}-byte values, "
            f"this agent's {key_type.__name__}/{value_type.__name__} are {want[0]}/{want[1]} "
            "bytes: not this agent's map (a pin left by another version or program, or an "
            "object not rebuilt by `make bpf`)",
            errno.EINVAL,
        )


class PinnedMap(Generic[K, V]):
    """A BPF map (hash, LRU, LPM trie, array) opened by its pin path or from an fd
    (:meth:`from_fd`), with typed keys and values; also a mapping (``m[k]``, ``m[k] = v``,
    ``del m[k]``, ``for k in m``, ``len(m)``).

    Args:
        path: the pin, e.g. ``/sys/fs/bpf/cilia/cilium_lb4_services_v2``.
        key_type, value_type: ctypes layouts (``datapath.layout``, ``loadbalancer.layout``).

    Raises:
        LibbpfError: no such pin, no permission (root needed), libbpf missing, or the
            map's key or value size is not the layouts' (:func:`check_layout`).
    """

    def __init__(self, path: pathlib.Path, key_type: type[K], value_type: type[V]) -> None:
        self.path = path
        self.key_type = key_type
        self.value_type = value_type
        self.fd = obj_get(path, "map")
        try:
            check_layout(self.fd, str(path), key_type, value_type)
        except LibbpfError:
            self.close()
            raise

    @classmethod
    def from_fd(cls, fd: int, name: str, key_type: type[K], value_type: type[V]) -> PinnedMap[K, V]:
        """A handle on the map behind ``fd`` (e.g. :meth:`BpfObject.map_fd`); the handle
        owns a duplicate of ``fd``, so closing either leaves the other open. ``name`` is
        used in messages."""
        check_layout(fd, name, key_type, value_type)
        self = cls.__new__(cls)
        self.path = pathlib.Path(name)
        self.key_type = key_type
        self.value_type = value_type
        self.fd = os.dup(fd)
        return self

    def __getitem__(self, key: K) -> V:
        """The value of ``key``. Raises KeyError: absent."""
        value = self.lookup(key)
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: K, value: V) -> None:
        """:meth:`update`."""
        self.update(key, value)

    def __delitem__(self, key: K) -> None:
        """:meth:`delete`; raises KeyError when ``key`` was absent."""
        if not self.delete(key):
            raise KeyError(key)

    def __iter__(self) -> Iterator[K]:
        return self.keys()

    def keys(self) -> Iterator[K]:
        """Every key, in the kernel's iteration order (copies)."""
        return map_keys(self.fd, self.key_type)

    def clear(self) -> int:
        """Delete every entry (the keys read first, in batches where the map allows);
        returns how many were deleted."""
        return sum(self.delete(key) for key in [k for k, _ in self.batch_items()])

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())

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

    def batch_items(self, batch: int = 4096) -> Iterator[tuple[K, V]]:
        """Every (key, value) (copies), read ``batch`` entries per ``BPF_MAP_LOOKUP_BATCH``
        (hash and LRU maps, kernel 5.6) instead of two syscalls per entry; a map or kernel
        without batch lookups (an LPM trie: EINVAL; ENOTSUPP) falls back to :meth:`items`.
        The kernel walks a hash map by bucket, so entries deleted meanwhile do not restart
        the walk.

        Raises:
            LibbpfError: a batch failed for another reason (ENOSPC: one bucket holds more
                than ``batch`` entries).
        """
        fn = libbpf().bpf_map_lookup_batch
        fn.argtypes = [ctypes.c_int, *(ctypes.c_void_p,) * 5, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        keys = (self.key_type * batch)()
        values = (self.value_type * batch)()
        key_size, value_size = ctypes.sizeof(self.key_type), ctypes.sizeof(self.value_type)
        token_in, token_out = ctypes.c_uint64(), ctypes.c_uint64()  # the kernel's u32 bucket
        first = True
        while True:
            count = ctypes.c_uint32(batch)
            rc = fn(self.fd, None if first else ctypes.byref(token_in), ctypes.byref(token_out),
                    keys, values, ctypes.byref(count), None)  # fmt: skip
            err = _err(rc) if rc < 0 else 0
            if first and err in (errno.EINVAL, _ENOTSUPP, errno.EOPNOTSUPP):
                yield from self.items()
                return
            if err not in (0, errno.ENOENT):
                raise LibbpfError(f"cannot read {self.path.name} in batches", err)
            for i in range(count.value):
                key = self.key_type.from_buffer_copy(keys, i * key_size)
                value = self.value_type.from_buffer_copy(values, i * value_size)
                yield cast(K, key), cast(V, value)
            if err == errno.ENOENT:
                return
            token_in.value = token_out.value
            first = False

    def close(self) -> None:
        """Close the map's file descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> PinnedMap[K, V]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PerCpuMap(Generic[K, V]):
    """A per-CPU hash or array map (``BPF_MAP_TYPE_PERCPU_*``): each key holds one value per
    possible CPU, read together (the kernel copies ``ncpus`` values, each padded to 8 bytes).

    Args:
        fd: the map's fd (duplicated; the handle owns its copy).
        name: for messages.
        key_type, value_type: ctypes layouts.
    """

    def __init__(self, fd: int, name: str, key_type: type[K], value_type: type[V]) -> None:
        self.name = name
        self.key_type = key_type
        self.value_type = value_type
        self.ncpus = int(libbpf().libbpf_num_possible_cpus())
        if self.ncpus <= 0:
            raise LibbpfError("cannot count possible CPUs", -self.ncpus or errno.EIO)
        self.stride = (ctypes.sizeof(value_type) + 7) // 8 * 8
        check_layout(fd, name, key_type, value_type)
        self.fd = os.dup(fd)

    def _values(self, buf: ctypes.Array[ctypes.c_char]) -> list[V]:
        out: list[V] = []
        for cpu in range(self.ncpus):
            value = self.value_type()
            ctypes.memmove(ctypes.byref(value), ctypes.byref(buf, cpu * self.stride),
                           ctypes.sizeof(value))  # fmt: skip
            out.append(value)
        return out

    def lookup(self, key: K) -> list[V] | None:
        """The per-CPU values of ``key`` (index = CPU number), or None."""
        buf = ctypes.create_string_buffer(self.stride * self.ncpus)
        if libbpf().bpf_map_lookup_elem(self.fd, ctypes.byref(key), buf) != 0:
            return None
        return self._values(buf)

    def items(self) -> Iterator[tuple[K, list[V]]]:
        """Every (key, per-CPU values), in the kernel's iteration order (copies)."""
        lib = libbpf()
        buf = ctypes.create_string_buffer(self.stride * self.ncpus)
        for key in map_keys(self.fd, self.key_type):
            if lib.bpf_map_lookup_elem(self.fd, ctypes.byref(key), buf) != 0:
                continue  # deleted between the two calls
            yield key, self._values(buf)

    def close(self) -> None:
        """Close the map's file descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
