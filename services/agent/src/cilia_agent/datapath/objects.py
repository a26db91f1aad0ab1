"""BPF objects compiled ahead of time (``make bpf``: ``bpf/bpf_*.c`` → ``build/bpf/*.o``),
loaded with Debian's ``libbpf.so.1`` through ctypes.

:meth:`BpfObject.load` opens an ELF object, points every map declared with
``__uint(pinning, LIBBPF_PIN_BY_NAME)`` at ``<pin_dir>/<map name>`` (libbpf reuses a pin
whose type, key/value size, max_entries and flags match, and pins a new map otherwise), sets
``max_entries`` of the maps the caller sizes, writes the program's load-time configuration
into ``const volatile struct … CONFIG`` (``.rodata``: the verifier sees constants and prunes
the branches a configuration disables), and loads the programs. Upstream Cilium compiles with
clang and loads ELF objects the same way (its loader is Go; this one is libbpf's).

:class:`RingBuffer` reads a ``BPF_MAP_TYPE_RINGBUF`` map with libbpf's ``ring_buffer__*``, or
(:meth:`RingBuffer.drain`) many fixed-size records per Python call straight from the mapped
ring, following the kernel's ring-buffer ABI (see :class:`RingBuffer`).

Where objects are: :func:`default_bpf_dir` (``--bpf-dir`` / ``$CILIA_BPF_DIR``, the
checkout's ``build/bpf``, or the image's ``/opt/cilia/bpf``); :func:`object_path` refuses a
missing object, and in a checkout one older than its sources, with a message naming
``make bpf``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import pathlib
import platform
import select
import struct
import threading
from collections.abc import Callable, Mapping
from typing import TypeVar

from cilia_agent.datapath import libbpf as lb
from cilia_agent.datapath.errors import BpfUnavailable
from cilia_agent.datapath.libbpf import LibbpfError, PerCpuMap, PinnedMap

__all__ = [
    "BpfObject",
    "BpfUnavailable",
    "RingBuffer",
    "default_bpf_dir",
    "object_path",
]

log = logging.getLogger(__name__)

K = TypeVar("K", bound=ctypes.Structure | ctypes.c_uint32 | ctypes.c_uint16)
V = TypeVar("V", bound=ctypes.Structure | ctypes.c_uint8 | ctypes.c_uint32 | ctypes.c_uint64)

IMAGE_BPF_DIR = pathlib.Path("/opt/cilia/bpf")
CONFIG_VAR = "CONFIG"
VERIFIER_LOG_SIZE = 1 << 20  # bytes of verifier log kept for a failed load (the tail)
VERIFIER_LOG_TAIL = 40  # lines of it quoted in BpfUnavailable
LIBBPF_MESSAGES_KEPT = 20  # libbpf warnings quoted in BpfUnavailable

_REPO = pathlib.Path(__file__).resolve().parents[5]


def default_bpf_dir() -> pathlib.Path:
    """The directory of the compiled objects: ``$CILIA_BPF_DIR``, ``<checkout>/build/bpf``
    when this module runs from a checkout (``<checkout>/bpf/bpf_lxc.c`` exists), else the
    image's ``/opt/cilia/bpf``."""
    env = os.environ.get("CILIA_BPF_DIR")
    if env:
        return pathlib.Path(env)
    if (_REPO / "bpf" / "bpf_lxc.c").is_file():
        return _REPO / "build" / "bpf"
    return IMAGE_BPF_DIR


def object_path(bpf_dir: pathlib.Path, stem: str, source_stem: str = "") -> pathlib.Path:
    """``<bpf_dir>/<stem>.o``, checked.

    In a checkout (``bpf_dir`` is ``<repo>/build/bpf`` and ``<repo>/bpf/<source_stem or
    stem>.c`` exists) the object must be newer than that source and every ``bpf/lib/*.h``
    (``source_stem``: a variant built from another object's source, e.g. ``bpf_sock_compat``
    from ``bpf_sock.c``).

    Raises:
        BpfUnavailable: the object is missing or stale (the message says to run
            ``make bpf``).
    """
    path = bpf_dir / f"{stem}.o"
    src_dir = bpf_dir.parent.parent / "bpf"
    source = src_dir / f"{source_stem or stem}.c"
    in_checkout = bpf_dir.name == "bpf" and bpf_dir.parent.name == "build" and source.is_file()
    if not path.is_file():
        hint = "run `make bpf`" if in_checkout else "run `make bpf` in a checkout"
        raise BpfUnavailable(
            f"no compiled BPF object {path}: {hint}, or point --bpf-dir / CILIA_BPF_DIR at "
            "the directory holding the .o files"
        )
    if in_checkout:
        built = path.stat().st_mtime
        for src in (source, *sorted((src_dir / "lib").glob("*.h"))):
            if src.stat().st_mtime > built:
                raise BpfUnavailable(f"{path} is older than {src}: run `make bpf`")
    return path


