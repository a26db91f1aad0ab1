"""Layouts of C types as the compiler laid them out (BTF), to check ``layout``'s mirrors.

``make bpf`` compiles ``bpf_lxc.c`` with BTF (``-g``) and libbpf loads that BTF with every map
it creates, so a loaded map names its BTF object (``btf_id``) and, through the map's
definition (``__type(key, …)``), its key and value types. ``bpftool -j btf dump id N``
prints that object; :class:`Btf` reads it.
:func:`ctypes_layout` gives the same shape for a ctypes mirror, and :func:`layout_diff` the
differences (field names, byte offsets, sizes, total size) in words a person can act on.

Only what the mirrors use is read: STRUCT/UNION members at byte offsets (no bitfields), INT,
TYPEDEF/CONST/VOLATILE/RESTRICT, ARRAY, PTR and ENUM sizes.

Source: the kernel's BTF format (Documentation/bpf/btf.rst: kinds, ``bits_offset``, map
key/value type ids); bpftool's JSON output of ``btf dump`` and ``map show``.
"""

from __future__ import annotations

import ctypes
import json
import pathlib
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_QUALIFIERS = frozenset({"TYPEDEF", "CONST", "VOLATILE", "RESTRICT", "TYPE_TAG"})


class BtfError(Exception):
    """bpftool failed or the BTF lacks what was asked (message names the map/type)."""


@dataclass(frozen=True)
class Field:
    """One member: name, byte offset from the start of the struct, size in bytes."""

    name: str
    offset: int
    size: int


@dataclass(frozen=True)
class Layout:
    """A type's shape: its name, total size in bytes, and members (empty for scalars)."""

    name: str
    size: int
    fields: tuple[Field, ...] = ()


class Btf:
    """One BTF object as ``bpftool -j btf dump`` prints it (``{"types": [...]}``)."""

    def __init__(self, dump: Mapping[str, Any]) -> None:
        self._types: dict[int, Mapping[str, Any]] = {int(t["id"]): t for t in dump["types"]}

    def find(self, name: str, kind: str = "STRUCT") -> int:
        """The id of the type ``name`` of ``kind``.

        Raises:
            BtfError: no such type.
        """
        for type_id, info in self._types.items():
            if info.get("kind") == kind and info.get("name") == name:
                return type_id
        raise BtfError(f"BTF has no {kind} {name!r}")

    def size(self, type_id: int) -> int:
        """Size in bytes of type ``type_id`` (qualifiers and typedefs followed)."""
        info = self._types[type_id]
        kind = info["kind"]
        if kind in _QUALIFIERS:
            return self.size(int(info["type_id"]))
        if kind == "ARRAY":
            return int(info["nr_elems"]) * self.size(int(info["type_id"]))
        if kind == "PTR":
            return 8
        return int(info["size"])

    def layout(self, type_id: int) -> Layout:
        """The :class:`Layout` of ``type_id`` (a struct's members, or a scalar's size).

        Raises:
            BtfError: a member is a bitfield (its offset is not a whole byte).
        """
        info = self._types[type_id]
        while info["kind"] in _QUALIFIERS and info["kind"] != "TYPEDEF":
            info = self._types[int(info["type_id"])]
        name = str(info.get("name") or info["kind"].lower())
        if info["kind"] not in ("STRUCT", "UNION"):
            return Layout(name, self.size(type_id))
        fields = []
        for member in info["members"]:
            bits = int(member["bits_offset"])
            if bits % 8 or member.get("bitfield_size"):
                raise BtfError(f"{name}.{member['name']} is a bitfield: not mirrored")
            fields.append(Field(member["name"], bits // 8, self.size(int(member["type_id"]))))
        return Layout(name, int(info["size"]), tuple(fields))

    def map_key_value(self, map_name: str) -> tuple[Layout, Layout]:
        """Key and value layouts of the map ``map_name`` as its object declared it.

        A libbpf object declares each map as a variable of an anonymous struct whose members
        ``key`` and ``value`` are pointers to the map's key and value types (``__type(key,
        T)``).

        Raises:
            BtfError: no such map in this BTF.
        """
        for info in self._types.values():
            if info.get("kind") == "VAR" and info.get("name") == map_name:
                definition = self._types[int(info["type_id"])]
                members = {m["name"]: int(m["type_id"]) for m in definition.get("members", ())}
                if "key" not in members or "value" not in members:
                    break
                key, value = (self._types[members[n]] for n in ("key", "value"))
                return (
                    self.layout(int(key["type_id"])),
                    self.layout(int(value["type_id"])),
                )
        raise BtfError(f"no map {map_name!r} (a variable with key and value members) in this BTF")


def _bpftool(*args: str) -> Any:
    proc = subprocess.run(["bpftool", "-j", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BtfError(f"bpftool {' '.join(args)} failed: {proc.stderr.strip() or proc.stdout}")
    return json.loads(proc.stdout)


def btf_of_map(*, pinned: pathlib.Path | None = None, map_id: int | None = None) -> Btf:
    """The BTF object of a loaded map, given its pin path or its kernel map id.

    Raises:
        BtfError: bpftool failed (not root, no such map) or the map carries no BTF.
    """
    spec = ["pinned", str(pinned)] if pinned is not None else ["id", str(map_id)]
    info = _bpftool("map", "show", *spec)
    if not info.get("btf_id"):
        raise BtfError(f"map {' '.join(spec)} carries no BTF")
    return Btf(_bpftool("btf", "dump", "id", str(info["btf_id"])))


def map_id_of_fd(fd: int) -> int:
    """Kernel id of the map behind this process's file descriptor ``fd`` (from fdinfo).

    Raises:
        BtfError: ``fd`` is not a BPF map.
    """
    for line in pathlib.Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "map_id":
            return int(value)
    raise BtfError(f"fd {fd} is not a BPF map")


def ctypes_layout(ctype: type[ctypes.Structure] | type[ctypes._SimpleCData[Any]]) -> Layout:
    """The :class:`Layout` of a ctypes mirror (a Structure's fields or a scalar's size)."""
    if not issubclass(ctype, ctypes.Structure):
        return Layout(ctype.__name__, ctypes.sizeof(ctype))
    fields = tuple(
        Field(name, getattr(ctype, name).offset, getattr(ctype, name).size)
        for name, *_ in ctype._fields_
    )
    return Layout(ctype.__name__, ctypes.sizeof(ctype), fields)


def layout_diff(compiled: Layout, mirror: Layout) -> Sequence[str]:
    """Differences between the compiled type and its mirror; empty when they agree.

    Each entry names the type and the member, e.g. ``"policy_key.dport: offset 14 size 2 in
    BTF, offset 14 size 4 in PolicyKey"``.
    """
    where = f"{compiled.name} vs {mirror.name}"
    problems = []
    if compiled.size != mirror.size:
        problems.append(f"{where}: size {compiled.size} in BTF, {mirror.size} in the mirror")
    ours = {f.name: f for f in mirror.fields}
    theirs = {f.name: f for f in compiled.fields}
    for field in compiled.fields:
        mine = ours.get(field.name)
        if mine is None:
            problems.append(f"{where}: {field.name} (offset {field.offset}) missing in the mirror")
        elif (mine.offset, mine.size) != (field.offset, field.size):
            problems.append(
                f"{compiled.name}.{field.name}: offset {field.offset} size {field.size} in BTF, "
                f"offset {mine.offset} size {mine.size} in {mirror.name}"
            )
    problems += [
        f"{where}: {f.name} is in the mirror but not in BTF" for f in mirror.fields
        if f.name not in theirs
    ]  # fmt: skip
    return problems