# ----- libbpf's messages ----------------------------------------------------------------------

_LIBBPF_WARN = 0  # enum libbpf_print_level: LIBBPF_WARN, LIBBPF_INFO, LIBBPF_DEBUG
_LIBBPF_DEBUG = 2
_collect = threading.local()
_load_lock = threading.Lock()
_printer: object = None


def _install_printer() -> None:
    """Route libbpf's messages to logging (debug), keeping the warnings of the load in
    progress on this thread for its error message."""
    global _printer
    if _printer is not None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    vsnprintf = libc.vsnprintf
    vsnprintf.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p]
    vsnprintf.restype = ctypes.c_int

    def printer(level: int, fmt: bytes | None, args: int | None) -> int:
        if level >= _LIBBPF_DEBUG or fmt is None:
            return 0
        buf = ctypes.create_string_buffer(1024)
        vsnprintf(buf, len(buf), fmt, args)
        text = buf.value.decode(errors="replace").rstrip().removeprefix("libbpf: ")
        kept: list[str] | None = getattr(_collect, "messages", None)
        if kept is not None and level == _LIBBPF_WARN:
            kept.append(text)
        log.debug("libbpf: %s", text)
        return 0

    _printer = lb.PRINT_FN(printer)
    lb.libbpf().libbpf_set_print(ctypes.cast(_printer, ctypes.c_void_p))


# ----- objects --------------------------------------------------------------------------------


def _config_offset(lib: ctypes.CDLL, obj: int, path: pathlib.Path) -> tuple[int, int]:
    """(offset, size) of ``CONFIG`` in the object's ``.rodata`` (from its BTF DATASEC).

    Raises:
        BpfUnavailable: no BTF, no ``.rodata`` or no ``CONFIG`` in it.
    """
    btf = lib.bpf_object__btf(obj)
    if not btf:
        raise BpfUnavailable(f"{path} has no BTF (compile with -g)")
    sec_id = lib.btf__find_by_name_kind(btf, b".rodata", lb.BTF_KIND_DATASEC)
    if sec_id < 0:
        raise BpfUnavailable(f"{path} has no .rodata: declare `const volatile struct … CONFIG`")
    sec = lib.btf__type_by_id(btf, sec_id)
    vlen = sec.contents.info & 0xFFFF
    infos = ctypes.cast(
        ctypes.addressof(sec.contents) + ctypes.sizeof(lb.BtfType),
        ctypes.POINTER(lb.BtfVarSecinfo * vlen),
    ).contents
    for info in infos:
        var = lib.btf__type_by_id(btf, info.type)
        if lib.btf__name_by_offset(btf, var.contents.name_off) == CONFIG_VAR.encode():
            return int(info.offset), int(info.size)
    raise BpfUnavailable(f"{path} has no {CONFIG_VAR} variable in .rodata")


def _find(lib: ctypes.CDLL, finder: str, obj: int, name: str) -> int:
    ptr = getattr(lib, finder)(obj, name.encode())
    if not ptr:
        raise KeyError(name)
    return int(ptr)


def _check_pinned_size(pin: pathlib.Path, entries: int) -> None:
    """Refuse, naming both sizes and the way out, a pinned map whose ``max_entries`` is not
    ``entries`` (a map-size flag changed since the pin was made): libbpf would refuse it as a
    bare "parameter mismatch", and replacing it would drop what the running pods' policy and
    connections hold. No pin, or not a map: nothing to say (libbpf pins or refuses it).

    Raises:
        BpfUnavailable: the sizes differ.
    """
    if not pin.exists():
        return
    try:
        fd = lb.obj_get(pin, "map")
    except LibbpfError:
        return
    try:
        pinned = int(lb.map_info(fd, str(pin)).max_entries)
    except LibbpfError:
        return
    finally:
        os.close(fd)
    if pinned != entries:
        raise BpfUnavailable(
            f"pinned map {pin} has {pinned} entries, this start asks {entries}: start with the "
            f"size it was made with, or, to apply the new one (the endpoints' maps start "
            f"empty), stop the agent and remove the pins (cilia-agent init clean-state "
            f"--bpf-state --bpf-pin-dir {pin.parent})"
        )


class BpfObject:
    """One loaded ELF object (its programs and maps), created with :meth:`load`.

    File descriptors stay valid until :meth:`close`; attached programs and pinned maps
    outlive it in the kernel.
    """

    def __init__(self, path: pathlib.Path, obj: int) -> None:
        self.path = path
        self._obj: int | None = obj

    @classmethod
    def load(
        cls,
        path: pathlib.Path,
        *,
        pin_dir: pathlib.Path,
        config: ctypes.Structure | None = None,
        max_entries: Mapping[str, int] | None = None,
    ) -> BpfObject:
        """Open ``path``, configure it and load it into the kernel.

        Args:
            path: the ``.o`` (see :func:`object_path`).
            pin_dir: bpffs directory of the pinned maps (created when missing).
            config: the program's ``CONFIG`` (a ctypes mirror of the same size), written
                into ``.rodata`` before load; None keeps the defaults compiled in.
            max_entries: map name → entries, set before load (the C default otherwise).

        Raises:
            BpfUnavailable: the file cannot be opened, a named map or ``CONFIG`` is
                missing or of another size, a pinned map has another ``max_entries``
                (:func:`_check_pinned_size`: both sizes and the way out) or otherwise does
                not match (libbpf's "parameter mismatch"), or the verifier refused a program (its log's tail
                in the message).
        """
        lib = lb.libbpf()
        _install_printer()
        created = not pin_dir.exists()
        try:
            pin_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BpfUnavailable(
                f"cannot create {pin_dir}: is bpffs mounted? ({exc})", kernel=True
            ) from exc
        log_buf = ctypes.create_string_buffer(VERIFIER_LOG_SIZE)
        opts = lb.OpenOpts(
            sz=ctypes.sizeof(lb.OpenOpts),
            pin_root_path=str(pin_dir).encode(),
            kernel_log_buf=ctypes.cast(log_buf, ctypes.c_void_p),
            kernel_log_size=VERIFIER_LOG_SIZE,
        )
        with _load_lock:
            _collect.messages = []
            obj = 0
            try:
                obj = lib.bpf_object__open_file(str(path).encode(), ctypes.byref(opts)) or 0
                if not obj:
                    raise BpfUnavailable(
                        cls._failure(path, "cannot open", ctypes.get_errno() or errno.EINVAL)
                    )
                for name, entries in (max_entries or {}).items():
                    try:
                        m = _find(lib, "bpf_object__find_map_by_name", obj, name)
                    except KeyError:
                        raise BpfUnavailable(f"{path} has no map {name}") from None
                    _check_pinned_size(pin_dir / name, entries)
                    rc = lib.bpf_map__set_max_entries(m, entries)
                    if rc < 0:
                        raise BpfUnavailable(cls._failure(path, f"max_entries of {name}", -rc))
                if config is not None:
                    cls._write_config(lib, obj, path, config)
                rc = lib.bpf_object__load(obj)
                if rc < 0:
                    raise BpfUnavailable(
                        cls._failure(path, "cannot load", -rc, log_buf.value), kernel=True
                    )
            except BaseException:
                if obj:
                    lib.bpf_object__close(obj)
                if created:  # a failed first start leaves no empty pin directory behind
                    with contextlib.suppress(OSError):
                        pin_dir.rmdir()
                raise
            finally:
                _collect.messages = None
        log.debug("bpf object loaded", extra={"path": str(path), "pin_dir": str(pin_dir)})
        return cls(path, obj)

    @staticmethod
    def _write_config(
        lib: ctypes.CDLL, obj: int, path: pathlib.Path, config: ctypes.Structure
    ) -> None:
        offset, size = _config_offset(lib, obj, path)
        if size != ctypes.sizeof(config):
            raise BpfUnavailable(
                f"{CONFIG_VAR} of {path} is {size} bytes, the Python mirror "
                f"{type(config).__name__} {ctypes.sizeof(config)}: rebuild (`make bpf`) or "
                "fix the mirror"
            )
        rodata = 0
        m = lib.bpf_object__next_map(obj, None)
        while m:
            if lib.bpf_map__is_internal(m) and lib.bpf_map__name(m).endswith(b".rodata"):
                rodata = m
                break
            m = lib.bpf_object__next_map(obj, m)
        if not rodata:
            raise BpfUnavailable(f"{path} has no .rodata map")
        total = ctypes.c_size_t()
        data = lib.bpf_map__initial_value(rodata, ctypes.byref(total))
        if not data or offset + size > total.value:
            raise BpfUnavailable(f"{path}: .rodata is smaller than {CONFIG_VAR}")
        image = ctypes.create_string_buffer(ctypes.string_at(data, total.value), total.value)
        ctypes.memmove(ctypes.addressof(image) + offset, ctypes.addressof(config), size)
        rc = lib.bpf_map__set_initial_value(rodata, image, total.value)
        if rc < 0:
            raise BpfUnavailable(BpfObject._failure(path, "cannot set CONFIG", -rc))

    @staticmethod
    def _failure(path: pathlib.Path, what: str, err: int, verifier: bytes = b"") -> str:
        parts = [f"{what} {path}: {lb.strerror(err)}"]
        kept: list[str] = getattr(_collect, "messages", None) or []
        if kept:
            parts.append("libbpf: " + " | ".join(kept[-LIBBPF_MESSAGES_KEPT:]))
        lines = verifier.decode(errors="replace").strip().splitlines()
        if lines:
            parts.append("verifier log (tail):\n" + "\n".join(lines[-VERIFIER_LOG_TAIL:]))
        return "; ".join(parts)

    def _handle(self) -> int:
        if self._obj is None:
            raise ValueError(f"{self.path} is closed")
        return self._obj

    def prog_fd(self, name: str) -> int:
        """The fd of program ``name`` (the C function's name).

        Raises:
            KeyError: no such program.
        """
        lib = lb.libbpf()
        return int(lib.bpf_program__fd(_find(lib, "bpf_object__find_program_by_name",
                                             self._handle(), name)))  # fmt: skip

    def map_fd(self, name: str) -> int:
        """The fd of map ``name`` (valid until :meth:`close`).

        Raises:
            KeyError: no such map.
        """
        lib = lb.libbpf()
        return int(
            lib.bpf_map__fd(_find(lib, "bpf_object__find_map_by_name", self._handle(), name))
        )

    def max_entries(self, name: str) -> int:
        """The loaded map's ``max_entries``. Raises KeyError: no such map."""
        lib = lb.libbpf()
        return int(lib.bpf_map__max_entries(
            _find(lib, "bpf_object__find_map_by_name", self._handle(), name)))  # fmt: skip

    def map(self, name: str, key_type: type[K], value_type: type[V]) -> PinnedMap[K, V]:
        """A typed handle on map ``name`` with its own fd (close it, or use ``with``).

        Raises:
            KeyError: no such map.
        """
        return PinnedMap.from_fd(self.map_fd(name), name, key_type, value_type)

    def percpu_map(self, name: str, key_type: type[K], value_type: type[V]) -> PerCpuMap[K, V]:
        """A typed handle on the per-CPU map ``name`` (values are per-CPU lists).

        Raises:
            KeyError: no such map.
        """
        return PerCpuMap(self.map_fd(name), name, key_type, value_type)

    def ring_buffer(self, name: str, callback: Callable[[bytes], None]) -> RingBuffer:
        """A :class:`RingBuffer` on the ring-buffer map ``name``.

        Raises:
            KeyError: no such map. LibbpfError: not a ring buffer.
        """
        return RingBuffer(self.map_fd(name), callback)

    def close(self) -> None:
        """Release the object's fds (idempotent). Attached programs and pins stay."""
        if self._obj is not None:
            lb.libbpf().bpf_object__close(self._obj)
            self._obj = None

    def __enter__(self) -> BpfObject:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The BPF ring buffer as the kernel maps it to user space (include/uapi/linux/bpf.h and
# kernel/bpf/ringbuf.c; libbpf's ring_buffer__consume reads it the same way):
#   map offset 0, one page, read-write:  u64 consumer_pos (the reader's position);
#   map offset 1 page, read-only:        u64 producer_pos, then from the next page the data
#                                        area of max_entries bytes (a power of two), mapped
#                                        twice in a row, so a record that wraps around the end
#                                        is contiguous in the mapping.
# Positions only grow; a position's byte is at data[pos & (max_entries - 1)]. Each record is an
# 8-byte header {u32 len; u32 pg_off} followed by len bytes, the next record starting 8-byte
# aligned. len has bit 31 (BUSY) set from bpf_ringbuf_reserve until the record is committed and
# bit 30 (DISCARD) when it was discarded. The producer writes a record's header (BUSY) before it
# publishes the new producer_pos (store-release), and clears BUSY after writing the data
# (xchg); the consumer reads producer_pos (load-acquire), then each header (load-acquire), then
# the data, and publishes consumer_pos (store-release) after it read the records.
RINGBUF_HDR_SIZE = 8
RINGBUF_BUSY_BIT = 1 << 31
RINGBUF_DISCARD_BIT = 1 << 30
_U64 = struct.Struct("=Q")
_U32 = struct.Struct("=I")
# Loads are not reordered with other loads, nor stores with earlier loads, on x86-64 (its
# total store order), so plain loads and stores in program order give the acquire/release
# order the ABI asks for. Elsewhere :meth:`RingBuffer.drain` is not offered and the reader
# uses libbpf's consume (which has the barriers).
DIRECT_READ_SUPPORTED = platform.machine().lower() in ("x86_64", "amd64")


class RingBuffer:
    """Consumer of a ``BPF_MAP_TYPE_RINGBUF`` map (libbpf ``ring_buffer__new/poll/consume``).

    Two ways to read, not to be mixed within one drain (both advance the same
    ``consumer_pos``, so they may alternate between calls):

    - :meth:`poll` / :meth:`consume`: libbpf calls ``callback`` once per record (a ctypes
      callback into Python each time, about 2-4 µs per record);
    - :meth:`wait` (for a wakeup) + :meth:`drain` (x86-64, :data:`DIRECT_READ_SUPPORTED`): the records are
      read from the mapped ring by Python itself following the kernel ABI written above this
      class; a run of committed records of one size is handed over as one ``bytes`` block
      (headers included), so the cost per record is a small share of one memory copy.

    Args:
        map_fd: the ring buffer map's fd (duplicated; the consumer owns its copy).
        callback: called with each record (a ``bytes`` copy) from :meth:`poll` /
            :meth:`consume`, on the calling thread. An exception it raises is logged and
            the record skipped.

    Raises:
        LibbpfError: libbpf cannot map the buffer (not a ring buffer, no permission).
    """

    def __init__(self, map_fd: int, callback: Callable[[bytes], None]) -> None:
        self._callback = callback

        def sample(_ctx: int | None, data: int | None, size: int) -> int:
            try:
                callback(ctypes.string_at(data, size) if data else b"")
            except Exception:
                log.exception("ring buffer callback failed; record skipped")
            return 0

        self._sample = lb.RING_SAMPLE_FN(sample)  # kept alive as long as the buffer
        self._fd = os.dup(map_fd)
        ctypes.set_errno(0)
        rb = lb.libbpf().ring_buffer__new(self._fd, self._sample, None, None)
        if not rb:
            err = ctypes.get_errno() or errno.EINVAL
            os.close(self._fd)
            raise LibbpfError("cannot open the ring buffer", err)
        self._rb: int | None = int(rb)
        self._consumer: mmap.mmap | None = None
        self._producer: mmap.mmap | None = None
        self._mask = 0
        self._epoll: select.epoll | None = None

    def _map(self) -> tuple[mmap.mmap, mmap.mmap]:
        """Map the consumer page and the producer page + data area (once)."""
        if self._consumer is None or self._producer is None:
            self._handle()
            size = int(lb.map_info(self._fd, "ring buffer").max_entries)
            page = mmap.PAGESIZE
            self._consumer = mmap.mmap(
                self._fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
            self._producer = mmap.mmap(
                self._fd, page + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page
            )
            self._mask = size - 1
        return self._consumer, self._producer

    def wait(self, timeout_ms: int) -> bool:
        """Wait up to ``timeout_ms`` for the producer's next wakeup, without reading (the
        GIL is released). Edge-triggered (``epoll`` with ``EPOLLET`` on the map fd): records
        the programs write without a wakeup (``BPF_RB_NO_WAKEUP``) do not end the wait, so a
        caller that drains after every wait reads many records per wakeup instead of
        spinning while data trickles in (a level-triggered poll returns at once whenever
        the ring is not empty).

        Returns:
            True when a wakeup came, False on timeout.
        """
        self._handle()
        if self._epoll is None:
            self._epoll = select.epoll(1)
            self._epoll.register(self._fd, select.EPOLLIN | select.EPOLLET)
        return bool(self._epoll.poll(timeout_ms / 1000, 1))

    def drain(
        self,
        record_size: int,
        on_block: Callable[[bytes, int], None],
        on_record: Callable[[bytes], None],
    ) -> int:
        """Read every committed record now in the ring, without libbpf's per-record callback.

        Runs of consecutive records of exactly ``record_size`` bytes go to
        ``on_block(block, count)``: ``block`` holds ``count`` records, each the 8-byte
        ring-buffer header followed by the record (stride ``record_size + 8``, which must be a
        multiple of 8). Any other committed record goes to ``on_record(record)``. Discarded
        records are skipped; reading stops at the first record still being written (BUSY).
        ``consumer_pos`` is advanced past what was read, after the callbacks returned.

        Returns:
            The number of records handed over.

        Raises:
            RuntimeError: not x86-64 (:data:`DIRECT_READ_SUPPORTED`).
            ValueError: the buffer is closed, or ``record_size + 8`` is not a multiple of 8.
        """
        if not DIRECT_READ_SUPPORTED:
            raise RuntimeError(
                f"direct ring-buffer reads are not supported on {platform.machine()}"
            )
        stride = record_size + RINGBUF_HDR_SIZE
        if stride % 8:
            raise ValueError(f"record size {record_size} + 8 is not a multiple of 8")
        consumer, producer = self._map()
        base = mmap.PAGESIZE  # the data area in the producer mapping
        mask = self._mask
        pos = _U64.unpack_from(consumer, 0)[0]
        prod = _U64.unpack_from(producer, 0)[0]
        words = stride // 4
        delivered = 0
        while pos < prod:
            start = base + (pos & mask)
            runs = (prod - pos) // stride
            if runs:
                # The len word of each record, were all of them ``record_size`` long: a
                # strided view read before the data is copied (headers first, as the ABI says).
                with (
                    memoryview(producer) as whole,
                    whole[start : start + runs * stride] as area,
                    area.cast("I") as ints,
                ):
                    lens = ints[0::words].tolist()
                good = runs if lens.count(record_size) == runs else _leading(lens, record_size)
                if good:
                    on_block(producer[start : start + good * stride], good)
                    delivered += good
                    pos += good * stride
                    continue
            raw_len = _U32.unpack_from(producer, start)[0]
            if raw_len & RINGBUF_BUSY_BIT:
                break
            size = raw_len & ~(RINGBUF_BUSY_BIT | RINGBUF_DISCARD_BIT)
            if not raw_len & RINGBUF_DISCARD_BIT:
                data = start + RINGBUF_HDR_SIZE
                on_record(producer[data : data + size])
                delivered += 1
            pos += (size + RINGBUF_HDR_SIZE + 7) & ~7
        _U64.pack_into(consumer, 0, pos)
        return delivered

    def _handle(self) -> int:
        if self._rb is None:
            raise ValueError("ring buffer is closed")
        return self._rb

    def poll(self, timeout_ms: int) -> int:
        """Wait up to ``timeout_ms`` (the GIL is released) and deliver what arrived;
        returns the number of records (0 when interrupted by a signal).

        Raises:
            LibbpfError: epoll failed.
        """
        n = int(lb.libbpf().ring_buffer__poll(self._handle(), timeout_ms))
        if n == -errno.EINTR:
            return 0
        if n < 0:
            raise LibbpfError("ring buffer poll failed", -n)
        return n

    def consume(self) -> int:
        """Deliver every record available now, without waiting; returns how many.

        Raises:
            LibbpfError: reading failed.
        """
        n = int(lb.libbpf().ring_buffer__consume(self._handle()))
        if n < 0:
            raise LibbpfError("ring buffer consume failed", -n)
        return n

    def close(self) -> None:
        """Free the consumer (idempotent)."""
        for mapping in (self._consumer, self._producer):
            if mapping is not None:
                mapping.close()
        self._consumer = self._producer = None
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None
        if self._rb is not None:
            lb.libbpf().ring_buffer__free(self._rb)
            self._rb = None
            with contextlib.suppress(OSError):
                os.close(self._fd)

    def __enter__(self) -> RingBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _leading(values: list[int], wanted: int) -> int:
    """How many items at the start of ``values`` equal ``wanted``."""
    for i, value in enumerate(values):
        if value != wanted:
            return i
    return len(values)
